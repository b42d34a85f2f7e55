"""Each of perfmon's threads in a training process: its CPU per second and per step, and how often it runs.

    python benchmarks/agent_threads.py [--job mlp|tiny] [--seconds 20] [--no-monitor] [--rates 10,100,1000]
                                       [--self-sampled]

One process runs ``agent_cpu.py``'s job under a whole agent, started as ``perfmon``'s bootstrap starts it (the
publisher, the socket server, the 1 Hz sampler, the recording, the hooks), with a monitor process reading all the
socket sends unless ``--no-monitor``. After a warm-up it reads Linux's schedstat of every thread of the process
(CPU time and the number of times it ran) over ``--seconds`` of training, and prints, per thread: ms of CPU per
second, us per step, and runs per second. ``agent_blocks.py`` gives the total with and without perfmon; this says
which thread it goes to.

``--rates`` paces the job instead (a step, then a sleep to the next slot) at each of the given step rates in turn,
a window of ``--seconds`` each, and adds the total of perfmon's threads per step at each rate: a fixed cost a second
(the 1 Hz sampler, the publisher's tick) shows as a per-step cost that grows as the rate falls. A rate of 0 is a
job that stopped stepping.

As ``perfmon train.py`` runs a script, the job's host and GPU readings are taken by another process (the
launcher's feed, here a process of its own) and sent to the job to record; ``--self-sampled`` runs the job's own
sampler thread instead, as a job started by ``perfmon.instrument()`` or torchrun does.
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

#: The launcher's feed, for the job's pid, until the job closes its socket.
FEEDER = """
import sys
from pathlib import Path
from perfmon import paths
from perfmon.monitor.host_feed import HostFeed
pid = int(sys.argv[1])
feed = HostFeed(pid, Path(sys.argv[2]), lambda: paths.pid_alive(pid)).start()
feed._thread.join()
"""


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
    p.add_argument("--self-sampled", action="store_true", help="the job's own sampler thread, not the launcher's feed")
    p.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=None,
                   help="comma-separated step rates to pace the job at, a window each (0: not stepping)")
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
        agent = Agent(run_dir, bootstrap._meta(__file__, sys.argv, False, run_dir), fed=not args.self_sampled)
        agent.start()
        feeder = None
        if not args.self_sampled and agent.server is not None:
            feeder = subprocess.Popen([sys.executable, "-c", FEEDER, str(os.getpid()), str(agent.server.path)],
                                      stdin=subprocess.DEVNULL)
            wait_for(lambda: agent.sampler._fed_last is not None, "the first fed sample")
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
        windows = []
        steps0, ran = agent.tracker.count, 0
        for rate in args.rates or [None]:
            if rate is not None:
                ran += paced(step, rate, 3.0)  # the publisher's tick and the idle backoff settle at this rate
            before, t0 = schedstats(), time.perf_counter()
            n = paced(step, rate, args.seconds)
            after, wall = schedstats(), time.perf_counter() - t0
            windows.append((rate, n, wall, before, after))
            ran += n
        agent.instrumentation.uninstall()
        agent.finish({"code": 0, "signal": None, "traceback": None, "exception": None})
        _api.set_agent(None)
        for helper in (reader, feeder):
            if helper is not None:
                helper.wait(timeout=60)
    if agent.tracker.count - steps0 < ran:
        raise SystemExit(f"the agent counted {agent.tracker.count - steps0} of {ran} steps")
    for rate, n, wall, before, after in windows:
        pace = "as fast as it goes" if rate is None else f"paced at {rate:g} steps/s"
        print(f"job {args.job} {pace}: {n} steps in {wall:.1f} s ({n / wall:.0f} steps/s), monitor "
              f"{'off' if args.no_monitor else 'connected'}, "
              f"{'sampled by the job' if args.self_sampled or feeder is None else 'sampled by a feed'}")
        total = 0
        for name, (cpu, runs) in sorted(after.items()):
            if name in before:
                d_cpu, d_runs = cpu - before[name][0], runs - before[name][1]
                total += d_cpu if name.startswith("perfmon") else 0
                per_step = f"{d_cpu / 1e3 / n:9.2f} us/step" if n else " " * 17
                print(f"  {name:<18} {d_cpu / 1e6 / wall:8.2f} ms/s {per_step} {d_runs / wall:7.1f} runs/s")
        per_step = f"{total / 1e3 / n:9.2f} us/step" if n else " " * 17
        print(f"  {'perfmon in all':<18} {total / 1e6 / wall:8.2f} ms/s {per_step}")


def paced(step, rate: float | None, seconds: float) -> int:
    """Run ``step`` for ``seconds``: as fast as it goes (``rate`` None), at ``rate`` steps a second (a sleep to
    each step's slot), or not at all (0). Returns the steps run."""
    t0 = time.perf_counter()
    end, n = t0 + seconds, 0
    if rate is None:
        while time.perf_counter() < end:
            for _ in range(50):
                step()
            n += 50
        return n
    if rate == 0:
        time.sleep(seconds)
        return 0
    while True:
        slot = t0 + n / rate
        if slot >= end:
            return n
        delay = slot - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        step()
        n += 1


if __name__ == "__main__":
    main()
