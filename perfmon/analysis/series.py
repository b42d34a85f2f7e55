"""Bounded aggregates for any run length: log-bucket histograms and multi-resolution time series."""

from __future__ import annotations

import math
from collections import Counter, deque


class Histogram:
    """Log-spaced buckets (2% wide): quantiles within ~1% over any number of values.

    ``n`` counts values exactly; bucket counts may be weighted (a fast job's live stream sends the newest
    rows of each tick, each standing for the rows it summarises in bulk), so quantiles use ``weight``.
    """

    RATIO = 1.02

    def __init__(self) -> None:
        self.counts: dict[int, float] = {}
        self.n = 0
        self.weight = 0.0
        self.zeros = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.weight += 1.0
        if x <= 1e-6:
            self.zeros += 1
            return
        k = math.floor(math.log(x) * _INV_LOG_RATIO)
        self.counts[k] = self.counts.get(k, 0) + 1

    def add_many(self, values: list[float], weight: float = 1.0, extra: int = 0) -> None:
        """``add`` for each value, in one pass (the monitor folds thousands of steps per message); each
        counts ``weight`` times in the quantiles, and ``extra`` values summarised elsewhere count in ``n``."""
        log, floor, inv = math.log, math.floor, _INV_LOG_RATIO
        keys = [floor(log(x) * inv) for x in values if x > 1e-6]
        self.n += len(values) + extra
        self.weight += len(values) * weight
        self.zeros += (len(values) - len(keys)) * weight
        counts = self.counts
        for k, c in Counter(keys).items():
            counts[k] = counts.get(k, 0) + c * weight

    def without(self, x: float) -> Histogram:
        """A copy with one value ``x`` (added before, with weight 1) taken out."""
        out = Histogram()
        out.counts, out.n, out.weight, out.zeros = dict(self.counts), self.n - 1, self.weight - 1.0, self.zeros
        if x <= 1e-6:
            out.zeros -= 1
        else:
            k = math.floor(math.log(x) * _INV_LOG_RATIO)
            left = out.counts.get(k, 0) - 1
            if left > 0:
                out.counts[k] = left
            else:
                out.counts.pop(k, None)
        return out

    def quantile(self, q: float) -> float | None:
        if not self.n or self.weight <= 0:
            return None
        rank = q * (self.weight - 1) if self.weight >= 1 else 0.0
        seen = self.zeros
        if rank < seen:
            return 0.0
        for k in sorted(self.counts):
            seen += self.counts[k]
            if rank < seen:
                return self.RATIO ** (k + 0.5)  # bucket midpoint (geometric)
        return self.RATIO ** (max(self.counts) + 0.5)


    def cumulative(self, bounds: list[float]) -> list[float]:
        """The weight of values at or below each bound (ascending), as Prometheus buckets count: a bucket
        counts below a bound when its upper edge is at or below it (within the 2% a bucket spans)."""
        keys = sorted(self.counts)
        out, seen, i = [], self.zeros, 0
        for bound in bounds:
            while i < len(keys) and self.RATIO ** (keys[i] + 1) <= bound * (1 + 1e-9):
                seen += self.counts[keys[i]]
                i += 1
            out.append(seen)
        return out


_INV_LOG_RATIO = 1.0 / math.log(Histogram.RATIO)


class TimeSeries:
    """Fine recent, coarse old: each level keeps a fixed number of [bucket, sum, n, max, min] points."""

    LEVELS = ((1.0, 600), (10.0, 720), (60.0, 1440), (600.0, 1008))  # 10 min, 2 h, 24 h, 7 days

    def __init__(self) -> None:
        self.levels: list[deque[list[float]]] = [deque(maxlen=n) for _, n in self.LEVELS]

    def add(self, t: float, value: float) -> None:
        # O(1) per value: only the finest level is touched; a closed bucket rolls up once
        res = self.LEVELS[0][0]
        bucket = math.floor(t / res) * res
        points = self.levels[0]
        if points and points[-1][0] == bucket:
            p = points[-1]
            p[1] += value
            p[2] += 1
            if value > p[3]:
                p[3] = value
            if value < p[4]:
                p[4] = value
        else:
            if points:
                self._roll(1, points[-1])
            points.append([bucket, value, 1, value, value])

    def add_many(self, times: list[float], values: list[float]) -> None:
        """``add`` for each (time, value), in one loop (a steps message holds thousands)."""
        res, floor = self.LEVELS[0][0], math.floor
        points = self.levels[0]
        last = points[-1] if points else None
        for t, value in zip(times, values, strict=True):
            bucket = floor(t / res) * res
            if last is not None and last[0] == bucket:
                last[1] += value
                last[2] += 1
                if value > last[3]:
                    last[3] = value
                if value < last[4]:
                    last[4] = value
            else:
                if last is not None:
                    self._roll(1, last)
                last = [bucket, value, 1, value, value]
                points.append(last)

    def _roll(self, level: int, closed: list[float]) -> None:
        if level >= len(self.LEVELS):
            return
        res = self.LEVELS[level][0]
        bucket = math.floor(closed[0] / res) * res
        points = self.levels[level]
        if points and points[-1][0] == bucket:
            p = points[-1]
            p[1] += closed[1]
            p[2] += closed[2]
            p[3] = max(p[3], closed[3])
            p[4] = min(p[4], closed[4])
        else:
            if points:
                self._roll(level + 1, points[-1])
            points.append([bucket, closed[1], closed[2], closed[3], closed[4]])

    def span_covered(self, level: int) -> float:
        res, n = self.LEVELS[level]
        return res * n

    def values(self, span: float | None, now: float | None = None) -> list[float]:
        """Bucket means over the last ``span`` seconds (None: the whole run), finest level that covers it."""
        return [p[1] / p[2] for p in self._points(span, now)]

    def extent(self, span: float | None, now: float | None = None) -> tuple[float, float] | None:
        """The smallest and the largest single value over the same span as :meth:`values` (a bucket's mean hides a
        spike); None where there is none."""
        points = self._points(span, now)
        return (min(p[4] for p in points), max(p[3] for p in points)) if points else None

    def _points(self, span: float | None, now: float | None = None) -> list[list[float]]:
        now = now if now is not None else self._last()
        if now is None:
            return []
        level = len(self.LEVELS) - 1
        want = span if span is not None else now - self._first()
        for i in range(len(self.LEVELS)):
            first = self.levels[i][0][0] if self.levels[i] else now
            if now - first >= want or len(self.levels[i]) < self.LEVELS[i][1]:
                level = i
                break
        cut = now - want if span is not None else -math.inf
        return [p for p in self.levels[level] if p[0] >= cut - self.LEVELS[level][0]]

    def _last(self) -> float | None:
        return self.levels[0][-1][0] if self.levels[0] else None

    def _first(self) -> float:
        for points in reversed(self.levels):
            if points:
                return points[0][0]
        return 0.0
