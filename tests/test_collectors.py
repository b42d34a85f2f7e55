"""Collectors: NVML on the fake backend (every panel state), host on the real psutil."""

from __future__ import annotations

import os

import pytest
from fake_nvml import (
    GIB,
    FakeNvml,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    h100,
)

from perfmon.collectors.host import HostSampler
from perfmon.collectors.nvml import NvmlSampler, visible_devices


def test_no_nvml_library_says_so(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert s.open() == "no NVIDIA driver (NVML library not found)"
    assert s.sample() == []


def test_no_gpu_found(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml(devices=[]))
    assert s.open() == "no NVIDIA GPU found"


def test_real_backend_on_this_machine_never_raises():
    s = NvmlSampler()
    reason = s.open()
    assert reason is None or isinstance(reason, str)
    assert isinstance(s.sample(), list)


def test_full_reading(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml([h100(procs=[(os.getpid(), 3 * GIB), (1, GIB)])]))
    assert s.open() is None
    (g,) = s.sample()
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["total_bytes"] == 80 * GIB
    assert g["util_gpu"] == 97 and g["mem_used_bytes"] == 60 * GIB and g["proc_mem_bytes"] == 3 * GIB
    assert g["power_w"] == 650.0 and g["power_limit_w"] == 700.0 and g["temp_c"] == 71
    assert g["sm_clock_mhz"] == 1980 and g["throttled"] == [] and g["pcie_tx_kbs"] == 1200


def test_not_supported_and_lost_gpu_give_none_not_errors(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml([h100(power=NVMLError_NotSupported(), pcie=NVMLError_NotSupported())])
    s = NvmlSampler(fake)
    s.open()
    (g,) = s.sample()
    assert g["power_w"] is None and g["pcie_rx_kbs"] is None and g["util_gpu"] == 97
    for key in ("util", "mem", "temp", "sm", "reasons", "procs"):
        fake.devices[0][key] = NVMLError_GpuIsLost()
    (g,) = s.sample()
    assert g["util_gpu"] is None and g["mem_used_bytes"] is None and g["throttled"] == []


def test_throttle_reasons_decoded(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml([h100(reasons=0x1 | 0x4 | 0x40)]))
    s.open()
    (g,) = s.sample()
    assert g["throttle"] == ["gpu_idle", "sw_power_cap", "hw_thermal"]
    assert g["throttled"] == ["hw_thermal", "sw_power_cap"]


@pytest.mark.parametrize(
    "env, expected",
    [(None, [0, 1, 2]), ("2,0", [2, 0]), ("1,7,0", [1]), ("", []), ("GPU-bbbb", [1]), ("GPU-zzzz", []), ("bbbb", [1])],
)
def test_cuda_visible_devices(env, expected):
    uuids = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]
    assert visible_devices(3, uuids, env) == expected


def test_visible_devices_used_by_sampler(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    fake = FakeNvml([h100(uuid="GPU-a"), h100(uuid="GPU-b", name="other")])
    s = NvmlSampler(fake)
    assert s.open() is None
    assert [g["name"] for g in s.sample()] == ["other"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlSampler(fake).open() == "no GPU visible to this process"


def test_host_sampler_real_numbers():
    s = HostSampler()
    sum(i * i for i in range(200_000))  # some CPU time between the two readings
    h = s.sample()
    assert h["rss_bytes"] > 10 * 1024 * 1024
    assert h["threads"] >= 1 and h["cpu_count"] >= 1 and h["mem_total_bytes"] > h["mem_used_bytes"] > 0
    assert h["workers"] == 0 and h["cpu_percent"] is not None


def test_host_sampler_survives_its_process_vanishing():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    s = HostSampler(child.pid)
    child.wait()
    h = s.sample()
    assert h["rss_bytes"] is None and h["system_cpu_percent"] is not None
