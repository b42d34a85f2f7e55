"""Host side of a trace: which CPU op launched each kernel, self CPU time of ops, host-device syncs.

Nesting is per thread (pid, tid) and by time, found with one sorted sweep and a stack per thread.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from perfmon.analysis.trace_load import HostEvent, TraceEvents

SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
SCALAR_OPS = frozenset({"aten::item", "aten::_local_scalar_dense"})


def by_thread(events: Iterable[HostEvent]) -> dict[tuple[object, object], list[HostEvent]]:
    """Events per thread, sorted by start, outer first (stable: ties keep file order, parents first)."""
    out: dict[tuple[object, object], list[HostEvent]] = defaultdict(list)
    for e in events:
        out[e.thread].append(e)
    for lst in out.values():
        lst.sort(key=lambda e: (e.start, -e.end))
    return out


def _innermost(spans: Sequence[HostEvent], times: Sequence[float]) -> list[HostEvent | None]:
    """For each time (sorted), the innermost of the spans (one thread, sorted by by_thread) containing it."""
    out: list[HostEvent | None] = []
    stack: list[HostEvent] = []
    i = 0
    for t in times:
        while i < len(spans) and spans[i].start <= t:
            while stack and stack[-1].end <= spans[i].start:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1].end < t:
            stack.pop()
        out.append(stack[-1] if stack else None)
    return out


def launching_ops(
    runtime: Iterable[HostEvent], ops: Iterable[HostEvent], annotations: Iterable[HostEvent]
) -> dict[int, str]:
    """Correlation id -> the innermost CPU op around its runtime call (launch): each kernel gets one op.

    Kernels launched outside any op (a fused optimizer's multi_tensor_apply) go to the innermost user
    annotation around the launch (its record_function, e.g. "Optimizer.step#FusedAdam.step"), else to
    "[no op] <runtime call>"."""
    ops_t, ann_t = by_thread(ops), by_thread(annotations)
    out: dict[int, str] = {}
    for thread, calls in by_thread(runtime).items():
        times = [c.start for c in calls]
        inner_ops = _innermost(ops_t.get(thread, []), times)
        inner_ann = _innermost(ann_t.get(thread, []), times)
        for call, op, ann in zip(calls, inner_ops, inner_ann, strict=True):
            out[call.correlation] = op.name if op else ann.name if ann else f"[no op] {call.name}"
    return out


def self_cpu(ops: Iterable[HostEvent], annotations: Iterable[HostEvent]) -> dict[str, float]:
    """Self CPU time (us) by op name: duration minus the direct children (ops, annotations) on the thread,
    as torch's key_averages() computes self_cpu_time_total."""
    self_us: dict[HostEvent, float] = {o: o.end - o.start for o in ops}
    for spans in by_thread([*self_us, *annotations]).values():
        stack: list[HostEvent] = []
        for s in spans:
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if stack and stack[-1] in self_us:
                self_us[stack[-1]] -= s.end - s.start
            stack.append(s)
    out: dict[str, float] = defaultdict(float)
    for o, us in self_us.items():
        out[o.name] += max(us, 0.0)
    return out


def count_syncs(ev: TraceEvents) -> tuple[int, float | None]:
    """Host-device synchronisations inside the ProfilerSteps, and per step (None without steps).

    Counted: each cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize call, plus each
    outermost aten::item / aten::_local_scalar_dense that made CUDA calls but none of those (older PyTorch
    copied with a synchronous cudaMemcpy). An `.item()` holding a sync call is that call, counted once; one
    with no CUDA call inside read a CPU tensor and synchronised nothing."""
    if not ev.steps:
        return 0, None
    first, last = ev.steps[0].start, max(s.end for s in ev.steps)
    calls = by_thread(r for r in ev.runtime if first <= r.start <= last)
    count = sum(1 for lst in calls.values() for r in lst if r.name in SYNC_CALLS)
    scalar = by_thread(o for o in ev.ops if o.name in SCALAR_OPS and first <= o.start <= last)
    for thread, items in scalar.items():
        thread_calls = calls.get(thread, [])
        starts = [r.start for r in thread_calls]
        outer_end = -math.inf
        for o in items:
            if o.end <= outer_end:
                continue  # the _local_scalar_dense inside its aten::item
            outer_end = o.end
            inside = thread_calls[bisect.bisect_left(starts, o.start) : bisect.bisect_right(starts, o.end)]
            if inside and not any(r.name in SYNC_CALLS for r in inside):
                count += 1
    return count, count / len(ev.steps)
