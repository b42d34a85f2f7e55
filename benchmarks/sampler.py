"""CPU cost of the agent's sampler thread: CPU seconds it uses per wall second.

    python benchmarks/sampler.py [--seconds 10] [--interval 1.0]

Runs the real Sampler (psutil host, NVML where present, allocator) inside this process,
with a few busy child processes standing in for DataLoader workers, and reads the
thread's own CPU time (time.thread_time) around each sample.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from perfmon.agent.runtime import Agent
from perfmon.analysis.report import load_recording


def _worker(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PERFMON_RUNTIME_DIR"] = str(Path(tmp) / "rt")
        stop = mp.Event()
        procs = [mp.Process(target=_worker, args=(stop,), daemon=True) for _ in range(a.workers)]
        for proc in procs:
            proc.start()
        agent = Agent(Path(tmp) / "run", {"script": "bench", "pid": os.getpid(), "start": time.time()},
                      sample_interval=a.interval)
        agent.start()
        time.sleep(a.seconds)  # the benchmark's own duration, not synchronisation
        agent.finish({"code": 0})
        stop.set()
        # the recording, as a monitor reads it: the job keeps no state of its own
        state = load_recording(Path(tmp) / "run")
    n = state.samples_seen
    cpu = state.sampler_cpu_s
    print(f"samples: {n} at {a.interval:g} s; sampler CPU {cpu * 1000:.1f} ms in total, "
          f"{cpu / max(n, 1) * 1000:.2f} ms per sample, "
          f"{cpu / (n * a.interval) * 100 if n else 0:.3f}% of one core")


if __name__ == "__main__":
    main()
