"""A 1,000,000-step synthetic stream through the monitor: memory stays bounded, frames stay fast.

    python benchmarks/scale.py [--steps 1000000]

Feeds ``steps`` messages (2,000 rows each, like the agent sends) plus 1 Hz samples into
RunState with the rules engine evaluated once a simulated second, and reports RSS after
each 100k steps; then renders the dashboard on the final state and times its frames.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time

import psutil

from perfmon import protocol
from perfmon.analysis.rules import Engine
from perfmon.analysis.state import RunState


def feed(steps: int, rate: float = 10_000.0) -> tuple[RunState, list[tuple[int, float]]]:
    rng = random.Random(0)
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="scale.py", argv=["scale.py"], pid=1, start=1e9, cuda=False))
    engine = Engine()
    proc = psutil.Process()
    seq, t, memory = 2, 1e9, []
    fields = list(protocol.STEP_FIELDS)
    next_second = t + 1
    for base in range(1, steps + 1, 2000):
        rows = []
        for i in range(base, min(base + 2000, steps + 1)):
            d, f, b, o, x = (rng.uniform(0.005, 0.02) for _ in range(5))
            dur = d + f + b + o + x
            t += 1 / rate
            rows.append([i, t, dur, d, f, b, o, x, 32])
        state.apply(protocol.message("steps", fields=fields, rows=rows, seq=seq))
        seq += 1
        while t >= next_second:
            state.apply(protocol.message("sample", seq=seq, t=next_second, host={"cpu_percent": 95.0, "rss_bytes": 2**30,
                                                                                  "cpu_count": 2}, gpus=[]))
            seq += 1
            engine.update(state)
            next_second += 1
        if (base - 1) % 100_000 == 0:
            gc.collect()
            memory.append((base - 1, proc.memory_info().rss))
    return state, memory


async def frames(state: RunState, n: int = 20) -> list[float]:
    from perfmon.tui.app import PerfmonApp

    app = PerfmonApp(state, None, None)
    times = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for _ in range(n):
            t0 = time.perf_counter()
            app.refresh_data()  # derive every panel's info from the state and redraw what changed
            app.screen.refresh()
            await pilot.pause()
            times.append((time.perf_counter() - t0) * 1000)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    a = p.parse_args()
    t0 = time.perf_counter()
    state, memory = feed(a.steps)
    elapsed = time.perf_counter() - t0
    print(f"fed {a.steps:,} steps in {elapsed:.1f} s ({elapsed / a.steps * 1e6:.1f} us/step)")
    for step, rss in memory:
        print(f"  after {step:>9,} steps: RSS {rss / 2**20:7.1f} MiB")
    growth = memory[-1][1] - memory[1][1] if len(memory) > 2 else 0
    print(f"RSS growth from 100k to {memory[-1][0]:,} steps: {growth / 2**20:.1f} MiB")
    times = sorted(asyncio.run(frames(state)))
    print(f"dashboard frame at 120x40 on the final state: median {times[len(times) // 2]:.1f} ms, "
          f"max {times[-1]:.1f} ms over {len(times)} frames")


if __name__ == "__main__":
    main()
