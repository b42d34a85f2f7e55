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

from perfmon import _api, protocol

__version__ = "0.1.0"
__all__ = ["step", "phase", "instrument", "__version__"]

_PHASES = frozenset(protocol.PHASES)


def step() -> None:
    """Mark the end of a training step. From the first call on, only explicit calls end steps."""
    agent = _api.get_agent()
    if agent is not None:
        agent.step()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed block as phase ``name`` (data, forward, backward or optimizer)."""
    if name not in _PHASES:
        raise ValueError(f"unknown phase {name!r}; expected one of {sorted(_PHASES)}")
    agent = _api.get_agent()
    if agent is None:
        yield
        return
    agent.begin(name)
    try:
        yield
    finally:
        agent.end(name)


def instrument(run_dir: str | None = None) -> None:
    """Start the agent in this process (for scripts not started by ``perfmon``), so that
    ``perfmon attach`` works. Idempotent; the recording goes to ``run_dir`` (default
    ``./perfmon-runs/<time>-<script>/``); it is finished when the interpreter exits."""
    import atexit
    import os
    import sys

    inherited = _api.get_agent()
    if inherited is not None and getattr(inherited, "pid", os.getpid()) == os.getpid():
        return
    from perfmon.agent import bootstrap

    if inherited is not None:  # a forked child (multiprocessing's fork): its parent's agent came along, silenced
        bootstrap.forget_inherited(inherited)

    if run_dir:
        os.environ["PERFMON_RUN_DIR"] = str(run_dir)
    script = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    agent = bootstrap.start_agent(script, list(sys.argv))
    if agent is None:
        return

    def _finish() -> None:
        exc = getattr(sys, "last_value", None)
        info = {"code": 1 if exc else 0, "signal": None, "traceback": None,
                "exception": f"{type(exc).__name__}: {exc}" if exc else None}
        bootstrap.finish_agent(agent, info)

    atexit.register(_finish)
