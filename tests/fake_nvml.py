"""A scripted stand-in for the pynvml module (the only test double of the GPU path).

Same function names as pynvml; values come from a per-device dict; a value that is an
exception instance is raised (NotSupported, a vanished GPU, ...).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's own name
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    pass


NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1

GIB = 1 << 30


def h100(**over: Any) -> dict[str, Any]:
    dev = {
        "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1111aaaa-0000-0000-0000-000000000000",
        "util": (97, 40), "mem": (80 * GIB, 60 * GIB), "power": 650_000, "limit": 700_000, "temp": 71,
        "sm": 1980, "sm_max": 1980, "reasons": 0, "pcie": (1200, 800), "procs": [],
    }
    dev.update(over)
    return dev


class FakeNvml:
    def __init__(self, devices: list[dict[str, Any]] | None = None, init_error: Exception | None = None) -> None:
        self.devices = devices if devices is not None else [h100()]
        self.init_error = init_error
        self.NVML_CLOCK_SM = NVML_CLOCK_SM
        self.NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
        self.NVML_PCIE_UTIL_TX_BYTES = NVML_PCIE_UTIL_TX_BYTES
        self.NVML_PCIE_UTIL_RX_BYTES = NVML_PCIE_UTIL_RX_BYTES

    def _get(self, handle: int, key: str) -> Any:
        value = self.devices[handle][key]
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return self._get(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> str:  # noqa: N802
        return self._get(h, "uuid")

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        total, used = self._get(h, "mem")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        gpu, mem = self._get(h, "util")
        return SimpleNamespace(gpu=gpu, memory=mem)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        return self._get(h, "power")

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:  # noqa: N802
        return self._get(h, "limit")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        return self._get(h, "temp")

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return self._get(h, "sm")

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        return self._get(h, "sm_max")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:  # noqa: N802
        return self._get(h, "reasons")

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:  # noqa: N802
        return self._get(h, "pcie")[counter]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self._get(h, "procs")]
