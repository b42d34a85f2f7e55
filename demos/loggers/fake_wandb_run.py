"""A training loop that logs to Weights & Biases the usual way, with a stand-in ``wandb`` module (no account,
no network): ``wandb.init()``, ``wandb.log({...})`` every step, ``wandb.finish()``. What was logged, perfmon's
``commit=False`` additions included, is written to ``--out`` (JSON lines) for the test to read."""

from __future__ import annotations

import argparse
import json
import sys
import time
import types

import torch
from torch import nn


class _Run:
    def __init__(self, out: str) -> None:
        self.out = open(out, "w")  # noqa: SIM115 - closed by finish()
        self.pending: dict = {}
        self.step = 0

    def log(self, data: dict, commit: bool = True) -> None:
        self.pending.update(data)
        if commit:
            self.out.write(json.dumps({"_step": self.step, **self.pending}) + "\n")
            self.out.flush()
            self.pending = {}
            self.step += 1


def _install_fake_wandb(out: str) -> types.ModuleType:
    wandb = types.ModuleType("wandb")
    wandb.run = None

    def init(**kwargs: object) -> _Run:
        wandb.run = _Run(out)
        return wandb.run

    def log(data: dict, commit: bool = True) -> None:
        wandb.run.log(data, commit)

    def finish() -> None:
        wandb.run.out.close()
        wandb.run = None

    wandb.init, wandb.log, wandb.finish = init, log, finish
    sys.modules["wandb"] = wandb
    return wandb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    wandb = _install_fake_wandb(args.out)
    wandb.init(project="demo")
    model = nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        wandb.log({"loss": loss.item()})
        step += 1
        time.sleep(0.005)
    wandb.finish()
    print(f"{step} steps")


if __name__ == "__main__":
    main()
