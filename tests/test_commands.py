"""Commands and profiler windows against a real training process on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from perfmon import messages
from perfmon.analysis.profile_window import export_text, summarise_window
from perfmon.messages.commands import Command
from perfmon.monitor.launch import Target, TrainingProcess
from perfmon.monitor.sources import LiveSource, wait_for_socket

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demos" / "train_mlp.py"
pytestmark = pytest.mark.e2e


class Session:
    """A launched job and a live connection that collects every message."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.proc = TrainingProcess(Target(str(DEMO), None, list(args)), tmp / "run").start()
        try:
            assert wait_for_socket(self.proc.socket_path, self.proc.alive, timeout=60)
            self.source = LiveSource(self.proc.socket_path, self.proc.run_dir)
            self.source.connect()
        except BaseException:  # a job of 100,000 steps left running would load every test after it for an hour
            for _ in range(3):  # SIGINT, SIGTERM, SIGKILL
                self.proc.stop()
            self.proc.wait()
            raise
        self.messages: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for msg in self.source.messages():
            with self._cond:
                self.messages.append(msg)
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for m in self.messages:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; last messages: {[m.get('type') for m in self.messages[-5:]]}"
                self._cond.wait(left)

    def result(self, name: str, done: bool = True, after: int = 0) -> dict:
        return self.wait_for(lambda m: m.get("kind") == "command_result" and m.get("name") == name
                             and m.get("done") == done and m.get("id", 0) >= after)

    def close(self) -> None:
        if self.proc.alive():
            self.proc.stop()
            self.proc.stop()
        self.proc.wait()
        self.source.close()


@pytest.fixture
def session(tmp_path):
    s = Session(tmp_path, "--steps", "100000")
    yield s
    s.close()


def test_profile_window_on_demand_and_busy_and_export(session):
    session.wait_for(lambda m: m.get("type") == "steps")
    assert session.source.send(Command("export", id=1))
    assert "no profiler window yet" in session.result("export", after=1)["message"]
    assert session.source.send(Command("profile", id=2))
    assert session.result("profile", done=False)["ok"] is True
    assert session.source.send(Command("profile", id=3))
    busy = session.wait_for(lambda m: m.get("kind") == "command_result" and m.get("id") == 3)
    assert busy["ok"] is False and "busy" in busy["message"]
    raw = session.wait_for(lambda m: m.get("type") == "profile")
    assert "top_ops" not in raw  # the job only captures and exports: the window is analysed outside it
    trace = Path(raw["trace"])
    assert trace.parent == session.proc.run_dir / "traces" and trace.name.endswith(".pt.trace.json")
    assert "traceEvents" in json.loads(trace.read_text())  # a Chrome trace
    prof = summarise_window(raw)
    names = [op["name"] for op in prof["top_ops"]]
    assert {"aten::addmm", "aten::mm"} & set(names)
    assert prof["active_steps"] == 3 and prof["device"] == "cpu" and prof["top_kernels"] == []
    assert prof["syncs_per_step"] is None and prof["device_busy"] is None  # no device on a CPU run
    assert abs(sum(op["share"] for op in prof["top_ops"]) - 1.0) < 0.5  # top 30 of all ops
    mm = next(op for op in prof["top_ops"] if op["name"] in ("aten::addmm", "aten::mm"))
    assert mm["calls"] >= 3 and mm["self_ms"] > 0
    # cached outside traces/ (tools read every .json there): a replay does not parse the trace again
    assert (session.proc.run_dir / "analysis" / (trace.name + ".summary.json")).is_file()
    assert [p.name for p in trace.parent.iterdir()] == [trace.name]
    assert session.source.send(Command("export", id=4))
    assert session.result("export", after=4)["trace"] == str(trace)
    out = export_text(messages.parse(prof), session.proc.run_dir)  # type: ignore[arg-type]
    assert out.parent == session.proc.run_dir / "exports" and out.read_text().count("aten::") >= 3


def test_cpu_cache_and_snapshot_say_plainly_there_is_no_cuda(session):
    session.wait_for(lambda m: m.get("type") == "steps")
    session.source.send(Command("empty_cache", id=1))
    assert session.result("empty_cache")["message"] == "no CUDA device: nothing to free"
    session.source.send(Command("memory_snapshot", id=2))
    snap = session.result("memory_snapshot")
    assert snap["ok"] is False and "n/a" in snap["message"]


def test_count_flops_of_one_step(session):
    session.wait_for(lambda m: m.get("type") == "steps")
    session.source.send(Command("count_flops", id=1))
    res = session.result("count_flops")
    # MLP 256-1024-1024-1, batch 64: forward 2*64*(256*1024 + 1024*1024 + 1024) FLOPs; backward ~2x
    forward = 2 * 64 * (256 * 1024 + 1024 * 1024 + 1024)
    assert 2 * forward < res["flops_per_step"] < 3.1 * forward


def test_a_command_flood_is_refused_instead_of_slowing_every_step(session):
    """What waits for a step end is scanned on the training thread at every step end: a monitor that sent 20,000
    FLOP counts for step 10**12 made the job's steps ~270x slower for the rest of the run. A step too far ahead,
    and a second FLOP count are each refused at once (and the queue has a cap), and the job's steps go on."""
    session.wait_for(lambda m: m.get("type") == "steps")
    session.source.send(Command("count_flops", id=1, at_step=10**12))
    far = session.result("count_flops", after=1)
    assert far["ok"] is False and "steps ahead" in far["message"]
    session.source.send(Command("count_flops", id=2, at_step=10**5))
    session.source.send(Command("count_flops", id=3, at_step=10**5))
    second = session.wait_for(lambda m: m.get("kind") == "command_result" and m.get("id") == 3)
    assert second["ok"] is False and "already being counted" in second["message"]
    before = sum(m.get("type") == "steps" for m in session.messages)
    session.wait_for(lambda _: sum(m.get("type") == "steps" for m in session.messages) > before + 1)  # steps go on


def test_periodic_windows_do_not_change_results(tmp_path):
    args = ["--steps", "60", "--log-every", "20", "--hidden", "256"]
    # one intra-op thread in both: on a loaded machine plain python alone once printed 15.9638 for 15.9637 (two
    # threads' partial sums may meet in another order); the claim here is perfmon's, not the BLAS's
    env = dict(os.environ, OMP_NUM_THREADS="1")
    plain = subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, check=True, env=env)
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "perfmon.cli", "--headless", "--interval", "100", "--profile-every", "20",
         "--run-dir", str(run), str(DEMO), *args], capture_output=True, text=True, timeout=240, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == plain.stdout
    # nothing of the profiler's in the script's stderr either: with profile_memory, torch's CPU allocator wrote
    # "[W... CPUAllocator.cpp] Memory block of unknown size..." there from the first window on
    assert (run / "stderr.log").read_text() == plain.stderr
    report = json.loads(subprocess.run([sys.executable, "-m", "perfmon.cli", "report", str(run), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert len(report["profiles"]) >= 2
    for prof in report["profiles"]:  # analysed by `perfmon report` from each window's trace
        assert {"aten::addmm", "aten::mm"} & {op["name"] for op in prof["top_ops"]}
        assert "traceEvents" in json.loads(Path(prof["trace"]).read_text())
    assert not list((run / "traces").glob("*.tmp"))


@pytest.mark.parametrize("profile_memory", [False, True], ids=["default", "profile_memory"])
def test_a_window_records_allocations_only_when_asked(tmp_path, profile_memory):
    """``--profile-memory``: the trace has the allocator's ``[memory]`` events; without it, none (and torch prints
    nothing about blocks allocated before the window)."""
    import torch

    from perfmon.agent.profiler import ProfilerWindow

    done = threading.Event()
    published: list[dict | None] = []
    errors: list[BaseException] = []
    window = ProfilerWindow(tmp_path, 0, 1, 1, lambda: 0, lambda msg: (published.append(msg), done.set()),
                            lambda where, exc: errors.append(exc), "test", profile_memory=profile_memory)
    before = [torch.randn(64, 64) for _ in range(4)]  # made before the window, freed inside it
    window.start()  # warm-up step
    assert window.step() is False  # the active step
    del before
    (torch.randn(64, 64) @ torch.randn(64, 64)).sum()
    assert window.step() is True  # stopped, and exported on a worker thread
    assert done.wait(60) and not errors
    events = json.loads(Path(published[0]["trace"]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert any(e.get("name") == "[memory]" for e in events) is profile_memory


@pytest.mark.parametrize(("wait", "warmup", "active"), [(1, 1, 3), (0, 1, 1), (0, 0, 3), (2, 0, 1), (3, 2, 4)])
def test_the_window_schedule_is_torchs_without_a_warning_in_the_job(wait, warmup, active):
    """torch.profiler.schedule warns (a Python warning: in the script's stderr) when warmup is 0; perfmon's window
    schedule does what torch's does with repeat=1, quietly (the launcher says it instead)."""
    import warnings

    import torch

    from perfmon.agent.profiler import window_schedule

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = window_schedule(wait, warmup, active)
        actions = [ours(i) for i in range(12)]
    assert caught == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    assert actions == [theirs(i) for i in range(12)]
    assert actions.count(torch.profiler.ProfilerAction.RECORD_AND_SAVE) == 1


def test_periodic_traces_are_dropped_in_window_order_whatever_order_their_exports_end(tmp_path):
    """Exports overlap (a big trace is still being written while the next window ends): the newest windows' traces
    stay, by the window's step, and traces added from many threads at once are all accounted for."""
    import threading

    from perfmon import paths
    from perfmon.agent.profiler import PeriodicTraces

    (tmp_path / "traces").mkdir()
    (tmp_path / "analysis").mkdir()

    def trace(step: int) -> str:
        path = tmp_path / "traces" / f"t{step:03}.pt.trace.json"
        path.write_text("{}")
        paths.trace_analysis(path).write_text("{}")  # analysed
        return str(path)

    keeper = PeriodicTraces(keep=2)
    for step in (10, 30, 20, 50, 40):  # exports ending out of order
        keeper.add(trace(step), step)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["t040.pt.trace.json", "t050.pt.trace.json"]

    keeper = PeriodicTraces(keep=3)
    steps = list(range(100, 160))
    made = {step: trace(step) for step in steps}
    threads = [threading.Thread(target=keeper.add, args=(made[step], step)) for step in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = sorted(p.name for p in (tmp_path / "traces").iterdir() if p.name >= "t100")
    assert left == [f"t{s}.pt.trace.json" for s in steps[-3:]]
