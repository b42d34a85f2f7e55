"""Numbers shared by the panels: readings as floats, and formatting (short, fixed-width friendly,
"—" or "n/a" for unknown)."""

from __future__ import annotations

from typing import Any

DASH = "—"
Num = float | None


def number(value: Any) -> Num:
    """A reading as a float, None when missing or not a number."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def ms(value: float | None) -> str:
    """Milliseconds in at most 5 characters: ``0.41``, ``12.3``, ``842``, ``12.3s``."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    if value < 10_000:
        return f"{value:.0f}"
    if value < 100_000:
        return f"{value / 1000:.1f}s"
    return f"{value / 1000:.0f}s"


def ms_range(low: float, high: float) -> str:
    """``37.3–84.0 ms``; each end with its own unit where one reaches seconds: ``8.49 ms–15.0 s``."""
    if high < 10_000:
        return f"{ms(low)}–{ms(high)} ms"

    def one(value: float) -> str:
        text = ms(value)
        return text.replace("s", " s") if text.endswith("s") else f"{text} ms"

    return f"{one(low)}–{one(high)}"


def share(value: float | None) -> str:
    """A fraction as a percentage: ``4.5%``, ``45%``, ``100%``."""
    if value is None:
        return DASH
    pct = value * 100
    return f"{pct:.1f}%" if pct < 9.95 else f"{pct:.0f}%"


def rate(value: float | None) -> str:
    """A per-second rate: ``3.42``, ``12.3``, ``842``, ``12.3k``."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.2f}"
    if value < 1000:
        return f"{value:.1f}" if value < 100 else f"{value:.0f}"
    if value < 1_000_000:
        return f"{value / 1000:.1f}k"
    return f"{value / 1_000_000:.1f}M"


def duration(seconds: float) -> str:
    """Elapsed time as ``0:02:03`` or ``2d 03:04:05``."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}" if days else clock


def count(value: int) -> str:
    """An integer with thousands separators."""
    return f"{value:,}"


NA = "n/a"
_BINARY = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _num3(value: float) -> str:
    """Three significant digits: ``1.31``, ``12.3``, ``842``."""
    return f"{value:.2f}" if value < 9.995 else f"{value:.1f}" if value < 99.95 else f"{value:.0f}"


def nbytes(value: float | None, short: bool = False) -> str:
    """Bytes in binary units: ``61.2 GiB``, ``512 MiB``, ``0 B`` (``short``: ``61.2G``); "n/a" for unknown."""
    if not isinstance(value, int | float):
        return NA
    for size, name in _BINARY:
        if abs(value) >= size * 0.9995:
            return f"{_num3(value / size)}{name[0]}" if short else f"{_num3(value / size)} {name}"
    return f"{value:.0f}B" if short else f"{value:.0f} B"


def gib(value: float | None) -> str:
    """Bytes as GiB without the unit (for ``used/total GiB``)."""
    if not isinstance(value, int | float):
        return NA
    return _num3(value / (1 << 30))


def si(value: float | None) -> str:
    """A count with an SI suffix: ``1.31M`` parameters, ``12.2T`` FLOPs, ``842``; "n/a" for unknown."""
    if not isinstance(value, int | float):
        return NA
    for size, name in _SI:
        if abs(value) >= size * 0.9995:
            return f"{_num3(value / size)}{name}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def pct(value: float | None) -> str:
    """A percentage value (0..100): ``87%``, ``4.5%``; "n/a" for unknown."""
    if not isinstance(value, int | float):
        return NA
    return f"{value:.1f}%" if 0 < value < 9.95 else f"{value:.0f}%"


def num(value: float | None, unit: str = "", digits: int = 0) -> str:
    """A plain number with an optional unit: ``412 W``, ``71°C``; "n/a" for unknown."""
    if not isinstance(value, int | float):
        return NA
    return f"{value:,.{digits}f}{unit}" if abs(value) >= 10_000 else f"{value:.{digits}f}{unit}"


def ago(seconds: float) -> str:
    """How long ago: ``just now``, ``12s ago``, ``3 min ago``, ``2 h ago``."""
    if seconds < 1:
        return "just now"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def flops_rate(value: float | None) -> str:
    """FLOP/s: ``286 TFLOP/s``, ``11.5 GFLOP/s``; "n/a" for unknown."""
    if not isinstance(value, int | float) or not value:
        return NA
    text = si(value)
    return f"{text[:-1]} {text[-1]}FLOP/s" if text[-1].isalpha() else f"{text} FLOP/s"
