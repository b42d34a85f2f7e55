"""Gradient accumulation: 4 forward/backward per optimizer step; --steps counts optimizer steps."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ACCUM = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * ACCUM * 4, 32)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=args.batch_size, drop_last=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = micro = 0
    while steps < args.steps:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb) / ACCUM
            loss.backward()
            micro += 1
            if micro % ACCUM == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps += 1
                if steps >= args.steps:
                    break
    print(f"done steps={steps} micro={micro}")


if __name__ == "__main__":
    main()
