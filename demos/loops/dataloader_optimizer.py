"""DataLoader + AdamW: the plain loop shape. One step per optimizer.step().

--hold-at K --gate PATH: after step K, wait until PATH exists (lets tests act mid-run).
"""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--gate", default=None)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * 8, 32)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == args.hold_at and args.gate:
                print(f"holding at step {step}", flush=True)
                while not os.path.exists(args.gate):
                    time.sleep(0.01)
            if step >= args.steps:
                break
    print(f"done steps={step} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
