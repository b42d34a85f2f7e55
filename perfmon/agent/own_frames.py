"""The frames perfmon's launcher puts below the script's own, and the script's view of its stack without them.

Under ``python SCRIPT`` the script's module frame is the oldest on the main thread's stack. Under perfmon the
launcher's (runpy, ``python -m perfmon.agent``, the call that runs the script) lie below it, and whatever prints the
stack would print them: ``traceback.print_stack()``, ``logging`` with ``stack_info=True``, ``inspect.stack()``, and
autograd's anomaly mode, whose "Traceback of forward call that caused the error" comes from
``traceback.extract_stack()``. Those read the stack through ``traceback.walk_stack`` and
``inspect.getouterframes``; their stand-ins stop where the launcher's frames begin. pdb (``breakpoint()``) reads
it through ``bdb.Bdb``: its ``where`` lists no launcher frame, ``up`` stops at the script's oldest, and stepping off
the end of the script ends it instead of stepping into the launcher. ``warnings.warn`` with a ``stacklevel`` past
the script's oldest frame names ``sys:1``, as python does, not the launcher's line. (Tracebacks of exceptions
are trimmed where the launcher reports them. Stacks read in C, a profiler's ``with_stack`` or the allocator's
history, still show the launcher's frames.)

perfmon's hook wrappers (``agent/hooks.py``: the root module's ``__call__``, ``torch.save``, a closure) put a frame
of their own between the script's. The same readers skip those frames, a warning's ``stacklevel`` does not count
them, and a caught exception's traceback (``traceback.walk_tb`` and its full-positions twin) has no entry for them.
"""

from __future__ import annotations

import bdb
import inspect
import itertools
import logging
import os
import runpy
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

from perfmon.agent.stand_in import replaced, stand_in

#: runpy's frames between the launcher's call and the module it runs (``-m``, a directory's ``__main__.py``).
#: ``_run_code``, which python's own ``-m`` shows too, is not among them. Compared by identity: a code object's
#: hash is its constants', and dynamo's generated code (a compiled function's resume, on the stack while torch's
#: FakeTensorMode takes ``traceback.extract_stack()``) holds unhashable ones.
_RUNPY = tuple(fn.__code__ for fn in (runpy.run_module, runpy.run_path, runpy._run_module_code))
_launcher: frozenset[FrameType] = frozenset()
#: The files of perfmon's wrappers: the hooks (``agent/hooks.py``; not imported here: it imports torch) and the
#: ``os.kill``/``os._exit`` stand-ins (``agent/exits.py``: a handler raising in a script that signals itself
#: raises through ``kill``) and the import hook that installs the hooks as torch is imported
#: (``agent/bootstrap.py``: a torch that fails to import raises through it), and the writer of the script's stdout
#: and stderr (``agent/output.py``: a print to a broken pipe raises through it). Their frames sit between the script's own (the root module's ``__call__``,
#: ``torch.save``, a closure, ``os.kill``) and are hidden like the launcher's: a warning's ``stacklevel`` and a
#: caught or uncaught exception's traceback count and show the script's frames.
WRAPPER_FILES = frozenset(path for name in ("hooks.py", "exits.py", "bootstrap.py", "output.py")
                          for p in (os.path.join(os.path.dirname(os.path.abspath(__file__)), name),)
                          for path in (p, os.path.realpath(p)))


def _is_wrapper(frame: FrameType) -> bool:
    """``frame`` runs code of perfmon's hook wrappers."""
    return frame.f_code.co_filename in WRAPPER_FILES


def _not_wrapper(item: tuple[FrameType, int]) -> bool:
    return item[0].f_code.co_filename not in WRAPPER_FILES


def _is_launchers(frame: FrameType) -> bool:
    """``frame`` is the launcher's, or runpy's working for the launcher (never for the script's own runpy call)."""
    f: FrameType | None = frame
    while f is not None and _is_runpy(f.f_code):
        f = f.f_back
    return f in _launcher


def _is_runpy(code: Any) -> bool:
    return any(code is c for c in _RUNPY)


def hide(caller: FrameType) -> None:
    """Show the script its stack as if it began above ``caller`` (the launcher's frame that runs it, and every
    frame below it, by identity: a script that calls runpy itself keeps its own runpy frames)."""
    global _launcher
    frames = []
    f: FrameType | None = caller
    while f is not None:
        frames.append(f)
        f = f.f_back
    _launcher = frozenset(frames)
    hide_wrappers()


def hide_wrappers() -> None:
    """Put the stand-ins in place (once): the launcher's frames, where ``hide`` named them, and perfmon's wrapper
    frames, in every process perfmon records (launched, ``perfmon.instrument()``, a spawned rank)."""
    if replaced(traceback.walk_stack):
        return
    real_walk, real_outer = traceback.walk_stack, inspect.getouterframes

    def walk_stack(f: FrameType | None) -> Iterator[tuple[FrameType, int]]:
        # takewhile and filter are C: the real generator is resumed from the same Python frame as without the
        # stand-in, so its own start (walk_stack(None) counts frames back from itself) is unchanged, on every Python
        return itertools.takewhile(lambda item: not _is_launchers(item[0]), filter(_not_wrapper, real_walk(f)))

    def getouterframes(frame: FrameType | None, context: int = 1) -> list[Any]:
        out = real_outer(frame, context)
        for i, info in enumerate(out):
            if _is_launchers(info.frame):
                out = out[:i]
                break
        return [info for info in out if not _is_wrapper(info.frame)]

    traceback.walk_stack = stand_in(walk_stack, real_walk)
    inspect.getouterframes = stand_in(getouterframes, real_outer)
    _hide_from_tracebacks()
    _hide_from_thread_errors()
    _hide_from_debuggers()
    _hide_from_warnings()
    _hide_from_logging()


def _hide_from_logging() -> None:
    """``logging``'s ``stacklevel`` (``logger.info(..., stacklevel=2)`` in a helper called from ``forward``) skips
    its own frames as internal (Python 3.11+): a wrapper's frame is one more."""
    real = getattr(logging, "_is_internal_frame", None)
    if real is None or replaced(real):
        return

    def is_internal_frame(frame: FrameType) -> bool:
        return frame.f_code.co_filename in WRAPPER_FILES or real(frame)

    logging._is_internal_frame = stand_in(is_internal_frame, real)  # type: ignore[attr-defined]


def _hide_from_tracebacks() -> None:
    """A caught exception's traceback, as ``traceback.print_exc``, ``format_exc``, ``logging.exception`` and
    ``TracebackException`` read it (through these two generators): no entry for a wrapper's frame, as under
    python, where the exception never passed through one. (An uncaught one is trimmed where it is reported.)"""
    for name in ("walk_tb", "_walk_tb_with_full_positions"):
        real = getattr(traceback, name, None)
        if real is None or replaced(real):
            continue

        def walk(tb: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Iterator[Any]:
            return filter(_not_wrapper, _real(tb, *args, **kwargs))

        setattr(traceback, name, stand_in(walk, real))


def without_wrapper_frames(tb: TracebackType | None) -> TracebackType | None:
    """The same traceback without the frames of perfmon's wrappers (a Dataset error raised through the
    DataLoader wrapper, Ctrl-C during backward): what plain python would print."""
    kept = []
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) not in WRAPPER_FILES:
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(kept):
        out = TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


def trim_chain(exc: BaseException, top: Callable[[TracebackType | None], TracebackType | None] | None = None) -> None:
    """Drop wrapper frames from the traceback of ``exc`` and of the exceptions it chains (``raise ... from``,
    during handling); ``top`` trims ``exc``'s own instead (the launcher's frames too)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = (top if top is not None and e is exc else without_wrapper_frames)(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _hide_from_thread_errors() -> None:
    """An exception a thread leaves uncaught: python's own ``threading.excepthook`` prints its traceback in C,
    past the stand-ins above; this one hands it the traceback without wrapper frames (a forward raising in a
    training thread passed through the root module's ``__call__``)."""
    real = threading.excepthook
    if replaced(real):
        return

    def excepthook(args: Any, /) -> Any:
        exc = args.exc_value
        if isinstance(exc, BaseException):  # python prints the traceback each exception of the chain holds
            trim_chain(exc)
            args = threading.ExceptHookArgs((args.exc_type, exc, exc.__traceback__, args.thread))
        return real(args)

    threading.excepthook = stand_in(excepthook, real)


def _hide_from_debuggers() -> None:
    """pdb, and every debugger built on bdb: the stack it shows, and where it stops tracing. Done in
    ``get_stack``, which a debugger calls from inside its trace function (where nothing is traced) as it stops."""
    real_get_stack = bdb.Bdb.get_stack

    def get_stack(self: bdb.Bdb, f: FrameType | None, t: Any) -> tuple[list[Any], int]:
        bottom, below = None, f
        while below is not None and not _is_launchers(below):
            bottom, below = below, below.f_back
        if bottom is not None and below is not None and self.botframe is not None and _is_launchers(self.botframe):
            # set_trace() made the launcher's oldest frame the bottom: as under python, the script's oldest is,
            # and nothing below it is traced (stepping off the script's end ends it)
            self.botframe = bottom
            while below is not None:
                below.f_trace = None
                below = below.f_back
        stack, i = real_get_stack(self, f, t)
        k = 0
        while k < len(stack) and _is_launchers(stack[k][0]):  # oldest first: the launcher's come first
            k += 1
        return stack[k:], max(0, i - k)

    bdb.Bdb.get_stack = stand_in(get_stack, real_get_stack)  # type: ignore[method-assign]


def _count_back(frame: FrameType, stacklevel: int) -> tuple[bool, int]:
    """``stacklevel`` counted from ``frame`` (1: ``frame``) the way python's warnings count it (importlib's own
    frames skipped), perfmon's wrapper frames not counted: whether it goes below the script's oldest frame, and
    how many wrapper frames it passed (what python must count on top to land on the same frame)."""
    f: FrameType | None = frame
    wrappers = 0
    for _ in range(stacklevel - 1):
        assert f is not None
        f = f.f_back
        while f is not None and ("importlib" in f.f_code.co_filename and "_bootstrap" in f.f_code.co_filename
                                 or f.f_code.co_filename in WRAPPER_FILES):
            wrappers += f.f_code.co_filename in WRAPPER_FILES
            f = f.f_back
        if f is None or _is_launchers(f):
            return True, wrappers
    return False, wrappers


def _hide_from_warnings() -> None:
    """A warning whose ``stacklevel`` reaches past the script's stack: python, finding no frame there, names
    ``sys:1`` (and keeps its once-registry in ``sys``); the launcher's frames are no place to name."""
    real_warn = warnings.warn

    def warn(message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kwargs: Any) -> None:
        wrappers = 0
        if isinstance(stacklevel, int) and stacklevel > 1 and not kwargs:
            past, wrappers = _count_back(sys._getframe(1), stacklevel)
            if past:
                if isinstance(message, Warning):
                    category = type(message)
                registry = sys.__dict__.setdefault("__warningregistry__", {})
                warnings.warn_explicit(message, category or UserWarning, "sys", 1, module="sys", registry=registry,
                                       source=source)
                return
        # + this frame (python takes a stacklevel below 1 as 1: the caller's), + the wrappers passed on the way
        real_warn(message, category, max(stacklevel, 1) + 1 + wrappers if isinstance(stacklevel, int) else stacklevel,
                  source, **kwargs)

    warnings.warn = stand_in(warn, real_warn)
