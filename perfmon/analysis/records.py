"""The store's own records: a step of the recent window, phase totals, the exit, the peaks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from perfmon.analysis.series import Histogram


class Step(NamedTuple):
    """A step of the recent window: times in ms (device times where measured), ``other`` the rest."""

    i: int
    t: float  # end, wall clock
    dur: float
    data: float
    forward: float
    backward: float
    optimizer: float
    other: float
    samples: int  # 0: not counted
    windowed: bool  # inside a profiler / FLOP-counter window: slowed down, left out of the statistics
    prefetch: float = 0.0  # ms other threads spent fetching batches that ended in this step (a prefetching thread)

    def ms(self, phase: str) -> float:
        """A phase's time; ``step``: the whole step's."""
        return self.dur if phase == "step" else getattr(self, phase)


@dataclass
class PhaseTotals:
    total_ms: float = 0.0
    hist: Histogram = field(default_factory=Histogram)


@dataclass(frozen=True, slots=True)
class Capturing:
    """A profiler window being captured: why, since when, from which step (the monitor's count)."""

    reason: str | None
    t: float | None
    step: int


@dataclass
class ExitInfo:
    code: int | None = None
    signal: str | None = None
    exception: str | None = None
    traceback: str | None = None
    t: float | None = None


@dataclass
class Peaks:
    """The highest readings since start (None: never read)."""

    cpu_percent: float | None = None
    rss_bytes: float | None = None
    workers_rss_bytes: float | None = None
    util_gpu: float | None = None
    reserved_bytes: float | None = None  # the allocator's peak reserved
    allocated_bytes: float | None = None  # its peak allocated, since start
    steady_allocated_bytes: float | None = None  # the highest sample-window peak past the first steps


def higher(old: float | None, new: float | None) -> float | None:
    """The higher of a peak and a new reading, either of which may be unknown."""
    return old if new is None else new if old is None else max(old, new)
