"""A loop that profiles itself, as the PyTorch profiler recipe and Lightning's PyTorchProfiler do: a scheduled
torch.profiler session over the first steps (``schedule(wait, warmup, active, repeat)`` and an ``on_trace_ready``
that reads ``key_averages()``), later a ``with torch.profiler.profile()`` block around a few steps, ``emit_itt``
ranges (VTune's; ``emit_nvtx`` is Nsight Systems'), and a legacy
``torch.autograd.profiler.profile(enabled=args.profile)`` switched off, as scripts leave it. The script checks its
own results: a profile that comes back without the model's matmuls fails it (exit 3)."""

import argparse
import json
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true", help="turn the legacy profiler on")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    truth = {"steps": 0, "profiles": [], "block_ops": 0}

    def train_step():
        x = torch.randn(32, 64)
        y = torch.randint(0, 10, (32,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        truth["steps"] += 1
        return loss

    def on_trace_ready(prof):
        names = {e.key for e in prof.key_averages()}
        truth["profiles"].append("aten::addmm" in names)

    # 1. the recipe: a scheduled session over the first 12 steps (two cycles of 1 + 1 + 3, then idle)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=2),
                 on_trace_ready=on_trace_ready) as prof:
        for _ in range(12):
            train_step()
            prof.step()
    # 2. no profiler of the script's own
    while truth["steps"] < args.steps // 2:
        train_step()
    # 3. a few steps looked at closely
    with torch.profiler.profile(record_shapes=True) as block:
        for _ in range(4):
            train_step()
    truth["block_ops"] = int(any(e.key == "aten::addmm" for e in block.key_averages()))
    # 3b. ranges for Intel VTune around a few steps (emit_nvtx, for Nsight Systems, holds the profiler the same way)
    with torch.autograd.profiler.emit_itt():
        for _ in range(6):
            train_step()
    # 4. the rest, under a legacy profiler left switched off
    with torch.autograd.profiler.profile(enabled=args.profile):
        while truth["steps"] < args.steps:
            loss = train_step()
    print(f"loss {loss.item():.4f} profiles {truth['profiles']} block {truth['block_ops']}")
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))
    if not all(truth["profiles"]) or len(truth["profiles"]) != 2 or not truth["block_ops"]:
        sys.exit(3)


if __name__ == "__main__":
    main()
