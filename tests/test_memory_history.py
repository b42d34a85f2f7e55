"""The memory_snapshot flow (key m) against a fake ``torch.cuda.memory``: no GPU needed.

The fake keeps the allocator's one piece of state that matters (is history being recorded, and by
whom) and logs every call, so the tests check what perfmon did to the user's settings.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from perfmon.agent.commands import Commands
from perfmon.agent.memory_history import DEFAULT_STEPS, MemorySnapshots
from perfmon.messages.commands import Command, CommandError, parse_command

SNAPSHOT = Command("memory_snapshot")


class FakeCudaMemory:
    """``torch.cuda.memory``'s private history API, as far as perfmon uses it."""

    def __init__(self, history: str | None = None) -> None:
        self.history = history  # "all"/"state" while recording, None when off
        self.calls: list[tuple] = []
        self.fail: dict[str, Exception] = {}

    def _record_memory_history(self, enabled="all", **kwargs) -> None:
        self.calls.append(("record", enabled, kwargs))
        if "record" in self.fail and enabled is not None or "stop" in self.fail and enabled is None:
            raise self.fail["record" if enabled is not None else "stop"]
        self.history = enabled

    def _dump_snapshot(self, filename: str) -> None:
        self.calls.append(("dump", self.history))
        if "dump" in self.fail:
            Path(filename).write_bytes(b"half")
            raise self.fail["dump"]
        with open(filename, "wb") as f:
            pickle.dump({"segments": [], "device_traces": [[{"action": "alloc"}] if self.history else []]}, f)

    def _snapshot(self) -> dict:
        return {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}] if self.history == "all" else []]}

    def is_history_enabled(self) -> bool:
        return self.history is not None


class Replies:
    def __init__(self) -> None:
        self.all: list[dict] = []

    def __call__(self, fields: dict) -> None:
        self.all.append(fields)

    @property
    def last(self) -> dict:
        return self.all[-1]


def make(tmp_path: Path, fake: FakeCudaMemory, flag: bool = True, step: list[int] | None = None):
    errors: list[tuple[str, BaseException]] = []
    step = step if step is not None else [42]
    snaps = MemorySnapshots(tmp_path / "memory", lambda: step[0], lambda w, e: errors.append((w, e)),
                            cuda_memory=fake, history_enabled=fake.is_history_enabled if flag else None)
    return snaps, errors


def dumps(fake: FakeCudaMemory) -> list[tuple]:
    return [c for c in fake.calls if c[0] == "dump"]


def test_records_exactly_n_steps_then_saves_and_turns_history_off(tmp_path):
    fake = FakeCudaMemory()
    snaps, errors = make(tmp_path, fake)
    msg = SNAPSHOT
    assert snaps.check(msg, queued=False) is None
    ack = snaps.accepted(msg)
    assert ack["done"] is False and ack["message"] == f"memory snapshot: recording allocation history for {DEFAULT_STEPS} steps…"
    replies = Replies()
    snaps.begin(msg, replies)
    assert fake.history == "all" and snaps.recording
    (_, enabled, kwargs), = fake.calls
    assert enabled == "all" and kwargs["max_entries"] > 0
    assert replies.all == []  # the request already said "recording…"
    for _ in range(DEFAULT_STEPS - 1):
        snaps.boundary()
    assert dumps(fake) == [] and fake.history == "all" and replies.all == []
    snaps.boundary()
    # dumped while history was still on, then turned off (turning off first would drop the history)
    assert fake.calls[1:] == [("dump", "all"), ("record", None, {})]
    assert fake.history is None and not snaps.recording
    done = replies.last
    assert done["ok"] is True and done["done"] is True and done["steps"] == DEFAULT_STEPS
    path = Path(done["path"])
    assert path.parent == tmp_path / "memory" and re.fullmatch(r"snapshot-step42-\d+\.pickle", path.name)
    assert pickle.loads(path.read_bytes())["device_traces"] == [[{"action": "alloc"}]]
    assert str(path) in done["message"] and "pytorch.org/memory_viz" in done["message"]
    assert not list(path.parent.glob("*.tmp")) and errors == []
    snaps.boundary()  # nothing more happens
    assert len(fake.calls) == 3 and len(replies.all) == 1


def test_history_the_script_turned_on_is_dumped_at_once_and_left_alone(tmp_path):
    fake = FakeCudaMemory(history="state")  # the user's own settings: not even "all"
    snaps, errors = make(tmp_path, fake)
    replies = Replies()
    snaps.begin(SNAPSHOT, replies)
    assert fake.calls == [("dump", "state")]  # no _record_memory_history call at all
    assert fake.history == "state" and not snaps.recording
    assert replies.last["ok"] and replies.last["done"] and Path(replies.last["path"]).exists()
    assert "already records allocation history" in replies.last["message"]
    for _ in range(10):
        snaps.boundary()
    snaps.finish()
    assert fake.calls == [("dump", "state")] and fake.history == "state" and errors == []


def test_without_the_allocator_flag_recorded_traces_show_history_is_on(tmp_path):
    user = FakeCudaMemory(history="all")
    snaps, _ = make(tmp_path, user, flag=False)
    snaps.begin(SNAPSHOT, Replies())
    assert user.calls == [("dump", "all")] and user.history == "all"

    off = FakeCudaMemory()
    snaps, _ = make(tmp_path, off, flag=False)
    snaps.begin(SNAPSHOT, Replies())
    assert off.calls[0][:2] == ("record", "all") and snaps.recording


def test_steps_field_sets_the_length_and_bad_values_are_refused(tmp_path):
    fake = FakeCudaMemory()
    snaps, _ = make(tmp_path, fake)
    for bad in (0, -1, "5", 2.5, True, 10_000):  # refused where the command is parsed, before it gets here
        refusal = parse_command({"name": "memory_snapshot", "steps": bad})
        assert isinstance(refusal, CommandError) and "steps" in refusal.result()["message"], bad
    msg = Command("memory_snapshot", steps=2)
    assert snaps.check(msg, queued=False) is None and "for 2 steps" in snaps.accepted(msg)["message"]
    replies = Replies()
    snaps.begin(msg, replies)
    snaps.boundary()
    assert dumps(fake) == []
    snaps.boundary()
    assert dumps(fake) == [("dump", "all")] and replies.last["steps"] == 2 and fake.history is None


def test_busy_while_queued_or_recording(tmp_path):
    fake = FakeCudaMemory()
    snaps, _ = make(tmp_path, fake)
    assert "busy" in snaps.check(SNAPSHOT, queued=True)["message"]
    first, second = Replies(), Replies()
    snaps.begin(SNAPSHOT, first)
    snaps.boundary()
    busy = snaps.check(SNAPSHOT, queued=False)
    assert busy["ok"] is False and busy["message"].startswith("busy") and "4 of 5 steps" in busy["message"]
    snaps.begin(SNAPSHOT, second)  # slipped past check: still refused, recording untouched
    assert second.last["ok"] is False and "busy" in second.last["message"]
    assert len(fake.calls) == 1 and snaps.left == 4


def test_torch_without_the_private_api_is_not_available(tmp_path):
    class OldTorchMemory:
        def _dump_snapshot(self, filename: str) -> None:
            raise AssertionError("must not be called")

    snaps, _ = make(tmp_path, OldTorchMemory(), flag=False)  # type: ignore[arg-type]
    refusal = snaps.check(SNAPSHOT, queued=False)
    assert refusal == {"ok": False, "done": True,
                       "message": "memory snapshot: n/a (this torch has no _record_memory_history)"}


def test_job_ending_while_recording_saves_what_it_has_and_turns_history_off(tmp_path):
    fake = FakeCudaMemory()
    snaps, errors = make(tmp_path, fake)
    replies = Replies()
    snaps.begin(SNAPSHOT, replies)
    snaps.boundary()
    snaps.boundary()
    snaps.finish()
    assert fake.calls[1:] == [("dump", "all"), ("record", None, {})] and fake.history is None
    assert replies.last["ok"] and replies.last["steps"] == 2 and "after 2 of 5 steps" in replies.last["message"]
    snaps.finish()
    assert len(fake.calls) == 3 and errors == []


def test_torch_errors_are_answered_and_counted_never_raised(tmp_path):
    fake = FakeCudaMemory()
    fake.fail["record"] = RuntimeError("not supported with cudaMallocAsync")
    snaps, errors = make(tmp_path, fake)
    replies = Replies()
    snaps.begin(SNAPSHOT, replies)
    assert replies.last["ok"] is False and "not supported with cudaMallocAsync" in replies.last["message"]
    assert not snaps.recording and [w for w, _ in errors] == ["memory_snapshot"]

    fake = FakeCudaMemory()
    snaps, errors = make(tmp_path / "b", fake)
    replies = Replies()
    snaps.begin(Command("memory_snapshot", steps=1), replies)
    fake.fail["dump"] = OSError("disk full")
    snaps.boundary()
    assert fake.history is None  # turned off even though the dump failed
    assert replies.last["ok"] is False and "disk full" in replies.last["message"] and len(errors) == 1
    assert not list((tmp_path / "b" / "memory").iterdir())  # no half-written snapshot left

    fake = FakeCudaMemory()
    snaps, errors = make(tmp_path / "c", fake)
    replies = Replies()
    snaps.begin(Command("memory_snapshot", steps=1), replies)
    fake.fail["stop"] = RuntimeError("stuck")
    snaps.boundary()
    assert replies.last["ok"] is False and Path(replies.last["path"]).exists() and "stuck" in replies.last["message"]
    assert len(errors) == 1 and not snaps.recording


def test_default_seam_is_torch_cuda_memory(tmp_path):
    snaps = MemorySnapshots(tmp_path, lambda: 0, lambda w, e: None)
    assert snaps.memory is torch.cuda.memory
    assert snaps.history_enabled is getattr(torch._C, "_cuda_isHistoryEnabled", None)


# -- through Commands, as the agent drives it ----------------------------------------------------
class FakeAgent:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.tracker = SimpleNamespace(count=7)
        self.errors: list[tuple[str, BaseException]] = []
        self.instrumentation = object()
        self.enabled = True  # the agent runs (not finished, not a forked worker)

    def record_error(self, where: str, exc: BaseException) -> None:
        self.errors.append((where, exc))

    def publish(self, msg: dict) -> None:
        pass


@pytest.fixture
def commands(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    agent = FakeAgent(tmp_path / "run")
    cmds = Commands(agent, {})
    fake = FakeCudaMemory()
    cmds.memory = MemorySnapshots(agent.run_dir / "memory", lambda: agent.tracker.count, agent.record_error,
                                  cuda_memory=fake, history_enabled=fake.is_history_enabled)
    return cmds, fake, agent


def send(cmds: Commands, msg: dict) -> list[dict]:
    got: list[dict] = []
    command = parse_command({"name": "memory_snapshot", **msg})
    assert isinstance(command, Command)
    cmds.request(command, lambda data: got.append(json.loads(data)))
    return got


def test_commands_record_for_n_step_boundaries_after_the_request(commands):
    cmds, fake, agent = commands
    replies = send(cmds, {"id": 1, "steps": 3})
    assert replies[0]["done"] is False and "recording allocation history for 3 steps" in replies[0]["message"]
    assert fake.calls == []  # torch is only touched on the training thread
    busy = send(cmds, {"id": 2})  # still queued
    assert busy[0]["ok"] is False and busy[0]["message"].startswith("busy") and busy[0]["id"] == 2
    cmds.boundary()  # the next boundary starts recording
    assert fake.history == "all" and dumps(fake) == []
    assert send(cmds, {"id": 3})[0]["message"].startswith("busy")
    cmds.boundary()
    cmds.boundary()
    assert dumps(fake) == []
    agent.tracker.count = 10
    cmds.boundary()  # 3 steps recorded
    assert dumps(fake) == [("dump", "all")] and fake.history is None
    done = replies[-1]
    assert done["id"] == 1 and done["done"] is True and done["ok"] is True and done["name"] == "memory_snapshot"
    assert Path(done["path"]).name.startswith("snapshot-step10-") and Path(done["path"]).exists()
    cmds.boundary()
    assert len(fake.calls) == 3 and agent.errors == []
    again = send(cmds, {"id": 4})  # a new press after the last one finished: a new recording
    assert again[0]["ok"] is True and again[0]["done"] is False


def test_commands_do_nothing_at_boundaries_while_the_agent_is_off(commands):
    """The hooks call the commands straight at each step end; a finished agent, or a DataLoader worker forked with
    the hooks in place, must not start what a monitor asked for."""
    cmds, fake, agent = commands
    send(cmds, {"id": 1, "steps": 1})
    agent.enabled = False
    cmds.boundary()
    assert fake.history is None and fake.calls == []  # still queued, untouched
    agent.enabled = True
    cmds.boundary()
    assert fake.history == "all"


def test_commands_finish_turns_off_history_perfmon_started(commands):
    cmds, fake, _ = commands
    replies = send(cmds, {"id": 1})
    cmds.boundary()
    cmds.boundary()
    cmds.finish()
    assert fake.calls[1:] == [("dump", "all"), ("record", None, {})] and fake.history is None
    assert replies[-1]["done"] is True and "after 1 of 5 steps" in replies[-1]["message"]


def test_commands_without_cuda_say_so(commands, monkeypatch):
    cmds, fake, _ = commands
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    reply = send(cmds, {"id": 1})
    assert reply == [reply[0]] and reply[0]["message"] == "memory snapshot: n/a (no CUDA device)"
    cmds.boundary()
    assert fake.calls == []
