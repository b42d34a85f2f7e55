"""Number formatting shared by the panels: short, fixed-width friendly, "—" for unknown."""

from __future__ import annotations

DASH = "—"


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
