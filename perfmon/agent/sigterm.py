"""perfmon's SIGTERM handler in the job, and keeping it out of the script's sight.

Installed only when the script has none at start: on SIGTERM it records the steps so far and the exit, then dies of
the signal as python would. The script never sees it: ``signal.getsignal`` and the previous handler that
``signal.signal`` returns read SIG_DFL while it is perfmon's, as under plain python. A handler that chains the one it
found (PyTorch Lightning's signal connector) therefore chains nothing, and one that restores SIG_DFL and kills itself
dies as it means to. A forked child that inherited it (a DataLoader worker, a ``multiprocessing`` process) dies of
the signal as with SIG_DFL, leaving the parent's recording and discovery files alone.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

_MARK = "__perfmon_sigterm__"


def _real(fn: Any) -> Any:
    return getattr(fn, "__perfmon_original__", fn)


def is_perfmon(handler: Any) -> bool:
    """``handler`` is a perfmon SIGTERM handler (this process's agent's, or one a fork inherited)."""
    return getattr(handler, _MARK, False)


def install(agent: Any, finish: Callable[[Any, dict[str, Any]], None]) -> None:
    """On SIGTERM, when the script has no handler of its own: ``finish(agent, exit_info)``, then die of it."""
    current = _real(signal.getsignal)(signal.SIGTERM)
    if current is not signal.SIG_DFL and not is_perfmon(current):
        return

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != agent.pid:  # a forked child that inherited it: what SIG_DFL does
            _die()
            return
        if _real(signal.getsignal)(signal.SIGTERM) is not handler:
            return  # called by a handler that held on to it somehow: under plain python there was nothing to call
        if agent.defer_while_publishing(lambda: handler(signum, frame)):
            return  # it landed inside publish(): finish when that returns, or the publisher's steps are lost
        finish(agent, {"code": None, "signal": "SIGTERM", "exception": None, "traceback": None})
        _die()

    setattr(handler, _MARK, True)
    try:
        _real(signal.signal)(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return
    _hide()


#: signals whose default action ends the process
_FATAL = frozenset(getattr(signal, name) for name in (
    "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGABRT", "SIGKILL", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGPIPE")
    if hasattr(signal, name))


def install_self_kill(agent: Any, finish: Callable[[Any, dict[str, Any]], None]) -> None:
    """A script that kills itself with a signal it left at SIG_DFL (a preemption handler that restores SIG_DFL and
    signals itself again, as chaining code does when it found no handler to call) dies at once, as under plain
    python; its steps so far and the exit are recorded first, as for ``os._exit``."""
    if getattr(os.kill, "__perfmon_original__", None) is not None and os.getpid() == getattr(
            os.kill, "__perfmon_pid__", None):
        return
    real_kill = _real(os.kill)

    def kill(pid: int, sig: int) -> None:
        if pid in (0, os.getpid()) and os.getpid() == agent.pid:
            try:
                if sig in _FATAL and _real(signal.getsignal)(sig) is signal.SIG_DFL:
                    name = signal.Signals(sig).name
                    finish(agent, {"code": None, "signal": name, "exception": None, "traceback": None})
            except Exception:  # noqa: BLE001, S110 - the script asked to die now: nothing may stop it
                pass
        real_kill(pid, sig)

    kill.__doc__, kill.__name__, kill.__qualname__ = real_kill.__doc__, real_kill.__name__, real_kill.__qualname__
    kill.__perfmon_original__ = real_kill  # type: ignore[attr-defined]
    kill.__perfmon_pid__ = os.getpid()  # type: ignore[attr-defined]
    os.kill = kill


def reset_inherited() -> None:
    """In a forked child starting an agent of its own: the inherited handler goes (the child's own replaces it)."""
    if is_perfmon(_real(signal.getsignal)(signal.SIGTERM)):
        try:
            _real(signal.signal)(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass


def _die() -> None:
    _real(signal.signal)(signal.SIGTERM, signal.SIG_DFL)
    _real(os.kill)(os.getpid(), signal.SIGTERM)


def _hide() -> None:
    """``signal.getsignal`` and ``signal.signal`` report SIG_DFL where perfmon's handler is."""
    if getattr(signal.getsignal, "__perfmon_original__", None) is not None:
        return
    real_get, real_set = signal.getsignal, signal.signal

    def getsignal(signalnum: Any) -> Any:
        handler = real_get(signalnum)
        return signal.SIG_DFL if is_perfmon(handler) else handler

    def signal_(signalnum: Any, handler: Any) -> Any:
        previous = real_set(signalnum, handler)
        return signal.SIG_DFL if is_perfmon(previous) else previous

    for fake, real in ((getsignal, real_get), (signal_, real_set)):
        fake.__doc__, fake.__name__, fake.__qualname__ = real.__doc__, real.__name__, real.__qualname__
        fake.__module__ = real.__module__
        fake.__perfmon_original__ = real  # type: ignore[attr-defined]
    signal.getsignal = getsignal
    signal.signal = signal_
