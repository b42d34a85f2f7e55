"""``sample`` messages: host, GPU and allocator readings (what :mod:`perfmon.agent.sampler` sends)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from perfmon.messages.base import CONVERT, Invalid, Message, num, record

# Why a process's GPU memory is "n/a" (``proc_mem_reason``), where the job and its launcher must agree.
PROC_NOT_VISIBLE = "pid not visible to NVML (container PID namespace?)"
PROC_NO_CONTEXT = "no CUDA context in this process yet"
#: Said for a GPU reading from before ``proc_mem_reason``: its 0 meant "pid not in NVML's list", not 0 bytes.
LEGACY_PROC_MEM_REASON = "pid not in NVML's process list (container PID namespace?)"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSample:
    """One GPU's NVML reading (:mod:`perfmon.collectors.nvml`); the hello carries only the static part."""

    index: int | None = None  # NVML's index
    name: str | None = None
    uuid: str | None = None
    total_bytes: float | None = None
    power_limit_w: float | None = None
    sm_clock_max_mhz: float | None = None
    util_gpu: float | None = None  # % of the time a kernel ran
    util_mem: float | None = None  # % of the time device memory was read or written
    mem_used_bytes: float | None = None  # by every process on the device
    proc_mem_bytes: float | None = None  # by this process; None when unknown, never a 0 that means so
    proc_mem_reason: str | None = None  # why ``proc_mem_bytes`` is unknown
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle: tuple[str, ...] = ()  # every clock-event reason
    throttled: tuple[str, ...] = ()  # those that hold the GPU back (power, thermal)
    pcie_tx_kbs: float | None = None
    pcie_rx_kbs: float | None = None


def gpu(d: dict[str, Any]) -> GpuSample:
    reading = record(GpuSample, d)
    if "proc_mem_reason" not in d and d.get("proc_mem_bytes") == 0:  # an older agent's "not in the list"
        return replace(reading, proc_mem_bytes=None, proc_mem_reason=LEGACY_PROC_MEM_REASON)
    return reading


def gpus(v: Any) -> tuple[GpuSample, ...]:
    return tuple(gpu(d) for d in v if isinstance(d, dict)) if isinstance(v, list | tuple) else ()


CONVERT["tuple[GpuSample, ...]"] = gpus


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSample:
    """The trainer, its DataLoader workers and the system (:mod:`perfmon.collectors.host`)."""

    cpu_percent: float | None = None  # the trainer's, over the last interval (100 per busy core)
    rss_bytes: float | None = None
    threads: int | None = None
    workers: int | None = None  # DataLoader workers (child processes)
    workers_cpu_percent: float | None = None
    workers_wait_percent: float | None = None  # runnable but waiting for a CPU (Linux schedstat), 100 = one worker
    workers_rss_bytes: float | None = None
    system_cpu_percent: float | None = None  # the whole host, 0..100
    cpu_count: int | None = None
    usable_cpus: float | None = None  # what this process may use: the CPU affinity mask or cgroup quota, if fewer
    cpu_limit: str | None = None  # what limits ``usable_cpus`` below ``cpu_count``; None: nothing
    torch_threads: int | None = None  # torch's intra-op threads in the trainer
    trainer_wait_percent: float | None = None  # the trainer's threads runnable but waiting for a CPU, 100 = one
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    mem_available_bytes: float | None = None
    swap_used_bytes: float | None = None
    load1: float | None = None
    io_read_bps: float | None = None  # the trainer's reads


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaMem:
    """The caching allocator's counters on the model's device (:mod:`perfmon.collectors.cuda_mem`)."""

    device: int | None = None
    allocated_bytes: float | None = None
    reserved_bytes: float | None = None
    peak_allocated_bytes: float | None = None  # since start (a script's own peak reset does not clear it)
    peak_reserved_bytes: float | None = None
    window_peak_allocated_bytes: float | None = None  # in the last sample window; None without window peaks
    window_peak_reserved_bytes: float | None = None
    alloc_retries: float | None = None
    ooms: float | None = None
    fragmentation_bytes: float | None = None  # reserved, not allocated
    inactive_split_bytes: float | None = None  # free space inside blocks that also hold live tensors
    peak_inactive_split_bytes: float | None = None  # in the last sample window


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample(Message):
    """One sampler tick. ``None`` for a part not sent (the last reading stands); ``gpus`` empty: no GPU."""

    t: float
    host: HostSample | None = None
    gpus: tuple[GpuSample, ...] | None = None
    cuda_mem: CudaMem | None = None
    sampler_cpu_s: float | None = None  # the sampler thread's CPU time for this tick
    interval_s: float | None = None


def parse_sample(msg: dict[str, Any], seq: int | None) -> Sample | Invalid:
    """A ``sample`` message; without a time it cannot be placed: :class:`Invalid`. An empty reading is
    no reading."""
    try:
        t = float(msg["t"])
    except (KeyError, TypeError, ValueError):
        return Invalid(seq=seq, what="a sample without a time")
    host, devices, cm = msg.get("host"), msg.get("gpus"), msg.get("cuda_mem")
    reading = record(HostSample, host) if isinstance(host, dict) and host else None
    threads = msg.get("torch_threads")  # a fed reading: the job appends it to the launcher's line
    if reading is not None and reading.torch_threads is None and isinstance(threads, int):
        reading = replace(reading, torch_threads=threads)
    devs = gpus(devices) if isinstance(devices, list) else None
    if devs and msg.get("cuda_context") is True:  # the launcher read NVML before the job's CUDA context showed
        devs = tuple(replace(g, proc_mem_reason=PROC_NOT_VISIBLE) if g.proc_mem_reason == PROC_NO_CONTEXT else g
                     for g in devs)
    return Sample(
        seq=seq, t=t, host=reading, gpus=devs,
        cuda_mem=record(CudaMem, cm) if isinstance(cm, dict) and cm else None,
        sampler_cpu_s=num(msg.get("sampler_cpu_s")), interval_s=num(msg.get("interval_s")),
    )
