"""perfmon's whole cost inside one training process, agent on and off in alternating blocks.

    python benchmarks/agent_blocks.py [--job mlp|tiny] [--pairs 30] [--block-s 2.0] [--no-monitor]

Cross-process A/B runs (``agent_cpu.py``) cannot resolve 1% on a shared VM: two processes of the same program
differ by more than that (memory layout, which core, what else runs). Here one process runs the loop of
``agent_cpu.py``'s job in blocks of about ``--block-s`` seconds, alternately (ABBA) without perfmon and with a
whole agent, as ``perfmon`` starts it in a job:

* ``off``: plain torch; no perfmon thread exists (checked);
* ``on``: a fresh ``Agent`` started (its publisher, socket server and 1 Hz sampler threads, its recording), the
  torch hooks installed as ``perfmon``'s bootstrap installs them (the C hot path where built), and, unless
  ``--no-monitor``, a monitor process connected to the agent's socket reading everything the agent sends (as
  ``perfmon --headless`` and the dashboard are). The block is timed only after a warm-up and once the monitor is
  connected; afterwards the hooks are removed and the agent finished, outside the timed steps. Every on block
  must record exactly the steps it ran (the agent's own count is checked).

The agent's work comes in ticks (the publisher twice a second, the sampler once), so an on block starts after a
random warm-up of 0.1 to 1.1 s: over the pairs the ticks fall evenly across the timed steps, and the mean per-step
cost is the true average, not a lucky window between ticks. The host's own noise decides how many pairs are
needed: on a shared 2-core VM one pair's ratio scatters by ~10%, so 1% needs a few hundred pairs.

Printed, over the pairs (each on block against the off block next to it, so drifts of the machine cancel):
the in-loop wall-time ratio (goal on the ``mlp`` job: <= 1.01) and perfmon's CPU per step, all the process's
threads together (goal: <= 10 us), with the median, the mean and a 95% interval of the mean (t-based), and how
the CPU splits between the training thread (the hooks) and perfmon's own threads. And two parts of the
slowdown that the host's speed does not blur, from Linux's schedstat of the training thread: the time it sleeps
(waiting for the GIL that perfmon's threads hold) and the time it waits for a CPU, each on minus off, per step.

The mean of per-pair ratios reads high by about the variance of one block (x -> 1/x is convex: with blocks that
scatter by 10%, +1%), so the geometric mean of the ratios, with its interval, is printed too, and the
Hodges-Lehmann estimate of the log ratio with its Wilcoxon interval: a block's time on this host has heavy tails
(one block in twenty is 20-50% off, either way), which a mean and its t interval take at full weight.
``--control`` runs the same pairs with no perfmon in either block (an A/A test): what the method and the host read
by themselves.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: a monitor that reads and discards all the agent sends (what a connected monitor costs the job is the send)
READER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
while s.recv(1 << 16):
    pass
"""


class Block:
    """One timed block, per step in us: wall time, process CPU (every thread), the training thread's CPU, and,
    from Linux's schedstat of the training thread, its time runnable but waiting for a CPU (``queued``) and its
    time asleep (``blocked``: wall - on a CPU - queued; in this loop only the GIL puts it to sleep)."""

    def __init__(self, steps: int, wall: float, process: float, thread: float, sched: tuple[int, int] | None) -> None:
        self.wall = wall / steps * 1e6
        self.process = process / steps * 1e6
        self.thread = thread / steps * 1e6
        self.queued = self.blocked = float("nan")
        if sched is not None:
            on_cpu, queued = sched
            self.queued = queued / 1e3 / steps
            self.blocked = max(0.0, self.wall - (on_cpu + queued) / 1e3 / steps)


def schedstat() -> tuple[int, int] | None:
    """The calling thread's ns on a CPU and ns runnable waiting for one; None where Linux does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, queued, _ = f.read().split()
        return int(on_cpu), int(queued)
    except (OSError, ValueError):
        return None


def timed(step: Callable[[], None], n: int) -> Block:
    s0 = schedstat()
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(n):
        step()
    c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
    s1 = schedstat()
    sched = None if s0 is None or s1 is None else (s1[0] - s0[0], s1[1] - s0[1])
    return Block(n, w1 - w0, c1 - c0, t1 - t0, sched)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def on_block(step: Callable[[], None], n: int, warmup: int, run_dir: Path, monitor: bool) -> Block:
    """``warmup`` then ``n`` timed steps under a fresh agent, finished afterwards."""
    from perfmon import _api
    from perfmon.agent import bootstrap
    from perfmon.agent.runtime import Agent

    agent = Agent(run_dir, bootstrap._meta(__file__, sys.argv, False, run_dir))
    agent.start()
    _api.set_agent(agent)
    bootstrap.install_hooks(agent)
    reader = None
    try:
        if monitor and agent.server is not None:
            reader = subprocess.Popen([sys.executable, "-c", READER, str(agent.server.path)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            wait_for(lambda: agent.server.client_count == 1, "the monitor to connect")
        for _ in range(warmup):
            step()
        block = timed(step, n)
    finally:
        agent.instrumentation.uninstall()
        agent.finish({"code": 0, "signal": None, "traceback": None, "exception": None})
        _api.set_agent(None)
        if reader is not None:
            reader.wait(timeout=60)  # the agent closed the socket: the reader ends
    if agent.tracker.count != warmup + n:
        raise SystemExit(f"the agent counted {agent.tracker.count} steps of {warmup + n}")
    return block


def interval(diffs: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% interval (Student's t, two-sided)."""
    from math import sqrt

    t95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042,
           40: 2.021, 60: 2.000, 120: 1.980}
    df = len(diffs) - 1
    t = t95[max(k for k in t95 if k <= max(df, 1))]  # between two keys, the smaller df's t: the wider interval
    return statistics.fmean(diffs), t * statistics.stdev(diffs) / sqrt(len(diffs))


def hodges_lehmann(values: list[float]) -> tuple[float, float, float]:
    """The Hodges-Lehmann estimate of the centre of ``values`` (paired differences: the median of all pairwise
    means) and its distribution-free 95% interval from Wilcoxon's signed-rank statistic (normal approximation,
    fine from ~20 values). On this host a block's time has heavy tails (a neighbour's burst makes one block 30-50%
    slower, either way), which widen a t interval of the mean; this interval needs only that the noise be
    symmetric, which the alternating order of the blocks makes it."""
    n = len(values)
    walsh = sorted((values[i] + values[j]) / 2 for i in range(n) for j in range(i, n))
    k = int(n * (n + 1) / 4 - 1.959964 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
    k = min(max(k, 0), len(walsh) - 1)
    return statistics.median(walsh), walsh[k], walsh[len(walsh) - 1 - k]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("mlp", "tiny"), default="mlp")
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--block-s", type=float, default=1.0, help="seconds a timed block lasts, about")
    p.add_argument("--no-monitor", action="store_true", help="no monitor connected to the agent's socket")
    p.add_argument("--control", action="store_true",
                   help="A/A: 'on' blocks without perfmon (the same random warm-up): what the method alone reads")
    args = p.parse_args()
    # finish() leaves summary.json to the launcher when the launcher is this process's parent
    os.environ["PERFMON_LAUNCHER_PID"] = str(os.getppid())
    os.environ.setdefault("PERFMON_RUNTIME_DIR", tempfile.mkdtemp(prefix="perfmon-rt-"))

    import agent_cpu

    step = agent_cpu.make_step(args.job)
    for _ in range(200):
        step()
    probe = timed(step, 200)
    per_s = 1e6 / probe.wall
    n = max(100, int(args.block_s * per_s))
    rng = random.Random(0)
    threads = threading.active_count()
    pairs: list[tuple[Block, Block]] = []
    what = ("A/A control: no perfmon in any block" if args.control
            else f"monitor {'off' if args.no_monitor else 'connected'}")
    print(f"job {args.job}: {args.pairs} pairs of blocks of {n} steps (~{args.block_s:.1f} s), {what}", flush=True)
    with tempfile.TemporaryDirectory(prefix="perfmon-agent-blocks-") as tmp:
        for i in range(args.pairs):
            got: dict[str, Block] = {}
            for way in ("off", "on") if i % 2 == 0 else ("on", "off"):
                if way == "on":
                    warmup = int(rng.uniform(0.1, 1.1) * per_s) + 3  # the first 3 steps find the model
                    if args.control:
                        for _ in range(warmup):
                            step()
                        got[way] = timed(step, n)
                    else:
                        got[way] = on_block(step, n, warmup, Path(tmp) / f"run-{i}", not args.no_monitor)
                else:
                    if threading.active_count() != threads:
                        raise SystemExit(f"perfmon threads left running: {threading.enumerate()}")
                    for _ in range(int(0.1 * per_s)):
                        step()
                    got[way] = timed(step, n)
            on, off = got["on"], got["off"]
            pairs.append((on, off))
            print(f"pair {i:2d}: wall {off.wall:8.2f} -> {on.wall:8.2f} us ({on.wall / off.wall:.4f})   process CPU "
                  f"{off.process:8.2f} -> {on.process:8.2f} us ({on.process - off.process:+7.2f})", flush=True)
    report(pairs)


def report(pairs: list[tuple[Block, Block]]) -> None:
    ratios = [on.wall / off.wall for on, off in pairs]
    cpu = [on.process - off.process for on, off in pairs]
    hooks = [on.thread - off.thread for on, off in pairs]
    agent = [on.process - on.thread for on, _ in pairs]  # the job has one torch thread: the rest are perfmon's
    r_mean, r_half = interval(ratios)
    logs = [math.log(r) for r in ratios]
    g_mean, g_half = interval(logs)
    c_mean, c_half = interval(cpu)
    print(f"in-loop wall ratio: median {statistics.median(ratios):.4f}, mean {r_mean:.4f} +- {r_half:.4f} "
          f"(95%; goal <= 1.01 on the mlp job)")
    # the mean of ratios reads high by about the variance of a block (1/x is convex): the geometric mean does not
    print(f"  geometric mean {math.exp(g_mean):.4f} (95%: {math.exp(g_mean - g_half):.4f} to "
          f"{math.exp(g_mean + g_half):.4f})")
    h_mid, h_lo, h_hi = hodges_lehmann(logs)
    print(f"  Hodges-Lehmann {math.exp(h_mid):.4f} (95%, Wilcoxon: {math.exp(h_lo):.4f} to {math.exp(h_hi):.4f})")
    print(f"perfmon's CPU per step, all threads: median {statistics.median(cpu):+.2f} us, mean {c_mean:+.2f} "
          f"+- {c_half:.2f} us (95%; goal <= 10)")
    print(f"  training thread (hooks): median {statistics.median(hooks):+.2f} us; "
          f"perfmon's threads: median {statistics.median(agent):.2f} us, mean {statistics.fmean(agent):.2f} us")
    blocked = [on.blocked - off.blocked for on, off in pairs]
    queued = [on.queued - off.queued for on, off in pairs]
    if all(b == b for b in blocked):  # schedstat was read (not NaN)
        b_mean, b_half = interval(blocked)
        q_mean, q_half = interval(queued)
        print(f"training thread asleep (the GIL): {statistics.fmean(on.blocked for on, _ in pairs):.2f} us/step on, "
              f"{statistics.fmean(off.blocked for _, off in pairs):.2f} off: {b_mean:+.2f} +- {b_half:.2f} us/step; "
              f"waiting for a CPU: {q_mean:+.2f} +- {q_half:.2f} us/step (95%)")


if __name__ == "__main__":
    main()
