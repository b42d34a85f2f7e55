"""Monitor -> agent commands as typed values: built by the monitor, parsed once by the agent.

The wire form is the ``command`` line the agent has always read (``{"v", "type": "command", "name", "id", ...}``),
so older monitors and newer agents (and the reverse) still understand each other. :func:`parse_command` is the
agent's one check of a decoded line: an unknown name or a bad argument becomes a :class:`CommandError`, which the
agent answers with ``ok=False``; nothing downstream reads the dict again.

Stdlib only (and :mod:`perfmon.protocol`): the agent inside the job and the monitor outside it both import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal, cast, get_args

from perfmon import protocol

#: Every command an agent runs; anything else is refused. The one list: the agent checks names against it,
#: the monitor's ``Command.name`` is typed by it.
CommandName = Literal["profile", "empty_cache", "count_flops", "memory_snapshot", "export", "stop", "log_metrics",
                      "close_output"]
COMMAND_NAMES: tuple[str, ...] = get_args(CommandName)

#: ``memory_snapshot``'s ``steps``: at most this many steps of allocation history (each costs host memory).
MAX_SNAPSHOT_STEPS = 1000
#: ``log_metrics``: at most this many numbers a call, each named in under ``MAX_METRIC_NAME`` characters.
MAX_METRICS = 500
MAX_METRIC_NAME = 200
#: ``close_output``'s ``streams``: the job's streams whose reader is gone (the pipe perfmon copies them to broke)
Stream = Literal["stdout", "stderr"]
STREAMS: tuple[str, ...] = get_args(Stream)


@dataclass(frozen=True, slots=True)
class Command:
    """One command. Arguments a command does not use stay None (and are not sent)."""

    name: CommandName
    _: KW_ONLY
    #: echoed in every ``command_result`` for it, so a monitor can match answers to requests
    id: int | str | None = None
    #: start at this step boundary rather than the next one (every rank of a job starts a window at one step)
    at_step: int | None = None
    #: ``memory_snapshot``: steps of allocation history to record (None: the agent's default)
    steps: int | None = None
    #: ``log_metrics``: numbers for the script's wandb run (a dict is not hashable: left out of the hash)
    metrics: Mapping[str, float] | None = field(default=None, hash=False)
    #: the ranks of a job that get it (None: all); the monitor's routing, which agents ignore
    ranks: tuple[int, ...] | None = None
    #: ``close_output``: the streams to break, as the reader's end of a pipe closing breaks them under plain python
    streams: tuple[Stream, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        """The protocol message; arguments that are None are left out, as monitors always did."""
        msg = protocol.message("command", name=self.name)
        if self.id is not None:
            msg["id"] = self.id
        if self.at_step is not None:
            msg["at_step"] = self.at_step
        if self.steps is not None:
            msg["steps"] = self.steps
        if self.metrics is not None:
            msg["metrics"] = dict(self.metrics)
        if self.ranks is not None:
            msg["ranks"] = list(self.ranks)
        if self.streams is not None:
            msg["streams"] = list(self.streams)
        return msg

    def to_line(self) -> bytes:
        """:meth:`to_wire` as the newline-terminated JSON line sent to an agent."""
        return protocol.encode(self.to_wire())


@dataclass(frozen=True, slots=True)
class CommandError:
    """Why a command line is refused. ``name`` is set only for a known command (its result is titled by it)."""

    message: str
    name: CommandName | None = None
    id: int | str | None = None

    def result(self) -> dict[str, Any]:
        """The ``command_result`` fields answering it. An unknown name is answered in ``error``, a bad argument in
        ``message``: where monitors have always read each (and the agent's other refusals put theirs)."""
        known = self.name is not None
        fields: dict[str, Any] = {"name": self.name} if known else {}
        if self.id is not None:
            fields["id"] = self.id
        return {**fields, "ok": False, "done": True, ("message" if known else "error"): self.message}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def parse_command(msg: Mapping[str, Any]) -> Command | CommandError:
    """A decoded ``command`` message (``v``/``type`` already checked by :func:`perfmon.protocol.decode`) as a
    :class:`Command`, or the :class:`CommandError` to answer. Never raises; keys it does not know are ignored
    (a newer monitor's extras). ``id`` is optional: older monitors' ``log_metrics`` carried none."""
    name = msg.get("name")
    rid = msg.get("id")
    if rid is not None and not (_is_int(rid) or isinstance(rid, str)):
        rid = None  # not echoed: the answer must not carry what the line got wrong
        if name in COMMAND_NAMES:
            return CommandError("command id must be an integer or a string", name=cast(CommandName, name))
    if not isinstance(name, str) or name not in COMMAND_NAMES:
        return CommandError(f"command {name!r} is not allowed", id=rid)
    known = cast(CommandName, name)

    def refused(why: str) -> CommandError:
        return CommandError(why, name=known, id=rid)

    at_step = msg.get("at_step")
    if at_step is not None and not (_is_int(at_step) and at_step >= 0):
        return refused(f"{name}: at_step must be a step number (a whole number >= 0)")
    steps = metrics = None
    if name == "memory_snapshot":
        steps = msg.get("steps")
        if steps is not None and not (_is_int(steps) and 1 <= steps <= MAX_SNAPSHOT_STEPS):
            return refused(f"memory snapshot: steps must be a whole number from 1 to {MAX_SNAPSHOT_STEPS}")
    if name == "log_metrics":
        metrics = msg.get("metrics")
        if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS or not all(
                isinstance(k, str) and len(k) < MAX_METRIC_NAME and _is_number(v) for k, v in metrics.items()):
            return refused(f"log_metrics wants a dict of at most {MAX_METRICS} numbers")
        metrics = dict(metrics)  # the caller's dict stays the caller's
    streams = None
    if name == "close_output":
        streams = msg.get("streams")
        if not isinstance(streams, list | tuple) or not streams or not all(s in STREAMS for s in streams):
            return refused("close_output: streams must be a list of " + " and ".join(STREAMS))
        streams = tuple(dict.fromkeys(cast(Stream, s) for s in streams))
    ranks = msg.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list | tuple) or not all(_is_int(r) and r >= 0 for r in ranks):
            return refused(f"{name}: ranks must be a list of rank numbers")
        ranks = tuple(ranks)
    return Command(known, id=rid, at_step=at_step, steps=steps, metrics=metrics, ranks=ranks, streams=streams)
