"""The rule signature, the registry, thresholds and the facts every rule reads."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from perfmon.analysis import metrics
from perfmon.analysis.metrics import MemoryBudget
from perfmon.analysis.records import Step
from perfmon.analysis.store import Store
from perfmon.messages import CudaMem, GpuSample, HostSample, ModelInfo, ProfileWindow
from perfmon.protocol import ALL_PHASES

SEVERITIES = ("info", "warn", "critical")


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str
    title: str
    evidence: dict[str, Any]
    fix: str
    impact: float = 0.0  # share of step time at stake, 0..1
    supersedes: tuple[str, ...] = ()  # a more specific diagnosis hides these

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["supersedes"]
        return out

    @property
    def rank(self) -> tuple[int, float]:
        return (SEVERITIES.index(self.severity), self.impact)


@dataclass
class Config:
    """Thresholds (defaults from torch-tb-profiler, TraceML and common practice; see each rule)."""

    warmup_steps: int = 30
    min_steps: int = 20
    hold: int = 3  # evaluations a finding must hold before it shows
    clear: int = 5  # evaluations it must stop holding before it clears
    data_warn: float = 0.10
    data_critical: float = 0.20
    prefetch_busy: float = 0.80  # a prefetching thread fetches this share of the step time: the loop waits on it
    loader_cpu_saturated: float = 0.90
    cpu_wait_warn: float = 0.20  # the trainer's threads wait this share of the CPU time they want
    cpu_wait_critical: float = 0.50
    busy_host_cpus: float = 0.5  # other processes use this many CPUs: step-time spikes may be the host's
    device_busy_min: float = 0.50
    nvml_util_min: float = 90.0
    syncs_per_step_warn: float = 1.0
    memory_pressure: float = 0.90
    fragmentation_ratio: float = 1.3  # at the allocator peak: reserved vs allocated
    fragmentation_min_bytes: int = 1 << 30
    instability_ratio: float = 2.0
    spike_ratio: float = 3.0
    instability_min_excess: float = 0.10  # share of time lost to slow steps
    creep_growth: float = 0.10
    creep_min_bytes: int = 100 << 20
    creep_min_points: int = 20
    optimizer_share: float = 0.25
    optimizer_min_tensors: int = 10
    optimizer_loop_ms_per_tensor: float = 1.0
    straggler_warn: float = 0.10  # a rank this much slower than the median rank
    straggler_critical: float = 0.20
    rank_memory_imbalance: float = 0.20
    rank_memory_min_bytes: int = 1 << 30
    rank_communication_share: float = 0.30
    disabled: tuple[str, ...] = ()

    @classmethod
    def from_toml(cls, path: Path) -> Config:
        """``--rules FILE``: ``[thresholds]`` overrides, ``disabled = ["id", ...]``."""
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]

        data = tomllib.loads(Path(path).read_text())
        defaults = cls()
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        table = data.get("thresholds", {})
        if not isinstance(table, dict):  # `thresholds = 3` instead of a [thresholds] table
            raise ValueError(f"'thresholds' wants a table ([thresholds] and a setting a line), got {table!r}")
        for key, value in {**table, **{k: v for k, v in data.items() if k != "thresholds"}}.items():
            key = key.replace("-", "_")
            if key in RETIRED:
                raise ValueError(f"{key!r} is no longer a setting: {RETIRED[key]}")
            if key not in known:
                raise ValueError(f"unknown setting {key!r}")
            if key == "disabled":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError(f"'disabled' wants a list of rule ids, got {value!r}")
                unknown = sorted(set(value) - rule_ids())
                if unknown:  # a misspelt id would leave its rule on without a word
                    raise ValueError(f"'disabled' names no rule {', '.join(map(repr, unknown))} "
                                     f"(rules: {', '.join(sorted(rule_ids()))})")
                values[key] = tuple(value)
                continue
            default = getattr(defaults, key)
            # a string threshold would silently switch its rule off: refuse it, saying what is expected
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                    isinstance(default, int) and not isinstance(default, bool) and not isinstance(value, int)):
                want = "an integer" if isinstance(default, int) else "a number"
                raise ValueError(f"{key} wants {want} (default {default!r}), got {value!r}")
            if not math.isfinite(value) or value < 0:  # a negative share or nan fires a rule always, or never
                raise ValueError(f"{key} wants a number >= 0 (default {default!r}), got {value!r}")
            values[key] = value
        cfg = cls(**values)
        for name in known:
            critical = name.removesuffix("_warn") + "_critical"
            if name.endswith("_warn") and critical in known and getattr(cfg, critical) < getattr(cfg, name):
                raise ValueError(f"{critical} ({getattr(cfg, critical)!r}) is below {name} ({getattr(cfg, name)!r}): "
                                 "a finding would be critical before it warns")
        return cfg


#: Settings earlier versions accepted that never changed a finding: refused with the reason, not ignored.
RETIRED = {
    "fp32_gemm_share": "no-mixed-precision comes from the profiler window's trace analysis, which decides it "
                       "(FP32 kernels >= 50% of GEMM time: warn, >= 80%: critical)",
    "first_step_ratio": "no rule read it",
}


def rule_ids() -> set[str]:
    """Every rule id, the single-run rules' and the whole-job rules'."""
    from perfmon.analysis.rules.distributed import JOB_REGISTRY  # registered on import of the package

    return set(REGISTRY) | set(JOB_REGISTRY)


def judged_steps(state: Store, cfg: Config) -> list[Any]:
    """The recent steps the rules judge: past warm-up, outside profiler / FLOP-counter windows (slower steps)."""
    return [s for s in state.recent if s.i > cfg.warmup_steps and not s.windowed]


@dataclass
class Facts:
    """What the rules read, and all they read: the recent window past warm-up, and the whole run."""

    steps: list[Step]
    shares: dict[str, float]
    step_ms: list[float]
    total_steps: int
    profile: ProfileWindow | None  # the last profiler window
    model: ModelInfo  # empty before the first model message
    gpus: list[GpuSample]
    cuda_mem: CudaMem | None
    host: HostSample  # CPU use averaged over the samples taken while stepping; empty before the first
    budget: MemoryBudget
    rss_history: list[float]  # RSS readings past warm-up, oldest first
    cuda_alloc_history: list[float]  # CUDA allocated memory, the same way
    closures_per_step: float | None = None  # optimizer.step(closure) evaluations a step (LBFGS, Lightning)

    @classmethod
    def from_state(cls, state: Store, cfg: Config) -> Facts:
        steps = judged_steps(state, cfg)
        total = sum(s.dur for s in steps)
        shares = {p: (sum(s.ms(p) for s in steps) / total if total > 0 else 0.0) for p in ALL_PHASES}
        return cls(
            steps=steps, shares=shares, step_ms=sorted(s.dur for s in steps),
            total_steps=state.steps, profile=state.profiles[-1] if state.profiles else None,
            model=state.model or ModelInfo(), gpus=state.gpus, cuda_mem=state.cuda_mem,
            host=metrics.recent_host(state) or HostSample(), budget=metrics.memory_budget(state),
            rss_history=list(state.rss_samples), cuda_alloc_history=list(state.cuda_alloc_samples),
            closures_per_step=metrics.closures_per_step(state),
        )

    def prefetch_busy(self) -> float:
        """The share of the step time other threads spent fetching batches (a prefetching generator's thread)."""
        total = sum(s.dur for s in self.steps)
        return min(1.0, sum(s.prefetch for s in self.steps) / total) if total > 0 else 0.0

    def quantile(self, q: float) -> float | None:
        v = self.step_ms
        if not v:
            return None
        pos = q * (len(v) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)


Rule = Callable[[Facts, Config], Finding | None]
REGISTRY: dict[str, tuple[Rule, str]] = {}
#: the rules that judge the steps' times: silent until ``min_steps`` steps past warm-up exist (a recording with a
#: profiler window but fewer steps still gets the rules that read the window, the GPUs and the host)
STEP_RULES: set[str] = set()


def rule(rule_id: str, threshold: str, *, reads_steps: bool = False) -> Callable[[Rule], Rule]:
    """Register a rule under a stable id; ``threshold`` documents when it fires and why; ``reads_steps``: it judges
    the steps' times (phase shares, quantiles), so it needs ``min_steps`` of them."""

    def deco(fn: Rule) -> Rule:
        REGISTRY[rule_id] = (fn, threshold)
        if reads_steps:
            STEP_RULES.add(rule_id)
        return fn

    return deco
