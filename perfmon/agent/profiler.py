"""torch.profiler windows, started and stopped on the training thread at step boundaries.

Measured: a profiler started from another thread captures nothing of the training
thread, so the socket thread only sets a request; the training thread starts the window at
the next boundary, steps it, stops it; the trace export runs on a worker thread. Nothing is
summarised here: the monitor analyses the exported trace outside the job. The trace is written
to a temp file and renamed, so a job that ends mid-window leaves a valid trace or none.
"""

from __future__ import annotations

import bisect
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from perfmon import paths


def window_schedule(wait: int, warmup: int, active: int) -> Callable[[int], Any]:
    """``torch.profiler.schedule(wait=, warmup=, active=, repeat=1)``, without its warning for ``warmup=0``: a
    Python warning raised in the job lands in the script's stderr (the launcher says it instead)."""
    actions = torch.profiler.ProfilerAction
    total = wait + warmup + active

    def action(step: int) -> Any:
        if step < wait or step >= total:
            return actions.NONE
        if step < wait + warmup:
            return actions.WARMUP
        return actions.RECORD if step < total - 1 else actions.RECORD_AND_SAVE

    return action


class ProfilerWindow:
    """One window: ``wait`` + ``warmup`` + ``active`` steps, then its trace exported and announced as ``profile``
    (the monitor analyses the trace, outside the job)."""

    def __init__(self, traces_dir: Path, wait: int, warmup: int, active: int, step_index: Callable[[], int],
                 publish: Callable[[dict[str, Any] | None], None], on_error: Callable[[str, BaseException], None],
                 reason: str, own: Callable[[], AbstractContextManager[None]] = nullcontext,
                 profile_memory: bool = False) -> None:
        self.traces_dir = traces_dir
        self.wait, self.warmup, self.active = wait, warmup, active
        self.total = wait + warmup + active
        self._step_index = step_index
        self._publish = publish
        self._on_error = on_error
        self.reason = reason
        # Off unless asked for: with it, torch's CPU allocator prints "Memory block of unknown size was allocated
        # before the profiling started" into the script's stderr (C++, past any Python warning filter) whenever a
        # window frees a tensor made before it, which is nearly every window of a training loop.
        self.profile_memory = profile_memory
        self._own = own  # marks perfmon's own profiler calls: not the script's sessions (agent.profiler_guard)
        self.steps_done = 0
        self.started_step = step_index()
        self.prof: Any = None
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=window_schedule(self.wait, self.warmup, self.active),
            record_shapes=True, profile_memory=self.profile_memory, with_flops=True,
        )
        with self._own():
            self.prof.start()
        self.t_start = time.time()

    def step(self) -> bool:
        """Advance at a boundary; True when the window is over (the profiler is stopped)."""
        self.steps_done += 1
        with self._own():
            if self.steps_done < self.total:
                self.prof.step()
                return False
            self.prof.stop()
        threading.Thread(target=self._export, name="perfmon-profile", daemon=True).start()
        return True

    def abort(self) -> None:
        """The job is ending mid-window: stop, and keep no partial trace."""
        try:
            with self._own():
                self.prof.stop()
        except Exception as exc:  # noqa: BLE001
            self._on_error("profiler", exc)

    def _export(self) -> None:
        msg = None
        try:
            msg = export_window(self.prof, self.traces_dir, self.active, self.cuda, self.started_step, self.reason)
        except Exception as exc:  # noqa: BLE001
            self._on_error("profiler", exc)
        self._publish(msg)  # None: the window failed; the caller still closes it


def _trace_name() -> str:
    # the layout torch.profiler.tensorboard_trace_handler writes
    return f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"


def export_window(prof: Any, traces_dir: Path, active: int, cuda: bool, step: int, reason: str) -> dict[str, Any]:
    """The ``profile`` message: which window, and the trace file it left. Nothing is summarised here: the
    monitor (or ``perfmon report``) analyses the trace outside the job (perfmon.analysis.profile_window)."""
    trace = None
    try:
        traces_dir.mkdir(parents=True, exist_ok=True)
        final = traces_dir / _trace_name()
        tmp = final.with_name(final.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, final)
        trace = str(final)
    except OSError:
        trace = None
    return {"type": "profile", "v": 1, "step": step, "active_steps": active, "reason": reason,
            "device": "cuda" if cuda else "cpu", "trace": trace, "t": time.time()}


class PeriodicTraces:
    """The traces of periodic windows (``--profile-every``/``--profile-interval``), at most ``keep`` of them on
    disk (0: all). A long run profiled every few hundred steps would otherwise fill the disk with them (a GPU
    model's trace is tens of MB). An older trace goes only once a monitor has analysed it (``RUN/analysis/``), so
    the dashboard, the report and replays still have the window's numbers; one nobody has analysed yet stays.
    Exports run on threads of their own and may overlap (a big trace is still being written while the next
    window ends): the traces are kept in the order of their windows, under a lock."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._traces: list[tuple[int, Path]] = []  # (the window's first step, its trace), oldest first
        self._lock = threading.Lock()

    def add(self, trace: str | None, step: int) -> list[Path]:
        """The periodic window that began at ``step`` wrote ``trace``: drop the analysed ones beyond the newest
        ``keep``; returns them."""
        if trace is None or self.keep <= 0:
            return []
        with self._lock:
            bisect.insort(self._traces, (step, Path(trace)))
            excess = len(self._traces) - self.keep
            if excess <= 0:
                return []
            dropped, stay = [], []
            for item in self._traces[:excess]:
                old = item[1]
                try:
                    if paths.trace_analysis(old).exists():
                        old.unlink(missing_ok=True)
                        dropped.append(old)
                        continue
                except OSError:
                    pass
                stay.append(item)  # not analysed yet (no monitor has read it), or not removable: kept
            self._traces = stay + self._traces[excess:]
            return dropped
