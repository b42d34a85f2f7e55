"""Trains --steps steps, then sys.exit(3)."""

import argparse
import sys

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        xb = torch.randn(16, 32)
        loss = nn.functional.mse_loss(model(xb), xb.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"exiting with 3 after steps={args.steps}", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
