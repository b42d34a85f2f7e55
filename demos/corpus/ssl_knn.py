"""Self-supervised training with a kNN monitor, the shape of SimSiam's and MoCo's: two augmented views of each
batch through the model (two forwards a step, a symmetric negative-cosine loss), and after every epoch a kNN
accuracy computed from features of the *backbone* only (``model.backbone(x)`` under ``no_grad``, as their
``knn_monitor`` calls ``model.encoder_q`` / ``net.backbone``) over a memory-bank loader and a test loader.

The monitor never calls the trained model itself: perfmon sees only its loaders' fetches between the epochs.
GROUND_TRUTH carries the steps, the samples each step trained on and the seconds the monitor took."""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class SimSiam(nn.Module):
    def __init__(self, dim: int = 32, feat: int = 64) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, feat), nn.ReLU(), nn.Linear(feat, feat), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(feat, feat), nn.BatchNorm1d(feat))
        self.predictor = nn.Sequential(nn.Linear(feat, 16), nn.ReLU(), nn.Linear(16, feat))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        z1, z2 = self.projector(self.backbone(x1)), self.projector(self.backbone(x2))
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2


def augment(x: torch.Tensor) -> torch.Tensor:
    return x * (1 + 0.1 * torch.randn_like(x)) + 0.05 * torch.randn_like(x)


def knn_monitor(backbone: nn.Module, memory: DataLoader, test: DataLoader, k: int = 5) -> float:
    backbone.eval()
    feats, labels = [], []
    with torch.no_grad():
        for x, y in memory:
            feats.append(F.normalize(backbone(x), dim=1))
            labels.append(y)
        bank, bank_y = torch.cat(feats), torch.cat(labels)
        correct = total = 0
        for x, y in test:
            sim = F.normalize(backbone(x), dim=1) @ bank.T
            pred = bank_y[sim.topk(k, dim=1).indices].mode(dim=1).values
            correct += (pred == y).sum().item()
            total += y.numel()
    backbone.train()
    return 100.0 * correct / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--monitor-batches", type=int, default=12)
    parser.add_argument("--out", default="corpus-out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    centers = torch.randn(10, 32) * 2

    def dataset(n: int) -> TensorDataset:
        y = torch.randint(0, 10, (n,))
        return TensorDataset(centers[y] + torch.randn(n, 32), y)

    train = DataLoader(dataset(args.batch_size * args.steps_per_epoch), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    memory = DataLoader(dataset(64 * args.monitor_batches), batch_size=64)
    test = DataLoader(dataset(64 * args.monitor_batches), batch_size=64)
    model = SimSiam()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    truth = {"steps": 0, "samples": 0, "monitor_s": 0.0}
    for epoch in range(args.epochs):
        for x, _ in train:
            loss = model(augment(x), augment(x))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            truth["steps"] += 1
            truth["samples"] += x.shape[0]
        begin = time.perf_counter()
        acc = knn_monitor(model.backbone, memory, test)
        truth["monitor_s"] += time.perf_counter() - begin
        print(f"epoch {epoch} loss {loss.item():.4f} knn acc {acc:.1f}")
    torch.save(model.backbone.state_dict(), os.path.join(args.out, "backbone.pth"))
    truth["samples_per_step"] = args.batch_size
    truth["monitor_s"] = round(truth["monitor_s"], 6)
    print("GROUND_TRUTH " + json.dumps({k: truth[k] for k in ("steps", "samples", "samples_per_step")},
                                       sort_keys=True))
    with open(os.path.join(args.out, "timing.json"), "w") as f:  # not compared: the script's own clock
        json.dump({"monitor_s": truth["monitor_s"]}, f)


if __name__ == "__main__":
    main()
