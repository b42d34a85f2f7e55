"""A script started with plain python that opts in with perfmon.instrument(), so perfmon attach works.

    python instrumented.py --steps 100000 --gate FILE   (runs until FILE exists, then exits)
"""

import argparse
import os

import torch
from torch import nn

import perfmon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--gate")
p.add_argument("--run-dir")
a = p.parse_args()
perfmon.instrument(run_dir=a.run_dir)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(a.steps):
    loss = model(torch.randn(32, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if a.gate and os.path.exists(a.gate):
        break
print("done")
