"""Findings from one trace: a registry of pure functions `TraceFacts -> Finding | None`, each with the numbers
that triggered it (evidence) and a concrete fix. Thresholds are module constants, explained where defined."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from perfmon.analysis.trace_breakdown import TraceFacts

Evidence = tuple[tuple[str, float | int | str | None], ...]


class Severity(enum.Enum):
    INFO = "info"
    WARN = "warn"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Finding:
    """A problem seen in the trace: stable kebab-case id, the numbers behind it, and what to change."""

    id: str
    severity: Severity
    title: str
    evidence: Evidence
    fix: str


Rule = Callable[[TraceFacts], "Finding | None"]

# The device waits more than it works: warn at half the window idle, critical at three quarters.
IDLE_WARN, IDLE_CRITICAL = 0.50, 0.75
# Communication not hidden behind compute, as a share of the window.
EXPOSED_COMM_WARN, EXPOSED_COMM_CRITICAL = 0.20, 0.40
# Copies from pageable host memory, as a share of the time the device is busy.
PAGEABLE_WARN, PAGEABLE_CRITICAL = 0.10, 0.25
# A training step needs no host-device synchronisation; one for logging the loss (`loss.item()`) is common
# and cheap. Each one stalls the host until the GPU drains its queue, so the host can no longer run ahead and
# the GPU then idles while the next kernels are launched. More than 2 per step is a habit in the loop (metrics
# with .item()/.cpu(), data-dependent shapes such as nonzero or boolean masks, event timing); more than 20 is
# one per layer or per parameter.
SYNCS_WARN, SYNCS_CRITICAL = 2.0, 20.0
# Launch-bound: kernels so short (median < 10 us, about one launch's host cost) that the host cannot keep up,
# seen as idle time (> 30% of the window) spent mostly (> half) in short gaps between kernels. Long gaps are
# waits for something else (data, communication, syncs) and do not count.
LAUNCH_MEDIAN_US, LAUNCH_IDLE, LAUNCH_SHORT_GAP_SHARE, LAUNCH_IDLE_CRITICAL = 10.0, 0.30, 0.50, 0.60
# Mixed precision: only when matrix kernels matter (>= 10% of busy time), by the share of their time in FP32
# CUDA-core kernels (tensor cores run fp16/bf16 ~8-16x faster); info when it is mostly TF32 instead.
GEMM_MIN_SHARE, FP32_GEMM_WARN, FP32_GEMM_CRITICAL = 0.10, 0.50, 0.80


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def device_underused(f: TraceFacts) -> Finding | None:
    if f.idle is None or f.idle <= IDLE_WARN:
        return None
    return Finding(
        "device-underused",
        Severity.CRITICAL if f.idle > IDLE_CRITICAL else Severity.WARN,
        f"GPU idle {f.idle:.0%} of the window",
        (("idle", _r(f.idle)), ("idle_ms", _ms(f.span_us * f.idle)), ("span_ms", _ms(f.span_us))),
        "The GPU waits on the host: check the other findings (communication, syncs, launches); feed it "
        "faster with DataLoader(num_workers>0, pin_memory=True, persistent_workers=True), remove per-step "
        "syncs, and raise the batch size if memory allows.",
    )


def communication_bound(f: TraceFacts) -> Finding | None:
    g, exposed = f.gpu, f.exposed_comm
    if g is None or exposed is None or exposed <= EXPOSED_COMM_WARN:
        return None
    return Finding(
        "communication-bound",
        Severity.CRITICAL if exposed > EXPOSED_COMM_CRITICAL else Severity.WARN,
        f"Communication not overlapped with compute takes {exposed:.0%} of the window",
        (("exposed_communication", _r(exposed)), ("communication_ms", _ms(g.comm_us)),
         ("comm_compute_overlap", _r(f.comm_compute_overlap)), ("span_ms", _ms(f.span_us))),
        "Overlap gradient all-reduce with backward: tune DistributedDataParallel(bucket_cap_mb=...) "
        "(smaller buckets start earlier, larger ones launch fewer collectives), keep DDP's overlap working "
        "(no find_unused_parameters=True unless needed, no syncs inside backward), and accumulate gradients "
        "over micro-batches inside `with model.no_sync():` so only the last one all-reduces.",
    )


def pageable_memcpy(f: TraceFacts) -> Finding | None:
    g, busy = f.gpu, f.busy_us
    if g is None or not busy or g.pageable_htod_us / busy <= PAGEABLE_WARN:
        return None
    share = g.pageable_htod_us / busy
    return Finding(
        "pageable-memcpy",
        Severity.CRITICAL if share > PAGEABLE_CRITICAL else Severity.WARN,
        f"Host-to-device copies from pageable memory take {share:.0%} of GPU busy time",
        (("pageable_htod_share", _r(share)), ("pageable_htod_ms", _ms(g.pageable_htod_us)),
         ("copies", g.pageable_htod_count)),
        "Copy from pinned memory: DataLoader(pin_memory=True) (or tensor.pin_memory() for your own "
        "buffers) and tensor.to(device, non_blocking=True), so copies run at full bandwidth and overlap "
        "compute.",
    )


def host_sync(f: TraceFacts) -> Finding | None:
    if f.syncs_per_step is None or f.syncs_per_step <= SYNCS_WARN:
        return None
    return Finding(
        "host-sync",
        Severity.CRITICAL if f.syncs_per_step > SYNCS_CRITICAL else Severity.WARN,
        f"{f.syncs_per_step:.1f} host-device synchronisations per step",
        (("syncs_per_step", round(f.syncs_per_step, 2)), ("syncs", f.syncs), ("steps", f.steps)),
        "Keep values on the GPU inside the step: accumulate metrics as tensors and call .item()/.cpu() "
        "every N steps, avoid printing tensors, nonzero()/boolean-mask indexing and torch.cuda.synchronize() "
        "in the loop; torch.cuda.set_sync_debug_mode('warn') points at each one.",
    )


def launch_bound(f: TraceFacts) -> Finding | None:
    g, idle = f.gpu, f.idle
    if g is None or idle is None or idle <= LAUNCH_IDLE or g.median_kernel_us >= LAUNCH_MEDIAN_US:
        return None
    short_share = g.short_gap_idle_us / g.idle_us
    if short_share <= LAUNCH_SHORT_GAP_SHARE:
        return None
    return Finding(
        "launch-bound",
        Severity.CRITICAL if idle > LAUNCH_IDLE_CRITICAL else Severity.WARN,
        f"Many short kernels (median {g.median_kernel_us:.1f} us) with the GPU idle {idle:.0%} between them",
        (("median_kernel_us", round(g.median_kernel_us, 2)), ("kernels", g.kernel_count), ("idle", _r(idle)),
         ("idle_in_short_gaps", _r(short_share))),
        "Launch fewer, larger kernels: torch.compile(model) fuses elementwise ops, and "
        "torch.compile(mode=\"reduce-overhead\") or CUDA graphs (torch.cuda.graphs) replay a whole step "
        "in one launch; use fused/foreach optimizers and a larger batch per step.",
    )


def no_mixed_precision(f: TraceFacts) -> Finding | None:
    g, busy = f.gpu, f.busy_us
    if g is None or not busy or g.gemm_us / busy < GEMM_MIN_SHARE:
        return None
    fp32, tf32 = g.gemm_fp32_us / g.gemm_us, g.gemm_tf32_us / g.gemm_us
    if fp32 >= FP32_GEMM_WARN:
        severity = Severity.CRITICAL if fp32 >= FP32_GEMM_CRITICAL else Severity.WARN
        title = f"{fp32:.0%} of matrix-multiply/convolution time runs in FP32 on CUDA cores, not tensor cores"
    elif fp32 + tf32 >= FP32_GEMM_WARN:
        # TF32 already uses tensor cores, at half the bf16 rate and with fp32 activations: worth knowing only.
        severity = Severity.INFO
        title = f"{fp32 + tf32:.0%} of matrix-multiply/convolution time in FP32/TF32 rather than bf16/fp16"
    else:
        return None
    return Finding(
        "no-mixed-precision",
        severity,
        title,
        (("fp32_gemm_share", _r(fp32)), ("tf32_gemm_share", _r(tf32)), ("gemm_ms", _ms(g.gemm_us)),
         ("gemm_share_of_busy", _r(g.gemm_us / busy))),
        "Run forward and loss under torch.autocast('cuda', dtype=torch.bfloat16) (float16 with "
        "torch.amp.GradScaler on GPUs without bf16, e.g. V100); on Ampere or newer at least allow TF32 with "
        "torch.set_float32_matmul_precision('high') and torch.backends.cudnn.allow_tf32 = True.",
    )


RULES: tuple[Rule, ...] = (
    device_underused,
    communication_bound,
    pageable_memcpy,
    host_sync,
    launch_bound,
    no_mixed_precision,
)


def findings(f: TraceFacts) -> tuple[Finding, ...]:
    """Every rule that fires, most severe first (stable within a severity)."""
    found = [x for rule in RULES if (x := rule(f)) is not None]
    order = {Severity.CRITICAL: 0, Severity.WARN: 1, Severity.INFO: 2}
    return tuple(sorted(found, key=lambda x: order[x.severity]))
