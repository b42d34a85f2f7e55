"""PyTorch Lightning's automatic optimization with ``accumulate_grad_batches`` and ``val_check_interval``
counted in batches: validation runs every N training batches, so it often lands between two micro-batches of
one optimizer step (Lightning's fit loop, unrolled: the validation loop under ``torch.no_grad`` with
``model.eval()``, then back to ``model.train()`` and the next batch)."""

import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=3)  # batches, not optimizer steps
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = DataLoader(TensorDataset(torch.randn(args.batches * args.batch_size, 32),
                                     torch.randn(args.batches * args.batch_size, 1)), batch_size=args.batch_size)
    val = DataLoader(TensorDataset(torch.randn(96, 32), torch.randn(96, 1)), batch_size=32)
    truth = {"steps": 0, "validations": 0, "val_batches": 0, "samples_per_step": args.batch_size * args.accumulate}
    for batch_idx, (x, y) in enumerate(train):
        loss = nn.functional.mse_loss(model(x), y) / args.accumulate
        loss.backward()
        if (batch_idx + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for vx, vy in val:
                    nn.functional.mse_loss(model(vx), vy)
                    truth["val_batches"] += 1
            model.train()
            truth["validations"] += 1
        if (batch_idx + 1) % args.accumulate == 0:
            opt.step()
            opt.zero_grad()
            truth["steps"] += 1
    print(f"trained {truth['steps']} steps, validated {truth['validations']} times")
    print("GROUND_TRUTH " + json.dumps(truth))


if __name__ == "__main__":
    main()
