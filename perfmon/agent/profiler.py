"""torch.profiler windows, started and stopped on the training thread at step boundaries.

Measured: a profiler started from another thread captures nothing of the training
thread, so the socket thread only sets a request; the training thread starts the window at
the next boundary, steps it, stops it; the trace export and ``key_averages`` (18-110 ms)
run on a worker thread. The trace is written to a temp file and renamed, so a job that
ends mid-window leaves a valid trace or none.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP_N = 30


class ProfilerWindow:
    """One window: ``wait`` + ``warmup`` + ``active`` steps, then a summary published as ``profile``."""

    def __init__(self, traces_dir: Path, wait: int, warmup: int, active: int, step_index: Callable[[], int],
                 publish: Callable[[dict[str, Any] | None], None], on_error: Callable[[str, BaseException], None],
                 reason: str) -> None:
        self.traces_dir = traces_dir
        self.wait, self.warmup, self.active = wait, warmup, active
        self.total = wait + warmup + active
        self._step_index = step_index
        self._publish = publish
        self._on_error = on_error
        self.reason = reason
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
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            record_shapes=True, profile_memory=True, with_flops=True,
        )
        self.prof.start()
        self.t_start = time.time()

    def step(self) -> bool:
        """Advance at a boundary; True when the window is over (the profiler is stopped)."""
        self.steps_done += 1
        if self.steps_done < self.total:
            self.prof.step()
            return False
        self.prof.stop()
        threading.Thread(target=self._summarize, name="perfmon-profile", daemon=True).start()
        return True

    def abort(self) -> None:
        """The job is ending mid-window: stop, and keep no partial trace."""
        try:
            self.prof.stop()
        except Exception as exc:  # noqa: BLE001
            self._on_error("profiler", exc)

    def _summarize(self) -> None:
        msg = None
        try:
            msg = summarize(self.prof, self.traces_dir, self.active, self.cuda, self.started_step, self.reason)
        except Exception as exc:  # noqa: BLE001
            self._on_error("profiler", exc)
        self._publish(msg)  # None: the window failed; the caller still closes it


def _trace_name() -> str:
    # the layout torch.profiler.tensorboard_trace_handler writes
    return f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"


def summarize(prof: Any, traces_dir: Path, active: int, cuda: bool, step: int, reason: str) -> dict[str, Any]:
    """The ``profile`` message fields: top ops, syncs per step, device busy, trace path."""
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
    averages = prof.key_averages(group_by_input_shape=True)
    rows = []
    for ev in averages:
        if ev.key.startswith("ProfilerStep"):
            continue
        self_dev = getattr(ev, "self_device_time_total", 0) or 0
        rows.append({
            "name": ev.key, "calls": int(ev.count),
            # on GPU, kernels (device time, no host time of their own) are told apart from ops
            "kind": "kernel" if cuda and self_dev > 0 and not ev.self_cpu_time_total else "op",
            "self_ms": (self_dev if cuda else ev.self_cpu_time_total) / 1000.0,
            "total_ms": (getattr(ev, "device_time_total", 0) if cuda else ev.cpu_time_total) / 1000.0,
            "self_cpu_ms": ev.self_cpu_time_total / 1000.0,
            "flops": int(getattr(ev, "flops", 0) or 0),
            "shapes": str(ev.input_shapes)[:120] if ev.input_shapes else "",
        })
    total_self = sum(r["self_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["self_ms"] / total_self
    rows.sort(key=lambda r: r["self_ms"], reverse=True)
    # what actually blocks the host: the runtime's sync calls (an .item() on a CUDA tensor ends in one);
    # a CPU run has no device to wait for: an .item() there is a plain read, not a sync
    syncs = sum(r["calls"] for r in rows if r["name"] in CUDA_SYNCS) if cuda else None
    return {
        "type": "profile", "v": 1, "step": step, "active_steps": active, "reason": reason, "device": "cuda" if cuda else "cpu",
        "top_ops": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows[:TOP_N]],
        "ops_total": len(rows), "syncs_per_step": syncs / active if active and syncs is not None else None,
        "device_busy": _device_busy(prof) if cuda else None, "trace": trace, "t": time.time(),
    }


def _device_busy(prof: Any) -> float | None:
    """Fraction of the active window during which any GPU kernel ran (union of intervals)."""
    try:
        spans = []
        for ev in prof.events():
            if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
                spans.append((ev.time_range.start, ev.time_range.end))
        if not spans:
            return 0.0
        spans.sort()
        busy, cur_s, cur_e = 0, spans[0][0], spans[0][1]
        lo, hi = spans[0][0], max(e for _, e in spans)
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        cpu = [(ev.time_range.start, ev.time_range.end) for ev in prof.events() if ev.name.startswith("ProfilerStep")]
        if cpu:
            lo, hi = min(s for s, _ in cpu), max(e for _, e in cpu)
        return min(1.0, busy / (hi - lo)) if hi > lo else None
    except Exception:  # noqa: BLE001
        return None
