"""Each of perfmon's threads in a training process: its CPU per second and per step, and how often it runs.

    python benchmarks/agent_threads.py [--job mlp|tiny] [--seconds 20] [--no-monitor]

One process runs ``agent_cpu.py``'s job under a whole agent, started as ``perfmon``'s bootstrap starts it (the
publisher, the socket server, the 1 Hz sampler, the recording, the hooks), with a monitor process reading all the
socket sends unless ``--no-monitor``. After a warm-up it reads Linux's schedstat of every thread of the process
(CPU time and the number of times it ran) over ``--seconds`` of training, and prints, per thread: ms of CPU per
second, us per step, and runs per second. ``agent_blocks.py`` gives the total with and without perfmon; this says
which thread it goes to.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_blocks import READER, wait_for  # noqa: E402


def schedstats() -> dict[str, tuple[int, int]]:
    """Thread name -> (ns on a CPU, times it ran), for the threads Python knows."""
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                on_cpu, _, runs = f.read().split()
        except (OSError, ValueError):
            continue
        out[t.name] = (int(on_cpu), int(runs))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("mlp", "tiny"), default="mlp")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--no-monitor", action="store_true")
    args = p.parse_args()
    os.environ["PERFMON_LAUNCHER_PID"] = str(os.getppid())  # summary.json is left to a launcher
    os.environ.setdefault("PERFMON_RUNTIME_DIR", tempfile.mkdtemp(prefix="perfmon-rt-"))
    if not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        raise SystemExit("needs Linux's /proc/PID/task/TID/schedstat")

    import agent_cpu

    from perfmon import _api
    from perfmon.agent import bootstrap
    from perfmon.agent.runtime import Agent

    step = agent_cpu.make_step(args.job)
    for _ in range(200):
        step()
    with tempfile.TemporaryDirectory(prefix="perfmon-agent-threads-") as tmp:
        run_dir = Path(tmp) / "run"
        agent = Agent(run_dir, bootstrap._meta(__file__, sys.argv, False, run_dir))
        agent.start()
        _api.set_agent(agent)
        bootstrap.install_hooks(agent)
        reader = None
        if not args.no_monitor and agent.server is not None:
            reader = subprocess.Popen([sys.executable, "-c", READER, str(agent.server.path)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            wait_for(lambda: agent.server.client_count == 1, "the monitor to connect")
        end = time.perf_counter() + 3.0  # past the agent's start: the first model count, the hello
        while time.perf_counter() < end:
            step()
        before, steps0, t0 = schedstats(), agent.tracker.count, time.perf_counter()
        end = t0 + args.seconds
        n = 0
        while time.perf_counter() < end:
            for _ in range(50):
                step()
            n += 50
        after, wall = schedstats(), time.perf_counter() - t0
        agent.instrumentation.uninstall()
        agent.finish({"code": 0, "signal": None, "traceback": None, "exception": None})
        _api.set_agent(None)
        if reader is not None:
            reader.wait(timeout=60)
    if agent.tracker.count - steps0 < n:
        raise SystemExit(f"the agent counted {agent.tracker.count - steps0} of {n} steps")
    print(f"job {args.job}: {n} steps in {wall:.1f} s ({n / wall:.0f} steps/s), monitor "
          f"{'off' if args.no_monitor else 'connected'}")
    for name, (cpu, runs) in sorted(after.items()):
        if name in before:
            d_cpu, d_runs = cpu - before[name][0], runs - before[name][1]
            print(f"  {name:<18} {d_cpu / 1e6 / wall:8.2f} ms/s {d_cpu / 1e3 / n:9.2f} us/step "
                  f"{d_runs / wall:7.1f} runs/s")


if __name__ == "__main__":
    main()
