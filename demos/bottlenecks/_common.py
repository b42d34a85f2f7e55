"""Shared bits of the bottleneck demos: a tiny MLP, a dataset with slow samples and a CLI with --steps."""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import Dataset


def args(default_steps: int = 150) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=default_steps)
    p.add_argument("--seconds", type=float, default=0.0, help="train at least this long (where the demo reads it)")
    return p.parse_args()


def mlp(dim: int = 128, hidden: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class SlowDataset(Dataset):
    """Each sample costs ``decode_s`` of (fake) decoding / augmentation."""

    def __init__(self, decode_s: float) -> None:
        self.decode_s = decode_s

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(self.decode_s)
        return torch.randn(128), torch.randn(1)
