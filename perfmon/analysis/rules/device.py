"""The accelerator: under-used, stalled by host syncs, without tensor cores, throttled."""

from __future__ import annotations

from perfmon.analysis.rules.base import Config, Facts, Finding, rule


@rule("device-underused", "GPU busy < 50% of a profiler window, or NVML utilization < 90%, with data share <= 10%",
      reads_steps=True)
def device_underused(f: Facts, cfg: Config) -> Finding | None:
    if not f.gpus or f.shares["data"] > cfg.data_warn:
        return None
    busy = f.profile.device_busy if f.profile is not None else None
    util = f.gpus[0].util_gpu
    low_busy = busy is not None and busy < cfg.device_busy_min
    low_util = util is not None and util < cfg.nvml_util_min
    if not low_busy and not low_util:
        return None
    what = f"busy {busy:.0%} of the profiled window" if low_busy else f"NVML utilization {util:.0f}%"
    return Finding(
        "device-underused", "warn", f"GPU under-used ({what}) while data is not the bottleneck",
        {"device_busy": busy, "util_gpu": util, "data_share": round(f.shares["data"], 4)},
        "The GPU waits for the CPU to launch work: raise the batch size, torch.compile the model, capture "
        "steady steps in CUDA graphs (mode='reduce-overhead'), fuse many tiny ops.",
        impact=1.0 - (busy if busy is not None else (util or 0) / 100.0),
    )


@rule("host-sync", ">= 1 CUDA runtime synchronisation per step (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize: what .item(), .cpu() and DtoH copies end in) in the last profiler window")
def host_sync(f: Facts, cfg: Config) -> Finding | None:
    prof = f.profile
    syncs = prof.syncs_per_step if prof is not None else None
    if prof is None or prof.device != "cuda" or syncs is None or syncs < cfg.syncs_per_step_warn:
        return None  # on CPU nothing waits for a device
    names = [op.name for op in prof.top_ops if op.name is not None and (op.name in (
        "aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize") or "DtoH" in op.name)]
    return Finding(
        "host-sync", "warn",
        f"{syncs:.1f} host-device synchronisations per step",
        {"syncs_per_step": syncs, "ops": names, "window_step": prof.step},
        "Each .item()/.cpu()/print(tensor) waits for the GPU to drain. Accumulate metrics on the device "
        "(running_loss += loss.detach()) and call .item() every N steps, not every step.",
    )


def _from_trace(f: Facts, rule_id: str) -> Finding | None:
    """The last profiler window's own finding ``rule_id``, as its trace analysis found it (what actually ran on
    the device: kernels, copies, gaps), above info; windows summarised by older jobs carry none."""
    prof = f.profile
    found = prof.finding(rule_id) if prof is not None else None
    if found is None or found.severity not in ("warn", "critical"):
        return None
    evidence = dict(found.evidence or {})
    evidence["window_step"] = prof.step if prof is not None else None
    impact = evidence.get("impact")
    return Finding(rule_id, found.severity, found.title or rule_id, evidence, found.fix or "",
                   impact=float(impact) if isinstance(impact, int | float) else 0.0)


@rule("no-mixed-precision", "in the last CUDA profiler window's trace, FP32 (non-tensor-core) GEMM/convolution kernels "
      "hold most of the matrix time (decided from the kernels that ran, not from parameter dtypes: autocast keeps "
      "parameters in fp32)")
def no_mixed_precision(f: Facts, cfg: Config) -> Finding | None:
    return _from_trace(f, "no-mixed-precision")


@rule("communication-bound", "in the last profiler window's trace, communication not overlapped with compute > 20% "
      "of the span")
def communication_bound(f: Facts, cfg: Config) -> Finding | None:
    return _from_trace(f, "communication-bound")


@rule("pageable-memcpy", "in the last profiler window's trace, host-to-device copies from pageable memory > 10% of "
      "device time")
def pageable_memcpy(f: Facts, cfg: Config) -> Finding | None:
    return _from_trace(f, "pageable-memcpy")


@rule("launch-bound", "in the last profiler window's trace, many short kernels (median < 10 us) with the GPU idle "
      "> 30% of the span, mostly in gaps < 50 us")
def launch_bound(f: Facts, cfg: Config) -> Finding | None:
    return _from_trace(f, "launch-bound")


@rule("throttling", "NVML clock-event reasons: thermal or power capping, or power draw >= 98% of the limit")
def throttling(f: Facts, cfg: Config) -> Finding | None:
    for g in f.gpus:
        reasons = list(g.throttled)
        power, limit = g.power_w, g.power_limit_w
        at_limit = bool(power and limit and power >= 0.98 * limit)
        if reasons or at_limit:
            why = ", ".join(reasons) or "power at its limit"
            return Finding(
                "throttling", "warn", f"GPU {g.index if g.index is not None else 0} is throttled ({why})",
                {"reasons": reasons, "power_w": power, "power_limit_w": limit, "temp_c": g.temp_c,
                 "sm_clock_mhz": g.sm_clock_mhz, "sm_clock_max_mhz": g.sm_clock_max_mhz},
                "Check cooling and airflow (thermal), the power limit (nvidia-smi -q -d PERFORMANCE,POWER), and other jobs "
                "sharing the node; clocks below max mean every kernel runs slower.",
            )
    return None
