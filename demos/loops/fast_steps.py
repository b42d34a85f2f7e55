"""Very fast steps (thousands per second): a tiny update marked with perfmon.step().

    python fast_steps.py --seconds 10 [--report FILE]
Writes per-second step counts to --report (JSON) so tests can compare loop speed over time.
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
per_second = []
count, second_start, end = 0, time.perf_counter(), time.perf_counter() + a.seconds
while True:
    w.add_(1.0)
    perfmon.step()
    count += 1
    now = time.perf_counter()
    if now - second_start >= 1.0:
        per_second.append(count)
        count, second_start = 0, now
        if now >= end:
            break
if a.report:
    with open(a.report, "w") as f:
        json.dump(per_second, f)
print("steps", sum(per_second) + count)
