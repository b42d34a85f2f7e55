"""Is a profiler window's cost confined to its steps? Steps/s outside windows, periodic profiling on vs off.

    python benchmarks/profile_overhead.py [--steps 600] [--every 100] [--runs 3]

Runs demos/train_mlp.py under `perfmon --headless` with and without `--profile-every`, then compares the
median step time of the steps outside any window (the recording marks window start/stop), and reports how
many steps each window slowed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from perfmon import protocol
from perfmon.monitor.sources import ReplaySource

DEMO = Path(__file__).resolve().parent.parent / "demos" / "train_mlp.py"


def step_times(run: Path) -> tuple[list[float], list[float]]:
    """(outside windows, inside windows) step durations in ms."""
    windows: list[list[float]] = []
    rows: list[dict] = []
    for msg in ReplaySource(run).messages():
        if msg["type"] == "event" and msg.get("kind") == "window_started":
            windows.append([msg["t"], float("inf")])
        elif msg["type"] == "event" and msg.get("kind") == "window_stopped" and windows:
            windows[-1][1] = msg["t"]
        elif msg["type"] == "steps":
            rows += protocol.step_rows_to_dicts(msg)
    out, inside = [], []
    for r in rows[30:]:  # past warm-up
        start = r["t"] - r["dur_ms"] / 1000
        (inside if any(start < b and r["t"] > a for a, b in windows) else out).append(r["dur_ms"])
    return out, inside


def run(tmp: Path, name: str, extra: list[str], steps: int) -> tuple[list[float], list[float]]:
    d = tmp / name
    subprocess.run([sys.executable, "-m", "perfmon.cli", "--headless", "--interval", "1000", "--run-dir", str(d),
                    *extra, str(DEMO), "--steps", str(steps)], check=True, capture_output=True)
    return step_times(d)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    off_all, on_out, on_in = [], [], []
    with tempfile.TemporaryDirectory() as t:
        for i in range(a.runs):
            off, _ = run(Path(t), f"off{i}", [], a.steps)
            out, inside = run(Path(t), f"on{i}", ["--profile-every", str(a.every)], a.steps)
            off_all.append(statistics.median(off))
            on_out.append(statistics.median(out))
            on_in.append(statistics.median(inside) if inside else float("nan"))
            print(f"run {i + 1}: no profiling {off_all[-1]:.2f} ms/step; with windows every {a.every}: outside "
                  f"{on_out[-1]:.2f} ms/step, inside {on_in[-1]:.2f} ms/step ({len(inside)} steps in windows)")
    ratio = statistics.median(on_out) / statistics.median(off_all)
    print(f"outside windows vs no profiling: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); "
          f"inside windows: {statistics.median(on_in) / statistics.median(off_all):.2f}x")


if __name__ == "__main__":
    main()
