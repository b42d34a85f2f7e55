"""A small MLP trained on synthetic data with a DataLoader and an optimizer (CPU friendly).

    perfmon demos/train_mlp.py --steps 300
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SyntheticDataset(Dataset):
    """Random regression data, generated deterministically per index."""

    def __init__(self, n: int, dim: int, delay: float = 0.0) -> None:
        self.n, self.dim, self.delay = n, dim, delay
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.w = torch.randn(dim, 1, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        x = self.x[i]
        return x, x @ self.w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--data-delay", type=float, default=0.0, help="seconds of fake work per sample")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    data = SyntheticDataset(args.batch_size * 50, args.dim, args.data_delay)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)

    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
    print("done")


if __name__ == "__main__":
    main()
