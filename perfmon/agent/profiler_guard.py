"""The torch.profiler sessions the script runs itself, so that perfmon's windows never spoil them.

Kineto records one session per process. A perfmon window that is open when the script's own profiler begins (its
schedule's warm-up, or ``with torch.autograd.profiler.profile()``) leaves the script's ``key_averages()`` empty, and
the script's session would end perfmon's. The script comes first: perfmon's window stops before the script's session
begins, and none starts while one of the script's is open. The hooks report the script's sessions here (the legacy
profiler object that every torch.profiler session runs on: from its ``_prepare_trace`` to its ``__exit__``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class ScriptProfilers:
    """Open profiler sessions of the script's own (perfmon's windows excluded)."""

    def __init__(self, on_open: Callable[[], None] = lambda: None) -> None:
        #: called on the thread that opens the script's session, before it begins: perfmon's window gives way
        self.on_open = on_open
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()  # a session dropped unclosed stops counting
        self._own = threading.local()

    @contextmanager
    def own(self) -> Iterator[None]:
        """perfmon's own profiler calls (its windows) on this thread: not the script's."""
        self._own.active = True
        try:
            yield
        finally:
            self._own.active = False

    def _mine(self) -> bool:
        return getattr(self._own, "active", False)

    def opening(self, session: Any) -> None:
        """A profiler session is about to begin (``_prepare_trace``)."""
        if self._mine() or session in self._open:
            return
        self.on_open()
        self._open.add(session)

    def closed(self, session: Any) -> None:
        """A profiler session ended (``__exit__``)."""
        self._open.discard(session)

    @property
    def busy(self) -> bool:
        """The script has a session open: perfmon's windows wait."""
        return len(self._open) > 0
