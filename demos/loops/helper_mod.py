"""A sibling module imported by sibling_import.py (found through sys.path[0] = the script's dir)."""

from torch import nn

GREETING = "helper_mod imported"


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
