"""Findings about multi-GPU training: one process driving several GPUs, and jobs of several ranks.

``data-parallel`` is an ordinary rule (one run's facts). The job rules compare ranks: each is a pure
function ``(rows: list[RankRow], cfg: Config) -> Finding | None`` registered with :func:`job_rule`;
:func:`evaluate_job` runs them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from perfmon.analysis.job import RankRow, rank_gaps
from perfmon.analysis.rules.base import Config, Facts, Finding, rule
from perfmon.protocol import ALL_PHASES

JobRule = Callable[[list[RankRow], Config], Finding | None]
JOB_REGISTRY: dict[str, tuple[JobRule, str]] = {}


def job_rule(rule_id: str, threshold: str) -> Callable[[JobRule], JobRule]:
    """Register a rule over the ranks of a job under a stable id; ``threshold`` says when it fires."""

    def deco(fn: JobRule) -> JobRule:
        JOB_REGISTRY[rule_id] = (fn, threshold)
        return fn

    return deco


def evaluate_job(rows: list[RankRow], cfg: Config | None = None) -> list[Finding]:
    """Every job rule that holds for these ranks, most severe first."""
    cfg = cfg or Config()
    out = []
    for rule_id, (fn, _) in JOB_REGISTRY.items():
        if rule_id in cfg.disabled:
            continue
        try:
            finding = fn(rows, cfg)
        except (ArithmeticError, KeyError, TypeError, ValueError):
            finding = None
        if finding is not None:
            out.append(finding)
    return sorted(out, key=lambda f: f.rank, reverse=True)


@rule("data-parallel", "the model is wrapped in nn.DataParallel (one process driving every GPU)")
def data_parallel(f: Facts, cfg: Config) -> Finding | None:
    if "DataParallel" not in f.model.roots:
        return None
    return Finding(
        "data-parallel", "warn", "nn.DataParallel: one Python process drives every GPU",
        {"model": list(f.model.roots), "gpus": len(f.gpus)},
        "DataParallel replicates the model and scatters each batch from one thread every step, and GPU 0 "
        "gathers the outputs: it is slower than one GPU per process and PyTorch recommends against it. Use "
        "DistributedDataParallel with one process per GPU: wrap the model in DDP, init_process_group, a "
        "DistributedSampler, and start it with torchrun (perfmon torchrun --nproc-per-node N train.py).",
        impact=0.3,
    )


def _median(values: list[float]) -> float:
    return statistics.median(values)


_PHASE_FIX = {
    "data": "its input pipeline is slower: give its DataLoader more workers (num_workers, persistent_workers, "
            "pin_memory), check that node's CPU load and disk, and that every rank reads an equal share",
    "forward": "it computes the forward pass slower: a slower or throttled GPU (see its device view), another "
               "process on the same GPU, or larger inputs on that rank (uneven sequence lengths or batches)",
    "backward": "it computes the backward pass slower: a slower or throttled GPU, another process on its GPU, "
                "or larger inputs on that rank",
    "optimizer": "its optimizer step is slower: state on a different device, or a rank-specific extra (EMA, "
                 "gradient clipping with logging) on that rank",
    "other": "it spends more time between the phases: work only that rank does (logging, metrics, "
             "checkpointing or evaluation on rank 0) belongs outside the step, or after a barrier on all ranks",
}


@job_rule("straggler", "one rank's step time (or, in DDP, its work before the all-reduce wait) > 10% warn / "
                       "20% critical above the median of the other ranks'; names the phase that explains the gap")
def straggler(rows: list[RankRow], cfg: Config) -> Finding | None:
    timed = [r for r in rows if r.mean_ms and r.phases and r.steady >= cfg.min_steps]
    if len(timed) < 2:
        return None
    gaps = rank_gaps(timed)
    slow = max(timed, key=lambda r: (gaps[r.rank], -r.rank))
    gap = gaps[slow.rank]
    if gap <= cfg.straggler_warn:
        return None

    def others(r: RankRow, value: Callable[[RankRow], float]) -> float:
        return _median([value(o) for o in timed if o.rank != r.rank])  # the median of the other ranks

    median_step = others(slow, lambda o: o.mean_ms or 0.0)
    excess = {p: slow.phases.get(p, 0.0) - others(slow, lambda o, p=p: o.phases.get(p, 0.0)) for p in ALL_PHASES}
    phase = max(excess, key=lambda p: excess[p])
    where = f" on node {slow.node}" if slow.node is not None else ""
    return Finding(
        "straggler", "critical" if gap > cfg.straggler_critical else "warn",
        f"rank {slow.rank}{where} holds the job back: its {phase} phase takes {excess[phase]:.1f} ms/step more "
        f"than the other ranks' ({gap:.0%} more work per step)",
        {"rank": slow.rank, "phase": phase, "node": slow.node, "host": slow.host, "gap": round(gap, 4),
         "phase_ms": round(slow.phases.get(phase, 0.0), 3),
         "others_phase_ms": round(slow.phases.get(phase, 0.0) - excess[phase], 3),
         "step_ms": round(slow.mean_ms or 0.0, 3), "others_step_ms": round(median_step, 3),
         "step_ms_by_rank": {str(r.rank): round(r.mean_ms or 0.0, 3) for r in timed}},
        f"Every rank waits for the slowest one at each gradient all-reduce (the others' wait shows in their "
        f"backward), so the whole job runs at rank {slow.rank}'s pace: {_PHASE_FIX[phase]}.",
        impact=min(1.0, gap / (1.0 + gap)),
    )


@job_rule("rank-memory-imbalance", "one rank's peak allocated GPU memory > 20% and > 1 GiB above the median rank's")
def rank_memory_imbalance(rows: list[RankRow], cfg: Config) -> Finding | None:
    sized = [r for r in rows if r.allocated_bytes]
    if len(sized) < 2:
        return None
    median = _median([float(r.allocated_bytes or 0) for r in sized])
    top = max(sized, key=lambda r: (r.allocated_bytes or 0, -r.rank))
    extra = float(top.allocated_bytes or 0) - median
    if median <= 0 or extra / median <= cfg.rank_memory_imbalance or extra < cfg.rank_memory_min_bytes:
        return None
    return Finding(
        "rank-memory-imbalance", "warn",
        f"rank {top.rank} peaks at {extra / 2**30:.1f} GiB more GPU memory than the median rank",
        {"rank": top.rank, "peak_allocated_bytes": top.allocated_bytes, "median_peak_allocated_bytes": median,
         "by_rank": {str(r.rank): r.allocated_bytes for r in sized}},
        f"The batch size every rank can use is set by rank {top.rank}: work only that rank does (gathering "
        "metrics or a full state_dict for checkpoints on rank 0, an EMA copy, evaluation) or uneven inputs "
        "(variable sequence lengths) hold memory the others do not. Spread it, or gather on CPU.",
        impact=0.1,
    )


@job_rule("communication-heavy", "the ranks' last profiler windows spend > 30% of busy GPU time in communication "
                                 "kernels (median over ranks)")
def communication_heavy(rows: list[RankRow], cfg: Config) -> Finding | None:
    shares = [r for r in rows if r.comm_share is not None]
    if not shares:
        return None
    median = _median([float(r.comm_share or 0.0) for r in shares])
    if median <= cfg.rank_communication_share:
        return None
    return Finding(
        "communication-heavy", "warn", f"communication takes {median:.0%} of the GPUs' busy time (median rank)",
        {"median_share": round(median, 4), "by_rank": {str(r.rank): round(float(r.comm_share or 0.0), 4)
                                                       for r in shares}},
        "Much of each step moves gradients between GPUs: a larger batch per GPU (or gradient accumulation with "
        "no_sync) sends less per sample; bucket_cap_mb and gradient_as_bucket_view help DDP overlap; across "
        "nodes, a faster interconnect or FSDP/ZeRO sharding changes what is sent.",
        impact=min(1.0, median),
    )
