"""Shared bits of the bottleneck demos: a tiny MLP and a CLI with --steps."""

import argparse

import torch
from torch import nn


def args(default_steps: int = 150) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=default_steps)
    return p.parse_args()


def mlp(dim: int = 128, hidden: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
