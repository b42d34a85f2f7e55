"""GPU smoke check (< 3 minutes): real NVML, real allocator numbers, CUDA-event phase times.

    perfmon --headless --interval 5 --profile-every 100 --run-dir RUN demos/gpu_smoke.py --steps 400
    perfmon report RUN --json
    python demos/gpu_smoke.py --verify RUN

Run directly (python demos/gpu_smoke.py --check) it also prints what perfmon's own
collectors read on this machine, for comparison with nvidia-smi. ``--verify RUN`` checks each live
profiler window of the run (as the monitor analysed it) against ``perfmon trace`` on its own trace file:
the same device busy share, breakdown and top ops, GPU kernels present, and no no-mixed-precision
finding above info (the loop runs under bf16 autocast, so bf16 tensor-core GEMMs must be what ran).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn


def collectors_check() -> None:
    from perfmon.collectors.nvml import NvmlSampler

    s = NvmlSampler()
    print("nvml:", s.open() or "ok")
    print(json.dumps(s.sample(), indent=1, default=str))
    if torch.cuda.is_available():
        torch.ones(1, device="cuda")
        from perfmon.collectors.cuda_mem import CudaMemorySampler

        cm = CudaMemorySampler()
        print("allocator:", cm.sample())
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del big
        first = cm.sample()
        small = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        second = cm.sample()
        seen = torch.cuda.max_memory_allocated()
        print("window peaks (GiB):", first["window_peak_allocated_bytes"] / 2**30,
              second["window_peak_allocated_bytes"] / 2**30, "script's max_memory_allocated:", seen / 2**30)
        ok = first["window_peak_allocated_bytes"] >= 1 << 30 > second["window_peak_allocated_bytes"] >= 256 << 20
        print("window peaks:", "ok" if ok and seen >= 1 << 30 else "WRONG")
        del small


def verify(run: str) -> int:
    """Live windows vs ``perfmon trace`` on the same trace files; prints each check, 0 when all pass."""
    import subprocess

    cli = [sys.executable, "-m", "perfmon.cli"]
    report = json.loads(subprocess.run([*cli, "report", run, "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    failures = 0
    profiles = report.get("profiles") or []
    print(f"{len(profiles)} profiler windows in {run}")
    for prof in profiles:
        doc = json.loads(subprocess.run([*cli, "trace", prof["trace"], "--json"], capture_output=True, text=True,
                                        check=True).stdout)
        t = doc["traces"][0]
        checks = {
            "device is a GPU": t["device"] != "cpu",
            "kernels in the trace": bool(t["top_kernels"]),
            "busy matches": prof.get("device_busy") == t["busy"],
            "breakdown matches": all((prof.get("breakdown") or {}).get(k) == t[k]
                                     for k in ("idle", "compute", "non_compute", "communication", "memory")),
            "top ops match": [o["name"] for o in prof["top_ops"][:5]] == [o["name"] for o in t["top_ops"][:5]],
            "bf16 GEMMs seen": not any(f["id"] == "no-mixed-precision" and f["severity"] != "info"
                                       for f in t["findings"]),
        }
        for name, ok in checks.items():
            print(f"  window at step {prof.get('step')}: {name}: {'ok' if ok else 'WRONG'}")
            failures += not ok
    return 1 if failures or not profiles else 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--verify", metavar="RUN", help="check RUN's live profiler windows against perfmon trace")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--check", action="store_true", help="print the collectors' raw readings first")
    args = p.parse_args()
    if args.verify:
        sys.exit(verify(args.verify))
    if args.check:
        collectors_check()
    if not torch.cuda.is_available():
        print("no CUDA device: this smoke check needs a GPU", file=sys.stderr)
        sys.exit(3)
    dev = torch.device("cuda")
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(6)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch_size * 8, args.width)
    y = torch.randn(args.batch_size * 8, args.width)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                         shuffle=True, pin_memory=True, drop_last=True)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} "
                      f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB "
                      f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB", flush=True)
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
