"""No optimizer, no DataLoader: loss.backward() then a manual SGD update under no_grad."""

import argparse

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    lr = 1e-2
    for _ in range(args.steps):
        xb = torch.randn(args.batch_size, 32)
        yb = xb.sum(1, keepdim=True)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        with torch.no_grad():
            for p_ in model.parameters():
                p_ -= lr * p_.grad
                p_.grad = None
    print(f"done steps={args.steps} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
