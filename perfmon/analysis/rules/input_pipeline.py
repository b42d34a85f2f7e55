"""Input pipeline: a step waiting for data, and DataLoader workers that cannot keep up."""

from __future__ import annotations

from perfmon.analysis.rules.base import Config, Facts, Finding, rule
from perfmon.analysis.rules.host_cpu import other_processes_cpus
from perfmon.messages import LoaderSettings, as_sent, training_loader


def _loader(f: Facts) -> LoaderSettings | None:
    return training_loader(f.model.loaders)


@rule("input-bound", "data share of step > 10% warn, > 20% critical (torch-tb-profiler's DataLoader rule, TraceML); "
      "or batches come from a prefetching thread that spends >= 80% of the step time fetching them while other (the "
      "loop's wait for its queue) is > 10% of the step: warn, critical when other > 20%", reads_steps=True)
def input_bound(f: Facts, cfg: Config) -> Finding | None:
    share = f.shares["data"]
    if share <= cfg.data_warn:
        return _prefetch_bound(f, cfg)
    return Finding(
        "input-bound", "critical" if share > cfg.data_critical else "warn",
        f"Input-bound: {share:.0%} of each step waits for data",
        {"data_share": round(share, 4), "data_ms_mean": round(sum(s.data for s in f.steps) / len(f.steps), 3),
         "loader": as_sent(loader) if (loader := _loader(f)) else None},
        "; ".join(_loader_fixes(f)) + ".", impact=share,
    )


def _prefetch_bound(f: Facts, cfg: Config) -> Finding | None:
    """A prefetching thread (prefetch_generator's BackgroundGenerator, a queue fed by a thread) iterates the
    DataLoader: its fetches are no phase of the steps, and the training thread's wait for its queue is "other".
    When that thread fetches for nearly the whole step time, it is what the loop waits for."""
    busy, other = f.prefetch_busy(), f.shares["other"]
    if busy < cfg.prefetch_busy or other <= cfg.data_warn:  # busy, but not waited for (an evaluation thread, say)
        return None
    loader = _loader(f)
    return Finding(
        "input-bound", "critical" if other > cfg.data_critical else "warn",
        f"Input-bound: a prefetching thread fetches batches {busy:.0%} of the step time, and the loop waits for it "
        f"(other is {other:.0%} of each step)",
        {"prefetch_busy": round(busy, 4), "other_share": round(other, 4),
         "prefetch_ms_mean": round(sum(s.prefetch for s in f.steps) / len(f.steps), 3),
         "loader": as_sent(loader) if loader else None},
        "The thread that iterates the DataLoader cannot keep up, and the training thread's wait for its queue shows "
        "as other: " + "; ".join(_loader_fixes(f)) + " (the thread keeps one batch ahead of the step, under the "
        "same GIL: DataLoader workers are processes that load in parallel).", impact=other,
    )


def _loader_fixes(f: Facts) -> list[str]:
    """What to change in the loader, from its settings."""
    loader = _loader(f)
    cpus = f.host.cpu_count or 1
    steps = []
    if loader:
        nw = loader.num_workers
        others = other_processes_cpus(f.host) or 0.0
        if nw < cpus and others >= cpus - 1.0 + 0.25:  # other processes leave less than a CPU: workers would wait too
            steps.append(f"free CPUs before raising DataLoader(num_workers={nw}): other processes use {others:.1f} of "
                         f"this host's {cpus} CPUs, and more workers would wait for a CPU too (a host of its own)")
        elif nw < cpus:
            steps.append(f"raise DataLoader(num_workers={nw}) towards {min(cpus, max(2 * nw, 4))} (this host has {cpus} CPUs)")
        if not loader.pin_memory and f.gpus:
            steps.append("set pin_memory=True so host-to-device copies overlap")
        if nw and loader.built_every_epoch:  # persistent_workers cannot keep workers across loaders
            steps.append(f"build the DataLoader once, before the epoch loop: a new one each epoch starts its {nw} "
                         "workers again at every epoch (persistent_workers keeps them only across one loader's epochs)")
        elif nw and not loader.persistent_workers:
            steps.append("set persistent_workers=True to keep workers across epochs")
        if nw:
            steps.append(f"raise prefetch_factor (now {loader.prefetch_factor}) so batches are ready ahead")
    else:
        steps.append("load data in a DataLoader with num_workers > 0, pin_memory=True, persistent_workers=True")
    if loader and loader.dataset == "TensorDataset":  # no decoding to move: the cost is a fetch per sample
        steps.append("fetch a batch with one indexing instead of one per sample and a collate: slice the tensors "
                     "yourself, or DataLoader(dataset, batch_size=None, sampler=BatchSampler(RandomSampler(dataset), "
                     f"batch_size={loader.batch_size or 'B'}, drop_last=False))")
    else:
        steps.append("move decoding/augmentation out of the hot path (pre-process once, cache, or do it on the GPU)")
    return steps


@rule("loader-cpu-bound", "data share > 10% with DataLoader workers filling > 90% of the CPUs, or wanting them (their CPU time plus their time runnable but waiting for a CPU, Linux schedstat: a host shared with other jobs gives them only a share), or a > 90% busy host at least 40% of it the workers: CPU-bound preprocessing; or every worker busy with CPUs to spare (too few workers)", reads_steps=True)
def loader_cpu_bound(f: Facts, cfg: Config) -> Finding | None:
    share = f.shares["data"]
    loader = _loader(f)
    host = f.host
    if share <= cfg.data_warn or not loader or not loader.num_workers:
        return None
    nw = loader.num_workers
    cpus = host.cpu_count or 1
    workers_cpu = host.workers_cpu_percent or 0.0
    per_worker = workers_cpu / nw / 100.0
    system = (host.system_cpu_percent or 0.0) / 100.0
    workers_frac = workers_cpu / (100.0 * cpus)
    # What the workers would use with the host to themselves: their CPU plus the time they sat runnable,
    # waiting for a CPU (on a host shared with other jobs they get only a share of it, whatever they need).
    demand_frac = (workers_cpu + (host.workers_wait_percent or 0.0)) / (100.0 * cpus)
    # The workers themselves must be what fills the CPUs: a busy host with idle workers is not this finding.
    # (Linux gives each session an equal share of a busy host: beside one other job the workers get about half.)
    if (workers_frac >= cfg.loader_cpu_saturated or demand_frac >= cfg.loader_cpu_saturated
            or (system >= cfg.loader_cpu_saturated and workers_frac >= 0.4 * system)):
        return Finding(
            "loader-cpu-bound", "critical" if share > cfg.data_critical else "warn",
            f"DataLoader workers saturate the CPU: {nw} workers use {workers_frac:.0%} of {cpus} CPUs, "
            f"host {system:.0%} busy",
            {"workers": nw, "workers_cpu_percent": round(workers_cpu, 1), "workers_cpu_share": round(workers_frac, 3),
             "workers_wait_percent": None if host.workers_wait_percent is None else round(host.workers_wait_percent, 1),
             "workers_demand_share": round(demand_frac, 3),
             "system_cpu_percent": round(system * 100.0, 1), "cpu_count": cpus, "data_share": round(share, 4)},
            "Preprocessing is CPU-bound: more workers will not help past the CPU count. Make each sample cheaper "
            "(pre-decode, smaller images, simpler augmentation), move augmentation to the GPU, or use a host with more cores.",
            # the trainer then waits for a CPU too: its own workers are why
            impact=share, supersedes=("input-bound", "cpu-contention"),
        )
    if per_worker >= cfg.loader_cpu_saturated and nw < cpus:
        want = min(cpus, 2 * nw)
        return Finding(
            "loader-cpu-bound", "critical" if share > cfg.data_critical else "warn",
            f"Too few DataLoader workers: {nw} workers each at {per_worker:.0%} CPU, {cpus - nw} CPUs to spare",
            {"workers": nw, "per_worker_cpu": round(per_worker, 3), "system_cpu_percent": round(system * 100.0, 1),
             "cpu_count": cpus, "data_share": round(share, 4)},
            f"Raise DataLoader(num_workers={nw}) to {want}: each worker is busy all the time and the host has idle CPUs.",
            impact=share, supersedes=("input-bound",),
        )
    return None
