"""perfmon's own threads in the job (each named ``perfmon-...``), and the script's view of ``threading`` without them.

Under plain python a script that lists its threads (``threading.enumerate()``, ``active_count()``) sees only its
own; one that joins every thread but its own at the end (to wait for an async checkpoint) would wait forever on
perfmon's, which live as long as the job. So the script's view leaves them out; perfmon reads the real list.
"""

from __future__ import annotations

import threading

from perfmon.agent.stand_in import replaced, stand_in

PREFIX = "perfmon-"
_enumerate = threading.enumerate  # the real list, whatever the script is shown


def native_ids() -> set[int]:
    """The OS thread ids of perfmon's threads (not the trainer's when its CPU wait is read)."""
    return {t.native_id for t in _enumerate() if t.name.startswith(PREFIX) and t.native_id}


def hide() -> None:
    """Show the script ``threading.enumerate()`` and ``active_count()`` without perfmon's threads."""
    if replaced(threading.enumerate):
        return

    def enumerate() -> list[threading.Thread]:  # noqa: A001 - the name the script calls
        return [t for t in _enumerate() if not t.name.startswith(PREFIX)]

    def active_count() -> int:
        return len(enumerate())

    threading.active_count = stand_in(active_count, threading.active_count)
    threading.enumerate = stand_in(enumerate, threading.enumerate)
