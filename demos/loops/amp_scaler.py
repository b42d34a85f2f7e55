"""torch.amp.GradScaler("cpu") with bf16 autocast: scaler.scale(loss).backward(); scaler.step(opt)."""

import argparse

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(args.steps):
        xb = torch.randn(args.batch_size, 32)
        yb = xb.sum(1, keepdim=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(f"done steps={args.steps} scale={scaler.get_scale()} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
