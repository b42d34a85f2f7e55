"""The dashboard's own CPU use at its default refresh, in a real terminal (a pty), on a live job.

    python benchmarks/dashboard_cpu.py [--seconds 20] [--warmup 6] [--size 120x40]

Starts ``perfmon SCRIPT`` in a pseudo-terminal of the given size (as a user's SSH session would
be), lets it warm up, then reads the monitor process's CPU time (user + system, its own process
only: the training job is a separate process) over ``--seconds`` of wall time. Two jobs: the MLP
demo (~90 steps/s, telemetry at 1 Hz) and ``demos/loops/fast_steps.py`` (tens of thousands of
steps/s, the heaviest stream the monitor folds). Goal: < 5% of one core.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "mlp": [str(ROOT / "demos" / "train_mlp.py"), "--steps", "1000000"],
    "fast-steps": [str(ROOT / "demos" / "loops" / "fast_steps.py"), "--seconds", "600"],
}


def _drain(fd: int, stop: threading.Event) -> None:
    """Read the terminal's output as a terminal would, so the monitor never blocks on a full pty."""
    while not stop.is_set():
        try:
            if not os.read(fd, 65536):
                return
        except OSError:
            return


def measure(job: list[str], seconds: float, warmup: float, cols: int, rows: int) -> dict[str, float]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows))
        mon = subprocess.Popen([sys.executable, "-m", "perfmon.cli", "--run-dir", f"{tmp}/run", *job],
                               stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        stop = threading.Event()
        reader = threading.Thread(target=_drain, args=(master, stop), daemon=True)
        reader.start()
        try:
            proc = psutil.Process(mon.pid)
            time.sleep(warmup)
            c0, t0 = proc.cpu_times(), time.monotonic()
            time.sleep(seconds)
            c1, t1 = proc.cpu_times(), time.monotonic()
        finally:
            for child in psutil.Process(mon.pid).children(recursive=True):  # the job runs in its own session
                child.kill()
            mon.kill()
            mon.wait()
            stop.set()
            os.close(master)
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"cpu_s": cpu, "wall_s": t1 - t0, "percent_of_core": 100.0 * cpu / (t1 - t0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--size", default="120x40", help="terminal COLSxROWS")
    p.add_argument("--job", choices=sorted(JOBS), action="append", help="default: both")
    a = p.parse_args()
    cols, rows = (int(x) for x in a.size.split("x"))
    for name in a.job or ["mlp", "fast-steps"]:
        r = measure(JOBS[name], a.seconds, a.warmup, cols, rows)
        print(f"{name:<11} {a.size}: monitor CPU {r['cpu_s']:.2f} s over {r['wall_s']:.1f} s = "
              f"{r['percent_of_core']:.1f}% of one core", flush=True)


if __name__ == "__main__":
    main()
