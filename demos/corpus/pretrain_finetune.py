"""Two stages in one script, as self-supervised recipes run them: pre-train an autoencoder, then train a classifier
(a new class of model) on its frozen encoder with a new optimizer: a linear probe, or fine-tuning a new head."""

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class AutoEncoder(nn.Module):
    def __init__(self, dim: int = 128, code: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, code))
        self.decoder = nn.Sequential(nn.Linear(code, 512), nn.ReLU(), nn.Linear(512, dim))

    def forward(self, x):
        return self.decoder(self.encoder(x))


class Probe(nn.Module):
    def __init__(self, encoder: nn.Module, code: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(code, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                  nn.Linear(1024, classes))

    def forward(self, x):
        with torch.no_grad():
            z = self.encoder(x)
        return self.head(z)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrain-steps", type=int, default=20)
    p.add_argument("--probe-steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(64 * 16, 128), torch.randint(0, 10, (64 * 16,))
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, drop_last=True)
    truth = {"steps": 0, "pretrain_steps": 0}

    ae = AutoEncoder()
    opt = torch.optim.AdamW(ae.parameters(), lr=1e-3)
    while truth["pretrain_steps"] < args.pretrain_steps:
        for xb, _ in loader:
            loss = nn.functional.mse_loss(ae(xb), xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            truth["pretrain_steps"] += 1
            if truth["pretrain_steps"] == args.pretrain_steps:
                break
    print(f"pre-training loss {loss.item():.4f}")
    truth["steps"] = truth["pretrain_steps"]

    probe = Probe(ae.encoder)
    opt = torch.optim.AdamW(probe.head.parameters(), lr=1e-3)
    done = 0
    while done < args.probe_steps:
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(probe(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == args.probe_steps:
                break
    print(f"probe loss {loss.item():.4f}")
    truth["steps"] += done
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
