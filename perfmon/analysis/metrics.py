"""What a run's store adds up to: phase statistics, rates, shares, the memory budget, FLOPs and MFU,
the status in words. Pure functions of a :class:`~perfmon.analysis.store.Store`; nothing is kept."""

from __future__ import annotations

import math
import re
import signal as _signal
import time
from dataclasses import dataclass, replace

from perfmon.analysis.peaks import peak_tflops
from perfmon.analysis.records import Step
from perfmon.analysis.store import Store
from perfmon.messages import HostSample
from perfmon.protocol import ALL_PHASES


@dataclass(frozen=True)
class PhaseStat:
    """One phase's (or the whole step's) times in ms and its share of step time; None: no steps to tell."""

    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    share: float | None = None


#: Each of protocol.ALL_PHASES, and "step" for the whole step.
PhaseStats = dict[str, PhaseStat]


@dataclass(frozen=True)
class Flops:
    """FLOPs per step, achieved FLOP/s from the recent step time, and MFU where a peak is known."""

    flops_per_step: float | None = None
    achieved_flops: float | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None  # where the peak comes from, in words
    mfu: float | None = None
    reason: str | None = None  # why there is no MFU


@dataclass(frozen=True)
class MemoryBudget:
    """Static vs per-step peak memory, activation memory per sample, the largest batch that fits."""

    static_bytes: float | None = None  # parameters + gradients + optimizer state
    peak_bytes: float | None = None
    activation_bytes: float | None = None  # peak - static
    per_sample_bytes: int | None = None
    batch: int | None = None
    max_batch: int | None = None
    capacity_bytes: float | None = None
    margin: float | None = None  # share of the device left at the reserved peak
    peak_source: str | None = None  # "steady state" (window peaks past warm-up) or "since start"
    reason: str | None = None  # why a number is missing


# -- steps ------------------------------------------------------------------------------------------
def phase_stats(store: Store, recent: bool = True) -> PhaseStats:
    """Per phase (and ``step``): mean, p50, p95 in ms and share of step time."""
    out: PhaseStats = {}
    if recent:
        rows = [s for s in store.recent if not s.windowed]
        total = sum(s.dur for s in rows) or 0.0
        for p in (*ALL_PHASES, "step"):
            out[p] = _stats(sorted(s.ms(p) for s in rows), total)
        return out
    first = first_step_left_out(store)
    total = store.totals["step"].total_ms - (first.dur if first else 0.0)
    for p in (*ALL_PHASES, "step"):
        tot = store.totals[p]
        hist, total_ms = (tot.hist.without(first.ms(p)), tot.total_ms - first.ms(p)) if first else (tot.hist,
                                                                                                    tot.total_ms)
        n = hist.n
        out[p] = PhaseStat(mean_ms=total_ms / n if n else None, p50_ms=hist.quantile(0.5),
                           p95_ms=hist.quantile(0.95), share=total_ms / total if total > 0 else None)
    return out


#: Whole-run figures leave step 1 out from this many steps in the statistics on (a shorter run keeps it).
FIRST_STEP_KEPT_BELOW = 3


def first_step_left_out(store: Store) -> Step | None:
    """Step 1, where the whole-run figures (phase table, steps/s, samples/s) leave it out: it holds what ran before
    the loop was learned (lazy initialisation, compilation, setup between a first forward and the loop), so a
    short run's figures would describe its warm-up. ``None`` where they keep it (a short run, or step 1 was in a
    profiler window or summarised in bulk: never seen as a row)."""
    first = store.first_step
    if first is None or store.totals["step"].hist.n < FIRST_STEP_KEPT_BELOW:
        return None
    return first


def _stats(values: list[float], total: float) -> PhaseStat:
    if not values:
        return PhaseStat()
    return PhaseStat(mean_ms=sum(values) / len(values), p50_ms=_quantile(values, 0.5),
                     p95_ms=_quantile(values, 0.95), share=sum(values) / total if total > 0 else None)


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def steps_per_s(store: Store, recent: bool = True) -> float | None:
    if recent:
        if len(store.recent) < 2:
            return None
        first, last = store.recent[0], store.recent[-1]
        span = last.t - (first.t - first.dur / 1000.0)
        # by index, not by row count: a fast job's live stream sends only the newest rows of each tick
        return (last.i - first.i + 1) / span if span > 0 else None
    if not store.steps or store.first_start is None or store.last_end is None:
        return None
    first = first_step_left_out(store)
    if first is not None:  # from step 1's end: the steps after it, over their time
        span = store.last_end - first.t
        return (store.steps_folded - 1) / span if span > 0 else None
    span = store.last_end - store.first_start
    return store.steps_folded / span if span > 0 else None


#: A running job is quiet (an evaluation, a checkpoint, a hang) once its last step ended this long ago and more than
#: two of its recent steps' time ago: past what the agent's 1 s tick and the job's own pace explain.
QUIET_MIN_S = 5.0


def quiet_for(store: Store, now: float) -> float | None:
    """Seconds since the last step ended, when the job has gone quiet (:data:`QUIET_MIN_S`); else None. A recent
    step's time is its 95th percentile, not the longest: one 12 s step (a pause at an epoch's end) hid every later
    quiet stretch under 24 s."""
    if store.exit is not None or store.last_end is None:
        return None
    gap = now - store.last_end
    rate = steps_per_s(store)
    durs = sorted(s.dur for s in store.recent)
    long_step = _quantile(durs, 0.95) / 1000.0 if durs else 0.0
    period = max(1.0 / rate if rate else 0.0, long_step)
    return gap if gap > max(QUIET_MIN_S, 2 * period) else None


def samples_per_s(store: Store, recent: bool = True) -> float | None:
    if recent:
        rows = [s for s in store.recent if s.samples]
        if len(rows) < 2 or len(rows) < len(store.recent) // 2:
            return None
        rate = steps_per_s(store, recent=True)
        return None if rate is None else rate * sum(s.samples for s in store.recent) / len(store.recent)
    sps = steps_per_s(store, recent=False)
    first = first_step_left_out(store)
    counted, total, steps = store.samples_steps, store.samples_total, store.steps_folded
    if first is not None:
        counted, total, steps = counted - (first.samples > 0), total - first.samples, steps - 1
    # as over the recent window: where most steps fetched no batch perfmon saw (itertools.cycle(loader) replays
    # the first pass's batches; a loader used only at the start), samples/s would be a fraction of the truth
    if sps is None or counted < 2 or counted < steps // 2:
        return None
    return sps * total / steps


def batch_size(store: Store) -> int | None:
    """Typical samples per step over the recent window (median)."""
    values = sorted(s.samples for s in store.recent if s.samples)
    return values[len(values) // 2] if values else None


def outside_shares(store: Store, now: float | None = None) -> dict[str, float] | None:
    """Share of the job's wall time spent outside training steps, by kind (None: none seen). ``now``: where a job
    without an exit ends (a replay's clock, a killed job's last word); the wall clock by default."""
    total = sum(store.outside_ms.values())
    wall = elapsed(store, now) * 1000.0
    if total <= 0 or wall <= 0:
        return None
    return {k: min(1.0, v / wall) for k, v in store.outside_ms.items()}


def closures_per_step(store: Store) -> float | None:
    """Mean closure evaluations per step (LBFGS-style ``step(closure)``), None when there are none."""
    if not store.closures_total:
        return None
    return store.closures_total / max(1, store.closure_steps)


def no_loader(store: Store) -> bool:
    """The job has stepped without a DataLoader (the model's facts list none) and no fetch was timed: its *data*
    reads 0 while the script builds its batches itself (slicing tensors, a replay buffer), which is *other*."""
    model = store.model
    return (store.steps > 0 and model is not None and not model.loaders and store.totals["data"].total_ms <= 0
            and store.prefetch_ms <= 0)


def prefetch_share(store: Store) -> float | None:
    """Time other threads spent fetching batches (a prefetching generator), as a share of the step time; None
    when no fetch ran on another thread."""
    total = store.totals["step"].total_ms
    if store.prefetch_ms <= 0 or total <= 0:
        return None
    return min(1.0, store.prefetch_ms / total)  # a fetch begun before the first step ends in it


# -- resources --------------------------------------------------------------------------------------
def recent_host(store: Store) -> HostSample | None:
    """The latest host sample with its CPU percentages averaged over the recent samples taken while
    training stepped (an instant right after the loop ends, or between bursts, would mislead)."""
    hosts = store.busy_hosts
    if not hosts:
        return store.host
    last = hosts[-1]

    def mean(values: list[float | None], own: float | None) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else own

    return replace(
        last, cpu_percent=mean([h.cpu_percent for h in hosts], last.cpu_percent),
        workers_cpu_percent=mean([h.workers_cpu_percent for h in hosts], last.workers_cpu_percent),
        workers_wait_percent=mean([h.workers_wait_percent for h in hosts], last.workers_wait_percent),
        trainer_wait_percent=mean(list(store.busy_trainer_waits), last.trainer_wait_percent),
        system_cpu_percent=mean([h.system_cpu_percent for h in hosts], last.system_cpu_percent),
    )


def mean_cpu_percent(store: Store) -> float | None:
    return store.cpu_sum / store.cpu_n if store.cpu_n else None


def flops(store: Store) -> Flops:
    """FLOPs per step, achieved FLOP/s from the recent step time, and MFU where a peak is known."""
    per_step = store.model.flops_per_step if store.model else None
    step_ms = phase_stats(store, recent=True)["step"].mean_ms
    achieved = per_step / (step_ms / 1000.0) if per_step and step_ms else None
    peak = store.meta.peak_tflops
    source = "--peak-tflops" if peak else None
    if not peak and store.gpus:
        name = store.gpus[0].name
        peak = peak_tflops(name)
        source = f"{name} dense bf16" if peak else None
    mfu = achieved / (peak * 1e12) if achieved and peak else None
    reason = None
    if mfu is None:
        reason = (("no FLOP count yet (press f)" if store.exit is None else
                   "not counted (--count-flops, or f while the job runs)") if not per_step else
                  "no known peak for this device: pass --peak-tflops" if store.gpus else
                  "CPU run: MFU needs --peak-tflops")
    return Flops(flops_per_step=per_step, achieved_flops=achieved, peak_tflops=peak, peak_source=source,
                 mfu=mfu, reason=reason)


def memory_budget(store: Store) -> MemoryBudget:
    """Static vs per-step peak memory, per-sample activation memory, the largest batch that fits."""
    static = store.model.static_bytes if store.model else None
    out = MemoryBudget(static_bytes=static, batch=batch_size(store))
    cm = store.cuda_mem
    if cm is None or not store.gpus:
        cpu = ("CPU run: no allocator statistics, activation memory cannot be told apart from the "
               "process's RSS")
        return replace(out, reason=cpu if store.meta.cuda is not True else "waiting for allocator statistics")
    capacity = store.gpus[0].total_bytes
    # the steady-state per-step peak (sample windows past the first steps) where window peaks
    # are on; the peak since start otherwise, which may hold a first-step spike
    peak, source = store.peaks.steady_allocated_bytes, "steady state"
    if peak is None:
        peak, source = cm.peak_allocated_bytes, "since start"
    out = replace(out, capacity_bytes=capacity, peak_bytes=peak, peak_source=source)
    if capacity and cm.peak_reserved_bytes is not None:
        out = replace(out, margin=1.0 - cm.peak_reserved_bytes / capacity)
    if static is None or peak is None:
        return replace(out, reason="waiting for model facts")
    activation = max(0, peak - static)
    out = replace(out, activation_bytes=activation)
    if not out.batch or not activation:
        unknown = "batch size unknown (no DataLoader batches seen)"
        return replace(out, reason=unknown if not out.batch else None)
    per_sample = activation / out.batch
    out = replace(out, per_sample_bytes=int(per_sample))
    if capacity is not None:
        # keep 5% of the device for the allocator's own slack and the CUDA context
        out = replace(out, max_batch=max(0, int((capacity * 0.95 - static) // per_sample)))
    return out


# -- the run ------------------------------------------------------------------------------------------
def elapsed(store: Store, now: float | None = None) -> float:
    start = store.meta.start
    if start is None:
        return 0.0
    exit_ = store.exit
    end = exit_.t if exit_ and exit_.t else (now if now is not None else time.time())
    return max(0.0, end - start)


def status(store: Store) -> str:
    """``starting``, ``running``, ``exited 0``, ``failed: ValueError``,
    ``failed: SyntaxError (syn.py line 2)``, ``killed by SIGKILL``: always one line."""
    exit_ = store.exit
    if exit_ is None and store.execed is not None:
        return f"replaced itself with {store.execed.program or 'another program'} (os.exec*)"
    if exit_ is None:
        return "running" if store.meta.received else "starting"
    if exit_.signal:
        return f"killed by {exit_.signal}"
    if exit_.exception:
        m = re.match(r"([\w.]+)(?::.*?)?(\s\([^()]* line \d+\))?$", exit_.exception)
        return f"failed: {m[1]}{m[2] or ''}" if m else "failed"
    return f"exited {exit_.code}"


def exit_status(store: Store) -> int | None:
    """The shell-style status: code, or 128+N for a signal."""
    if store.exit is None:
        return None
    if store.exit.signal:
        num = getattr(_signal, store.exit.signal, None)
        return 128 + int(num) if num is not None else 1
    return store.exit.code
