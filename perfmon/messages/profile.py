"""``profile`` messages: a profiler window, as the job announces it and as its trace analysis summarises it.

The job sends which window it was and the trace it left (step, steps, reason, device, trace, t); the monitor
adds what it read from the trace (:mod:`perfmon.analysis.profile_window`): top ops and kernels, the HTA
breakdown, syncs per step, and the trace's own findings. Windows summarised by older jobs carry their top ops
(with inclusive times and FLOPs) and no trace analysis. Every part is read once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfmon.messages.base import CONVERT, Message, record, records


@dataclass(frozen=True, slots=True, kw_only=True)
class OpStat:
    """One row of a window's top ops or kernels (times in ms; ``share`` of the window's op or kernel time)."""

    name: str | None = None
    calls: int | None = None
    kind: str | None = None  # "op" or "kernel"
    self_ms: float | None = None
    total_ms: float | None = None  # windows summarised by older jobs: inclusive time
    self_cpu_ms: float | None = None
    share: float | None = None
    flops: float | None = None  # older jobs' windows
    shapes: str | None = None
    given: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakdown:
    """Where a GPU window's time went, as shares of its span (HTA's definitions)."""

    idle: float | None = None
    compute: float | None = None
    non_compute: float | None = None
    communication: float | None = None
    memory: float | None = None
    comm_compute_overlap: float | None = None
    span_ms: float | None = None
    given: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceFinding:
    """A finding of the window's trace analysis (what ran on the device), with its evidence and fix."""

    id: str | None = None
    severity: str | None = None
    title: str | None = None
    evidence: dict[str, Any] | None = None
    fix: str | None = None
    given: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileWindow(Message):
    """One profiler window: which, and (once analysed) what it found."""

    step: int | None = None
    active_steps: int | None = None
    reason: str | None = None
    device: str | None = None
    trace: str | None = None  # the exported Chrome trace; None: the export failed
    t: float | None = None
    top_ops: tuple[OpStat, ...] = ()
    top_kernels: tuple[OpStat, ...] = ()
    ops_total: int | None = None
    syncs_per_step: float | None = None
    device_busy: float | None = None
    breakdown: Breakdown | None = None
    trace_findings: tuple[TraceFinding, ...] = ()
    trace_steps: int | None = None
    analysis_error: str | None = None
    given: frozenset[str] = frozenset()

    def finding(self, rule_id: str) -> TraceFinding | None:
        """The trace analysis' finding ``rule_id``, if it made one."""
        return next((x for x in self.trace_findings if x.id == rule_id), None)


CONVERT["tuple[OpStat, ...]"] = lambda v: records(OpStat, v)
CONVERT["tuple[TraceFinding, ...]"] = lambda v: records(TraceFinding, v)
CONVERT["Breakdown | None"] = lambda v: record(Breakdown, v) if isinstance(v, dict) else None
CONVERT["dict[str, Any] | None"] = lambda v: dict(v) if isinstance(v, dict) else None


def parse_profile(msg: dict[str, Any], seq: int | None) -> ProfileWindow:
    return record(ProfileWindow, msg, seq=seq)
