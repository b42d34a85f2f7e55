"""A hand-written loop whose evaluation forgets ``torch.no_grad()``: ``model.eval()``, then the validation batches
with autograd still recording (as many tutorials and quick scripts write it), then ``model.train()``."""

import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--criterion", action="store_true",
                        help="one loss module for training and validation (model.eval() leaves it in train mode)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(TensorDataset(torch.randn(320, 32), torch.randn(320, 1)), batch_size=args.batch_size)
    val = DataLoader(TensorDataset(torch.randn(512, 32), torch.randn(512, 1)), batch_size=64)
    loss_fn = nn.MSELoss() if args.criterion else nn.functional.mse_loss
    truth = {"steps": 0, "val_batches": 0, "samples_per_step": args.batch_size}
    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            truth["steps"] += 1
        model.eval()
        total = 0.0
        for vx, vy in val:
            total += loss_fn(model(vx), vy).item()
            truth["val_batches"] += 1
        print(f"epoch {epoch}: val loss {total / len(val):.4f}")
    print("GROUND_TRUTH " + json.dumps(truth))


if __name__ == "__main__":
    main()
