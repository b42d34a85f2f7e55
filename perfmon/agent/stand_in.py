"""A function perfmon puts in the place of a Python one the script can see (``os._exit``, ``os.kill``,
``signal.getsignal``, ``threading.enumerate``...): it answers to the same name, and the real one stays reachable."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def stand_in(fake: F, real: Callable[..., Any]) -> F:
    """``fake`` with ``real``'s name, qualified name, doc and module; ``real`` kept as ``__perfmon_original__``."""
    functools.update_wrapper(fake, real, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    fake.__perfmon_original__ = real  # type: ignore[attr-defined]
    return fake


def original(fn: Any) -> Any:
    """What ``fn`` stands in for (``fn`` itself when perfmon put nothing in its place)."""
    return getattr(fn, "__perfmon_original__", fn)


def replaced(fn: Any) -> bool:
    """perfmon already put a stand-in in this place."""
    return getattr(fn, "__perfmon_original__", None) is not None
