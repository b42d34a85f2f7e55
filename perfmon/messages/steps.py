"""``steps`` messages: rows of per-step phase times, read into columns.

The monitor's hot path (a fast job sends thousands of rows a second, a replay millions): each column
is read in one pass over the rows, and only when a value fails is the message read again row by
row to find where it stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perfmon.messages.base import Message, num
from perfmon.protocol import ALL_PHASES, OUTSIDE_KINDS, PHASES, STEP_FIELDS


@dataclass(frozen=True, slots=True, kw_only=True)
class Bulk:
    """Rows of a fast job that the live stream summarised instead of sending (the recording has them)."""

    n: int
    sum_ms: dict[str, float]  # by phase (``ALL_PHASES``) and ``dur``, the step time
    samples: int = 0
    samples_steps: int = 0  # rows that counted samples
    closures: int = 0
    closure_steps: int = 0  # rows that reported closures
    prefetch_ms: float = 0.0  # other threads' DataLoader fetches (a prefetching generator)
    last_i: int | None = None
    first_start: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRows(Message):
    """The readable rows of a ``steps`` message, as columns (row ``k`` is index ``k`` of each).

    ``phases`` holds one column per phase of ``PHASES``: the device time where the row has one
    (``dev_<phase>_ms``), else the host time. ``cut``: a value that is not a number (or a missing
    column) ended the message; the rows before it are here, and the message counts as skipped.
    """

    i: list[int] = field(default_factory=list)
    t: list[float] = field(default_factory=list)  # end of the step, wall clock
    dur: list[float] = field(default_factory=list)  # ms
    phases: tuple[list[float], ...] = ()
    samples: list[int] = field(default_factory=list)  # 0: not counted
    closures: list[int] | None = None  # per row, None where not reported; None: no such column
    prefetch: list[float] | None = None  # ms other threads spent fetching batches, per row; None: no such column
    device_timed: bool = False  # some row has device (CUDA event) times
    cut: bool = False
    outside: dict[str, float] = field(default_factory=dict)  # ms outside steps, by ``OUTSIDE_KINDS``
    bulk: Bulk | None = None

    def __len__(self) -> int:
        return len(self.i)


def _columns(rows: list[list[Any]], col: dict[str, int]) -> dict[str, Any]:
    """Every column of ``rows``; raises on the first value that is not a number."""
    i_s, i_c, i_dev, i_p = col.get("samples"), col.get("closures"), col.get("dev_forward_ms"), col.get("prefetch_ms")
    phases = []
    for p in PHASES:
        host, dev = col[f"{p}_ms"], col.get(f"dev_{p}_ms")
        phases.append([float(r[host]) for r in rows] if dev is None else
                      [float(r[host] if r[dev] is None else r[dev]) for r in rows])
    return {
        "i": [int(r[col["i"]]) for r in rows], "t": [float(r[col["t"]]) for r in rows],
        "dur": [float(r[col["dur_ms"]]) for r in rows], "phases": tuple(phases),
        "samples": [0] * len(rows) if i_s is None else
        [int(s) if isinstance(s, int | float) and s > 0 else 0 for s in (r[i_s] for r in rows)],
        "closures": None if i_c is None else
        [c if isinstance(c, int) else None for c in (r[i_c] for r in rows)],
        "prefetch": None if i_p is None else [max(0.0, float(r[i_p])) for r in rows],
        "device_timed": i_dev is not None and any(r[i_dev] is not None for r in rows),
    }


_BAD = (TypeError, ValueError, OverflowError, KeyError)


def parse_steps(msg: dict[str, Any], seq: int | None) -> StepRows:
    """A ``steps`` message; a row of the wrong length is dropped alone, a bad value cuts the message."""
    outside = msg.get("outside")
    spent = {}
    if isinstance(outside, dict):
        for kind in OUTSIDE_KINDS:
            value = num(outside.get(f"{kind}_ms"))
            if value is not None and value > 0:
                spent[kind] = float(value)
    fields, rows = msg.get("fields", STEP_FIELDS), msg.get("rows")
    if not isinstance(fields, list | tuple) or not isinstance(rows, list):
        return StepRows(seq=seq, outside=spent)
    try:
        col = {f: k for k, f in enumerate(fields)}
        for name in ("i", "t", "dur_ms", *(f"{p}_ms" for p in PHASES)):
            col[name]  # noqa: B018 - a required column
    except _BAD:
        return StepRows(seq=seq, outside=spent, cut=True)
    good = [r for r in rows if isinstance(r, list) and len(r) == len(fields)]
    cut = False
    try:
        columns = _columns(good, col)
    except _BAD:  # find the row that fails: the rows before it count
        cut = True
        k = 0
        while k < len(good):
            try:
                _columns(good[k:k + 1], col)
            except _BAD:
                break
            k += 1
        columns = _columns(good[:k], col)
    return StepRows(seq=seq, outside=spent, cut=cut, bulk=_bulk(msg.get("bulk")), **columns)


def _bulk(bulk: Any) -> Bulk | None:
    if not isinstance(bulk, dict):
        return None
    n, sums = bulk.get("n"), bulk.get("sum_ms")
    if not isinstance(n, int) or n <= 0 or not isinstance(sums, dict):
        return None
    sum_ms = {key: float(v) for key in (*ALL_PHASES, "dur") if (v := num(sums.get(key))) is not None}

    def positive(key: str) -> int:
        value = bulk.get(key)
        return value if isinstance(value, int) and value > 0 else 0

    last, start = bulk.get("last_i"), num(bulk.get("first_start"))
    return Bulk(n=n, sum_ms=sum_ms, samples=positive("samples"), samples_steps=positive("samples_steps"),
                closures=positive("closures"), closure_steps=positive("closure_steps"),
                prefetch_ms=max(0.0, float(num(bulk.get("prefetch_ms")) or 0.0)),
                last_i=last if isinstance(last, int) else None,
                first_start=float(start) if start is not None else None)
