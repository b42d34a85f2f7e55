"""Imports helper_mod from the script's own directory, as plain `python script.py` allows."""

import argparse

import torch
from helper_mod import GREETING, make_model
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(GREETING, flush=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        xb = torch.randn(16, 32)
        loss = nn.functional.mse_loss(model(xb), xb.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"done steps={args.steps}")


if __name__ == "__main__":
    main()
