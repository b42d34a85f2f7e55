"""The agent's messages as typed values: checked once, at the monitor's boundary, then read by attribute.

:func:`parse` turns a decoded message (:func:`perfmon.protocol.decode`) into one of the frozen
dataclasses here. A field of the wrong type becomes None (or empty); a message that cannot be read
at all becomes :class:`Invalid`, which the state counts as skipped. Numbers keep their JSON type
(an int stays an int), so what the report writes back is what came in.
The other direction, monitor -> agent, is :mod:`perfmon.messages.commands`: a :class:`Command` the monitor
builds and the agent parses once (:func:`parse_command`).

Stdlib only (and :mod:`perfmon.protocol`): the monitor, the report and the tests use it.
"""

from __future__ import annotations

from typing import Any

from perfmon.messages.base import Invalid, Message, Other, Reset, as_sent, merged, record
from perfmon.messages.commands import (
    COMMAND_NAMES,
    Command,
    CommandError,
    CommandName,
    parse_command,
)
from perfmon.messages.events import (
    AgentWarning,
    CommandResult,
    Event,
    Exec,
    Exit,
    ProfileStarted,
    RanksSpawned,
    WindowEdge,
    parse_event,
)
from perfmon.messages.facts import (
    Hello,
    LoaderSettings,
    ModelInfo,
    OptimizerFlags,
    children_name,
    training_loader,
)
from perfmon.messages.profile import Breakdown, OpStat, ProfileWindow, TraceFinding, parse_profile
from perfmon.messages.steps import Bulk, StepRows, parse_steps
from perfmon.messages.telemetry import (
    LEGACY_PROC_MEM_REASON,
    PROC_NO_CONTEXT,
    PROC_NOT_VISIBLE,
    CudaMem,
    GpuSample,
    HostSample,
    Sample,
    parse_sample,
)

__all__ = [
    "COMMAND_NAMES", "Command", "CommandError", "CommandName", "parse_command",
    "LEGACY_PROC_MEM_REASON", "PROC_NO_CONTEXT", "PROC_NOT_VISIBLE", "AgentWarning", "Breakdown", "Bulk", "CommandResult", "CudaMem", "Event",
    "Exec", "Exit", "GpuSample", "Hello", "HostSample", "Invalid", "LoaderSettings", "Message", "ModelInfo", "OpStat",
    "OptimizerFlags", "Other", "ProfileStarted", "ProfileWindow", "RanksSpawned", "Reset", "Sample", "StepRows", "TraceFinding",
    "WindowEdge", "as_sent", "children_name", "merged", "parse", "training_loader",
]


def parse(msg: dict[str, Any]) -> Message:
    """The typed message for a decoded one."""
    seq = msg.get("seq")
    seq = seq if isinstance(seq, int) else None
    kind = msg.get("type")
    if kind == "steps":
        return parse_steps(msg, seq)
    if kind == "sample":
        return parse_sample(msg, seq)
    if kind == "event":
        return parse_event(msg, seq)
    if kind == "hello":
        return record(Hello, msg, seq=seq)
    if kind == "model":
        return record(ModelInfo, msg, seq=seq)
    if kind == "profile":
        return parse_profile(msg, seq)
    if kind == "reset":
        return Reset(seq=seq)
    return Other(seq=seq, type=kind if isinstance(kind, str) else None)
