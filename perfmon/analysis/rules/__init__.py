"""Findings: pure functions of the run's facts that name a bottleneck, its evidence and the fix.

Every rule has one signature, ``(facts: Facts, cfg: Config) -> Finding | None``, and is
registered with :func:`rule`. :class:`~perfmon.analysis.rules.engine.Engine` runs them with hysteresis.
"""

from __future__ import annotations

from perfmon.analysis.rules.base import REGISTRY, Config, Facts, Finding, rule
from perfmon.analysis.rules.engine import Engine, evaluate_once

# importing the families registers their rules
from perfmon.analysis.rules import device, distributed, host_cpu, input_pipeline, memory, steps  # noqa: E402,F401  isort: skip
from perfmon.analysis.rules.distributed import JOB_REGISTRY, evaluate_job  # noqa: E402

__all__ = ["JOB_REGISTRY", "REGISTRY", "evaluate_job", "Config", "Engine", "Facts", "Finding", "evaluate_once", "rule"]
