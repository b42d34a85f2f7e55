"""How many CPUs this process may really use, and how long its threads wait for one (Linux).

A container's CPU quota (cgroup ``cpu.max``, or v1's ``cpu.cfs_quota_us``) and a CPU affinity mask (``taskset``,
Slurm's binding) both leave a process fewer CPUs than the host has; torch sizes its intra-op pool from the host
(or the affinity mask), never from the quota. ``root`` is where ``/proc`` and ``/sys`` are looked up (tests give a
tree of their own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from perfmon.collectors.procfs import read_proc


@dataclass(frozen=True)
class CpuLimit:
    """The CPUs this process may use (a quota may be fractional) and what limits them (None: the host)."""

    usable: float
    limit: str | None


def usable_cpus(host_cpus: int, root: Path = Path("/"), pid: int | None = None) -> CpuLimit:
    """The tighter of the affinity mask and the cgroup CPU quota (v2 or v1, this cgroup or any parent) of process
    ``pid`` (this one by default: a launcher samples its job from outside)."""
    best = CpuLimit(float(host_cpus), None)
    affinity = _affinity(root, pid)
    if affinity is not None and affinity < best.usable:
        best = CpuLimit(float(affinity), f"CPU affinity ({affinity} of {host_cpus} CPUs)")
    quota = _quota(root, pid)
    if quota is not None and quota < best.usable:
        best = CpuLimit(quota, f"cgroup CPU quota ({quota:g} CPUs)")
    return best


def _affinity(root: Path, pid: int | None = None) -> int | None:
    if root == Path("/"):
        try:
            return len(os.sched_getaffinity(pid or 0))
        except (AttributeError, OSError):
            return None
    try:  # a test tree: the mask as /proc/self/status says it
        for line in (root / f"proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return _count_list(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _count_list(text: str) -> int:
    """CPUs in a Linux list such as ``0-3,8,10-11``."""
    n = 0
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def _quota(root: Path, pid: int | None = None) -> float | None:
    """The smallest quota on the process's cgroup path, in CPUs; None where there is none (or no cgroups)."""
    try:
        lines = (root / f"proc/{pid or 'self'}/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy
            for d in _upwards(root / "sys/fs/cgroup", path):
                found.extend(_v2(d / "cpu.max"))
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                for d in _upwards(root / "sys/fs/cgroup" / mount, path):
                    found.extend(_v1(d))
    return min(found) if found else None


def _upwards(base: Path, path: str) -> list[Path]:
    """The cgroup's own directory and each parent up to the mount (inside a container the path may not exist
    under the mount, which is then the container's own cgroup)."""
    out = []
    rel = Path(path.strip().lstrip("/"))
    while True:
        d = base / rel
        if d.is_dir():
            out.append(d)
        if rel == Path("."):
            return out
        rel = rel.parent


def _v2(path: Path) -> list[float]:
    try:
        values = path.read_text().split()  # "max 100000" or "200000 100000"
    except OSError:
        return []
    return _ratio(values[0], values[1]) if len(values) == 2 else []


def _v1(d: Path) -> list[float]:
    try:
        quota = (d / "cpu.cfs_quota_us").read_text().strip()
        period = (d / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return []
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> list[float]:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return []  # "max": no quota
    return [q / p] if q > 0 and p > 0 else []


def thread_wait_ns(pid: int, skip: set[int]) -> int | None:
    """Nanoseconds the process's threads (less ``skip``) have been runnable but waiting for a CPU, summed
    (``/proc/PID/task/*/schedstat``, second field); None where the kernel does not say."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, known = 0, False
    for tid in tids:
        if int(tid) in skip:
            continue
        try:
            total += int(read_proc(f"/proc/{pid}/task/{tid}/schedstat").split()[1])
            known = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total if known else None

