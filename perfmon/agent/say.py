"""perfmon's own lines on the job's stderr, which may not take them (a full disk, a closed stream)."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    """Print ``text`` on the job's stderr; a stderr that cannot take it is never an error of the job's."""
    try:
        print(text, file=sys.__stderr__ or sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError, RuntimeError):  # RuntimeError: a signal handler's print inside
        pass  # a print of the same stream ("reentrant call")
