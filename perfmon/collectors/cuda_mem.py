"""The torch.cuda caching allocator's view: allocated, reserved, peaks, retries, OOMs.

Reads the allocator's counters from the sampler thread; it never synchronises. Only called once
CUDA is initialised (calling it earlier would initialise CUDA). With window peaks on (the
default) the peaks of each sample window come from :class:`PeakWindows`, which keeps the
script's own ``max_memory_allocated()`` unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from perfmon.collectors.peak_window import PeakWindows


def _get(stats: dict[str, Any], *path: str) -> Any:
    for key in path:
        stats = stats.get(key) if isinstance(stats, dict) else None  # type: ignore[assignment]
    return stats


class CudaMemorySampler:
    """One allocator sample per call; peaks since start are perfmon's own (a script's reset does not clear them)."""

    def __init__(self, window_peaks: bool = True) -> None:
        self.window_peaks = window_peaks
        self._windows: PeakWindows | None = None
        self._since_start: dict[int, dict[str, int]] = {}

    def _stats(self, torch: Any, device: int) -> tuple[dict[str, Any], bool]:
        """Nested allocator stats, and whether their peaks are this window's."""
        if self.window_peaks and self._windows is None:
            self._windows = PeakWindows(torch._C)
            if not self._windows.install():
                self.window_peaks = False
        if self.window_peaks and self._windows is not None:
            return self._windows.take(device), True
        return torch.cuda.memory.memory_stats_as_nested_dict(device), False

    def sample(self, device: int | Callable[[], int] = 0) -> dict[str, Any] | None:
        """The allocator's numbers for ``device`` (or the device a callable names: asked only once CUDA is
        initialised, as finding it walks the model); None before torch imports or initialises CUDA."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        try:
            if not torch.cuda.is_initialized():
                return None
            if callable(device):
                device = device()
            stats, windowed = self._stats(torch, device)
        except Exception:  # noqa: BLE001 - "n/a", never raise
            return None
        allocated = _get(stats, "allocated_bytes", "all", "current") or 0
        reserved = _get(stats, "reserved_bytes", "all", "current") or 0
        peak_alloc = _get(stats, "allocated_bytes", "all", "peak") or 0
        peak_reserved = _get(stats, "reserved_bytes", "all", "peak") or 0
        start = self._since_start.setdefault(device, {"allocated": 0, "reserved": 0})
        start["allocated"] = max(start["allocated"], peak_alloc)
        start["reserved"] = max(start["reserved"], peak_reserved)
        return {
            "device": device,
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "peak_allocated_bytes": start["allocated"],
            "peak_reserved_bytes": start["reserved"],
            "window_peak_allocated_bytes": peak_alloc if windowed else None,
            "window_peak_reserved_bytes": peak_reserved if windowed else None,
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
            "fragmentation_bytes": max(0, reserved - allocated),
            # free space inside blocks that also hold live tensors: what the allocator cannot hand out whole or
            # release (its own measure of fragmentation); the peak is this window's, like the other peaks
            "inactive_split_bytes": _get(stats, "inactive_split_bytes", "all", "current"),
            "peak_inactive_split_bytes": _get(stats, "inactive_split_bytes", "all", "peak"),
        }
