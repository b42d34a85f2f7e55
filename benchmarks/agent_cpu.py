"""CPU that perfmon costs inside the training process, all its threads together, per step.

    python benchmarks/agent_cpu.py [--runs 5] [--steps 20000] [--job tiny|mlp] [--criterion] [--threads N]
                                   [--burners N]

The training script is this file with ``--train``: ``tiny`` is a linear model with SGD and no DataLoader
(~90 us per step: the highest step rate, where a per-step cost shows most); ``mlp`` is a DataLoader + AdamW
MLP of ~1.7 ms per step. ``--criterion``: the loss is a module (``nn.MSELoss()``, as most hand-written loops
have it) instead of ``nn.functional.mse_loss``. Each run times ``--steps`` steps after a warm-up inside the loop and reports the
process's CPU time (``time.process_time``: every thread of the process, so the agent's publisher, socket
and sampler threads count) and the training thread's own CPU time. Runs alternate with and without
perfmon (``perfmon --headless``, the monitor in its own process, which is not counted here).

Printed: per-step process CPU with and without (medians), the difference in us per step (goal: <= 10 us at
any step rate), how that splits between the training thread (hooks) and the agent's threads, and the
in-loop wall-time ratio (goal on the ``mlp`` job: <= 1.01), of the medians and over the ABBA pairs.

``--burners N`` keeps N busy processes running beside every run (a host shared with other work), and
``--threads N`` gives the job N torch intra-op threads: with ``--threads 2 --burners 1`` on two cores, torch's
threads wait for each other while perfmon's own threads and its monitor process compete for the free core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def make_step(job: str, threads: int = 1, criterion: bool = False):
    import torch
    from torch import nn

    loss_fn = nn.MSELoss() if criterion else nn.functional.mse_loss
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if job == "tiny":
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(4, 8), torch.randn(4, 1)

        def step() -> None:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(64 * 64, 128)
    loader = DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=64, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(128, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def batches():
        while True:
            yield from loader

    it = batches()

    def step() -> None:
        xb, yb = next(it)
        loss = loss_fn(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def train(args: argparse.Namespace) -> None:
    step = make_step(args.job, args.threads, args.criterion)
    for _ in range(args.warmup):
        step()
    cpu0, th0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(args.steps):
        step()
    cpu1, th1, t1 = time.process_time(), time.thread_time(), time.perf_counter()
    n = args.steps
    Path(args.out).write_text(json.dumps({
        "process_us": (cpu1 - cpu0) / n * 1e6, "thread_us": (th1 - th0) / n * 1e6, "wall_us": (t1 - t0) / n * 1e6,
        "monitored": "perfmon.agent" in sys.modules,
    }))


def perfmon_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("perfmon")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "perfmon.cli"]


def one_run(with_perfmon: bool, args: argparse.Namespace, tmp: Path, i: int) -> dict:
    out = tmp / f"{'with' if with_perfmon else 'without'}-{i}.json"
    script = [str(HERE), "--train", "--out", str(out), "--job", args.job, "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--threads", str(args.threads), *(["--criterion"] if args.criterion else [])]
    cmd = [*perfmon_cmd(), "--headless", "--run-dir", str(tmp / f"run-{i}"), *script] if with_perfmon \
        else [sys.executable, *script]
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"run failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
    result = json.loads(out.read_text())
    if result["monitored"] != with_perfmon:
        raise SystemExit(f"run {i}: expected monitored={with_perfmon}, got {result['monitored']}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="be the training script (used by the driver)")
    p.add_argument("--out")
    p.add_argument("--job", choices=("tiny", "mlp"), default="tiny")
    p.add_argument("--criterion", action="store_true", help="the loss as a module (nn.MSELoss())")
    p.add_argument("--runs", type=int, default=5, help="runs with and runs without perfmon")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the job")
    p.add_argument("--burners", type=int, default=0,
                   help="busy processes running throughout (a host shared with other work)")
    args = p.parse_args()
    if args.train:
        train(args)
        return
    results: dict[bool, list[dict]] = {False: [], True: []}
    # in their own session, as other work on a host is: Linux's autogroup shares CPU between sessions first, and
    # perfmon runs the job in a session of its own (so that it outlives the monitor)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(args.burners)]
    try:
        run_all(args, results)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    report(args, results)


def run_all(args: argparse.Namespace, results: dict[bool, list[dict]]) -> None:
    with tempfile.TemporaryDirectory(prefix="perfmon-agent-cpu-") as tmp:
        for i in range(args.runs):
            for with_perfmon in ((False, True) if i % 2 == 0 else (True, False)):
                r = one_run(with_perfmon, args, Path(tmp), i)
                results[with_perfmon].append(r)
                print(f"run {i} {'with   ' if with_perfmon else 'without'}: process {r['process_us']:.2f} us/step, "
                      f"training thread {r['thread_us']:.2f}, wall {r['wall_us']:.2f}", flush=True)


def report(args: argparse.Namespace, results: dict[bool, list[dict]]) -> None:
    def med(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[on])

    d_proc = med(True, "process_us") - med(False, "process_us")
    d_thread = med(True, "thread_us") - med(False, "thread_us")
    # the job's own threads besides training are perfmon's: process minus training thread, with perfmon
    others = statistics.median(r["process_us"] - r["thread_us"] for r in results[True])
    print(f"job {args.job}{' with a loss module' if args.criterion else ''}, {args.runs} runs each of {args.steps} steps, {args.threads} torch thread(s), "
          f"{args.burners} busy process(es) beside it")
    print(f"process CPU: {med(False, 'process_us'):.2f} us/step without, {med(True, 'process_us'):.2f} with: "
          f"perfmon costs {d_proc:+.2f} us/step (goal <= 10)")
    print(f"  training thread (hooks) {d_thread:+.2f} us/step; agent threads {others:.2f} us/step")
    # each run against its partner of the same ABBA pair: drifts of the machine between pairs cancel
    pairs = [w["wall_us"] / wo["wall_us"] for w, wo in zip(results[True], results[False], strict=True)]
    print(f"in-loop wall time ratio {med(True, 'wall_us') / med(False, 'wall_us'):.4f} (medians); "
          f"paired: median {statistics.median(pairs):.4f}, mean {statistics.fmean(pairs):.4f}")


if __name__ == "__main__":
    main()
