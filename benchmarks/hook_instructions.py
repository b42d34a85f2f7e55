"""What perfmon's hooks cost per step in instructions and cache misses: repeatable, whatever the machine is doing.

    python benchmarks/hook_instructions.py [--job mlp|tiny] [--ways none,c,py] [--steps 100,300] [--parallel 2]

Timing a few us on a ~1.7 ms step drowns in this VM's noise (one run to the next moves by tens of us).
valgrind's callgrind counts instructions and simulates the caches, so its counts are the same on a quiet and on a
loaded machine. Each way (``none``: plain torch; ``c``: perfmon's hooks with the C hot path; ``py``: the
pure-Python hooks) runs the loop of ``agent_cpu.py``'s job under ``valgrind --tool=callgrind --cache-sim=yes``
twice, for the two step counts of ``--steps``; the difference between the two runs, divided by the difference in
steps, is the cost of one step without start-up and import. Printed per step: instructions (Ir), L1 instruction
and data read misses (I1mr, D1mr) and last-level data read misses (DLmr), and each way's difference from ``none``.

Slow: importing torch alone takes ~45 s under valgrind and the mlp step ~80 ms; the default (three ways, two step
counts, two at a time) takes about 30 minutes on two cores. Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

EVENTS = ("Ir", "I1mr", "D1mr", "DLmr")


def train(job: str, way: str, steps: int) -> None:
    """The measured program: warm-up, then ``steps`` steps with the hooks of ``way``."""
    import agent_cpu

    step = agent_cpu.make_step(job)
    if way != "none":
        from perfmon.agent.hooks import Instrumentation
        from perfmon.agent.native import event_buffer

        events = event_buffer(100_000)  # the agent's own: the C hooks write compact slots to it
        inst = Instrumentation(lambda code, arg: events.append((code, perf_counter(), arg, None)),
                               lambda where, exc: print(f"perfmon error in {where}: {exc}", file=sys.stderr),
                               accelerated=way == "c")
        if way == "c" and inst._hot is None:
            raise SystemExit("the C hot path is not built here")
        inst.install()
        inst.fast = events.append
    for _ in range(50):
        step()
    for _ in range(steps):
        step()


def totals(path: Path) -> dict[str, int]:
    names: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("totals:"):
            return dict(zip(names, map(int, line.split()[1:]), strict=True))
    raise SystemExit(f"no totals in {path}")


def measure(job: str, way: str, steps: int, tmp: Path) -> dict[str, int]:
    out = tmp / f"callgrind.{way}.{steps}"
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--callgrind-out-file={out}", sys.executable,
           str(HERE), "--train", "--job", job, "--way", way, "--steps", str(steps)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return totals(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="be the measured program (used by the driver)")
    p.add_argument("--job", choices=("mlp", "tiny"), default="mlp")
    p.add_argument("--way", choices=("none", "c", "py"), default="none")
    p.add_argument("--ways", default="none,c,py")
    p.add_argument("--steps", default="100,300", help="two step counts (the difference is measured)")
    p.add_argument("--parallel", type=int, default=2)
    args = p.parse_args()
    if args.train:
        train(args.job, args.way, int(args.steps))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    ways = args.ways.split(",")
    low, high = (int(s) for s in args.steps.split(","))
    with tempfile.TemporaryDirectory(prefix="perfmon-hook-instr-") as tmp, \
            ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {(w, n): pool.submit(measure, args.job, w, n, Path(tmp)) for w in ways for n in (low, high)}
        per_step = {w: {e: (futures[w, high].result()[e] - futures[w, low].result()[e]) / (high - low)
                        for e in EVENTS} for w in ways}
    print(f"job {args.job}: per step, from runs of {low} and {high} steps under callgrind --cache-sim=yes")
    base = per_step.get("none")
    for w in ways:
        cols = "  ".join(f"{e} {per_step[w][e]:11.0f}" + (f" ({per_step[w][e] - base[e]:+7.0f})" if base else "")
                         for e in EVENTS)
        print(f"  {w:5s} {cols}")


if __name__ == "__main__":
    main()
