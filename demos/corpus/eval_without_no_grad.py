"""A hand-written loop whose evaluation forgets ``torch.no_grad()``: ``model.eval()``, then the validation batches
with autograd still recording (as many tutorials and quick scripts write it), then ``model.train()``."""

import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class CenterLoss(nn.Module):
    """MSE plus a pull towards a learned center of the predictions (the shape of face recognition's center loss):
    a loss with parameters, which the optimizer trains and ``model.eval()`` never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.center = nn.Parameter(torch.zeros(1))

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(pred, target) + 0.01 * (pred - self.center).pow(2).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--criterion", action="store_true",
                        help="one loss module for training and validation (model.eval() leaves it in train mode)")
    parser.add_argument("--center-loss", action="store_true",
                        help="a loss module with parameters of its own, trained with the model (a center loss)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 1))
    params = list(model.parameters())
    loss_fn = nn.MSELoss() if args.criterion else nn.functional.mse_loss
    if args.center_loss:
        loss_fn = CenterLoss()
        params += list(loss_fn.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    train = DataLoader(TensorDataset(torch.randn(320, 32), torch.randn(320, 1)), batch_size=args.batch_size)
    val = DataLoader(TensorDataset(torch.randn(512, 32), torch.randn(512, 1)), batch_size=64)
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
