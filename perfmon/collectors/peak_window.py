"""Allocator peaks per sample window, without changing the peaks the script reads.

The caching allocator keeps one set of peak counters per device, and the only way to learn the
peak of the last second is to reset them. A reset would change what the script's own
``torch.cuda.max_memory_allocated()`` (or ``torch.accelerator``'s) returns, so the reset is
hidden: before resetting, the peaks about to be lost are folded into a per-device "hidden" copy,
and the four functions through which Python reads or resets those counters are wrapped so the
script sees ``max(real peak, hidden peak)``, exactly what it would have seen without perfmon. A
reset by the script clears the hidden copy, as it would clear the real counters; the peaks it
resets are kept for perfmon's current window, so a script's reset does not cut a window short.

The wrapped functions live on ``torch._C``; every ``torch.cuda.memory`` and
``torch.accelerator.memory`` reader looks them up there at call time. Only an allocation that is
made *and* freed in the microseconds between perfmon's read and its reset escapes the window's
peak (it is still in no earlier window either: the window peak is a lower bound by that much).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

# (read, reset) pairs on torch._C that see the same per-device counters on a CUDA build
APIS = (("_cuda_memoryStats", "_cuda_resetPeakMemoryStats"),
        ("_accelerator_getDeviceStats", "_accelerator_resetPeakStats"))


def fold_peaks(hidden: dict[str, Any], stats: dict[str, Any]) -> None:
    """hidden[...]['peak'] = max(hidden, stats) for every 'peak' leaf of the nested ``stats``."""
    for key, value in stats.items():
        if isinstance(value, dict):
            fold_peaks(hidden.setdefault(key, {}), value)
        elif key == "peak" and isinstance(value, int | float):
            hidden[key] = max(hidden.get(key, value), value)


def merge_peaks(stats: dict[str, Any], hidden: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with each 'peak' leaf raised to the hidden one (in place; returns ``stats``)."""
    for key, value in hidden.items():
        have = stats.get(key)
        if isinstance(value, dict):
            if isinstance(have, dict):
                merge_peaks(have, value)
        elif key == "peak" and isinstance(have, int | float):
            stats[key] = max(have, value)
    return stats


class PeakWindows:
    """Owns the allocator's peak counters on behalf of the script, for per-window peaks.

    ``c`` is ``torch._C`` (a stand-in in tests). ``install`` wraps whichever of :data:`APIS` exist;
    ``take(device)`` returns the raw nested stats of the window since the last take and starts a
    new one. Thread-safe: the sampler takes while the training thread may read.
    """

    def __init__(self, c: Any) -> None:
        self.c = c
        self._lock = threading.Lock()
        self._hidden: dict[int, dict[str, Any]] = {}  # peaks the script should still see
        self._pending: dict[int, dict[str, Any]] = {}  # peaks of this window the script reset away
        self._originals: dict[str, Callable[..., Any]] = {}
        self._read: Callable[[int], dict[str, Any]] | None = None
        self._reset: Callable[[int], Any] | None = None

    @property
    def installed(self) -> bool:
        return self._read is not None

    def install(self) -> bool:
        """Wrap the read/reset functions; False (nothing changed) if this build has none."""
        if self.installed:
            return True
        for read_name, reset_name in APIS:
            read, reset = getattr(self.c, read_name, None), getattr(self.c, reset_name, None)
            if read is None or reset is None:
                continue
            if self._read is None:  # the CUDA pair, if present, is what perfmon itself reads
                self._read, self._reset = read, reset
            self._originals[read_name], self._originals[reset_name] = read, reset
            setattr(self.c, read_name, self._wrap_read(read))
            setattr(self.c, reset_name, self._wrap_reset(reset))
        return self.installed

    def uninstall(self) -> None:
        """Put the original functions back; the script's later reads see the real counters."""
        for name, fn in self._originals.items():
            setattr(self.c, name, fn)
        self._originals.clear()
        self._read = self._reset = None

    def take(self, device: int) -> dict[str, Any]:
        """Stats of ``device`` whose peaks are this window's; the next window starts now."""
        assert self._read is not None and self._reset is not None, "install() first"
        with self._lock:
            stats = self._read(device)
            fold_peaks(self._hidden.setdefault(device, {}), stats)
            self._reset(device)
            pending = self._pending.pop(device, None)
        return merge_peaks(stats, pending) if pending else stats

    def _wrap_read(self, read: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(read)
        def read_stats(device: int, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                stats = read(device, *args, **kwargs)
                hidden = self._hidden.get(device)
                if hidden and isinstance(stats, dict):
                    try:
                        merge_peaks(stats, hidden)
                    except Exception:  # noqa: BLE001 - the script's call must never fail because of perfmon
                        pass
            return stats

        return read_stats

    def _wrap_reset(self, reset: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(reset)
        def reset_peaks(device: int, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                try:
                    before = self._read(device) if self._read is not None else None
                    if isinstance(before, dict):
                        fold_peaks(self._pending.setdefault(device, {}), before)
                except Exception:  # noqa: BLE001 - the script's reset goes ahead whatever happens here
                    pass
                result = reset(device, *args, **kwargs)
                self._hidden.pop(device, None)
            return result

        return reset_peaks
