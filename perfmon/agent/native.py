"""The optional C hot path (``perfmon.agent._hot``), and the pure-Python stand-ins for what it provides.

Where ``_hot`` was built (a C compiler at install) the training thread's hot state lives in C structs that the C
hooks read directly: :class:`HotState` (the base of ``steps.Boundaries``), :class:`CommandFields` (the base of
``commands.Commands``) and the event buffer (:func:`event_buffer`). Python reads and writes the same fields as
attributes, so the rest of perfmon is the same code either way. ``PERFMON_NO_ACCEL=1`` turns all of it off.
"""

from __future__ import annotations

import os
from collections import deque
from itertools import repeat, starmap
from typing import Any


def accelerator() -> Any:
    """The C hot path (``perfmon.agent._hot``), or None: not built here, or ``PERFMON_NO_ACCEL=1``."""
    if os.environ.get("PERFMON_NO_ACCEL"):
        return None
    try:
        from perfmon.agent import _hot
    except ImportError:
        return None
    return _hot


HOT = accelerator()


class _PyHotState:
    """The training thread's hot state, in Python (``_hot.State`` where built)."""

    __slots__ = ("depth", "in_data", "in_root", "in_backward", "train_thread", "prev_thread", "thread_returns",
                 "pending", "explicit",
                 "optimizers_seen", "discovering", "single", "ring", "sink", "commands", "engine_node")

    def __init__(self) -> None:
        self.depth = 0
        self.train_thread = 0  # the thread that trains (the last to run a backward); 0: not known
        self.prev_thread = 0  # the thread that trained before train_thread
        self.thread_returns = 0  # backwards back on the thread before the last one: loops training side by side
        self.in_data = 0  # inside a DataLoader fetch: module calls there are transforms, not the model
        self.in_root = 0  # inside a root's forward: same-class submodules are not roots
        self.in_backward = 0  # inside a backward: module calls there recompute checkpointed activations
        self.pending = False
        self.explicit = False
        self.optimizers_seen = False
        self.discovering = False
        self.single: Any = None
        self.ring: Any = None  # the C hooks' buffer: never set without them
        self.sink: Any = None
        self.commands: Any = None
        self.engine_node: Any = None  # torch._C._current_autograd_node: not None inside the autograd engine


class EventDeque(deque):
    """The event buffer in Python (``_hot.Ring`` where built): a deque with ``drain`` and a ``dropped`` count."""

    dropped = 0

    def drain(self) -> list[Any]:
        """Every event so far, oldest first (popped by a C-level loop: the training thread appends meanwhile)."""
        batch = list(starmap(self.popleft, repeat((), len(self))))
        if len(batch) == self.maxlen:  # full: the oldest may have been dropped (a deque does not count them)
            self.dropped += 1
        return batch


#: the base of ``steps.Boundaries``: its fields are C struct members where the C hot path was built
HotState: type = HOT.State if HOT is not None else _PyHotState
#: the base of ``commands.Commands``: the fields a step's end looks at, in C where built
CommandFields: type = HOT.CommandState if HOT is not None else object


def event_buffer(maxlen: int) -> Any:
    """The agent's event buffer: ``append(event)``, ``drain()``, ``len()``, ``maxlen``, ``dropped``."""
    return HOT.Ring(maxlen) if HOT is not None else EventDeque(maxlen=maxlen)
