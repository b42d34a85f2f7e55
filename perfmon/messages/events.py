"""``event`` messages the monitor reads: the job's exit, window edges, command answers, warnings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfmon.messages.base import Message, Other, counts, integer, num, record, text
from perfmon.protocol import exception_line


@dataclass(frozen=True, slots=True, kw_only=True)
class Event(Message):
    """An ``event`` message; the kinds read are the subclasses below, the rest are :class:`Other`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(Event):
    """How the job ended, as the agent saw it (signals are the launcher's to add)."""

    code: int | None = None
    signal: str | None = None
    exception: str | None = None  # one line (:func:`perfmon.protocol.exception_line`)
    traceback: str | None = None
    t: float | None = None
    agent_errors: dict[str, float] | None = None  # the agent's own failures, counted by part


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowEdge(Event):
    """A profiler or FLOP-counter window opened (``started``) or closed at ``t``: its steps run slower."""

    started: bool
    t: float
    what: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileStarted(Event):
    """A profiler window is being captured."""

    reason: str | None = None
    t: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult(Event):
    """The agent's answer to a command; ``done`` False: an acknowledgement, more to come."""

    name: str | None = None
    id: int | str | None = None
    ok: bool | None = None
    done: bool | None = None
    message: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentWarning(Event):
    """Something the agent wants the user to know (an old torch, a recording that failed)."""

    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksSpawned(Event):
    """The job spawned its ranks (``torch.multiprocessing.spawn``): each records in ``job_dir/rank-K/``."""

    job_dir: str
    world_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Exec(Event):
    """The script replaced itself with another program (``os.exec*``) at ``t``: the agent's recording ends here, and
    the new program's exit is recorded only by a launcher that waits on it."""

    program: str | None = None
    t: float | None = None
    failed: bool = False  # the exec raised: the script goes on, and so does the recording


def parse_event(msg: dict[str, Any], seq: int | None) -> Message:
    kind, t = msg.get("kind"), num(msg.get("t"))
    if kind == "exit":
        return Exit(seq=seq, code=integer(msg.get("code")), signal=text(msg.get("signal")),
                    exception=exception_line(text(msg.get("exception"))),
                    traceback=text(msg.get("traceback")), t=t, agent_errors=counts(msg.get("agent_errors")))
    if kind in ("window_started", "window_stopped") and t is not None:
        return WindowEdge(seq=seq, started=kind == "window_started", t=float(t), what=text(msg.get("what")))
    if kind == "exec":
        return Exec(seq=seq, program=text(msg.get("program")), t=t, failed=msg.get("failed") is True)
    if kind == "profile_started":
        return ProfileStarted(seq=seq, reason=text(msg.get("reason")), t=t)
    if kind == "command_result":
        return record(CommandResult, msg, seq=seq)
    if kind == "warning" and isinstance(msg.get("message"), str):
        return AgentWarning(seq=seq, message=msg["message"])
    if kind == "ranks" and isinstance(msg.get("job_dir"), str) and (world := integer(msg.get("world_size"))):
        return RanksSpawned(seq=seq, job_dir=msg["job_dir"], world_size=world)
    return Other(seq=seq, type="event")
