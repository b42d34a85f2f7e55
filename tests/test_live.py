"""The agent's socket and recording with a real in-process agent (no torch needed)."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
import tracemalloc

import pytest

from perfmon import paths, protocol
from perfmon.agent import server as server_mod
from perfmon.agent.runtime import Agent
from perfmon.analysis.state import RunState
from perfmon.monitor.sources import LiveSource, ReplaySource


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    meta = {"script": "train.py", "argv": ["train.py"], "pid": os.getpid(), "start": 1000.0, "run_dir": str(tmp_path / "run")}
    a = Agent(tmp_path / "run", meta, tick=0.05)
    a.start()
    yield a
    if a.server is not None:
        a.finish({"code": 0})


def publish_steps(agent, start, n, per_msg=1):
    for i in range(start, start + n, per_msg):
        rows = [[j, 1000.0 + j, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 8] for j in range(i, i + per_msg)]
        agent.publish(protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=rows))


def collect(source, out, done):
    for msg in source.messages():
        out.append(msg)
    done.set()


def test_socket_and_dir_permissions(agent):
    rt = paths.runtime_dir()
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    sock = paths.socket_path(os.getpid())
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    disc = json.loads(paths.discovery_path(os.getpid()).read_text())
    assert disc["socket"] == str(sock) and disc["protocol"] == protocol.VERSION


def test_live_source_backfills_then_streams_everything_in_order(agent):
    publish_steps(agent, 1, 30)  # before the monitor connects: must come from the recording
    source = LiveSource(paths.socket_path(os.getpid()), agent.run_dir)
    source.connect()
    got, done = [], threading.Event()
    threading.Thread(target=collect, args=(source, got, done), daemon=True).start()
    publish_steps(agent, 31, 30)
    agent.finish({"code": 0})
    assert done.wait(10)
    seqs = [m["seq"] for m in got if "seq" in m]
    assert seqs == list(range(1, seqs[-1] + 1))
    state = RunState()
    for m in got:
        state.apply(m)
    assert state.steps == 60 and state.exit is not None and state.exit.code == 0
    assert not os.path.exists(paths.socket_path(os.getpid()))


def test_slow_monitor_gets_gaps_refilled_from_recording(agent, monkeypatch):
    monkeypatch.setattr(server_mod, "CLIENT_BUFFER", 4096)
    source = LiveSource(paths.socket_path(os.getpid()), agent.run_dir)
    source.connect()
    publish_steps(agent, 1, 3000, per_msg=1)  # nobody reads meanwhile: the agent must drop, not block
    assert agent.server is not None
    dropped = sum(c.dropped for c in agent.server._clients.values())
    assert dropped > 0
    got, done = [], threading.Event()
    threading.Thread(target=collect, args=(source, got, done), daemon=True).start()
    publish_steps(agent, 3001, 10)
    agent.finish({"code": 0})
    assert done.wait(20)
    state = RunState()
    for m in got:
        state.apply(m)
    assert state.steps == 3010
    assert state.totals["step"].hist.n == 3010  # no step lost, none counted twice


def test_commands_are_answered_and_garbage_is_refused(agent):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(paths.socket_path(os.getpid())))
    f = sock.makefile("rb")
    assert json.loads(f.readline())["type"] == "hello"
    sock.sendall(b"garbage\n")
    assert json.loads(f.readline())["ok"] is False
    sock.sendall(protocol.encode(protocol.message("command", name="shell", cmd="id")))
    reply = json.loads(f.readline())
    assert reply["ok"] is False and "not allowed" in reply["error"]
    sock.sendall(protocol.encode(protocol.message("command", name="profile", id=7)))
    reply = json.loads(f.readline())
    assert reply["kind"] == "command_result" and reply["id"] == 7
    sock.close()
    publish_steps(agent, 1, 5)  # the agent is still fine
    assert agent.errors.get("server", 0) == 0


def test_unwritable_run_dir_stops_recording_once_and_training_goes_on(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    a = Agent(blocker / "run", {"script": "x", "pid": os.getpid(), "start": 0.0})
    a.start()
    publish_steps(a, 1, 5)
    a.finish({"code": 0})
    err = capfd.readouterr().err
    assert err.count("recording stopped") == 1 and "training continues" in err
    assert a._seq >= 7  # hello, the 5 steps messages and the exit were still numbered and served


def test_recording_leaves_the_last_of_the_disk_to_the_script(tmp_path, monkeypatch, capfd):
    """Less free space than the reserve: the recording stops before it would fill the disk the script logs and saves
    checkpoints to, says so once with the numbers, and the job is still served."""
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    free_mb = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / 2**20
    monkeypatch.setenv("PERFMON_DISK_RESERVE_MB", str(free_mb * 4 + 1024))  # the real free space, under the reserve
    a = Agent(tmp_path / "run", {"script": "x", "pid": os.getpid(), "start": 0.0})
    assert not a.recorder.active
    a.start()
    publish_steps(a, 1, 5)
    a.finish({"code": 0})
    err = capfd.readouterr().err
    assert err.count("recording stopped") == 1 and "MiB left on the disk" in err and "training continues" in err
    assert a._seq >= 7


def test_recording_stops_when_the_disk_fills_up_while_it_writes(tmp_path, monkeypatch):
    """The free space is looked at again every few MiB written (a stand-in for a disk that fills: statvfs answers
    with less space from its second call on)."""
    from types import SimpleNamespace

    from perfmon.agent import recorder as recorder_mod

    monkeypatch.setenv("PERFMON_DISK_RESERVE_MB", "100")
    answers = iter([1000, 99])  # MiB free: plenty at the start, then under the reserve
    monkeypatch.setattr(recorder_mod.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=next(answers) * 2**20, f_frsize=1))
    rec = recorder_mod.Recorder(tmp_path / "run")
    line = b"x" * 1023 + b"\n"
    written = 0
    while rec.write(line):
        written += len(line)
    assert written + len(line) == recorder_mod.CHECK_EVERY  # the write that crossed the check was the last
    assert rec.error is not None and "99 MiB left" in rec.error and not rec.active
    assert (tmp_path / "run" / "events.jsonl").stat().st_size == recorder_mod.CHECK_EVERY  # whole lines only


def test_an_attached_monitor_hears_that_the_recording_stopped(agent, monkeypatch):
    """The warning goes out with a seq of its own (with the last one's, a monitor dropped it as already had)."""
    from perfmon.agent import recorder as recorder_mod

    source = LiveSource(paths.socket_path(os.getpid()), agent.run_dir)
    source.connect()
    got, done = [], threading.Event()
    threading.Thread(target=collect, args=(source, got, done), daemon=True).start()
    deadline = time.monotonic() + 60
    # served live from here on: what is published after the recording stops is nowhere else to refill from
    while not any(m.get("type") == "hello" for m in list(got)):
        assert time.monotonic() < deadline, "the monitor was never greeted"
        time.sleep(0.01)
    publish_steps(agent, 1, 5)
    monkeypatch.setattr(recorder_mod, "CHECK_EVERY", 1)  # the next write looks, and finds the disk short
    monkeypatch.setattr(recorder_mod, "short_of_space", lambda path, reserve=None: "1 MiB left on the disk of X")
    publish_steps(agent, 6, 5)
    agent.finish({"code": 0})
    assert done.wait(10)
    warnings = [m.get("message") for m in got if m.get("kind") == "warning"]
    assert warnings == ["recording stopped: 1 MiB left on the disk of X; training continues"]
    state = RunState()
    for m in got:
        state.apply(m)
    assert state.steps == 10  # the monitor still got every step


def test_a_slow_recording_looks_at_the_free_space_every_minute_too(tmp_path, monkeypatch):
    """A run that records little (slow steps) may go hours between 4 MiB; the script may fill the disk meanwhile."""
    from types import SimpleNamespace

    from perfmon.agent import recorder as recorder_mod

    monkeypatch.setenv("PERFMON_DISK_RESERVE_MB", "100")
    answers = iter([1000, 99])
    monkeypatch.setattr(recorder_mod.os, "statvfs",
                        lambda path: SimpleNamespace(f_bavail=next(answers) * 2**20, f_frsize=1))
    now = [1000.0]
    monkeypatch.setattr(recorder_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))  # the recorder's clock only
    rec = recorder_mod.Recorder(tmp_path / "run")
    assert rec.write(b"one step\n") and rec.write(b"another\n")  # within the minute: not looked at
    now[0] += recorder_mod.CHECK_EVERY_S
    assert not rec.write(b"a minute later\n") and "99 MiB left" in (rec.error or "")


def test_replay_source_skips_garbage_and_partial_last_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    good = [protocol.message("hello", seq=1, script="x", start=1.0),
            protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=[[1, 2.0, 5, 1, 1, 1, 1, 1, None]], seq=2)]
    data = b"".join(protocol.encode(m) for m in good)
    (run / "events.jsonl").write_bytes(b"oops not json\n" + data + b'{"v":1,"type":"steps","rows":[[2')
    source = ReplaySource(run)
    msgs = list(source.messages())
    assert [m["type"] for m in msgs] == ["hello", "steps"]
    assert source.skipped == 1


def test_a_large_backlog_goes_out_in_bounded_lines(agent):
    from perfmon.agent.steps import BEGIN, BOUNDARY, END, OPTIMIZER_CREATED

    agent.emit(OPTIMIZER_CREATED)
    for i in range(25_000):  # a publisher that fell behind: one flush sees 25k steps
        if i:
            agent.emit(BOUNDARY)  # the hooks commit the previous step as the next one begins
        agent.emit(BEGIN, "optimizer")
        agent.emit(END, "optimizer")
    agent.finish({"code": 0})
    lines = (agent.run_dir / "events.jsonl").read_bytes().splitlines()
    assert max(len(line) for line in lines) < protocol.MAX_LINE // 10
    state = RunState()
    for msg in ReplaySource(agent.run_dir).messages():
        state.apply(msg)
    assert state.steps == 25_000


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_connection_from_another_user_is_refused(tmp_path, monkeypatch):
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="perfmon-peer-")  # reachable by others, unlike pytest's tmp dirs
    os.chmod(base, 0o755)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", os.path.join(base, "rt"))
    agent = Agent(tmp_path / "run", {"script": "x", "pid": os.getpid(), "start": 0.0}, sample_interval=None)
    agent.start()
    sock = paths.socket_path(os.getpid())
    # open the doors (dir 0700, socket 0600 normally keep others out); the peer check must still refuse
    os.chmod(sock.parent, 0o755)
    os.chmod(sock, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become "nobody" and try to read the stream
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(sock))
            os.write(w, str(len(s.recv(4096))).encode())
        except BaseException as exc:  # noqa: BLE001
            os.write(w, f"error {exc}".encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = os.read(r, 200).decode()
    try:
        assert got == "0"  # closed at once, not even a greeting
        assert agent.server is not None and agent.server.refused == 1
    finally:
        agent.finish({"code": 0})
        shutil.rmtree(base, ignore_errors=True)


def test_exit_waits_for_a_slow_publisher_and_loses_no_step(agent, monkeypatch):
    """A publisher far behind at exit (a loaded machine) still records every step: no timer cuts it short."""
    import time as _time

    from perfmon.agent import runtime
    from perfmon.agent.steps import BEGIN, BOUNDARY, END, OPTIMIZER_CREATED

    monkeypatch.setattr(runtime, "STEPS_PER_MESSAGE", 50)
    slow = agent._publish_steps

    def crawling(records, outside, live_from):  # ~8 s for the whole backlog, longer than any old exit timeout
        _time.sleep(0.4)
        slow(records, outside, live_from)

    monkeypatch.setattr(agent, "_publish_steps", crawling)
    agent.emit(OPTIMIZER_CREATED)
    for i in range(1000):
        if i:
            agent.emit(BOUNDARY)
        agent.emit(BEGIN, "optimizer")
        agent.emit(END, "optimizer")
    agent.finish({"code": 0})
    state = RunState()
    for msg in ReplaySource(agent.run_dir).messages():
        state.apply(msg)
    assert state.steps == 1000
    assert state.exit is not None


def test_publish_re_entered_from_a_signal_handler_does_not_deadlock(agent):
    """SIGTERM can land while the training thread is inside publish(): the handler publishes the exit."""
    import threading as _threading

    done = _threading.Event()

    def nested() -> None:
        with agent._lock:  # the main thread holds the publish lock, as when a signal lands inside publish()
            agent.publish(protocol.message("event", kind="warning", message="from a handler", t=0.0))
        done.set()

    nested()  # with a plain Lock this never returns
    assert done.is_set()


def test_what_a_handler_defers_runs_on_its_own_thread_once_the_outer_publish_returns(agent):
    import threading as _threading

    ran: list[int] = []
    assert not agent.defer_while_publishing(lambda: ran.append(1))  # not inside publish: the caller goes on
    with agent._lock:  # inside publish, as a signal handler finds it
        assert agent.defer_while_publishing(lambda: ran.append(_threading.get_ident()))
        agent.publish(protocol.message("event", kind="warning", message="nested", t=0.0))
        assert ran == []  # the outer publish has not returned yet
    other = _threading.Thread(target=agent.publish,
                              args=(protocol.message("event", kind="warning", message="other", t=0.0),))
    other.start()
    other.join()
    assert ran == []  # another thread's publish never runs it (a handler must run on the main thread)
    agent.publish(protocol.message("event", kind="warning", message="mine", t=0.0))
    assert ran == [_threading.get_ident()]
    agent.publish(protocol.message("event", kind="warning", message="again", t=0.0))
    assert ran == [_threading.get_ident()]  # once


SIGTERM_INSIDE_PUBLISH = """
import os, signal, sys, time
from pathlib import Path
from perfmon import protocol
from perfmon.agent import bootstrap, exits
from perfmon.agent.runtime import Agent
from perfmon.agent.steps import BEGIN, BOUNDARY, END, OPTIMIZER_CREATED

run = Path(sys.argv[1])
agent = Agent(run, {"script": "t.py", "argv": ["t.py"], "pid": os.getpid(), "start": 1.0}, tick=0.05,
              sample_interval=None)
agent.start()
exits.install_sigterm(agent, bootstrap.finish_agent)
agent.events.append((OPTIMIZER_CREATED, 0.0, None, None))
t = 1.0
for i in range(2000):
    if i:
        agent.events.append((BOUNDARY, t, None, None))
    for ph in ("forward", "backward", "optimizer"):
        agent.events.append((BEGIN, t, ph, None))
        t += 0.001
        agent.events.append((END, t, ph, None))
write = agent.recorder.write

def slow_write(data):
    if b"from the loop" in data:  # the main thread, inside publish(), holding its lock
        time.sleep(0.5)  # the publisher drains the 2,000 steps meanwhile and waits for the lock
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, at the next bytecode
    write(data)

agent.recorder.write = slow_write
agent.publish(protocol.message("event", kind="warning", message="from the loop", t=0.0))
time.sleep(60)  # never reached: SIGTERM ends the process when that publish returns
"""


def test_sigterm_inside_publish_finishes_once_publish_returns_and_loses_no_step(tmp_path):
    """SIGTERM landing while the main thread is inside publish(), with the publisher thread holding a drained
    batch and waiting for the lock that publish holds: the handler must not finish from there (it would wait for
    the publisher, which waits for it: a 2 x STALL_S hang, and the batch lost); it finishes as publish returns."""
    import signal
    import subprocess
    import sys
    import time as _time

    from perfmon.agent import runtime

    env = dict(os.environ, PERFMON_RUNTIME_DIR=str(tmp_path / "rt"), PERFMON_LAUNCHER_PID=str(os.getpid()))
    t0 = _time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SIGTERM_INSIDE_PUBLISH, str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=120)
    took = _time.monotonic() - t0
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    state = RunState()
    for msg in ReplaySource(tmp_path / "run").messages():
        state.apply(msg)
    assert state.steps == 2000, proc.stderr
    assert state.exit is not None and state.exit.signal == "SIGTERM"
    assert "agent" not in proc.stderr  # no internal error, no stall timeout
    assert took < runtime.STALL_S, took  # the publisher was never waited for


def test_a_fast_job_sends_monitors_a_bulk_summary_and_records_every_row(agent):
    """Over LIVE_ROWS steps in one tick: the socket carries the newest rows and a bulk summary (counts and
    sums exact, percentiles estimated), the recording every row; summary code reloads the recording."""
    from perfmon.agent import runtime
    from perfmon.agent.steps import BEGIN, BOUNDARY, END, OPTIMIZER_CREATED

    source = LiveSource(paths.socket_path(os.getpid()), agent.run_dir)
    source.connect()
    got, done = [], threading.Event()
    threading.Thread(target=collect, args=(source, got, done), daemon=True).start()
    n = 3000
    with agent._flush_lock:  # one flush sees the whole burst, as a tick does at ~30,000 steps/s
        agent.events.append((OPTIMIZER_CREATED, 0.0, None, None))
        t = 1.0
        for i in range(n):
            fwd, opt = 0.001 * (1 + i % 7), 0.0005 * (1 + i % 3)  # steps of varied length
            if i:
                agent.events.append((BOUNDARY, t, None, None))
            for phase, ms in (("forward", fwd), ("backward", 0.002), ("optimizer", opt)):
                agent.events.append((BEGIN, t, phase, None))
                t += ms
                agent.events.append((END, t, phase, None))
            t += 0.0001
    agent.finish({"code": 0})
    assert done.wait(10)
    live = RunState()
    rows_sent = 0
    for m in got:
        live.apply(m)
        rows_sent += len(m.get("rows", [])) if m.get("type") == "steps" else 0
    recorded = RunState()
    for m in ReplaySource(agent.run_dir).messages():
        recorded.apply(m)
    assert recorded.steps == live.steps == n and recorded.bulk_steps == 0
    assert rows_sent <= runtime.LIVE_ROWS + 5 and live.bulk_steps == n - rows_sent
    assert live.totals["step"].hist.n == recorded.totals["step"].hist.n == n
    for p in ("forward", "backward", "optimizer", "other", "step"):
        assert live.totals[p].total_ms == pytest.approx(recorded.totals[p].total_ms, rel=1e-6)
    assert live.steps_per_s(recent=False) == pytest.approx(recorded.steps_per_s(recent=False), rel=1e-6)
    assert live.steps_per_s(recent=True) == pytest.approx(recorded.steps_per_s(recent=True), rel=0.05)
    p50, p95 = (live.totals["step"].hist.quantile(q) for q in (0.5, 0.95))
    assert p50 == pytest.approx(recorded.totals["step"].hist.quantile(0.5), rel=0.15)
    assert p95 == pytest.approx(recorded.totals["step"].hist.quantile(0.95), rel=0.15)
    # the launcher's summary.json comes from the recording when the live view was estimated: exact percentiles
    from perfmon.analysis.report import build_summary
    from perfmon.monitor.launch import finalize_recording

    summary = finalize_recording(agent.run_dir, live, 0)
    assert summary is not None and summary["steps"] == n
    assert summary["step_ms"] == build_summary(recorded)["step_ms"]


@pytest.mark.parametrize(("events", "seconds", "expected"), [
    (0, 0.5, 0.5),  # an idle job: the plain tick
    (2_400, 0.5, 0.5),  # ~600 steps/s of 8 events: the plain tick
    (20_000, 0.5, 0.5),  # exactly FLUSH_EVENTS a tick
    (60_000, 0.5, 20_000 / 120_000),  # 120k events/s: sooner, ~20k events a flush
    (10_000_000, 1.0, 0.02),  # far beyond: never under MIN_TICK
    (5, 0.0, 0.5),  # a few events in no measurable time: no burst
])
def test_the_publisher_ticks_sooner_when_events_pile_up(events, seconds, expected):
    from perfmon.agent.runtime import FLUSH_EVENTS, MIN_TICK, next_wait

    assert (FLUSH_EVENTS, MIN_TICK) == (20_000, 0.02)
    assert next_wait(events, seconds, 0.5) == pytest.approx(expected)


@pytest.mark.parametrize(("waited", "expected"), [
    (0.5, 1.0),  # the first tick that found nothing: twice as long
    (1.0, 2.0),
    (2.0, 2.0),  # never over IDLE_TICK
    (0.02, 0.5),  # idle after a burst of short ticks: back to the plain tick first
])
def test_the_publisher_sleeps_longer_while_nothing_comes(waited, expected):
    from perfmon.agent.runtime import IDLE_TICK, next_wait

    assert IDLE_TICK == 2.0
    assert next_wait(0, waited, 0.5, waited) == pytest.approx(expected)
    assert next_wait(8, 2.0, 0.5, 2.0) == 0.5  # a step came: the plain tick again


def test_an_idle_publisher_does_not_flush_until_an_event_comes(tmp_path):
    from perfmon.agent.steps import BEGIN

    a = Agent(tmp_path / "run", {"script": "x"}, tick=0.01, sample_interval=None)
    ticks, flushes, flushed, six = [], [], threading.Event(), threading.Event()
    refresh, flush = a._refresh_discovery, a._flush

    def counted_refresh():
        ticks.append(time.monotonic())
        if len(ticks) >= 6:
            six.set()
        refresh()

    def counted_flush(final=False):
        flushes.append(final)
        flushed.set()
        return flush(final)

    a._refresh_discovery, a._flush = counted_refresh, counted_flush
    a.start()
    try:
        assert six.wait(60)
        assert flushes == []  # nothing was buffered: no flush
        if hasattr(a.events, "wake"):  # (without the C ring's alarm it never sleeps past its tick)
            assert ticks[5] - ticks[0] >= 0.6  # it wakes less and less often: 0.02 + ... + 0.32 s, not 5 x 0.01
        a.events.append((BEGIN, time.perf_counter(), "forward", None))
        assert flushed.wait(30)
    finally:
        a.finish({"code": 0, "signal": None, "traceback": None, "exception": None})


def _counting_flushes(a: Agent) -> threading.Event:
    flushed, flush = threading.Event(), a._flush
    a._flush = lambda final=False: (flushed.set(), flush(final))[1]
    return flushed


def test_a_burst_wakes_a_publisher_in_the_middle_of_its_tick(tmp_path):
    """The ring's alarm: WAKE_EVENTS events wake the publisher whatever it planned, so a burst is flushed in
    FLUSH_EVENTS-sized batches long before the buffer could overflow."""
    from perfmon.agent import runtime
    from perfmon.agent.native import HOT
    from perfmon.agent.steps import BEGIN

    if HOT is None:
        pytest.skip("the C hot path is not built here: the publisher then never sleeps past its tick")
    a = Agent(tmp_path / "run", {"script": "x"}, tick=3600.0, sample_interval=None)  # a tick of an hour
    flushed = _counting_flushes(a)
    a.start()
    try:
        for _ in range(runtime.WAKE_EVENTS - 1):
            a.events.append((BEGIN, 0.0, "forward", None))
        assert not flushed.is_set()  # below the mark: nothing wakes it (without the alarm the next line fails)
        a.events.append((BEGIN, 0.0, "forward", None))
        assert flushed.wait(60)
    finally:
        a.finish({"code": 0, "signal": None, "traceback": None, "exception": None})


def test_the_first_event_after_an_idle_stretch_wakes_the_publisher(tmp_path, monkeypatch):
    """A tick that found nothing plans a longer sleep; the first event ends it, so a job that resumes shows at once
    and a monitor's view of its step count is never more than a tick old."""
    from perfmon.agent import runtime
    from perfmon.agent.native import HOT
    from perfmon.agent.steps import BEGIN

    if HOT is None:
        pytest.skip("the C hot path is not built here: the publisher then never sleeps past its tick")
    asleep = threading.Event()
    monkeypatch.setattr(runtime, "next_wait", lambda *a: (asleep.set(), 3600.0)[1])  # idle: sleep an hour
    a = Agent(tmp_path / "run", {"script": "x"}, tick=0.01, sample_interval=None)
    flushed = _counting_flushes(a)
    a.start()
    try:
        assert asleep.wait(60)
        a.events.append((BEGIN, 0.0, "forward", None))
        assert flushed.wait(60)
    finally:
        a.finish({"code": 0, "signal": None, "traceback": None, "exception": None})


def test_without_the_c_ring_the_publisher_never_sleeps_past_its_tick(tmp_path, monkeypatch):
    from perfmon.agent import runtime
    from perfmon.agent.native import EventDeque

    monkeypatch.setattr(runtime, "event_buffer", lambda n: EventDeque(maxlen=n))
    a = Agent(tmp_path / "run", {"script": "x"}, tick=0.5, sample_interval=None)
    assert a._idle_tick == 0.5  # nothing would wake it for a burst
    a.recorder.close()


def test_a_job_without_cuda_stops_asking_torch_about_it(tmp_path, monkeypatch):
    import types

    import torch

    a = Agent(tmp_path / "run", {"script": "x"}, sample_interval=None)
    a._instrumentation = types.SimpleNamespace()
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: asked.append(1) or False)
    a._poll_cuda()
    a._poll_cuda()
    assert a.meta["cuda"] is False and asked == [] and not a.cuda_marks
    a.recorder.close()


@pytest.mark.parametrize("buffer", ["python", "c"])
def test_an_overflowing_event_buffer_is_said_once(tmp_path, buffer):
    from perfmon.agent.native import HOT, EventDeque
    from perfmon.agent.steps import BEGIN, END

    if buffer == "c" and HOT is None:
        pytest.skip("the C hot path is not built here")
    a = Agent(tmp_path / "run", {"script": "x"}, sample_interval=None)
    a.events = EventDeque(maxlen=10) if buffer == "python" else HOT.Ring(10)
    for i in range(15):  # the publisher fell behind: the oldest 5 are gone
        a.events.append((BEGIN if i % 2 == 0 else END, float(i), "forward", None))
    a._flush()
    for i in range(10):
        a.events.append((BEGIN if i % 2 == 0 else END, 20.0 + i, "forward", None))
    a._flush()
    said = [t for t in a._unreported if "overflowed" in t]
    assert len(said) == 1 and "10 events" in said[0] and "training is unaffected" in said[0]
    a.events.append((BEGIN, 40.0, "forward", None))
    a._flush()
    assert len([t for t in a._unreported if "overflowed" in t]) == 1


def test_step_rows_numbers_are_pythons_fixed_point_text():
    """The C rows write their numbers without printf (``put_fixed``): every kind of double must come out as
    Python's ``%.Nf`` says it, exact halves rounded to even, negative zero, huge, tiny, inf and NaN included."""
    import random
    import struct

    from perfmon.agent.native import HOT

    if HOT is None:
        pytest.skip("the C hot path is not built here")
    rng = random.Random(7)
    values = [0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 0.03125, 0.00005, -0.00004, 1e-300, 2.0**52, 2.0**52 - 0.5, 2.0**53,
              1e300, -1.7976931348623157e308, float("inf"), float("-inf"), float("nan"), -float("nan")]
    values += [k / 2**j for k in range(1, 400, 2) for j in (5, 10, 20, 30)]  # exact halves at every precision
    values += [rng.uniform(1.6e9, 1.8e9) for _ in range(20_000)]  # epoch seconds, the rows' time column
    values += [rng.random() * 10 ** rng.randint(-6, 6) for _ in range(20_000)]  # milliseconds
    values += [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(20_000)]
    for prec in (0, 1, 4, 6, 9):
        wrong = [(v, prec) for v in values if HOT.format_fixed(v, prec) != "%.*f" % (prec, v)]  # noqa: UP031 - the Python rows use %
        assert wrong == [], wrong[:5]


@pytest.mark.parametrize("live_from", [0, 1, 37, 200])
def test_step_rows_in_c_are_the_python_rows(tmp_path, live_from):
    """``_hot.step_rows`` (the publisher's common case in C) against the Python loop: the same message text, and
    the same bulk summary of the rows the monitors do not get."""
    import json
    import random

    from perfmon.agent.native import HOT
    from perfmon.agent.steps import NO_MARKS, StepRecord

    if HOT is None:
        pytest.skip("the C hot path is not built here")
    rng = random.Random(live_from)
    t = 12345.678901
    records = []
    for i in range(1, 181):
        phases = {p: rng.choice([0.0, rng.random() * 1e-3, rng.random() * 2.0]) for p in
                  ("data", "forward", "backward", "optimizer")}
        dur = sum(phases.values()) + rng.choice([-1e-4, 0.0, rng.random() * 1e-3])  # "other" below zero too
        records.append((StepRecord(i + 10**9 * (i % 3 == 0), t, t + dur, phases, rng.choice([None, 0, 64, 2**40]),
                                   NO_MARKS, 0), None))
        t += dur
    # and steps the tracker's fast path made in C (SteadySteps: step_rows reads their fields, not attributes)
    from perfmon.agent.steps import STEADY

    events = []
    for _ in range(60):
        ts = sorted(t + rng.random() * 3e-3 for _ in range(9))
        fetch = rng.random() < 0.5
        events.append((STEADY, ts[8], (ts[0] if fetch else None, ts[1] if fetch else None,
                                       rng.choice([None, 0, 64]) if fetch else None, ts[2], "m", *ts[3:7], "o"),
                       None))
        t = ts[8]
    steady: list = []
    HOT.steady_steps(events, 0, 7000, records[-1][0].end, set(), steady, NO_MARKS)
    assert len(steady) == 60 and type(steady[0]).__name__ == "SteadyStep"
    records[40:40] = [(rec, None) for rec in steady]
    out = {}
    for c_rows in (True, False):
        agent = Agent(tmp_path / f"run-{c_rows}", {"script": "x"}, sample_interval=None)
        agent.c_rows = c_rows
        agent._clock_offset = 1.7e9 + 0.123456789  # each agent reads its own: the same for both
        sent: list = []
        agent.publish_text = lambda body, live=None, sent=sent: sent.append((body, live))  # type: ignore[method-assign]
        agent._publish_steps(records, {"evaluation_ms": 1.5}, live_from)
        out[c_rows] = sent[0]
    (c_body, c_live), (py_body, py_live) = out[True], out[False]
    assert c_body == py_body
    assert (c_live is None) == (py_live is None) == (live_from == 0)
    if c_live is not None:
        c, py = json.loads(c_live), json.loads(py_live)
        assert c["rows"] == py["rows"] and len(c["rows"]) == 240 - min(live_from, 240)
        for key, value in py["bulk"].items():
            assert c["bulk"][key] == (pytest.approx(value) if key == "sum_ms" else value), key


def recorded(agent: Agent) -> list[dict]:
    path = agent.run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_a_tick_goes_out_in_one_write_and_every_line_keeps_its_place(tmp_path, monkeypatch):
    """The publisher's tick writes its lines together at its end. Another thread's message still follows them
    in seq order, and a monitor that connects meanwhile finds every line up to its ``live_seq`` in the
    recording, where it back-fills from."""
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    agent = Agent(tmp_path / "run", {"script": "train.py", "pid": os.getpid()})  # not started: no publisher
    writes: list[bytes] = []
    real_write = agent.recorder.write
    monkeypatch.setattr(agent.recorder, "write", lambda data: (writes.append(data), real_write(data))[1])
    warning = {"kind": "warning", "message": "m", "t": 0.0}
    with agent._batched():
        agent.publish(protocol.message("event", **warning))
        agent.publish_text('{"v":1,"type":"log","text":"two"}')
        assert recorded(agent) == [] and writes == []  # held for the tick's end
        other = threading.Thread(target=agent.publish, args=(protocol.message("event", **warning),))
        other.start()
        other.join()
        assert [m["seq"] for m in recorded(agent)] == [1, 2, 3]  # the tick's lines first: seq order kept
        agent.publish(protocol.message("event", **warning))
        hello = json.loads(agent._greeting())
        assert hello["live_seq"] == 4 and [m["seq"] for m in recorded(agent)] == [1, 2, 3, 4]
        agent.publish(protocol.message("event", **warning))
        agent.publish(protocol.message("event", **warning))
        assert len(recorded(agent)) == 4
    assert [m["seq"] for m in recorded(agent)] == [1, 2, 3, 4, 5, 6]
    assert len(writes) == 4 and writes[-1].count(b"\n") == 2  # 1+2 together, 3, 4, then 5+6 in one write
    agent.publish(protocol.message("event", **warning))  # outside a tick: at once
    assert len(recorded(agent)) == 7
    agent.recorder.close()


def test_a_gap_is_filled_from_the_recording_a_bounded_chunk_at_a_time(tmp_path):
    """A monitor stopped for a minute meets a gap of the whole backlog (hundreds of MB of recording at 20,000
    steps/s): it is read a chunk at a time, never whole (it took GiBs), and still given out entirely, in order."""
    run = tmp_path / "run"
    run.mkdir()
    n = 4000
    with open(run / "events.jsonl", "wb") as f:
        for seq in range(1, n + 1):
            rows = [[seq * 50 + j, 1000.0 + j, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 8] for j in range(50)]
            f.write(protocol.encode(protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=rows, seq=seq)))
    source = LiveSource(tmp_path / "no.sock", run)
    source.BACKFILL_CHUNK = 1 << 16
    assert (run / "events.jsonl").stat().st_size > 100 * source.BACKFILL_CHUNK
    seqs = []
    tracemalloc.start()
    try:
        for msg in source._backfill(n - 10):  # a gap up to seq n - 10: the rest is newer than asked
            seqs.append(msg["seq"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seqs == list(range(1, n - 9))
    # decoded, the file's messages take ten times its size; a chunk's, well under it
    assert peak < (run / "events.jsonl").stat().st_size / 2, f"{peak / 2**20:.0f} MiB held to fill the gap"
    assert [m["seq"] for m in source._backfill(None)] == list(range(n - 9, n + 1))  # the rest, at the end
