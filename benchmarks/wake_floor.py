"""What one periodic wake-up costs a process on this machine, before it does any work.

    python benchmarks/wake_floor.py [--seconds 10] [--periods 1,0.1]

perfmon's job wakes once a second (the publisher's tick: steps, readings, live view). At a slow step rate that
fixed cost is what "CPU per step" measures: at 1 step/s, a wake of W us is W us a step however little it does.
This measures the floor any design with a periodic wake in the job pays:

* ``python``: a Python thread that waits on a queue with a timeout (as perfmon's publisher does) and does nothing
  when it wakes, in a process whose main thread sleeps;
* ``C``: a C program that only calls ``nanosleep`` in a loop (compiled here with ``cc`` when one is found): no
  Python, no GIL, only the kernel's wake-up and the scheduler's accounting.

Each runs ``--seconds`` per period; CPU time comes from Linux's schedstat (the thread's, for Python; the whole
program's, less a run without sleeps, for C). Printed: us of CPU a wake-up, and the per-step floor it sets at
1, 10 and 30 steps/s for one wake-up a second.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

C_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
    double period = atof(argv[1]);
    long n = atol(argv[2]);
    struct timespec ts = {(time_t)period, (long)((period - (time_t)period) * 1e9)};
    for (long i = 0; i < n; i++) nanosleep(&ts, NULL);
    FILE *f = fopen("/proc/self/schedstat", "r");
    unsigned long long cpu_ns = 0, wait_ns = 0, runs = 0;
    if (f == NULL || fscanf(f, "%llu %llu %llu", &cpu_ns, &wait_ns, &runs) != 3) return 1;
    printf("%llu %llu\n", cpu_ns, runs);
    return 0;
}
"""


def schedstat(tid: int) -> tuple[int, int]:
    """CPU ns and times scheduled of one thread of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        cpu, _, runs = f.read().split()
    return int(cpu), int(runs)


def python_wake(period: float, seconds: float) -> float:
    """us of CPU per wake-up of an idle Python thread that waits on a queue with a timeout."""
    q: queue.SimpleQueue[None] = queue.SimpleQueue()
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                q.get(timeout=period)
            except queue.Empty:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(period * 2)  # past its first wake-ups
    assert thread.native_id is not None
    cpu0, _ = schedstat(thread.native_id)
    t0 = time.monotonic()
    time.sleep(seconds)
    cpu1, _ = schedstat(thread.native_id)
    wakes = (time.monotonic() - t0) / period
    stop.set()
    q.put(None)
    return (cpu1 - cpu0) / 1e3 / wakes


def c_wake(binary: Path, period: float, seconds: float) -> float:
    """us of CPU per wake-up of a C loop of nanosleep, less the same program without sleeps (its start-up)."""
    n = max(1, round(seconds / period))

    def run(count: int) -> int:
        out = subprocess.run([str(binary), str(period), str(count)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[0])

    base = min(run(0) for _ in range(5))
    return (run(n) - base) / 1e3 / n


def build_c(where: Path) -> Path | None:
    """The C loop, compiled with the first of cc, gcc, clang found; None without one."""
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        return None
    src, binary = where / "wake.c", where / "wake"
    src.write_text(C_SOURCE)
    done = subprocess.run([compiler, "-O2", str(src), "-o", str(binary)], capture_output=True)
    return binary if done.returncode == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--periods", default="1,0.1", help="wake-up periods in seconds, comma-separated")
    args = p.parse_args()
    if not os.path.exists("/proc/self/schedstat"):
        sys.exit("wake_floor: needs Linux's /proc/PID/schedstat")
    periods = [float(x) for x in args.periods.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_c(Path(tmp))
        print(f"{'way':<8} {'period s':>9} {'us/wake':>9}   per-step floor of one wake a second at 1 / 10 / 30 steps/s")
        for way in ("python", "C"):
            if way == "C" and binary is None:
                print("C        (no C compiler here: skipped)")
                continue
            for period in periods:
                us = python_wake(period, args.seconds) if way == "python" else c_wake(binary, period, args.seconds)
                print(f"{way:<8} {period:>9g} {us:>9.1f}   {us:.1f} / {us / 10:.1f} / {us / 30:.1f} us")


if __name__ == "__main__":
    main()
