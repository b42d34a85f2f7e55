"""Step-time structure: what to optimise first, unstable steps, a slow optimizer."""

from __future__ import annotations

import math

from perfmon.analysis.rules.base import Config, Facts, Finding, rule
from perfmon.analysis.rules.host_cpu import other_processes_cpus, wait_share
from perfmon.messages import OptimizerFlags, as_sent, training_loader

PHASE_ADVICE = {
    "data": "the input pipeline (see input-bound)",
    "forward": "the model's forward: bigger batches, torch.compile, bf16 autocast, fused kernels",
    "backward": "backward: bf16 autocast, activation checkpointing trade-offs, torch.compile",
    "optimizer": "the optimizer step: fused=True / foreach=True, fewer parameter tensors",
    "other": "time outside the phases: the loss, logging, .item()/.cpu() calls, checkpoint saves, "
             "zero_grad(set_to_none=True)",
}


@rule("priority", "always, as info, once min_steps steps past warm-up exist: the phases ranked by time", reads_steps=True)
def priority(f: Facts, cfg: Config) -> Finding | None:
    ranked = sorted(f.shares.items(), key=lambda kv: kv[1], reverse=True)
    top, share = ranked[0]
    note = ""
    if top == "data" and f.shares["data"] < cfg.data_warn:
        note = " (data is overlapped by workers: speeding it up gives nothing)"
    elif top == "other" and f.prefetch_busy() >= cfg.prefetch_busy:
        note = " (here mostly the wait for a prefetching thread's next batch: see input-bound)"
    elif top == "other" and f.closures_per_step:  # Lightning's training_step and hooks run inside the closure
        note = (" (here that includes the work of optimizer.step(closure)'s closure outside the model's forward and "
                "backward: the loss, logged metrics, a framework's hooks; log less often, without .item() or a "
                "sync across ranks every step)")
    return Finding(
        "priority", "info", f"Biggest phase: {top} ({share:.0%} of the last {len(f.steps)} steps)",
        {"share_by_phase": {p: round(s, 4) for p, s in ranked}, "steps": len(f.steps)},  # ranked, biggest first
        f"Optimise {PHASE_ADVICE[top]} first{note}.", impact=share,
    )


@rule("step-instability", "p99/p50 step time > 2 or periodic spikes > 3x the median, costing >= 10% of the time; "
      "info, not warn, when the spikes have no period and the host is busy with other work (other processes use "
      ">= busy_host_cpus CPUs, or the trainer waits for a CPU >= cpu_wait_warn of the time)", reads_steps=True)
def step_instability(f: Facts, cfg: Config) -> Finding | None:
    p50, p99 = f.quantile(0.5), f.quantile(0.99)
    if not p50 or p99 is None:
        return None
    spikes = [s.i for s in f.steps if s.dur > cfg.spike_ratio * p50]
    period = spike_period(spikes, [s.i for s in f.steps])
    ratio = p99 / p50
    excess = sum(max(0.0, s.dur - p50) for s in f.steps) / max(1e-9, sum(s.dur for s in f.steps))
    if (ratio <= cfg.instability_ratio and not period) or excess < cfg.instability_min_excess:
        return None
    what = f"every {period} steps" if period else f"p99 is {ratio:.1f}x p50"
    evidence = {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3), "ratio": round(ratio, 2),
                "spike_steps": spikes[-10:], "period": period}
    fix = ("Find what runs on the spiking steps: checkpoint saves, logging/evaluation every N steps, Python GC "
           "(gc.freeze() after setup), host syncs (.item()). Move them off the training loop or do them less often.")
    loader = training_loader(f.model.loaders)
    if period and loader is not None and loader.num_workers and (
            loader.built_every_epoch or not loader.persistent_workers):
        # each epoch's first step waits for the loader's workers to start (and fill their queue) again
        why, cure = (("the DataLoader is built anew every epoch", "build the loader once, before the epoch loop.")
                     if loader.built_every_epoch else
                     ("its DataLoader starts its workers again every epoch (persistent_workers=False)",
                      "set persistent_workers=True."))
        fix += (f" If {period} steps are an epoch, {why}: each epoch's first step waits for "
                f"{loader.num_workers} workers to start; {cure}")
    others, waits = other_processes_cpus(f.host), wait_share(f.host)
    busy = [f"other processes use {others:.1f} of {f.host.cpu_count or 1} CPUs"] if (
        others is not None and others >= cfg.busy_host_cpus) else []
    busy += [f"the trainer waits for a CPU {waits:.0%} of the time"] if (
        waits is not None and waits >= cfg.cpu_wait_warn) else []
    if busy and not period:  # a period is the loop's own; scattered spikes on a busy host are likely the host's
        evidence.update(other_processes_cpus=round(others, 2) if others is not None else None,
                        wait_share=round(waits, 3) if waits is not None else None)
        return Finding(
            "step-instability", "info", f"Uneven step time (p99 {ratio:.1f}x p50) on a busy host: "
            + " and ".join(busy), evidence,
            "Likely the host's, not the script's: other work preempts the trainer. Measure on a quiet host (or "
            "CPUs of its own: taskset, a cgroup) before changing the loop; if the spikes stay there: " + fix[0].lower()
            + fix[1:], impact=excess,
        )
    return Finding("step-instability", "warn", f"Unstable step time: spikes {what}", evidence, fix, impact=excess)


def spike_period(spikes: list[int], steps: list[int], coverage: float = 0.8, reach: int = 4,
                 alpha: float = 0.01) -> int | None:
    """The smallest period (>= 2 steps) such that the slow steps fall on nearly every step of one residue, at least
    three times, more often than chance would put them there: a checkpoint every N steps stays periodic when a busy
    host adds slow steps of its own between them, and random slow steps are not called periodic. Candidates are the
    distances from each slow step to the next ``reach`` ones, up to a third of the window. A residue's hits count
    when slow steps falling at random (at the rate of those off it) would hit it as often with a probability below
    ``alpha`` over every period and residue the window allows (a binomial tail, Bonferroni-corrected): random slow
    steps on a busy host were called periodic in 20-40% of windows of 200 steps, now ~0.1-0.6%. Each candidate costs one pass over the slow steps: the
    steps due on a residue are counted, not listed, since the rules run every second."""
    if len(spikes) < 3 or not steps:
        return None
    window = set(steps)
    spiked = [i for i in spikes if i in window]
    lo, hi = min(window), max(window)
    contiguous = len(window) == hi - lo + 1
    longest = (hi - lo + 1) // 3  # a period fits three times in the window: three hits of a longer gap are chance
    candidates = sorted({b - a for k, a in enumerate(spiked) for b in spiked[k + 1 : k + 1 + reach]
                         if 2 <= b - a <= longest})
    tried = sum(range(2, longest + 1))  # every (period, residue) the data could have picked

    def beyond_chance(n: int, due: int) -> bool:
        rate = (len(spiked) - n) / max(1, len(window) - due)  # the slow steps off this residue: the host's
        tail = sum(math.comb(due, k) * rate**k * (1 - rate) ** (due - k) for k in range(n, due + 1))
        return tail * tried < alpha

    for gap in candidates:
        hits: dict[int, int] = {}
        for i in spiked:
            hits[i % gap] = hits.get(i % gap, 0) + 1
        if contiguous:
            due = {r: (hi - r) // gap - (lo - 1 - r) // gap for r in hits}
        else:
            due = dict.fromkeys(hits, 0)
            for i in window:
                if i % gap in due:
                    due[i % gap] += 1
        if any(n >= 3 and n >= coverage * due[r] and beyond_chance(n, due[r]) for r, n in hits.items()):
            return gap
    return None


#: Where torch's default (foreach=None) picks the foreach implementation (torch.optim's supported devices).
FOREACH_DEVICES = frozenset({"cuda", "xpu"})


def _per_tensor(o: OptimizerFlags, gpu_run: bool) -> bool:
    """Whether the optimizer updates one tensor at a time: not fused, not foreach, and foreach=None is torch's
    default only where every parameter is on a foreach device (CUDA) and the optimizer is not differentiable.
    Recordings without parameter devices: a GPU run is taken to be on the GPU."""
    if o.fused or o.foreach is True:
        return False
    if o.foreach is None and not o.differentiable:
        on_gpu = set(o.devices) <= FOREACH_DEVICES if o.devices else gpu_run
        return not on_gpu
    return True


@rule("slow-optimizer", "optimizer share > 25% with a per-tensor implementation (not fused, not foreach: "
      "foreach=None is torch's foreach on CUDA, a per-tensor loop on CPU) over >= 10 tensors; at over 1 ms a "
      "tensor the update's arithmetic, not the loop, is named", reads_steps=True)
def slow_optimizer(f: Facts, cfg: Config) -> Finding | None:
    share = f.shares["optimizer"]
    slow = [o for o in f.model.optimizer_flags if _per_tensor(o, bool(f.gpus))
            and (o.param_tensors or 0) >= cfg.optimizer_min_tensors]
    if share <= cfg.optimizer_share or not slow:
        return None
    name = slow[0].name
    tensors = sum(o.param_tensors or 0 for o in slow)
    opt_ms = share * sum(f.step_ms) / len(f.step_ms) if f.step_ms else 0.0
    per_tensor = opt_ms / tensors if tensors else 0.0
    evidence = {"optimizer_share": round(share, 4), "optimizer_ms": round(opt_ms, 3),
                "ms_per_tensor": round(per_tensor, 4), "params": f.model.params,
                "optimizers": [as_sent(o) for o in slow]}
    if per_tensor > cfg.optimizer_loop_ms_per_tensor:
        # no loop costs a millisecond a tensor (a small update is tens of microseconds): the time is the update's
        # arithmetic over large tensors (a recommender's embedding table), which foreach only trims
        size = f" over {f.model.params:,} parameters" if f.model.params else ""
        return Finding(
            "slow-optimizer", "warn",
            f"Optimizer step takes {share:.0%} of each step ({name}{size}: {per_tensor:.1f} ms a tensor, the "
            "update's arithmetic)", evidence,
            "Each step updates every parameter, and that is the time (foreach=True or fused=True only trim the "
            "per-tensor overhead). A large nn.Embedding whose batches touch few rows: nn.Embedding(..., "
            "sparse=True) with torch.optim.SparseAdam for it (the rows a batch uses, not the whole table); else "
            "freeze what need not train, or an optimizer with less state (SGD with momentum keeps one tensor a "
            "parameter, Adam two).",
            impact=share,
        )
    return Finding(
        "slow-optimizer", "warn", f"Optimizer step takes {share:.0%} of each step ({name}, per-tensor loop)", evidence,
        f"Construct the optimizer with fused=True (CUDA) or foreach=True: torch.optim.{name}(params, ..., "
        "foreach=True) applies the update to all tensors at once instead of one small kernel per tensor.",
        impact=share,
    )
