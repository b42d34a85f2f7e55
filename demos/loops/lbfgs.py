"""torch.optim.LBFGS: optimizer.step(closure), the closure runs forward + backward (many times a step)."""

import argparse

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 16)
    y = x.sum(1, keepdim=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(args.steps):
        loss = opt.step(closure)
    print(f"done steps={args.steps} closure_calls={calls} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
