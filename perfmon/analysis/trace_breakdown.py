"""The numbers of one trace (TraceFacts): device time breakdown as HolisticTraceAnalysis (HTA) defines it, top
kernels, top ops, and the inputs of the findings. Interval unions are sort-and-sweep, O(n log n).

HTA definitions reproduced here (hta/analyzers/breakdown_analysis.py, communication_analysis.py, utils.py):
- a GPU kernel is any event with a stream and a correlation id (kernels, memcpy, memset; not
  gpu_user_annotation);
- window: with two or more ProfilerSteps, the last one is left out (it is often cut short when the profiler
  stops): kept are the kernels whose launch (runtime call, same correlation id) starts before it starts;
- span = first kernel start to last kernel end on the rank, all streams; idle = span minus the union of
  kernels; compute = union of computation kernels; non-compute = the rest;
- kernel kinds by name: communication `^nccl.*Kernel`, memory `^Memcpy|^Memset|^dma`, computation all but
  `nccl...Kernel`, `...Memcpy`, `Memset...`, `...Sync`; whatever matches none (event syncs) is "other";
- HTA rounds ns-resolution timestamps inwards (ceil start, floor end) for the breakdown; so do we there.
"""

from __future__ import annotations

import enum
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

from perfmon.analysis.trace_host import count_syncs, launching_ops, self_cpu
from perfmon.analysis.trace_load import DeviceEvent, HostEvent, TraceEvents

Interval = tuple[float, float]

# Launch overhead (Python + dispatcher + cudaLaunchKernel) is ~5-50 us per op: gaps shorter than this between
# kernels are the GPU waiting for the next launch, longer ones are waiting on something else.
SHORT_GAP_US = 50.0
TOP_N = 30  # the ops view shows up to 30 rows of a window

_COMM_RE = re.compile(r"^nccl.*Kernel")
_MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
# GEMM/conv kernels by precision, from the names cuBLAS/cuDNN/CUTLASS give them. Half precision
# (fp16/bf16/fp8) on tensor cores: data type in the name or a half instruction shape (h884, h1688, h16816).
_HALF_GEMM_RE = re.compile(r"fp16|bf16|f16f16|[hi]884|[hi]1688|[hi]16816|hmma|fp8|e4m3|e5m2", re.I)
# TF32 on tensor cores: fp32 data, single-precision instruction shapes (s1688, s16816) or "tf32" in the name.
_TF32_GEMM_RE = re.compile(r"tf32|s1688|s16816", re.I)
# Other tensor-core kernels whose data type the name does not tell (xmma, wmma, gmma, Hopper cuBLAS nvjet).
_OTHER_TC_RE = re.compile(r"tensorop|xmma|wmma|gmma|nvjet", re.I)
# FP32 on CUDA cores (SIMT): sgemm, cuDNN's scudnn convolutions, the fp32 conv engines, gemv.
_FP32_GEMM_RE = re.compile(
    r"sgemm|scudnn|simt|gemv|gemmk1|dgrad_engine|wgrad_alg|winograd|implicit_convolve", re.I
)


class KernelKind(enum.IntEnum):
    """HTA's kernel types; the values are bits of the overlap sweep."""

    COMPUTE = 1
    COMMUNICATION = 2
    MEMORY = 4
    OTHER = 8


class GemmKind(enum.Enum):
    HALF = "half"  # fp16/bf16/fp8 on tensor cores: mixed precision (or a tensor-core type the name hides)
    TF32 = "tf32"  # fp32 data on tensor cores
    FP32 = "fp32"  # fp32 on CUDA cores
    NONE = "none"  # not a matrix kernel


class OpBasis(enum.Enum):
    """What top ops are ranked by: the device time of their kernels, or (CPU-only trace) self CPU time."""

    DEVICE = "device_ms"
    SELF_CPU = "self_cpu_ms"


@lru_cache(maxsize=65536)
def kernel_kind(name: str) -> KernelKind:
    """HTA's get_kernel_type()."""
    if _COMM_RE.match(name):
        return KernelKind.COMMUNICATION
    if _MEMORY_RE.match(name):
        return KernelKind.MEMORY
    if not _NOT_COMPUTE_RE.match(name):
        return KernelKind.COMPUTE
    return KernelKind.OTHER


@lru_cache(maxsize=65536)
def gemm_kind(name: str) -> GemmKind:
    """Precision of a matrix-multiply/convolution kernel (NONE: not one)."""
    if _HALF_GEMM_RE.search(name):
        return GemmKind.HALF
    if _TF32_GEMM_RE.search(name):
        return GemmKind.TF32
    if _OTHER_TC_RE.search(name):
        return GemmKind.HALF
    if _FP32_GEMM_RE.search(name):
        return GemmKind.FP32
    return GemmKind.NONE


@dataclass(frozen=True)
class Stat:
    """A kernel or op aggregated by name: total microseconds and number of occurrences."""

    name: str
    us: float
    count: int


@dataclass(frozen=True)
class DeviceFacts:
    """What the GPU did in the analysis window (microseconds)."""

    idle_us: float
    compute_us: float  # time some computation kernel runs (union over streams); likewise below
    typed_us: float  # computation, communication or memory kernels (HTA's kernel-type total)
    comm_us: float
    memory_us: float
    comm_compute_us: float  # communication and computation at once
    kernel_count: int
    kernel_total_us: float  # sum of kernel durations, overlaps counted twice
    median_kernel_us: float
    short_gap_idle_us: float  # idle time in gaps shorter than SHORT_GAP_US
    pageable_htod_us: float
    pageable_htod_count: int
    gemm_us: float  # matrix-multiply/convolution kernels, all precisions
    gemm_fp32_us: float
    gemm_tf32_us: float
    top_kernels: tuple[Stat, ...]


@dataclass(frozen=True)
class TraceFacts:
    """Everything measured on one trace; the findings are pure functions of this. `gpu` is None for a CPU-only
    trace, and every device fraction then too."""

    file: str
    rank: int | None
    world_size: int | None
    device: str
    steps: int
    syncs: int
    syncs_per_step: float | None
    span_us: float  # device window (HTA's kernel_time); host span of the ops for a CPU-only trace
    top_ops: tuple[Stat, ...]
    op_basis: OpBasis
    op_total_us: float
    ops_total: int  # distinct ops (names) with time, before the cut to TOP_N
    gpu: DeviceFacts | None

    def _of_span(self, us: float | None) -> float | None:
        return us / self.span_us if us is not None and self.span_us > 0 else None

    @property
    def busy_us(self) -> float | None:
        return None if self.gpu is None else self.span_us - self.gpu.idle_us

    @property
    def idle(self) -> float | None:
        return None if self.gpu is None else self._of_span(self.gpu.idle_us)

    @property
    def busy(self) -> float | None:
        return self._of_span(self.busy_us)

    @property
    def compute(self) -> float | None:
        return None if self.gpu is None else self._of_span(self.gpu.compute_us)

    @property
    def non_compute(self) -> float | None:
        g = self.gpu
        return None if g is None else self._of_span(self.span_us - g.compute_us - g.idle_us)

    @property
    def communication(self) -> float | None:
        """Share of typed busy time during which a communication kernel runs (HTA kernel-type breakdown)."""
        g = self.gpu
        return g.comm_us / g.typed_us if g is not None and g.typed_us > 0 else None

    @property
    def memory(self) -> float | None:
        g = self.gpu
        return g.memory_us / g.typed_us if g is not None and g.typed_us > 0 else None

    @property
    def comm_compute_overlap(self) -> float | None:
        """Share of communication time during which computation runs too (HTA get_comm_comp_overlap)."""
        g = self.gpu
        return g.comm_compute_us / g.comm_us if g is not None and g.comm_us > 0 else None

    @property
    def exposed_comm(self) -> float | None:
        """Communication not hidden behind computation, as a share of the span."""
        g = self.gpu
        return None if g is None else self._of_span(g.comm_us - g.comm_compute_us)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals, sorted and disjoint."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _length(merged: Sequence[Interval]) -> float:
    return sum(e - s for s, e in merged)


def kind_sweep(merged_by_kind: dict[KernelKind, list[Interval]]) -> dict[int, float]:
    """Time during which exactly each combination (bit mask) of kernel kinds runs."""
    edges = sorted(
        (t, kind.value if i == 0 else -kind.value)
        for kind, merged in merged_by_kind.items()
        for interval in merged
        for i, t in enumerate(interval)
    )
    out: dict[int, float] = defaultdict(float)
    mask, last = 0, 0.0
    for t, delta in edges:
        if mask:
            out[mask] += t - last
        mask += delta
        last = t
    return out


def _hta_interval(k: DeviceEvent) -> Interval:
    # HTA rounds inwards: float (ns-resolution) timestamps otherwise make back-to-back kernels overlap by a
    # fraction of a microsecond (pytorch/pytorch#122425). Integer timestamps are unchanged.
    start = math.ceil(k.start)
    return start, max(start, math.floor(k.end))


def window(ev: TraceEvents) -> tuple[list[DeviceEvent], list[HostEvent], list[HostEvent]]:
    """Kernels, ops and runtime calls of HTA's analysis window (all but the last ProfilerStep)."""
    if len({s.name for s in ev.steps}) < 2:
        return list(ev.kernels), list(ev.ops), list(ev.runtime)
    cutoff = max(s.start for s in ev.steps)
    runtime = [r for r in ev.runtime if r.start < cutoff]
    launched = {r.correlation for r in runtime}
    kernels = [k for k in ev.kernels if k.correlation in launched]
    if not kernels:  # no launches recorded at all (HTA would fail here): keep every kernel
        kernels = list(ev.kernels)
    return kernels, [o for o in ev.ops if o.start < cutoff], runtime


def _top(totals: dict[str, float], counts: Counter[str], most_called: bool = False) -> tuple[Stat, ...]:
    """The TOP_N by time, costliest first; ``most_called``: and, in the same order, the TOP_N most called (the ops
    view sorts by calls too)."""
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = {name for name, _ in ranked[:TOP_N]}
    if most_called:
        keep |= set(sorted(totals, key=lambda name: (-counts[name], name))[:TOP_N])
    return tuple(Stat(name, us, counts[name]) for name, us in ranked if name in keep)


def facts(ev: TraceEvents) -> TraceFacts:
    """Measure one parsed trace."""
    kernels, ops, runtime = window(ev)
    syncs, syncs_per_step = count_syncs(ev)
    by_op: dict[str, float]
    if not kernels:
        # CPU-only: HTA's window exists for kernels still running when the profiler stops; all ops count, as
        # in prof.key_averages().
        by_op = self_cpu(ev.ops, ev.annotations)
        span = (max(o.end for o in ev.ops) - min(o.start for o in ev.ops)) if ev.ops else 0.0
        gpu, basis, counts = None, OpBasis.SELF_CPU, Counter(o.name for o in ev.ops)
    else:
        gpu, span = _device_facts(kernels)
        launcher = launching_ops(runtime, ops, ev.annotations)
        by_op = defaultdict(float)  # each kernel once, to the op that launched it
        for k in kernels:
            if kernel_kind(k.name) is not KernelKind.OTHER:
                by_op[launcher.get(k.correlation, "[no launch recorded]")] += k.end - k.start
        basis, counts = OpBasis.DEVICE, Counter(o.name for o in ops)
    return TraceFacts(
        file=ev.file,
        rank=ev.rank,
        world_size=ev.world_size,
        device=ev.device,
        steps=len(ev.steps),
        syncs=syncs,
        syncs_per_step=syncs_per_step,
        span_us=span,
        top_ops=_top(by_op, counts, most_called=True),
        op_basis=basis,
        op_total_us=sum(by_op.values()),
        ops_total=len(by_op),
        gpu=gpu,
    )


def _device_facts(kernels: Sequence[DeviceEvent]) -> tuple[DeviceFacts, float]:
    """The device numbers of the window's kernels, and the span."""
    by_kind: dict[KernelKind, list[Interval]] = defaultdict(list)
    for k in kernels:
        by_kind[kernel_kind(k.name)].append(_hta_interval(k))
    merged_all = merge(iv for ivs in by_kind.values() for iv in ivs)
    span = merged_all[-1][1] - merged_all[0][0]
    gaps = [b[0] - a[1] for a, b in pairwise(merged_all)]
    sweep = kind_sweep({kind: merge(by_kind[kind]) for kind in KernelKind if kind is not KernelKind.OTHER})
    comp, comm, mem = KernelKind.COMPUTE.value, KernelKind.COMMUNICATION.value, KernelKind.MEMORY.value

    # Per-kernel figures use the recorded durations: rounding would shave up to 1 us off each small kernel.
    typed = [k for k in kernels if kernel_kind(k.name) is not KernelKind.OTHER]
    totals: dict[str, float] = defaultdict(float)
    for k in typed:
        totals[k.name] += k.end - k.start
    gemm_us = dict.fromkeys(GemmKind, 0.0)
    for name, us in totals.items():
        gemm_us[gemm_kind(name)] += us
    pageable = [k for k in kernels if k.name.startswith("Memcpy HtoD (Pageable")]
    device = DeviceFacts(
        idle_us=span - _length(merged_all),
        compute_us=sum(t for m, t in sweep.items() if m & comp),
        typed_us=sum(sweep.values()),
        comm_us=sum(t for m, t in sweep.items() if m & comm),
        memory_us=sum(t for m, t in sweep.items() if m & mem),
        comm_compute_us=sum(t for m, t in sweep.items() if m & comm and m & comp),
        kernel_count=len(typed),
        kernel_total_us=sum(totals.values()),
        median_kernel_us=statistics.median(k.end - k.start for k in typed) if typed else 0.0,
        short_gap_idle_us=sum(g for g in gaps if g < SHORT_GAP_US),
        pageable_htod_us=sum(k.end - k.start for k in pageable),
        pageable_htod_count=len(pageable),
        gemm_us=sum(us for kind, us in gemm_us.items() if kind is not GemmKind.NONE),
        gemm_fp32_us=gemm_us[GemmKind.FP32],
        gemm_tf32_us=gemm_us[GemmKind.TF32],
        top_kernels=_top(totals, Counter(k.name for k in typed)),
    )
    return device, span
