"""What the dashboard watches: a launched job, an attached one or a recording; and so what its keys may do."""

from __future__ import annotations

from collections.abc import Callable

from perfmon.monitor.sources import PacedReplaySource, ReplaySource, Source
from perfmon.tui.widgets import fmt

LAUNCHED = "launched"
REPLAY = ReplaySource.mode


class Mode:
    """Decided once from the source (its ``mode``) and whether perfmon launched the job."""

    def __init__(self, source: Source | None, launched: bool) -> None:
        self.source = source
        self.launched = launched
        #: ``launched``, ``attached``, ``replay``, or "" for a source that does not say.
        self.name = LAUNCHED if launched else source.mode if source is not None else ""
        #: A replay played in time: the replay keys (space + - [ ]) work, and its clock is the dashboard's.
        self.player = source if isinstance(source, PacedReplaySource) else None

    @property
    def connected(self) -> bool:
        """An agent at the other end of the source takes commands now."""
        return bool(getattr(self.source, "connected", False))

    def live(self, job_ended: bool) -> bool:
        """Watching a running job, not a recording: commands and detach mean something (a live
        connection that dropped keeps its keys, and says "not connected" when one is pressed)."""
        if job_ended:
            return False
        return self.launched or self.name != REPLAY or self.connected

    def now(self, clock: Callable[[], float]) -> float:
        """The time the dashboard shows: the replay clock (recording time) in a paced replay, else
        ``clock()``."""
        if self.player is not None and self.player.position is not None:
            return self.player.position
        return clock()

    def label(self, start: float | None) -> str:
        """What the header says: the name; for a paced replay its speed, ⏸ or ▶, and where it is."""
        player = self.player
        if player is None:
            return self.name
        where = "end" if player.at_end else fmt.duration((player.position or 0) - (start or 0))
        return f"replay {player.speed:g}x {'⏸' if player.paused else '▶'} {where}"
