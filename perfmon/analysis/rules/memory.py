"""Memory: out-of-memory risk, allocator fragmentation, memory growing step after step."""

from __future__ import annotations

from perfmon.analysis.rules.base import Config, Facts, Finding, rule

GIB = 1 << 30


@rule("memory-pressure", "peak reserved > 90% of device memory; allocation retries or OOMs: critical")
def memory_pressure(f: Facts, cfg: Config) -> Finding | None:
    cm, gpus = f.cuda_mem, f.gpus
    if cm is None or not gpus or not gpus[0].total_bytes:
        return None
    total = gpus[0].total_bytes
    peak = cm.peak_reserved_bytes or 0
    retries, ooms = cm.alloc_retries or 0, cm.ooms or 0
    frac = peak / total
    if frac <= cfg.memory_pressure and not retries and not ooms:
        return None
    budget = f.budget
    fits = f" The largest batch that fits is about {budget.max_batch}." if budget.max_batch else ""
    return Finding(
        "memory-pressure", "critical" if retries or ooms else "warn",
        f"Memory pressure: peak reserved {frac:.0%} of {total / GIB:.0f} GiB" + (f", {retries} allocation retries" if retries else ""),
        {"peak_reserved_bytes": peak, "total_bytes": total, "alloc_retries": retries, "ooms": ooms,
         "per_sample_bytes": budget.per_sample_bytes, "max_batch": budget.max_batch},
        "Use bf16 autocast (halves activations), activation checkpointing (torch.utils.checkpoint), or a smaller "
        "micro-batch with gradient accumulation to keep the effective batch." + fits,
    )


@rule("fragmentation", "at the allocator's peak (since start), reserved >= 1.3x allocated and > 1 GiB more: "
      "memory the allocator holds but could not use when it needed the most")
def fragmentation(f: Facts, cfg: Config) -> Finding | None:
    # Judged at the peak, not now: after a step frees its activations, reserved >> allocated is the cache
    # doing its job; only at the peak is every reserved byte one the job could have used.
    cm = f.cuda_mem
    if cm is None:
        return None
    reserved, allocated = cm.peak_reserved_bytes or 0, cm.peak_allocated_bytes or 0
    slack = reserved - allocated
    if slack < cfg.fragmentation_min_bytes or reserved < cfg.fragmentation_ratio * max(allocated, 1):
        return None
    split = cm.peak_inactive_split_bytes
    return Finding(
        "fragmentation", "warn",
        f"Allocator fragmentation: {reserved / GIB:.1f} GiB reserved at the peak for {allocated / GIB:.1f} GiB in use",
        {"peak_reserved_bytes": reserved, "peak_allocated_bytes": allocated, "slack_bytes": slack,
         "peak_inactive_split_bytes": split, "alloc_retries": cm.alloc_retries},
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting the job; avoid tensors of ever-changing "
        "shapes (pad to buckets).",
    )


def _creep(values: list[float], cfg: Config) -> tuple[float, float] | None:
    """(growth fraction, bytes) if the series rises steadily (mostly non-decreasing halves). A series of half the
    points or more but fewer than ``creep_min_points`` (a run of 10-20 s past warm-up: a leak that had grown RSS
    4.7x in 16 s went unsaid) needs five times the growth and the bytes."""
    n = len(values)
    short = n < cfg.creep_min_points
    if n < max(3, cfg.creep_min_points // 2):
        return None
    scale = 5 if short else 1
    q = max(1, n // 4)
    first, last = sum(values[:q]) / q, sum(values[-q:]) / q
    mid = sum(values[q:-q]) / max(1, n - 2 * q)
    grown = last - first
    if (first <= 0 or grown < scale * cfg.creep_min_bytes or grown / first < scale * cfg.creep_growth
            or not first < mid < last):
        return None
    rises = sum(1 for a, b in zip(values, values[1:], strict=False) if b >= a)
    if rises < 0.6 * (n - 1):
        return None
    return grown / first, grown


@rule("memory-creep", "RSS or CUDA allocated memory up > 10% and > 100 MiB, rising steadily over >= 20 samples "
      "(a second each); over 10-19, a short run's, up > 50% and > 500 MiB")
def memory_creep(f: Facts, cfg: Config) -> Finding | None:
    for key, label, values in (("cuda_alloc", "GPU allocated memory", f.cuda_alloc_history),
                               ("rss", "process RSS", f.rss_history)):
        found = _creep(values, cfg)
        if found:
            growth, grown = found
            return Finding(
                "memory-creep", "critical" if growth >= 0.5 else "warn", f"Memory creep: {label} grew {growth:.0%} (+{grown / 2**20:,.0f} MiB) and keeps rising",
                {"series": key, "growth": round(growth, 3), "grown_bytes": int(grown), "points": len(values)},
                "Something keeps tensors alive across steps: accumulate `loss.item()` (a float), not `loss`; detach "
                "tensors you store for logging; clear lists/caches that grow every step.",
            )
    return None
