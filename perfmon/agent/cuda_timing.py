"""Device-side phase times from CUDA events, resolved off the hot path, never synchronizing.

Hooks record a ``torch.cuda.Event`` at each phase boundary once CUDA is initialised; the
step tracker pairs them per phase. Here, on the publisher thread, a step is released once
all its end events have completed (``query()``); until then it waits, in order.
"""

from __future__ import annotations

import sys
from collections import deque
from itertools import repeat
from operator import attrgetter
from typing import Any

from perfmon.agent.steps import StepRecord

#: Steps held waiting for the GPU; beyond this, the oldest go out with host times only.
MAX_PENDING = 2048


class CudaResolver:
    def __init__(self) -> None:
        self._pending: deque[StepRecord] = deque()

    @property
    def pending(self) -> int:
        """Steps held waiting for the GPU."""
        return len(self._pending)

    @staticmethod
    def make_event() -> Any:
        torch = sys.modules["torch"]
        if torch.cuda.is_current_stream_capturing():
            return None  # recording an event into a CUDA graph capture would break the capture
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, records: list[StepRecord], final: bool = False) -> list[tuple[StepRecord, dict[str, float] | None]]:
        """Steps ready to publish, in order, each with device ms per phase (or None)."""
        if not self._pending and not any(map(_marks, records)):  # host timing only: C-level passes
            return list(zip(records, repeat(None)))
        self._pending.extend(records)
        out: list[tuple[StepRecord, dict[str, float] | None]] = []
        while self._pending:
            rec = self._pending[0]
            if rec.marks and not final and len(self._pending) <= MAX_PENDING and not _done(rec):
                break
            self._pending.popleft()
            out.append((rec, _device_ms(rec) if rec.marks and _done(rec) else None))
        return out


_marks = attrgetter("marks")


def _done(rec: StepRecord) -> bool:
    try:
        return all(end.query() for pairs in rec.marks.values() for _, end in pairs)
    except Exception:  # noqa: BLE001 - a failed query means no device time for this step
        return True


def _device_ms(rec: StepRecord) -> dict[str, float] | None:
    try:
        return {
            phase: round(sum(start.elapsed_time(end) for start, end in pairs), 4)
            for phase, pairs in rec.marks.items()
        }
    except Exception:  # noqa: BLE001
        return None
