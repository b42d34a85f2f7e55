"""perfmon: a live performance monitor for PyTorch training, in the terminal.

Public API for loops the automatic hooks cannot see; every call is a no-op (and cheap)
when the script runs without perfmon::

    import perfmon
    for batch in batches:
        with perfmon.phase("data"):
            x = next_batch()
        ...
        perfmon.step()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from perfmon import _api

__version__ = "0.1.0"
__all__ = ["step", "phase", "__version__"]

_PHASES = frozenset({"data", "forward", "backward", "optimizer"})


def step() -> None:
    """Mark the end of a training step. From the first call on, only explicit calls end steps."""
    agent = _api.get_agent()
    if agent is not None:
        agent.emit(2, None)  # steps.STEP
        agent.boundary()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed block as phase ``name`` (data, forward, backward or optimizer)."""
    if name not in _PHASES:
        raise ValueError(f"unknown phase {name!r}; expected one of {sorted(_PHASES)}")
    agent = _api.get_agent()
    if agent is None:
        yield
        return
    agent.emit(0, name)  # steps.BEGIN
    try:
        yield
    finally:
        agent.emit(1, name)  # steps.END
