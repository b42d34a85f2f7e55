"""How much perfmon slows a training loop down, measured inside the loop.

    python benchmarks/overhead.py [--runs 7] [--steps 600] [--warmup 60]

The same training script (this file with ``--train``: an MLP step of ~5 ms on one CPU thread,
synthetic data, DataLoader + AdamW) runs alternately without perfmon (``python``) and with it
(``perfmon --headless --run-dir TMP``). The script times its own loop with ``perf_counter``
after a warm-up and writes the numbers to a JSON file, so start-up (imports, the agent, the
monitor) is not counted: only what perfmon adds to each step. It prints every run and the
slowdown as a ratio: median step time with perfmon / median without (goal: < 1.01).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def paired(on: list[dict], off: list[dict], key: str) -> tuple[float, float]:
    """Mean relative slowdown over (with, without) pairs run side by side, and its 95% half-width."""
    d = [a[key] / b[key] - 1.0 for a, b in zip(on, off, strict=True)]
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return statistics.fmean(d), half


# -- the training script ----------------------------------------------------------------------------
def make_loop(args: argparse.Namespace):
    """A step iterator over an endless DataLoader + AdamW MLP loop; each next() runs one training step."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * 64, args.dim)
    data = TensorDataset(x, x[:, :1].clone())
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def steps():
        while True:
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                yield

    return steps()


def timed(loop, n: int) -> dict:
    """Run ``n`` steps; wall and training-thread CPU time per step."""
    step_times = []
    t0 = prev = time.perf_counter()
    cpu0 = time.thread_time()
    for _ in range(n):
        next(loop)
        now = time.perf_counter()
        step_times.append(now - prev)
        prev = now
    wall = time.perf_counter() - t0
    return {
        "steps": n,
        "loop_s": wall,
        "mean_step_ms": wall / n * 1000.0,
        "median_step_ms": statistics.median(step_times) * 1000.0,
        # CPU time of the training thread: what the hooks cost it, less sensitive to other processes
        "cpu_step_ms": (time.thread_time() - cpu0) / n * 1000.0,
    }


def train(args: argparse.Namespace) -> None:
    loop = make_loop(args)
    for _ in range(args.warmup):
        next(loop)
    result = timed(loop, args.steps)
    result["monitored"] = "perfmon.agent" in sys.modules
    Path(args.out).write_text(json.dumps(result))
    print(f"loop {result['loop_s']:.3f} s, {result['mean_step_ms']:.3f} ms/step", flush=True)


def in_process(args: argparse.Namespace) -> None:
    """One process, blocks of steps alternately with and without perfmon's agent hooks (ABBA order).

    Measures the hot-path cost (hooks, event buffer, publisher thread, recording) free of the
    run-to-run noise of separate processes; not the monitor process. Uses perfmon internals.
    """
    from perfmon import _api
    from perfmon.agent.hooks import Instrumentation
    from perfmon.agent.runtime import Agent

    loop = make_loop(args)
    for _ in range(args.warmup):
        next(loop)
    with tempfile.TemporaryDirectory(prefix="perfmon-overhead-") as tmp:
        agent = Agent(Path(tmp) / "run", {"script": "overhead.py", "argv": ["overhead.py"], "pid": os.getpid(),
                                           "start": time.time(), "run_dir": tmp})
        agent.start()
        _api.set_agent(agent)
        blocks: dict[bool, list[dict]] = {False: [], True: []}
        blocks_in_order: list[tuple[dict, bool]] = []
        try:
            for b in range(args.blocks):
                on = b % 4 in (1, 2)  # off on on off, off on on off, ...
                inst = None
                if on:
                    inst = Instrumentation(agent.emit, agent.record_error)
                    inst.install()
                blocks[on].append(timed(loop, args.block_steps))
                blocks_in_order.append((blocks[on][-1], on))
                if inst is not None:
                    inst.uninstall()
        finally:
            _api.set_agent(None)
            agent.finish({"code": 0, "signal": None, "exception": None, "traceback": None})
        recorded = agent.tracker.count
    expected = args.block_steps * len(blocks[True])
    if abs(recorded - expected) > len(blocks[True]):
        raise SystemExit(f"the agent recorded {recorded} steps, expected ~{expected}: hooks not active?")
    # Blocks 2k and 2k+1 are neighbours (ABBA): one "with" and one "without" per pair.
    seq = blocks_in_order
    on_blocks = [seq[i] if seq[i][1] else seq[i + 1] for i in range(0, len(seq) - 1, 2)]
    off_blocks = [seq[i + 1] if seq[i][1] else seq[i] for i in range(0, len(seq) - 1, 2)]
    for key, label in (("mean_step_ms", "wall"), ("median_step_ms", "per-step median"), ("cpu_step_ms", "thread CPU")):
        off = statistics.median(r[key] for r in blocks[False])
        on = statistics.median(r[key] for r in blocks[True])
        mean, half = paired([b[0] for b in on_blocks], [b[0] for b in off_blocks], key)
        print(f"in-process {label:>15}: {off:.4f} ms without, {on:.4f} ms with hooks: ratio {on / off:.4f} "
              f"({(on / off - 1) * 100:+.2f}%, {(on - off) * 1000:+.1f} us/step); paired {mean * 100:+.2f}% ± {half * 100:.2f}%")
    print(f"({args.blocks} blocks of {args.block_steps} steps, {recorded} steps recorded by the agent)")


# -- the driver ---------------------------------------------------------------------------------------
def perfmon_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("perfmon")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "perfmon.cli"]


def one_run(with_perfmon: bool, train_args: list[str], tmp: Path, i: int) -> dict:
    out = tmp / f"{'with' if with_perfmon else 'without'}-{i}.json"
    script = [str(HERE), "--train", "--out", str(out), *train_args]
    if with_perfmon:
        cmd = [*perfmon_cmd(), "--headless", "--run-dir", str(tmp / f"run-{i}"), *script]
    else:
        cmd = [sys.executable, *script]
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"run failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    result = json.loads(out.read_text())
    if result["monitored"] != with_perfmon:
        raise SystemExit(f"run {i}: expected monitored={with_perfmon}, got {result['monitored']}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="be the training script (used by the driver)")
    p.add_argument("--out", help="(--train) where to write the loop timings")
    p.add_argument("--runs", type=int, default=7, help="runs with and runs without perfmon (default 7 each)")
    p.add_argument("--steps", type=int, default=600, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=60, help="untimed steps before the timed ones")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--json", action="store_true", help="print the result as JSON as well")
    p.add_argument("--in-process", action="store_true",
                   help="instead: one process, blocks with and without the agent's hooks (hot-path cost only)")
    p.add_argument("--blocks", type=int, default=40, help="(--in-process) number of blocks")
    p.add_argument("--block-steps", type=int, default=50, help="(--in-process) steps per block")
    args = p.parse_args()
    if args.in_process:
        in_process(args)
        return
    if args.train:
        if not args.out:
            p.error("--train needs --out")
        train(args)
        return

    train_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                  "--dim", str(args.dim), "--hidden", str(args.hidden)]
    results: dict[bool, list[dict]] = {False: [], True: []}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="perfmon-overhead-") as tmp:
        for i in range(args.runs):
            # Interleaved, alternating which goes first, so drifts in machine load hit both alike.
            order = (False, True) if i % 2 == 0 else (True, False)
            for with_perfmon in order:
                r = one_run(with_perfmon, train_args, Path(tmp), i)
                results[with_perfmon].append(r)
                label = "with   " if with_perfmon else "without"
                print(f"run {i + 1}/{args.runs} {label} perfmon: {r['mean_step_ms']:.3f} ms/step mean, "
                      f"{r['median_step_ms']:.3f} median, {r['cpu_step_ms']:.3f} thread CPU", flush=True)

    def med(flag: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[flag])

    ratio = med(True, "mean_step_ms") / med(False, "mean_step_ms")
    ratio_p50 = med(True, "median_step_ms") / med(False, "median_step_ms")
    ratio_cpu = med(True, "cpu_step_ms") / med(False, "cpu_step_ms")
    # Each with-run next to its without-run: machine drift over the benchmark cancels out.
    pairs = sorted(w["mean_step_ms"] / wo["mean_step_ms"] for w, wo in zip(results[True], results[False], strict=True))
    ratio_paired = statistics.median(pairs)
    print()
    for flag, label in ((False, "without perfmon:"), (True, "with perfmon:   ")):
        print(label, " ".join(f"{r['mean_step_ms']:.3f}" for r in results[flag]), "ms/step")
    print(f"median step time: {med(False, 'mean_step_ms'):.3f} ms without, {med(True, 'mean_step_ms'):.3f} ms with")
    print(f"slowdown ratio (median with / median without): {ratio:.4f}  ({(ratio - 1) * 100:+.2f}%)")
    print(f"same on per-step medians (robust to spikes):    {ratio_p50:.4f}  ({(ratio_p50 - 1) * 100:+.2f}%)")
    print(f"median of paired ratios (drift cancels):         {ratio_paired:.4f}  ({(ratio_paired - 1) * 100:+.2f}%)"
          f"  range {pairs[0]:.4f}..{pairs[-1]:.4f}")
    mean, half = paired(results[True], results[False], "mean_step_ms")
    print(f"mean paired slowdown, 95% interval:              {mean * 100:+.2f}% ± {half * 100:.2f}%")
    print(f"training-thread CPU time per step:               {ratio_cpu:.4f}  ({(ratio_cpu - 1) * 100:+.2f}%)")
    print(f"goal < 1.01: {'met' if ratio < 1.01 else 'NOT met'}   ({args.runs} runs each, {time.monotonic() - t0:.0f} s)")
    if args.json:
        print(json.dumps({"ratio": ratio, "ratio_per_step_median": ratio_p50, "ratio_paired": ratio_paired,
                          "ratio_thread_cpu": ratio_cpu,
                          "paired_ratios": pairs, "paired_mean": mean, "paired_ci95": half, "runs": args.runs,
                          "without": results[False], "with": results[True]}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
