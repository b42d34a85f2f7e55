"""Monitor-side state: everything the dashboard, headless mode and reports show.

:class:`RunState` is the :class:`~perfmon.analysis.store.Store` of what the run's messages said, with
the metrics of :mod:`perfmon.analysis.metrics` as methods, so readers ask one object.
"""

from __future__ import annotations

from perfmon.analysis import metrics
from perfmon.analysis.metrics import Flops, MemoryBudget, PhaseStats
from perfmon.analysis.records import ExitInfo, PhaseTotals, Step
from perfmon.analysis.series import Histogram, TimeSeries
from perfmon.analysis.store import RECENT_STEPS, SERIES, Store
from perfmon.messages import HostSample

__all__ = ["RECENT_STEPS", "SERIES", "ExitInfo", "Flops", "Histogram", "MemoryBudget", "PhaseTotals",
           "RunState", "Step", "TimeSeries"]


class RunState(Store):
    """Aggregates of one run, built from its message stream, and what they add up to."""

    @property
    def status(self) -> str:
        """One line: ``running``, ``exited 0``, ``failed: ValueError``, ``killed by SIGKILL``..."""
        return metrics.status(self)

    @property
    def exit_status(self) -> int | None:
        """The shell-style status: code, or 128+N for a signal."""
        return metrics.exit_status(self)

    @property
    def mean_cpu_percent(self) -> float | None:
        return metrics.mean_cpu_percent(self)

    def elapsed(self, now: float | None = None) -> float:
        return metrics.elapsed(self, now)

    def phase_stats(self, recent: bool = True) -> PhaseStats:
        return metrics.phase_stats(self, recent)

    def steps_per_s(self, recent: bool = True) -> float | None:
        return metrics.steps_per_s(self, recent)

    def quiet_for(self, now: float) -> float | None:
        return metrics.quiet_for(self, now)

    def samples_per_s(self, recent: bool = True) -> float | None:
        return metrics.samples_per_s(self, recent)

    def outside_shares(self, now: float | None = None) -> dict[str, float] | None:
        return metrics.outside_shares(self, now)

    def closures_per_step(self) -> float | None:
        return metrics.closures_per_step(self)

    def first_step_left_out(self) -> Step | None:
        return metrics.first_step_left_out(self)

    def prefetch_share(self) -> float | None:
        return metrics.prefetch_share(self)

    def no_loader(self) -> bool:
        return metrics.no_loader(self)

    def batch_size(self) -> int | None:
        return metrics.batch_size(self)

    def recent_host(self) -> HostSample | None:
        return metrics.recent_host(self)

    def flops(self) -> Flops:
        return metrics.flops(self)

    def memory_budget(self) -> MemoryBudget:
        return metrics.memory_budget(self)
