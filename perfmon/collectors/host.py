"""Host telemetry: the trainer, its DataLoader workers, the system.

On Linux the numbers read at every sample come straight from /proc, a file each, parsed for the few fields used
(the trainer's stat, the system's CPU times and memory): psutil parses every field of several files, and in a
training process, where a sample runs with cold caches under the job's GIL, that is most of what a sample costs.
psutil reads everything else, and all of it where /proc cannot be read. psutil raises on processes that vanish
between listing and reading (workers come and go every epoch); every read goes through :func:`_safe` and yields
None instead.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import psutil

from perfmon.collectors.cpus import thread_wait_ns, usable_cpus
from perfmon.collectors.procfs import read_proc


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (psutil.Error, OSError, AttributeError):
        return None


class HostSampler:
    """Call :meth:`sample` periodically; CPU percentages are over the time since the last call."""

    def __init__(self, pid: int | None = None, skip_threads: Callable[[], set[int]] | None = None) -> None:
        """``skip_threads``: thread ids not counted as the trainer's when its threads' CPU wait is read (the
        monitor's own threads in the job)."""
        self.proc = psutil.Process(pid or os.getpid())
        self._skip_threads = skip_threads or set
        self._children: dict[int, psutil.Process] = {}
        self._io_last: tuple[float, int] | None = None
        self._waits: dict[int, tuple[float, int]] = {}  # worker pid -> (when, its run-queue wait so far, ns)
        self._samples = 0
        self._others: set[int] = set()  # descendants the last full scan found
        self._swap: Any = None  # psutil.swap_memory(), read every SLOW_EVERY samples where /proc/meminfo is not
        self._cpu_times: tuple[int, int] | None = None  # the system's busy and total CPU time so far (/proc/stat)
        self.cpu_count = psutil.cpu_count() or 1
        self.limit = usable_cpus(self.cpu_count, pid=self.proc.pid)
        self._trainer_wait: tuple[float, int] | None = None  # (when, its threads' run-queue wait so far, ns)
        self._cpu_last: tuple[float, float] | None = None  # (when, the trainer's CPU seconds so far)
        self._own_stat()  # primes the CPU counter (psutil's, where /proc/PID/stat cannot be read)
        self._system_cpu()  # primes the system's

    def _workers(self) -> list[psutil.Process]:
        # every thread's children (and theirs) every FULL_SCAN_EVERY samples; in between only the main thread's
        # children, which is where DataLoader workers are forked: one small read a sample instead of one a thread
        full = self._samples % FULL_SCAN_EVERY == 0
        self._samples += 1
        main = _children_of_thread(self.proc.pid, self.proc.pid)
        pids: list[int] | None = None
        if main is not None:
            if full:
                pids = _descendants(self.proc.pid, main)
                self._others = set(pids) - set(main)  # not read at every sample
            else:
                pids = sorted(set(main) | {p for p in self._others if _exists(p)})
        if pids is None:  # no /proc/PID/task/TID/children here: psutil scans every process instead
            pids = [c.pid for c in _safe(lambda: self.proc.children(recursive=True)) or []]
        alive = {}
        for pid in pids:
            known = self._children.get(pid)
            if known is None:
                known = _safe(lambda pid=pid: psutil.Process(pid))
                if known is None:  # gone already
                    continue
                _safe(lambda c=known: c.cpu_percent(None))  # first call primes the counter
            alive[pid] = known
        self._children = alive
        return list(alive.values())

    def sample(self) -> dict[str, Any]:
        cpu_percent, threads, rss = self._own_stat()
        workers = self._workers()
        w_cpu = [_safe(lambda w=w: w.cpu_percent(None)) for w in workers]
        w_rss = [_safe(lambda w=w: w.memory_info().rss) for w in workers]
        mem = _read_meminfo()
        # the threads' CPU wait (a file a thread) every SLOW_EVERY samples, and swap there when psutil reads it
        # the first sample is one (the baseline), and so is the second: a job of a few seconds gets a reading
        slow = self._samples % SLOW_EVERY == 1 or self._samples == 2
        if mem is None:
            vm = _safe(psutil.virtual_memory)
            if slow or self._swap is None:
                self._swap = _safe(psutil.swap_memory)
            mem = (getattr(vm, "total", None), getattr(vm, "used", None), getattr(vm, "available", None),
                   getattr(self._swap, "used", None))
        load = _safe(os.getloadavg)
        return {
            "cpu_percent": cpu_percent,
            "rss_bytes": rss,
            "threads": threads,
            "workers": len(workers),
            "workers_cpu_percent": sum(c for c in w_cpu if c is not None) if workers else 0.0,
            "workers_rss_bytes": sum(r for r in w_rss if r is not None) if workers else 0,
            "workers_wait_percent": self._workers_wait(workers),
            "system_cpu_percent": self._system_cpu(),
            "cpu_count": self.cpu_count,
            "usable_cpus": self.limit.usable,
            "cpu_limit": self.limit.limit,
            "trainer_wait_percent": self._trainer_wait_percent() if slow else None,
            "mem_used_bytes": mem[1],
            "mem_total_bytes": mem[0],
            "mem_available_bytes": mem[2],
            "swap_used_bytes": mem[3],
            "load1": load[0] if load else None,
            "io_read_bps": self._io_rate(),
        }

    def _workers_wait(self, workers: list[psutil.Process]) -> float | None:
        """Time the workers spent runnable but waiting for a CPU since the last sample (100 = one worker all
        the time), from Linux's schedstat: with their CPU time, what they would use on a host of their own. None
        where the kernel does not say."""
        now = time.monotonic()
        total, known, seen = 0.0, False, {}
        for w in workers:
            try:
                wait_ns = int(read_proc(f"/proc/{w.pid}/schedstat").split()[1])
            except (OSError, ValueError, IndexError):
                continue
            seen[w.pid] = (now, wait_ns)
            last = self._waits.get(w.pid)
            if last is not None and now > last[0]:
                total += max(0, wait_ns - last[1]) / 1e9 / (now - last[0]) * 100.0
                known = True
        self._waits = seen
        return total if known or not workers else None

    def _own_stat(self) -> tuple[float | None, int | None, int | None]:
        """The trainer's CPU % since the last call, its threads and RSS: one read of ``/proc/PID/stat`` where
        psutil would read three files (stat, status, statm; ~110 us a sample, hot); psutil elsewhere."""
        now = time.monotonic()
        stat = _read_stat(self.proc.pid)
        if stat is None:
            p = self.proc
            mem = _safe(p.memory_info)
            return _safe(lambda: p.cpu_percent(None)), _safe(p.num_threads), getattr(mem, "rss", None)
        cpu_s, threads, rss = stat
        last, self._cpu_last = self._cpu_last, (now, cpu_s)
        pct = max(0.0, (cpu_s - last[1]) / (now - last[0]) * 100.0) if last is not None and now > last[0] else None
        return pct, threads, rss

    def _trainer_wait_percent(self) -> float | None:
        """Time the trainer's threads spent runnable but waiting for a CPU since the last reading (100 = one
        thread all the time): what a host shared with other work, or more threads than CPUs, takes from it."""
        now = time.monotonic()
        wait = thread_wait_ns(self.proc.pid, self._skip_threads())
        last, self._trainer_wait = self._trainer_wait, (None if wait is None else (now, wait))
        if wait is None or last is None or now <= last[0]:
            return None
        return max(0, wait - last[1]) / 1e9 / (now - last[0]) * 100.0

    def _system_cpu(self) -> float | None:
        """The host's CPU use (%) since the last call, as psutil.cpu_percent(None) computes it."""
        times = _read_cpu_times()
        if times is None:
            return _safe(lambda: psutil.cpu_percent(None))
        last, self._cpu_times = self._cpu_times, times
        if last is None:
            return None
        total = times[1] - last[1]
        return round((times[0] - last[0]) / total * 100.0, 1) if total > 0 else 0.0

    def _io_rate(self) -> float | None:
        read = _read_io_bytes(self.proc.pid)
        if read is None:
            io = _safe(self.proc.io_counters)
            if io is None:
                return None
            read = io.read_bytes
        now = time.monotonic()
        last, self._io_last = self._io_last, (now, read)
        if last is None or now <= last[0]:
            return None
        return max(0.0, (read - last[1]) / (now - last[0]))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except PermissionError:
        return True
    except OSError:
        return False


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read_stat(pid: int) -> tuple[float, int, int] | None:
    """CPU seconds (user + system), threads and RSS bytes from Linux's ``/proc/PID/stat``; None elsewhere."""
    try:
        text = read_proc(f"/proc/{pid}/stat")
        rest = text[text.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        # fields 14, 15 (utime, stime), 20 (num_threads), 24 (rss, pages); rest[0] is field 3
        return (int(rest[11]) + int(rest[12])) / _TICK, int(rest[17]), int(rest[21]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _read_cpu_times() -> tuple[int, int] | None:
    """The host's busy and total CPU time (clock ticks) from the first line of ``/proc/stat``: total is user to
    steal (guest time is inside user and nice), idle is idle + iowait, as psutil counts them; None elsewhere."""
    try:
        return parse_cpu_line(read_proc("/proc/stat", 512).split(b"\n", 1)[0])
    except OSError:
        return None


def parse_cpu_line(line: bytes) -> tuple[int, int] | None:
    """:func:`_read_cpu_times` of the line ``cpu  user nice system idle iowait irq softirq steal guest ...``."""
    try:
        ticks = [int(x) for x in line.split()[1:9]]
    except ValueError:
        return None
    if not line.startswith(b"cpu ") or len(ticks) < 5:
        return None
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


_MEMINFO = re.compile(rb"^(MemTotal|MemFree|MemAvailable|SwapTotal|SwapFree):\s+(\d+)", re.M)


def _read_meminfo() -> tuple[int, int, int, int | None] | None:
    """Total, used and available memory and swap used (bytes) from one read of ``/proc/meminfo``: used is
    total - available, as free(1) and psutil (6 and later) say. None elsewhere, and where the kernel has no
    MemAvailable (psutil estimates it there)."""
    try:
        return parse_meminfo(read_proc("/proc/meminfo"))
    except OSError:
        return None


def parse_meminfo(text: bytes) -> tuple[int, int, int, int | None] | None:
    """:func:`_read_meminfo` of the file's text."""
    got = {k: int(v) * 1024 for k, v in _MEMINFO.findall(text)}
    total, avail = got.get(b"MemTotal"), got.get(b"MemAvailable")
    if not total or not avail:
        return None
    if avail > total:  # a container's view (LXC): what psutil does
        avail = got.get(b"MemFree", total)
    swap_total, swap_free = got.get(b"SwapTotal"), got.get(b"SwapFree")
    swap_used = swap_total - swap_free if swap_total is not None and swap_free is not None else None
    return total, total - avail, avail, swap_used


def _read_io_bytes(pid: int) -> int | None:
    """Bytes the process read from storage (``read_bytes`` of ``/proc/PID/io``); None where it cannot be read."""
    try:
        for line in read_proc(f"/proc/{pid}/io").split(b"\n"):
            if line.startswith(b"read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


#: Samples between scans of every thread's children (the main thread's are read at every sample).
FULL_SCAN_EVERY = 10
#: The trainer's threads' CPU wait (a file a thread) is read every this many samples, and swap where psutil reads
#: it (two files; /proc/meminfo carries it with the rest of memory).
SLOW_EVERY = 5


def _children_of_thread(pid: int, tid: int) -> list[int] | None:
    try:
        return [int(x) for x in read_proc(f"/proc/{pid}/task/{tid}/children").split()]
    except (OSError, ValueError):
        return None


def _descendants(pid: int, main: list[int]) -> list[int]:
    """Every descendant of ``pid`` from Linux's per-thread ``children`` lists (``main``: its main thread's, read
    already): a few small reads, where psutil's ``children()`` reads the status of every process on the host."""
    out: list[int] = []
    stack: list[tuple[int, list[int] | None]] = [(pid, main)]  # a process, and its main thread's children if read
    while stack:
        parent, read = stack.pop()
        kids = list(read or [])
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{parent}/task")]
        except OSError:
            tids = []  # exited meanwhile
        for tid in tids:
            if tid != parent or read is None:
                kids.extend(_children_of_thread(parent, tid) or [])
        out.extend(kids)
        stack.extend((k, None) for k in kids)
    return out


def _child_pids(pid: int) -> list[int] | None:
    """Every descendant of ``pid``; None where the kernel has no per-thread ``children`` files."""
    main = _children_of_thread(pid, pid)
    return None if main is None else _descendants(pid, main)
