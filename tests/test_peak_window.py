"""Per-window allocator peaks: the script's own peak readings must not change.

The allocator is a stand-in (this machine has no CUDA); the functions the script calls are torch's
real ``torch.cuda.memory`` and ``torch.accelerator.memory`` readers, which look the counters up on
``torch._C`` at call time, exactly where :class:`PeakWindows` wraps them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from perfmon.collectors.cuda_mem import CudaMemorySampler
from perfmon.collectors.peak_window import PeakWindows, fold_peaks, merge_peaks

MiB = 1 << 20


class FakeAllocator:
    """Per-device counters shaped like the caching allocator's nested stats (current/peak per pool)."""

    def __init__(self, devices: int = 2) -> None:
        self.stats = {d: self._empty() for d in range(devices)}

    @staticmethod
    def _empty() -> dict[str, Any]:
        stat = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        return {
            "allocated_bytes": {"all": dict(stat), "large_pool": dict(stat), "small_pool": dict(stat)},
            "reserved_bytes": {"all": dict(stat)},
            "active": {"all": dict(stat)},
            "num_alloc_retries": 0, "num_ooms": 0,
        }

    def alloc(self, n: int, device: int = 0) -> None:
        s = self.stats[device]
        for path in (("allocated_bytes", "all"), ("allocated_bytes", "large_pool"), ("reserved_bytes", "all")):
            c = s[path[0]][path[1]]
            c["current"] += n
            c["allocated"] += n
            c["peak"] = max(c["peak"], c["current"])
        s["active"]["all"]["current"] += 1
        s["active"]["all"]["peak"] = max(s["active"]["all"]["peak"], s["active"]["all"]["current"])

    def free(self, n: int, device: int = 0) -> None:
        s = self.stats[device]
        for path in (("allocated_bytes", "all"), ("allocated_bytes", "large_pool")):
            c = s[path[0]][path[1]]
            c["current"] -= n
            c["freed"] += n
        s["active"]["all"]["current"] -= 1

    # the torch._C entry points
    def read(self, device: int) -> dict[str, Any]:
        return copy.deepcopy(self.stats[device])

    def reset(self, device: int) -> None:
        def walk(d: dict[str, Any]) -> None:
            for v in d.values():
                if isinstance(v, dict):
                    if "peak" in v:
                        v["peak"] = v["current"]
                    else:
                        walk(v)
        walk(self.stats[device])


#: torch.accelerator's memory readers exist from torch 2.8 on (make test-compat runs older ones too).
HAS_ACCELERATOR_API = hasattr(getattr(torch, "accelerator", None), "max_memory_allocated")


@pytest.fixture
def alloc(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A fake allocator behind torch._C, and torch's readers told CUDA is initialised."""
    fake = FakeAllocator()
    for name, fn in (("_cuda_memoryStats", fake.read), ("_cuda_resetPeakMemoryStats", fake.reset),
                     ("_accelerator_getDeviceStats", fake.read), ("_accelerator_resetPeakStats", fake.reset),
                     ("_accelerator_isAllocatorInitialized", lambda: True)):
        monkeypatch.setattr(torch._C, name, fn, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return fake


@pytest.fixture
def windows(alloc: FakeAllocator) -> Any:
    pw = PeakWindows(torch._C)
    assert pw.install()
    yield pw
    pw.uninstall()


def window_peak(pw: PeakWindows, device: int = 0) -> int:
    return pw.take(device)["allocated_bytes"]["all"]["peak"]


def test_window_peak_is_the_peak_since_the_last_take(alloc: FakeAllocator, windows: PeakWindows) -> None:
    alloc.alloc(100 * MiB)
    alloc.free(100 * MiB)
    assert window_peak(windows) == 100 * MiB
    alloc.alloc(30 * MiB)
    alloc.free(20 * MiB)
    assert window_peak(windows) == 30 * MiB
    # nothing happened: the window's peak is what is held now
    assert window_peak(windows) == 10 * MiB


def test_scripts_own_peak_readings_are_unchanged(alloc: FakeAllocator, windows: PeakWindows) -> None:
    alloc.alloc(100 * MiB)
    alloc.free(100 * MiB)
    windows.take(0)
    alloc.alloc(40 * MiB)
    windows.take(0)
    # the real counters now say 40 MiB; the script still reads the 100 MiB it would have read
    assert alloc.stats[0]["allocated_bytes"]["all"]["peak"] == 40 * MiB
    assert torch.cuda.max_memory_allocated(0) == 100 * MiB
    assert torch.cuda.memory_stats(0)["allocated_bytes.large_pool.peak"] == 100 * MiB
    assert torch.cuda.memory_stats(0)["active.all.peak"] == 1
    assert torch.cuda.max_memory_reserved(0) == 140 * MiB
    if HAS_ACCELERATOR_API:  # torch >= 2.8
        assert torch.accelerator.max_memory_allocated(0) == 100 * MiB
    # counters that are not peaks pass through untouched
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.current"] == 40 * MiB
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.freed"] == 100 * MiB


def test_scripts_reset_clears_the_hidden_peaks(alloc: FakeAllocator, windows: PeakWindows) -> None:
    alloc.alloc(100 * MiB)
    alloc.free(90 * MiB)
    windows.take(0)
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == 10 * MiB
    alloc.alloc(5 * MiB)
    windows.take(0)
    if HAS_ACCELERATOR_API:
        torch.accelerator.reset_peak_memory_stats(0)  # the other API resets the same counters
    else:
        torch.cuda.reset_peak_memory_stats(0)
    alloc.alloc(1 * MiB)
    assert torch.cuda.max_memory_allocated(0) == 16 * MiB


def test_devices_are_kept_apart(alloc: FakeAllocator, windows: PeakWindows) -> None:
    alloc.alloc(50 * MiB, device=1)
    alloc.free(50 * MiB, device=1)
    alloc.alloc(7 * MiB, device=0)
    assert window_peak(windows, 1) == 50 * MiB
    assert window_peak(windows, 0) == 7 * MiB
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(1) == 50 * MiB


def test_uninstall_gives_back_the_original_functions(alloc: FakeAllocator) -> None:
    pw = PeakWindows(torch._C)
    assert pw.install()
    assert torch._C._cuda_memoryStats is not alloc.read
    pw.uninstall()
    assert torch._C._cuda_memoryStats == alloc.read
    assert torch._C._accelerator_resetPeakStats == alloc.reset


def test_a_build_without_the_counters_is_left_alone() -> None:
    class Bare:
        pass

    pw = PeakWindows(Bare())
    assert not pw.install()
    assert vars(Bare()) == {}


def test_merge_never_breaks_the_scripts_call(alloc: FakeAllocator, windows: PeakWindows) -> None:
    alloc.alloc(8 * MiB)
    windows.take(0)
    windows._hidden[0]["allocated_bytes"] = {"all": {"peak": "garbage"}}  # a corrupt hidden copy
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.current"] == 8 * MiB


def test_fold_and_merge_handle_mismatched_shapes() -> None:
    hidden: dict[str, Any] = {}
    fold_peaks(hidden, {"a": {"peak": 5, "current": 1}, "n": 3, "b": {"all": {"peak": 2}}})
    assert hidden == {"a": {"peak": 5}, "b": {"all": {"peak": 2}}}
    out = merge_peaks({"a": {"peak": 1, "current": 1}, "b": 7, "c": {"peak": 9}}, hidden)
    assert out == {"a": {"peak": 5, "current": 1}, "b": 7, "c": {"peak": 9}}


def test_concurrent_reads_and_takes_agree(alloc: FakeAllocator, windows: PeakWindows) -> None:
    """The sampler taking windows while the script reads never shows the script a lower peak."""
    alloc.alloc(64 * MiB)
    alloc.free(63 * MiB)
    stop = threading.Event()
    seen: list[int] = []

    def sampler() -> None:
        while not stop.is_set():
            windows.take(0)

    t = threading.Thread(target=sampler)
    t.start()
    try:
        for _ in range(2000):
            seen.append(torch.cuda.max_memory_allocated(0))
    finally:
        stop.set()
        t.join()
    assert min(seen) == 64 * MiB


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 1000)),
    st.tuples(st.just("free"), st.integers(1, 1000)),
    st.tuples(st.just("reset"), st.just(0)),
    st.tuples(st.just("take"), st.just(0)),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_script_sees_what_it_would_without_perfmon(seq: list[tuple[str, int]]) -> None:
    """A twin allocator without perfmon gives the reference: every read must match it."""
    real, twin = FakeAllocator(1), FakeAllocator(1)
    c = type("C", (), {"_cuda_memoryStats": staticmethod(real.read),
                       "_cuda_resetPeakMemoryStats": staticmethod(real.reset)})()
    pw = PeakWindows(c)
    assert pw.install()
    held = 0
    window_max = 0
    for op, n in seq:
        if op == "alloc":
            real.alloc(n)
            twin.alloc(n)
            held += n
        elif op == "free":
            n = min(n, held)
            real.free(n)
            twin.free(n)
            held -= n
        elif op == "reset":
            c._cuda_resetPeakMemoryStats(0)
            twin.reset(0)
        else:
            assert pw.take(0)["allocated_bytes"]["all"]["peak"] == max(window_max, held)
            window_max = held
            continue
        window_max = max(window_max, held)
        assert c._cuda_memoryStats(0) == twin.read(0)


def test_sampler_reports_window_and_since_start_peaks(alloc: FakeAllocator) -> None:
    s = CudaMemorySampler()
    try:
        alloc.alloc(100 * MiB)
        alloc.free(100 * MiB)
        first = s.sample(0)
        alloc.alloc(20 * MiB)
        torch.cuda.reset_peak_memory_stats(0)  # the script's reset does not clear perfmon's since-start peak
        second = s.sample(0)
    finally:
        assert s._windows is not None
        s._windows.uninstall()
    assert first is not None and second is not None
    assert first["window_peak_allocated_bytes"] == 100 * MiB
    assert second["window_peak_allocated_bytes"] == 20 * MiB
    assert second["peak_allocated_bytes"] == 100 * MiB
    assert second["allocated_bytes"] == 20 * MiB
    assert second["reserved_bytes"] == 120 * MiB


def test_sampler_without_window_peaks_touches_nothing(alloc: FakeAllocator) -> None:
    s = CudaMemorySampler(window_peaks=False)
    alloc.alloc(100 * MiB)
    alloc.free(60 * MiB)
    out = s.sample(0)
    assert out is not None
    assert out["window_peak_allocated_bytes"] is None
    assert out["peak_allocated_bytes"] == 100 * MiB
    assert torch._C._cuda_memoryStats == alloc.read  # not wrapped
    assert alloc.stats[0]["allocated_bytes"]["all"]["peak"] == 100 * MiB  # not reset


@pytest.mark.parametrize(("env", "expected"), [(None, True), ("1", True), ("0", False)])
def test_agent_setting_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, env: str | None,
                                        expected: bool) -> None:
    from perfmon.agent.bootstrap import _meta

    if env is None:
        monkeypatch.delenv("PERFMON_WINDOW_PEAKS", raising=False)
    else:
        monkeypatch.setenv("PERFMON_WINDOW_PEAKS", env)
    assert _meta("train.py", [], False, tmp_path)["window_peaks"] is expected
