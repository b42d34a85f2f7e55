"""Host telemetry through psutil: the trainer, its DataLoader workers, the system.

psutil raises on processes that vanish between listing and reading (workers come and go
every epoch); every read goes through :func:`_safe` and yields None instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from perfmon.collectors.cpus import thread_wait_ns, usable_cpus


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
        self._swap: Any = None  # psutil.swap_memory(), read every SWAP_EVERY samples
        self.cpu_count = psutil.cpu_count() or 1
        self.limit = usable_cpus(self.cpu_count)
        self._trainer_wait: tuple[float, int] | None = None  # (when, its threads' run-queue wait so far, ns)
        self._cpu_last: tuple[float, float] | None = None  # (when, the trainer's CPU seconds so far)
        self._own_stat()  # primes the CPU counter (psutil's, where /proc/PID/stat cannot be read)
        _safe(lambda: psutil.cpu_percent(None))

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
        vm = _safe(psutil.virtual_memory)
        # read every SWAP_EVERY samples: two /proc files (~0.1 ms of the job's GIL), and one a thread
        slow = self._samples % SWAP_EVERY == 1 or self._swap is None
        if slow:
            self._swap = _safe(psutil.swap_memory)
        sw = self._swap
        load = _safe(os.getloadavg)
        return {
            "cpu_percent": cpu_percent,
            "rss_bytes": rss,
            "threads": threads,
            "workers": len(workers),
            "workers_cpu_percent": sum(c for c in w_cpu if c is not None) if workers else 0.0,
            "workers_rss_bytes": sum(r for r in w_rss if r is not None) if workers else 0,
            "workers_wait_percent": self._workers_wait(workers),
            "system_cpu_percent": _safe(lambda: psutil.cpu_percent(None)),
            "cpu_count": self.cpu_count,
            "usable_cpus": self.limit.usable,
            "cpu_limit": self.limit.limit,
            "trainer_wait_percent": self._trainer_wait_percent() if slow else None,
            "mem_used_bytes": getattr(vm, "used", None),
            "mem_total_bytes": getattr(vm, "total", None),
            "mem_available_bytes": getattr(vm, "available", None),
            "swap_used_bytes": getattr(sw, "used", None),
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
                with open(f"/proc/{w.pid}/schedstat") as f:
                    wait_ns = int(f.read().split()[1])
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

    def _io_rate(self) -> float | None:
        io = _safe(self.proc.io_counters)
        if io is None:
            return None
        now = time.monotonic()
        last, self._io_last = self._io_last, (now, io.read_bytes)
        if last is None or now <= last[0]:
            return None
        return max(0.0, (io.read_bytes - last[1]) / (now - last[0]))


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
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        rest = text[text.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        # fields 14, 15 (utime, stime), 20 (num_threads), 24 (rss, pages); rest[0] is field 3
        return (int(rest[11]) + int(rest[12])) / _TICK, int(rest[17]), int(rest[21]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


#: Samples between scans of every thread's children (the main thread's are read at every sample).
FULL_SCAN_EVERY = 10
#: Swap use is read every this many samples (it moves slowly; reading it costs as much as the rest of a sample).
SWAP_EVERY = 5


def _children_of_thread(pid: int, tid: int) -> list[int] | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            return [int(x) for x in f.read().split()]
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
