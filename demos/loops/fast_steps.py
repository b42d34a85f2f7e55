"""Very fast steps (thousands per second): a tiny update marked with perfmon.step().

    python fast_steps.py --seconds 10 [--report FILE]
Writes per-second step counts, and the training thread's CPU seconds in each of those seconds, to --report
(JSON: {"steps": [...], "cpu_s": [...]}) so tests can compare loop speed over time, also on a loaded machine.
"""

import argparse
import json
import time

import torch

import perfmon

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=10.0)
p.add_argument("--report")
a = p.parse_args()
w = torch.zeros(4)
per_second, cpu_per_second = [], []
count, second_start, end = 0, time.perf_counter(), time.perf_counter() + a.seconds
cpu_start = time.thread_time()
while True:
    w.add_(1.0)
    perfmon.step()
    count += 1
    now = time.perf_counter()
    if now - second_start >= 1.0:
        per_second.append(count)
        cpu_now = time.thread_time()
        cpu_per_second.append(cpu_now - cpu_start)
        count, second_start, cpu_start = 0, now, cpu_now
        if now >= end:
            break
if a.report:
    with open(a.report, "w") as f:
        json.dump({"steps": per_second, "cpu_s": cpu_per_second}, f)
print("steps", sum(per_second) + count)
