"""DataLoader with num_workers=2 under --context fork or spawn; the Dataset class lives in this script."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class ScriptDataset(Dataset):
    """Defined in the script (module __main__): fork and spawn workers must still find it."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.dim, generator=g)
        return x, x.sum(0, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", choices=("fork", "spawn"), default="fork", help="multiprocessing start method")
    p.add_argument("--epochs", type=int, default=1, help="the steps split into epochs (workers start at each)")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    loader = DataLoader(ScriptDataset(args.batch_size * (args.steps // args.epochs), 32), batch_size=args.batch_size,
                        num_workers=2, multiprocessing_context=args.context, drop_last=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 0
    for _ in range(args.epochs):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
    print(f"done steps={steps} context={args.context}")


if __name__ == "__main__":
    main()
