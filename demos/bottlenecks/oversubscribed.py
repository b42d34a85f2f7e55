"""More torch threads than CPUs: the trainer's own threads wait for each other (on a 2-CPU host, 4 threads).
What a container with a CPU quota does to torch, which sizes its thread pool from the host's CPUs."""

import os
import time

import torch
from _common import args

a = args(240)  # ~4 s at 2 CPUs: host readings come once a second, and the rule wants several
torch.set_num_threads(2 * (os.cpu_count() or 1))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 512), torch.randn(256, 512)
step, began = 0, time.monotonic()
while step < a.steps or time.monotonic() - began < a.seconds:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    step += 1
print("done", step)
