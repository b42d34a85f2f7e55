"""Monitor -> agent commands as typed values (``perfmon.messages.commands``): the wire form old monitors and agents
speak, the one parse the agent does, its refusals, and both ends of a real socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from perfmon import messages, protocol
from perfmon.agent.commands import Commands
from perfmon.agent.runtime import Agent
from perfmon.agent.server import Server
from perfmon.messages.commands import (
    COMMAND_NAMES,
    MAX_METRICS,
    Command,
    CommandError,
    parse_command,
)
from perfmon.monitor.sources import LiveSource

#: Every command as monitors send it: one per name, and each argument the agent reads.
VALID = [
    Command("profile", id=1),
    Command("profile", id=2, at_step=40),
    Command("profile", at_step=0, ranks=(0, 2)),
    Command("empty_cache", id="a"),
    Command("count_flops", id=3),
    Command("memory_snapshot", id=4),
    Command("memory_snapshot", id=5, steps=1),
    Command("memory_snapshot", steps=1000),
    Command("export", id=6),
    Command("stop", id=7),
    Command("log_metrics", metrics={"perfmon/step_ms": 12.5, "perfmon/finding/x": 3}),
    Command("log_metrics", metrics={}, ranks=(1,)),
    Command("close_output", streams=("stdout",)),
    Command("close_output", streams=("stdout", "stderr")),
]


def test_every_command_name_has_a_valid_case_and_the_protocol_agrees():
    assert {c.name for c in VALID} == set(COMMAND_NAMES)
    assert not hasattr(protocol, "COMMANDS")  # one list of names: this one
    assert messages.Command is Command and messages.parse_command is parse_command


def test_every_queued_command_has_its_step_boundary_work():
    # answered on the socket thread: stop and close_output (runtime), export; everything else runs as
    # Commands._do_<name>
    assert all(hasattr(Commands, f"_do_{name}") for name in COMMAND_NAMES
               if name not in ("stop", "close_output", "export"))


@pytest.mark.parametrize("command", VALID, ids=lambda c: c.name)
def test_valid_commands_round_trip_through_the_wire(command):
    line = command.to_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    msg = protocol.decode(line, allowed=("command",))
    assert parse_command(msg) == command


@pytest.mark.parametrize("old, command", [
    # the dicts monitors built before commands were typed, sent as protocol.message("command", **dict)
    ({"name": "profile", "id": 1}, Command("profile", id=1)),
    ({"name": "profile", "id": 2, "at_step": 57}, Command("profile", id=2, at_step=57)),
    ({"name": "stop", "id": 3}, Command("stop", id=3)),
    ({"name": "memory_snapshot", "id": 4, "steps": 5}, Command("memory_snapshot", id=4, steps=5)),
    ({"name": "log_metrics", "metrics": {"a": 1.0}}, Command("log_metrics", metrics={"a": 1.0})),
])
def test_the_wire_form_is_what_monitors_always_sent(old, command):
    line = protocol.encode(protocol.message("command", **old))
    assert command.to_line() == line  # byte for byte: an older agent reads a newer monitor's commands
    assert parse_command(json.loads(line)) == command  # and a newer agent an older monitor's


def test_unknown_keys_are_ignored_and_the_id_is_optional():
    msg = protocol.message("command", name="profile", future_option=True, steps=3, metrics={"a": 1})
    assert parse_command(msg) == Command("profile")  # steps/metrics belong to other commands
    assert parse_command({"name": "export"}) == Command("export")  # no v/type: what a monitor's dict has


@pytest.mark.parametrize("msg, name, rid, why", [
    ({"name": "shell", "id": 1, "cmd": "id"}, None, 1, "command 'shell' is not allowed"),
    ({"id": 2}, None, 2, "command None is not allowed"),
    ({"name": 7}, None, None, "command 7 is not allowed"),
    ({"name": ["profile"]}, None, None, "is not allowed"),
    ({"name": "profile", "id": 1.5}, "profile", None, "command id must be an integer or a string"),
    ({"name": "profile", "id": True}, "profile", None, "command id must be"),
    ({"name": "profile", "id": [1]}, "profile", None, "command id must be"),
    ({"name": "profile", "id": 1, "at_step": "40"}, "profile", 1, "profile: at_step must be a step number"),
    ({"name": "profile", "id": 1, "at_step": True}, "profile", 1, "at_step must be"),
    ({"name": "profile", "id": 1, "at_step": -1}, "profile", 1, "at_step must be"),
    ({"name": "profile", "id": 1, "at_step": 4.0}, "profile", 1, "at_step must be"),
    *[({"name": "memory_snapshot", "id": 9, "steps": bad}, "memory_snapshot", 9,
       "memory snapshot: steps must be a whole number from 1 to 1000") for bad in (0, -1, "5", 2.5, True, 1001)],
    ({"name": "log_metrics"}, "log_metrics", None, "log_metrics wants a dict of at most 500 numbers"),
    ({"name": "close_output"}, "close_output", None, "close_output: streams must be a list of stdout and stderr"),
    ({"name": "close_output", "streams": []}, "close_output", None, "close_output: streams must be a list"),
    ({"name": "close_output", "streams": ["stdin"]}, "close_output", None, "close_output: streams must be a list"),
    ({"name": "close_output", "streams": "stdout"}, "close_output", None, "close_output: streams must be a list"),
    ({"name": "log_metrics", "metrics": [1, 2]}, "log_metrics", None, "log_metrics wants a dict"),
    ({"name": "log_metrics", "metrics": {"a": "1"}}, "log_metrics", None, "log_metrics wants a dict"),
    ({"name": "log_metrics", "metrics": {"a": True}}, "log_metrics", None, "log_metrics wants a dict"),
    ({"name": "log_metrics", "metrics": {"a": None}}, "log_metrics", None, "log_metrics wants a dict"),
    ({"name": "log_metrics", "metrics": {"x" * 200: 1}}, "log_metrics", None, "log_metrics wants a dict"),
    ({"name": "log_metrics", "metrics": {f"m{i}": i for i in range(MAX_METRICS + 1)}}, "log_metrics", None,
     "log_metrics wants a dict"),
    ({"name": "empty_cache", "ranks": 1}, "empty_cache", None, "empty_cache: ranks must be a list of rank numbers"),
    ({"name": "empty_cache", "ranks": ["0"]}, "empty_cache", None, "ranks must be"),
    ({"name": "empty_cache", "ranks": [-1]}, "empty_cache", None, "ranks must be"),
])
def test_malformed_commands_are_refused_with_a_reason(msg, name, rid, why):
    err = parse_command(msg)
    assert isinstance(err, CommandError), err
    assert why in err.message and err.name == name and err.id == rid
    result = err.result()
    # what an agent answers: ok=False, done; an unknown name in "error" (as always), a bad argument in "message"
    assert result["ok"] is False and result["done"] is True
    assert result["error" if name is None else "message"] == err.message
    assert result.get("name") == name and result.get("id") == rid


def test_commands_are_frozen_and_hashable():
    command = Command("log_metrics", metrics={"a": 1.0})
    with pytest.raises(AttributeError):
        command.name = "stop"  # type: ignore[misc]
    assert hash(command) == hash(Command("log_metrics", metrics={"b": 2.0}))  # metrics are not hashed
    assert Command("profile", at_step=3) != Command("profile", at_step=4)


# -- the agent's side ---------------------------------------------------------------------------------


def _fake_commands(tmp_path: Path) -> Commands:
    agent = SimpleNamespace(run_dir=tmp_path, enabled=True, record_error=lambda where, exc: pytest.fail(f"{where}"),
                            publish=lambda msg: None, tracker=SimpleNamespace(count=0), instrumentation=SimpleNamespace(runs_compiled=lambda: False))
    return Commands(agent, {})


def test_commands_request_reads_the_typed_command(tmp_path):
    cmds = _fake_commands(tmp_path)
    replies: list[dict[str, Any]] = []
    cmds.request(Command("profile", id=5, at_step=10), lambda data: replies.append(json.loads(data)))
    assert replies == [protocol.message("event", kind="command_result", name="profile", id=5, ok=True, done=False,
                                        message="profile: starts at step 10")]
    assert [(name, command) for name, command, _ in cmds._queue] == [("profile", Command("profile", id=5, at_step=10))]
    cmds._do_profile = lambda command, answer: pytest.fail("ran before its step")  # type: ignore[method-assign]
    cmds.boundary()  # step 1 of 10: the window waits
    assert len(cmds._queue) == 1 and cmds.pending
    cmds.request(Command("export", id=6), lambda data: replies.append(json.loads(data)))
    assert replies[-1]["id"] == 6 and replies[-1]["ok"] is False and "no profiler window yet" in replies[-1]["message"]


def test_on_command_answers_stop_and_a_missing_torch_from_the_command():
    replies: list[dict[str, Any]] = []
    agent = SimpleNamespace(pid=0, commands=None)
    Agent._on_command(agent, Command("profile", id=8), lambda data: replies.append(json.loads(data)))  # type: ignore[arg-type]
    assert replies[-1]["name"] == "profile" and replies[-1]["id"] == 8 and replies[-1]["ok"] is False
    assert "not available" in replies[-1]["message"]


# -- both ends of a real socket -------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[Server, LiveSource, list[Command]]]:
    """An agent's server (which parses each command line) and a monitor's live source connected to it."""
    short = Path(tempfile.mkdtemp(prefix="pmcmd"))  # a Unix socket path must stay short
    got: list[Command] = []

    def on_command(command: Command, reply) -> None:
        got.append(command)
        reply(protocol.encode(protocol.message("event", kind="command_result", name=command.name, id=command.id,
                                               ok=True, done=True)))

    server = Server(short / "s.sock", lambda: protocol.encode(protocol.message("hello", live_seq=0)), on_command,
                    threading.Lock(), lambda where, exc: pytest.fail(f"{where}: {exc}"))
    server.start()
    source = LiveSource(short / "s.sock")
    source.connect()
    try:
        yield server, source, got
    finally:
        source.close()
        server.close()
        shutil.rmtree(short, ignore_errors=True)


def _replies(source: LiveSource, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    done = threading.Event()

    def read() -> None:
        for msg in source.messages():
            if msg.get("kind") == "command_result":
                out.append(msg)
                if len(out) == n:
                    done.set()
                    return

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), out
    return out


def test_the_socket_path_appears_only_once_the_agent_listens(monkeypatch):
    """A monitor connects as soon as it sees the path (``wait_for_socket``): one that came between the agent's
    bind and listen was refused, and read the recording instead of the live job (a loaded host hit it)."""
    short = Path(tempfile.mkdtemp(prefix="pmlst"))
    path = short / "s.sock"
    seen_at_listen: list[bool] = []
    listen = socket.socket.listen

    def watching(sock: socket.socket, *args: Any) -> None:
        seen_at_listen.append(path.exists())
        listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", watching)
    server = Server(path, lambda: b"", lambda command, reply: None, threading.Lock(),
                    lambda where, exc: pytest.fail(f"{where}: {exc}"))
    server.start()
    try:
        assert seen_at_listen == [False]
        assert path.exists() and sorted(p.name for p in short.iterdir()) == ["s.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        server.close()
        shutil.rmtree(short, ignore_errors=True)


def test_a_monitors_commands_reach_the_agent_typed_and_bad_ones_are_answered(served):
    server, source, got = served
    for command in VALID:
        assert source.send(command)
    assert source.send(Command("profile", id=99, ranks=(1,)))  # the routing field travels; the agent ignores it
    source._sock.sendall(protocol.encode(protocol.message("command", name="shell", id=100)))  # type: ignore[union-attr]
    source._sock.sendall(protocol.encode(protocol.message("command", name="memory_snapshot", id=101, steps=0)))  # type: ignore[union-attr]
    source._sock.sendall(b"garbage\n")  # type: ignore[union-attr]
    replies = _replies(source, len(VALID) + 4)
    deadline = time.monotonic() + 5
    while len(got) < len(VALID) + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [*VALID, Command("profile", id=99, ranks=(1,))]
    assert all(isinstance(c, Command) for c in got)
    bad = replies[-3:]
    assert bad[0]["ok"] is False and bad[0]["id"] == 100 and "not allowed" in bad[0]["error"] and "name" not in bad[0]
    assert bad[1] == protocol.message("event", kind="command_result", name="memory_snapshot", id=101, ok=False,
                                      done=True, message="memory snapshot: steps must be a whole number from 1 to 1000")
    assert bad[2]["ok"] is False and "not JSON" in bad[2]["error"]
    assert server.bad_lines == 3


def _profiling_commands(tmp_path: Path, **config: Any) -> tuple[Commands, list[dict[str, Any]], list[str]]:
    published: list[dict[str, Any]] = []
    warned: list[str] = []
    agent = SimpleNamespace(run_dir=tmp_path, enabled=True, record_error=lambda where, exc: pytest.fail(f"{where}"),
                            publish=published.append, warn=warned.append, instrumentation=SimpleNamespace(runs_compiled=lambda: False))
    return Commands(agent, {"wait": 0, "warmup": 1, "active": 3, **config}), published, warned


def _spin() -> None:
    import torch

    torch.randn(64, 64) @ torch.randn(64, 64)


def test_p_waits_while_the_script_profiles_and_a_window_gives_way_to_it(tmp_path):
    """Kineto records one session a process: perfmon's windows never start while one of the script's is open, and
    one that is open when the script's begins stops first (the hooks report the script's sessions: e2e in
    test_corpus)."""
    import torch

    cmds, published, warned = _profiling_commands(tmp_path)
    answers: list[dict[str, Any]] = []
    script = torch.autograd.profiler.profile()
    cmds.script_profilers.opening(script)  # what the patched _prepare_trace reports, then the session itself
    with script:
        cmds.request(Command("profile", id=1), lambda data: answers.append(json.loads(data)))
        cmds.boundary()
        _spin()
    cmds.script_profilers.closed(script)
    assert cmds.window is None and answers[-1]["ok"] is False and answers[-1]["done"] is True
    assert "runs its own torch.profiler" in answers[-1]["message"]
    assert warned == []  # p's answer says why: no warning toast besides
    assert any(e.key == "aten::mm" for e in script.key_averages())

    cmds.request(Command("profile", id=2), lambda data: answers.append(json.loads(data)))
    cmds.boundary()  # the script's session is closed: the window starts
    assert cmds.window is not None and answers[-1]["done"] is False
    script = torch.autograd.profiler.profile()
    cmds.script_profilers.opening(script)  # the script begins one meanwhile: perfmon's window stops first
    assert cmds.window is None
    assert answers[-1]["ok"] is False and answers[-1]["done"] is True and "given up" in answers[-1]["message"]
    assert [m["kind"] for m in published if m.get("kind", "").startswith("window_")] == ["window_started",
                                                                                       "window_stopped"]
    with script:
        _spin()
    assert any(e.key == "aten::mm" for e in script.key_averages())  # the script's own results are whole
    assert warned == []  # the answer to p said it
    assert not list((tmp_path / "traces").glob("*"))  # the window given up leaves no trace
    cmds._next_every = cmds.boundaries + 1  # a periodic window is due next (--profile-every)
    script = torch.autograd.profiler.profile()
    cmds.script_profilers.opening(script)
    cmds.boundary()  # skipped while the script's session is open: nobody asked, so a warning says why, once
    cmds.boundary()
    assert cmds.window is None and len(warned) == 1 and "runs its own torch.profiler" in warned[0]


def test_no_profiler_window_or_memory_snapshot_on_a_disk_short_of_the_reserve(tmp_path, monkeypatch):
    """A trace is MBs (a GPU model's tens of them) and a snapshot hundreds: with less free than the reserve left on
    the run dir's disk, ``p`` and ``m`` are answered why, and periodic windows are skipped with one warning."""
    free_mb = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / 2**20
    monkeypatch.setenv("PERFMON_DISK_RESERVE_MB", str(free_mb * 4 + 1024))
    cmds, published, warned = _profiling_commands(tmp_path)
    answers: list[dict[str, Any]] = []
    cmds.request(Command("profile", id=1), lambda data: answers.append(json.loads(data)))
    cmds._do_memory_snapshot(Command("memory_snapshot", id=2), answers.append)
    cmds.boundary()
    final = [a for a in answers if a["done"]]  # (p was first answered "starts at the next step boundary")
    assert cmds.window is None and all(a["ok"] is False for a in final)
    assert [a["message"].split(":")[0] for a in final] == ["no memory snapshot", "no profiler window"]
    assert all("MiB left on the disk" in a["message"] and "PERFMON_DISK_RESERVE_MB" in a["message"] for a in final)
    assert warned == []  # the answers said it
    for _ in range(3):
        cmds._next_every = cmds.boundaries + 1  # a periodic window is due
        cmds.boundary()
    assert cmds.window is None and len(warned) == 1 and warned[0].startswith("no profiler window")
    monkeypatch.setenv("PERFMON_DISK_RESERVE_MB", "0")
    cmds._next_every = cmds.boundaries + 1
    cmds.boundary()
    assert cmds.window is not None  # room again: the next one starts
    cmds.window.abort()


def test_periodic_traces_beyond_the_newest_few_go_once_analysed(tmp_path):
    """--profile-keep: of the periodic windows' traces only the newest N stay, and an older one goes only once a
    monitor has analysed it (its numbers live on in RUN/analysis/); the traces of windows asked for with p stay."""
    import threading

    from perfmon import paths

    cmds, published, warned = _profiling_commands(tmp_path, profile_keep=2)
    exported = threading.Semaphore(0)
    publish = cmds.agent.publish
    # the window's end is published after its trace is out and older ones are dropped
    cmds.agent.publish = lambda msg: (publish(msg), msg.get("kind") == "window_stopped" and exported.release())
    analysed: list[Path] = []

    def window(analyse: bool, periodic: bool = True) -> Path:
        """One window, due at the next step (never two at once: the next is made due only after this one's trace
        is out), and its trace."""
        if periodic:
            cmds._next_every = cmds.boundaries + 1  # --profile-every, due now
        deadline = time.monotonic() + 120
        while not exported.acquire(blocking=False):
            assert time.monotonic() < deadline, "no window was exported"
            _spin()
            cmds.boundary()
        cmds._next_every = None
        trace = Path([m for m in published if m.get("type") == "profile"][-1]["trace"])
        if analyse:  # what a monitor leaves once it has read the window
            paths.trace_analysis(trace).parent.mkdir(exist_ok=True)
            paths.trace_analysis(trace).write_text("{}")
            analysed.append(trace)
        return trace

    cmds.request(Command("profile", id=1), lambda data: None)
    asked = window(analyse=True, periodic=False)  # asked for with p: never dropped
    cmds.every = 1_000_000  # periodic windows on (each made due by hand)
    first = window(analyse=False)  # nobody analysed it: it stays
    periodic = [window(analyse=True) for _ in range(5)]
    on_disk = sorted((tmp_path / "traces").glob("*.json"))
    assert on_disk == sorted([asked, first, *periodic[-2:]])  # the newest 2 periodic ones, p's, the unanalysed one
    assert all(paths.trace_analysis(t).exists() for t in analysed)
    assert warned == [] and cmds.window is None


def test_a_flop_count_waits_for_the_scripts_own_dispatch_mode(tmp_path):
    """torch pops dispatch modes by position: perfmon's FLOP counter starts only where no mode of the script's is
    on, and ends only where its own is innermost; a count that had to span two steps is divided by two."""
    from torch.utils.flop_counter import FlopCounterMode

    cmds, published, warned = _profiling_commands(tmp_path)
    answers: list[dict[str, Any]] = []
    script = FlopCounterMode(display=False)
    with script:  # the script's counter is on at this step end: perfmon's waits
        cmds.request(Command("count_flops", id=1), lambda data: answers.append(json.loads(data)))
        cmds.boundary()
    assert cmds.flops_mode is None and cmds.pending
    cmds.boundary()  # now it starts
    assert cmds.flops_mode is not None
    _spin()  # one step's 64x64x64 matmul: 2 * 64**3 FLOPs
    script = FlopCounterMode(display=False)
    script.__enter__()  # the script's own count begins in this step and ends in the next
    cmds.boundary()  # perfmon's is not innermost: ending it would pop the script's
    assert cmds.flops_mode is not None
    _spin()
    script.__exit__(None, None, None)
    assert script.get_total_flops() == 2 * 64**3  # the script's count is its own
    cmds.boundary()
    assert cmds.flops_mode is None and answers[-1]["ok"] is True
    assert answers[-1]["flops_per_step"] == 2 * 64**3  # 2 steps' matmuls over the 2 steps it spanned
    assert warned == []


def test_a_window_gives_way_on_the_training_thread_when_the_script_profiles_from_another(tmp_path):
    """A profiler is driven from the thread that started it: the script's session opened on another thread has
    perfmon's window stopped by the training thread at its next step end, not from that other thread."""
    import torch

    cmds, published, warned = _profiling_commands(tmp_path)
    answers: list[dict[str, Any]] = []
    cmds.request(Command("profile", id=1), lambda data: answers.append(json.loads(data)))
    cmds.boundary()
    window = cmds.window
    assert window is not None
    other = threading.Thread(target=cmds.script_profilers.opening, args=(torch.autograd.profiler.profile(),))
    other.start()
    other.join()
    assert cmds.window is window and cmds.pending  # left to the training thread
    cmds.boundary()
    assert cmds.window is None and "given up" in answers[-1]["message"]
