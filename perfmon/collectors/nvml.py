"""GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py).

Every vendor call goes through :func:`_q`, once: an unsupported or failing query gives
``None`` (shown as "n/a"), never an exception. No NVML library or no GPU: :meth:`open`
returns the reason and the sampler yields nothing. The backend is the ``pynvml`` module
itself; tests pass a fake with the same function names.

This process's own GPU memory comes from NVML's list of compute processes, matched by pid.
When it cannot be read it is ``None`` with the reason in ``proc_mem_reason`` (never 0): in a
container with its own PID namespace NVML lists host pids, so our pid is never in the list.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from perfmon.messages.telemetry import PROC_NO_CONTEXT, PROC_NOT_VISIBLE

# Clock-throttle reason bits (nvmlClocksEventReason*), named as users know them.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}
#: Reasons that mean the GPU is being held back (idle and app clocks are not a problem).
LIMITING = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}

# Why this process's GPU memory is "n/a" (``proc_mem_reason``; ``proc_mem_bytes`` is then None); the first two,
# PROC_NOT_VISIBLE and PROC_NO_CONTEXT, live with the message, whose reader tells them apart for a fed reading.
PROC_QUERY_FAILED = "NVML process list unavailable"
PROC_NO_BYTES = "NVML gives no per-process memory here (MIG or vGPU?)"


def cuda_initialized() -> bool:
    """Whether torch has initialised CUDA in this process (so NVML should list it); False without torch."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch: not yet
        return False


def _q(fn: Callable[..., Any] | None, *args: Any) -> Any:
    """One NVML query; None for NotSupported, errors, missing functions."""
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError and friends: "n/a", never raise
        return None


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None


def visible_devices(count: int, uuids: list[str | None], env: str | None) -> list[int]:
    """NVML indices of the devices this process may use, honouring CUDA_VISIBLE_DEVICES."""
    if env is None:
        return list(range(count))
    picked: list[int] = []
    for item in (s.strip() for s in env.split(",")):
        if not item:
            break  # CUDA stops at the first empty or invalid entry
        if item.isdigit():
            idx = int(item)
            if idx >= count:
                break
            picked.append(idx)
        else:
            match = [i for i, u in enumerate(uuids) if u and (u == item or u.startswith(item) or u[4:].startswith(item))]
            if len(match) != 1:
                break
            picked.append(match[0])
    return picked


class NvmlSampler:
    """Samples the visible GPUs; ``backend`` defaults to the real pynvml."""

    def __init__(self, backend: Any = None, pid: int | None = None) -> None:
        self.backend = backend
        self.pid = pid or os.getpid()
        self.handles: list[tuple[int, Any]] = []
        self.reason: str | None = None
        self.static: list[dict[str, Any]] = []

    def open(self) -> str | None:
        """Initialise NVML; returns None when GPUs are there, else the reason in words."""
        if self.backend is None:
            try:
                import pynvml  # type: ignore[import-not-found]
            except ImportError:
                self.reason = "nvidia-ml-py is not installed"
                return self.reason
            self.backend = pynvml
        b = self.backend
        try:
            b.nvmlInit()
        except Exception as exc:  # noqa: BLE001
            name = type(exc).__name__
            self.reason = "no NVIDIA driver (NVML library not found)" if "LibraryNotFound" in name else f"NVML unavailable ({name})"
            return self.reason
        count = _q(b.nvmlDeviceGetCount) or 0
        all_handles = [_q(b.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        uuids = [_text(_q(b.nvmlDeviceGetUUID, h)) if h is not None else None for h in all_handles]
        for idx in visible_devices(count, uuids, os.environ.get("CUDA_VISIBLE_DEVICES")):
            if all_handles[idx] is not None:
                self.handles.append((idx, all_handles[idx]))
        if not self.handles:
            self.reason = "no GPU visible to this process" if count else "no NVIDIA GPU found"
            return self.reason
        for idx, h in self.handles:
            mem = _q(b.nvmlDeviceGetMemoryInfo, h)
            limit = _q(b.nvmlDeviceGetEnforcedPowerLimit, h)
            self.static.append({
                "index": idx, "name": _text(_q(b.nvmlDeviceGetName, h)), "uuid": uuids[idx],
                "total_bytes": getattr(mem, "total", None),
                "power_limit_w": limit / 1000.0 if isinstance(limit, int | float) else None,
                "sm_clock_max_mhz": _q(b.nvmlDeviceGetMaxClockInfo, h, getattr(b, "NVML_CLOCK_SM", 1)),
            })
        return None

    def sample(self) -> list[dict[str, Any]]:
        """One reading per visible GPU; every field may be None ("n/a")."""
        b = self.backend
        out = []
        procs_by_device = self._processes()
        listed = [procs is not None and any(getattr(p, "pid", None) == self.pid for p in procs)
                  for procs in procs_by_device]
        for i, ((_idx, h), static) in enumerate(zip(self.handles, self.static, strict=True)):
            util = _q(b.nvmlDeviceGetUtilizationRates, h)
            mem = _q(b.nvmlDeviceGetMemoryInfo, h)
            power = _q(b.nvmlDeviceGetPowerUsage, h)
            reasons_mask = _q(getattr(b, "nvmlDeviceGetCurrentClocksEventReasons", None), h)
            if reasons_mask is None:
                reasons_mask = _q(getattr(b, "nvmlDeviceGetCurrentClocksThrottleReasons", None), h)
            reasons = [n for bit, n in THROTTLE_REASONS.items() if isinstance(reasons_mask, int) and reasons_mask & bit]
            proc_mem, proc_reason = self._process_memory(procs_by_device[i], any(listed[:i] + listed[i + 1:]))
            out.append({
                **static,
                "util_gpu": getattr(util, "gpu", None),
                "util_mem": getattr(util, "memory", None),
                "mem_used_bytes": getattr(mem, "used", None),
                "proc_mem_bytes": proc_mem,
                "proc_mem_reason": proc_reason,
                "power_w": power / 1000.0 if isinstance(power, int | float) else None,
                "temp_c": _q(b.nvmlDeviceGetTemperature, h, getattr(b, "NVML_TEMPERATURE_GPU", 0)),
                "sm_clock_mhz": _q(b.nvmlDeviceGetClockInfo, h, getattr(b, "NVML_CLOCK_SM", 1)),
                "throttle": reasons,
                "throttled": sorted(set(reasons) & LIMITING),
                "pcie_tx_kbs": _q(b.nvmlDeviceGetPcieThroughput, h, getattr(b, "NVML_PCIE_UTIL_TX_BYTES", 0)),
                "pcie_rx_kbs": _q(b.nvmlDeviceGetPcieThroughput, h, getattr(b, "NVML_PCIE_UTIL_RX_BYTES", 1)),
            })
        return out

    def _processes(self) -> list[list[Any] | None]:
        """NVML's compute processes on each sampled device (None where the query fails)."""
        query = getattr(self.backend, "nvmlDeviceGetComputeRunningProcesses", None)
        lists = [_q(query, h) for _idx, h in self.handles]
        return [list(procs) if isinstance(procs, list | tuple) else None for procs in lists]

    def _process_memory(self, procs: list[Any] | None, listed_elsewhere: bool) -> tuple[int | None, str | None]:
        """(bytes this process holds on the device, None) or (None, why it is not known).

        Not being in NVML's list is not 0 bytes: in a container with its own PID namespace NVML
        lists host pids, and ours (the container's) is never among them. It is 0 only when NVML
        does list this pid on another device (it sees us, and we have no context on this one).
        """
        if procs is None:
            return None, PROC_QUERY_FAILED
        used = [getattr(p, "usedGpuMemory", None) for p in procs if getattr(p, "pid", None) == self.pid]
        if not used:
            if listed_elsewhere:
                return 0, None
            # before torch initialises CUDA there is no context: NVML rightly does not list us yet
            return None, PROC_NOT_VISIBLE if cuda_initialized() else PROC_NO_CONTEXT
        known = [u for u in used if isinstance(u, int) and not isinstance(u, bool)]
        if not known:  # pynvml gives None for NVML_VALUE_NOT_AVAILABLE (MIG, some vGPUs)
            return None, PROC_NO_BYTES
        return sum(known), None

    def close(self) -> None:
        if self.handles:
            _q(getattr(self.backend, "nvmlShutdown", None))
