"""The torch.cuda caching allocator's view: allocated, reserved, peaks, retries, OOMs.

Reads ``torch.cuda.memory_stats`` from the sampler thread; it never synchronises.
Only called once CUDA is initialised (calling it earlier would initialise CUDA).
"""

from __future__ import annotations

import sys
from typing import Any


class CudaMemorySampler:
    def __init__(self) -> None:
        self._window_reset = False

    def sample(self) -> dict[str, Any] | None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        try:
            if not torch.cuda.is_initialized():
                return None
            stats = torch.cuda.memory_stats()
        except Exception:  # noqa: BLE001 - "n/a", never raise
            return None
        allocated = stats.get("allocated_bytes.all.current", 0)
        reserved = stats.get("reserved_bytes.all.current", 0)
        out = {
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
            "fragmentation_bytes": max(0, reserved - allocated),
        }
        return out
