"""Trains a few steps, then raises ValueError("boom") at step 5 (after 5 complete steps)."""

import argparse

import torch
from torch import nn


def train_step(model, opt, step: int) -> None:
    if step == 5:
        raise ValueError("boom")
    xb = torch.randn(16, 32)
    loss = nn.functional.mse_loss(model(xb), xb.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        train_step(model, opt, step)
    print("done (not reached)")


if __name__ == "__main__":
    main()
