"""Chart pieces shared by the panels: chart spans, sparklines, stacked bars, the label column."""

from __future__ import annotations

#: Chart spans, cycled by the ``t`` key: (label, seconds or None for the whole run).
SPANS: tuple[tuple[str, float | None], ...] = (
    ("1 min", 60.0), ("10 min", 600.0), ("1 h", 3600.0), ("whole run", None),
)
BLOCKS = " ▁▂▃▄▅▆▇█"
#: Label column of the device and host panels (the same, so they line up when stacked).
LABEL_W = 6


def span_words(span: str) -> str:
    """A span label as a chart caption: ``last 1 min``, ``whole run``."""
    return span if span == "whole run" else f"last {span}"


def resample(values: tuple[float, ...] | list[float], width: int) -> list[float]:
    """Fit ``values`` into ``width`` columns: chunk means when longer, repeated points when shorter."""
    n = len(values)
    if n == 0 or width <= 0:
        return []
    if n <= width:
        return [values[j * n // width] for j in range(width)]
    out = []
    for j in range(width):
        chunk = values[j * n // width:(j + 1) * n // width]
        out.append(sum(chunk) / len(chunk))
    return out


def spark_rows(values: list[float], height: int) -> list[str]:
    """Multi-row sparkline (eighth blocks), min..max scaled; the lowest value keeps one eighth."""
    if not values:
        return [""] * height
    lo, hi = min(values), max(values)
    levels = height * 8
    cells = [1 + round((v - lo) / (hi - lo) * (levels - 1)) if hi > lo else levels // 2 for v in values]
    rows = []
    for r in range(height):
        base = (height - 1 - r) * 8
        rows.append("".join(BLOCKS[max(0, min(8, c - base))] for c in cells))
    return rows


def spark(values: tuple[float, ...], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """A one-row sparkline of ``values`` in ``width`` cells, on a fixed ``lo..hi`` scale when given."""
    cells = resample(values, width)
    if not cells:
        return ""
    if lo is not None and hi is not None and hi > lo:
        cells = [lo, hi, *cells]  # pin the scale: spark_rows scales min..max
        return spark_rows(cells, 1)[0][2:]
    return spark_rows(cells, 1)[0]


def stacked_bar(shares: list[tuple[str, float]], width: int) -> list[tuple[str, int]]:
    """Split ``width`` cells among parts by share (largest remainder), in the given order."""
    total = sum(s for _, s in shares)
    if total <= 0 or width <= 0:
        return []
    exact = [(p, s / total * width) for p, s in shares]
    cells = [(p, int(x)) for p, x in exact]
    left = width - sum(c for _, c in cells)
    order = sorted(range(len(exact)), key=lambda i: exact[i][1] - int(exact[i][1]), reverse=True)
    for i in order[:left]:
        cells[i] = (cells[i][0], cells[i][1] + 1)
    return [(p, c) for p, c in cells if c > 0]
