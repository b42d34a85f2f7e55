"""The trainer's own CPUs: threads that wait for a CPU, and why (too many torch threads, a quota, a shared host)."""

from __future__ import annotations

import math

from perfmon.analysis.rules.base import Config, Facts, Finding, rule
from perfmon.messages import HostSample, children_name


def wait_share(h: HostSample) -> float | None:
    """Of the CPU time the trainer's threads want, the share they sit runnable waiting for a CPU."""
    wait, cpu = h.trainer_wait_percent, h.cpu_percent
    if wait is None or cpu is None or cpu + wait <= 0:
        return None
    return wait / (cpu + wait)


def other_processes_cpus(h: HostSample) -> float | None:
    """CPUs the host's other processes use: the whole host's CPU less the trainer's and its workers'."""
    if h.system_cpu_percent is None or h.cpu_percent is None:
        return None
    host_cpus = h.cpu_count or 1
    return max(0.0, h.system_cpu_percent / 100.0 * host_cpus - h.cpu_percent / 100.0
               - (h.workers_cpu_percent or 0.0) / 100.0)


@rule("cpu-contention", "the trainer's threads runnable but waiting for a CPU >= 20% of the CPU time they want "
      "(Linux schedstat), >= 50% critical; the cause named from torch's intra-op threads against the CPUs the "
      "process may use (affinity mask, cgroup quota) and those other processes leave free")
def cpu_contention(f: Facts, cfg: Config) -> Finding | None:
    h = f.host
    wait, cpu = h.trainer_wait_percent, h.cpu_percent
    share = wait_share(h)
    if share is None or wait is None or cpu is None or share < cfg.cpu_wait_warn:
        return None
    host_cpus = h.cpu_count or 1
    usable = min(h.usable_cpus or host_cpus, host_cpus)
    workers = (h.workers_cpu_percent or 0.0) / 100.0
    others = other_processes_cpus(h) or 0.0
    free = max(0.0, min(usable, host_cpus - others) - workers)  # the CPUs left for the trainer's own threads
    want = max(1, math.floor(free + 0.25))  # a whole CPU less a reading's noise (1.98 free is 2)
    threads = h.torch_threads
    limit = h.cpu_limit
    children = children_name(h.workers, f.model.loaders)
    if threads is not None and threads > usable:
        title = (f"torch runs {threads} threads on {usable:g} usable CPUs ({limit})" if limit
                 else f"torch runs {threads} threads on the host's {usable:g} CPUs")
        why = (f"torch sizes its thread pool from the host's CPUs, not from the {limit}" if limit
               else "more threads than CPUs")
        fix = (f"Call torch.set_num_threads({want}) at the start of the script (or set OMP_NUM_THREADS={want}): "
               f"{why}, and its threads wait for each other.")
    elif threads is not None and threads > free + 0.5 and threads > want:  # fewer threads would fit: say how many
        title = (f"{threads} torch threads but {free:.1f} CPUs free: other processes use {others:.1f} of "
                 f"{host_cpus} CPUs" + (f", {children} {workers:.1f}" if workers >= 0.1 else ""))
        fix = (f"Call torch.set_num_threads({want}) (or OMP_NUM_THREADS={want}) so torch's threads fit the free "
               "CPUs; or give the job a host, or CPUs, of its own.")
    else:
        title = f"The trainer waits for a CPU {share:.0%} of the time it wants one"
        fix = ("Other work takes the CPUs the trainer needs"
               + _shares(others, workers, children) + ": " + _remedies(others, workers, children, threads))
    return Finding(
        "cpu-contention", "critical" if share >= cfg.cpu_wait_critical else "warn", title,
        {"wait_share": round(share, 3), "trainer_wait_percent": round(wait, 1), "trainer_cpu_percent": round(cpu, 1),
         "torch_threads": threads, "usable_cpus": usable, "cpu_limit": h.cpu_limit, "cpu_count": host_cpus,
         "other_processes_cpus": round(others, 2), "workers_cpus": round(workers, 2), "free_cpus": round(free, 2)},
        fix, impact=share,
    )


def _shares(others: float, workers: float, children: str) -> str:
    """`` (other processes 1.4 CPUs, DataLoader workers 0.4)``: who uses the CPUs, of those that use any."""
    used = [f"other processes {others:.1f} CPUs"] if others >= 0.05 else []
    used += [f"{children} {workers:.1f}"] if workers >= 0.05 else []
    return f" ({', '.join(used)})" if used else ""


def _remedies(others: float, workers: float, children: str, threads: int | None) -> str:
    """What would leave the trainer its CPUs, of what applies: only the knobs the job has turned up (a script
    with one torch thread and no workers was told to use fewer of each)."""
    parts = []
    if others >= 0.5:
        parts.append(f"stop or move the other processes that use {others:.1f} CPUs")
    if workers >= 0.1:
        parts.append(f"fewer {children}")
    if threads is not None and threads > 1:
        parts.append(f"fewer torch threads (torch.set_num_threads; it runs {threads})")
    parts.append("a host, or CPUs, of its own")
    return (", ".join(parts[:-1]) + ", or " + parts[-1] if len(parts) > 1 else parts[0][0].upper() + parts[0][1:]) + "."
