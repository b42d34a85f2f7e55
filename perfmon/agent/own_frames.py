"""The frames perfmon's launcher puts below the script's own, and the script's view of its stack without them.

Under ``python SCRIPT`` the script's module frame is the oldest on the main thread's stack. Under perfmon the
launcher's (runpy, ``python -m perfmon.agent``, the call that runs the script) lie below it, and whatever prints the
stack would print them: ``traceback.print_stack()``, ``logging`` with ``stack_info=True``, ``inspect.stack()``, and
autograd's anomaly mode, whose "Traceback of forward call that caused the error" comes from
``traceback.extract_stack()``. Those read the stack through ``traceback.walk_stack`` and
``inspect.getouterframes``; their stand-ins stop where the launcher's frames begin. (Tracebacks of exceptions
are trimmed where the launcher reports them. Stacks read in C, a profiler's ``with_stack`` or the allocator's
history, still show the launcher's frames.)
"""

from __future__ import annotations

import inspect
import sys
import traceback
from collections.abc import Iterable, Iterator
from types import CodeType, FrameType
from typing import Any

from perfmon.agent.stand_in import replaced, stand_in


def hide(below: Iterable[CodeType]) -> None:
    """Show the script its stack as if it ended at the first frame running one of ``below`` (not included)."""
    if replaced(traceback.walk_stack):
        return
    stop = frozenset(below)
    real_outer = inspect.getouterframes

    def walk_stack(f: FrameType | None) -> Iterator[tuple[FrameType, int]]:
        if f is None:  # the frame traceback's own walk_stack starts from: its generator sits where this one does
            f = sys._getframe().f_back.f_back.f_back.f_back  # type: ignore[union-attr]
        while f is not None and f.f_code not in stop:
            yield f, f.f_lineno
            f = f.f_back

    def getouterframes(frame: FrameType | None, context: int = 1) -> list[Any]:
        out = real_outer(frame, context)
        for i, info in enumerate(out):
            if info.frame.f_code in stop:
                return out[:i]
        return out

    traceback.walk_stack = stand_in(walk_stack, traceback.walk_stack)
    inspect.getouterframes = stand_in(getouterframes, inspect.getouterframes)
