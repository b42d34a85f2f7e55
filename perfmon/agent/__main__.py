"""``python -m perfmon.agent [-m MODULE | SCRIPT] ARGS``: run a script under the agent.

The script runs as ``__main__`` exactly as ``python SCRIPT ARGS`` would run it. Settings
come from the environment (the launcher sets them): ``PERFMON_RUN_DIR``.
"""

from __future__ import annotations

import atexit
import builtins
import importlib.machinery
import os
import runpy
import signal
import sys
import traceback
import types
import zipfile
from types import TracebackType

from perfmon import paths, protocol
from perfmon.agent import bootstrap, output, own_frames

USAGE = "usage: python -m perfmon.agent [-m MODULE | SCRIPT] [ARGS...]"


def _trim(tb: TracebackType | None) -> TracebackType | None:
    """Drop perfmon's and runpy's own frames from the top of a traceback."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), os.path.abspath(bootstrap.__file__)}

    def is_ours(name: str) -> bool:
        return name.startswith("<frozen runpy") or os.path.abspath(name) in ours

    while tb is not None and is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return own_frames.without_wrapper_frames(tb)


def run_script(path: str) -> None:
    """Run ``path`` as ``__main__`` the way ``python path`` does (absolute ``__file__``,
    ``__package__`` None, a fresh ``__main__`` module left in place afterwards)."""
    abspath = os.path.abspath(path)
    own_frames.hide(sys._getframe())  # the script's stack begins above this frame
    if os.path.isdir(abspath) or zipfile.is_zipfile(abspath):
        runpy.run_path(abspath, run_name="__main__")  # a dir or zip with __main__.py
        return
    main = types.ModuleType("__main__")
    main.__file__ = abspath
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", abspath)
    main.__builtins__ = builtins
    main.__cached__ = None
    sys.modules["__main__"] = main
    with open(abspath, "rb") as f:
        source = f.read()
    code = compile(source, abspath, "exec", dont_inherit=True)
    # the user's own script, which this launcher exists to run (nothing from a socket or recording)
    exec(code, main.__dict__)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    module = None
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        module, rest = argv[1], argv[2:]
        target = module
    else:
        script, rest = argv[0], argv[1:]
        target = script
        if not (os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))):
            print(f"perfmon: error: can't open file {script!r}: No such file", file=sys.stderr)
            return 2
        if not os.access(script, os.R_OK):
            print(f"perfmon: error: can't read file {script!r}: Permission denied", file=sys.stderr)
            return 2

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass

    agent = bootstrap.start_agent(target, [target, *rest], module=module is not None)
    if agent is not None and os.environ.get(paths.LAUNCHER_ENV):  # fds 1 and 2 are files in the run dir
        output.keep_going_on_full_disk(lambda: agent.warn(output.FULL_DISK))
    exit_info: dict = {"code": 0, "signal": None, "exception": None, "traceback": None}
    # Registered before the script runs, so it runs last: after python has stopped the executors the script left
    # open, waited for its non-daemon threads (training may run in one) and run the script's own atexit handlers.
    atexit.register(_at_exit, agent, exit_info)
    try:
        try:
            _run(module, target, rest)
        finally:
            _flush_io()  # as python does when the script ends: before the error, the exit message or atexit's output
    except SystemExit as exc:
        code = exc.code
        if code is None:
            exit_info["code"] = 0
        elif isinstance(code, int):
            # the status the parent sees: sys.exit(256) exits 0, (-1) 255, and one past a C long (2**100) 255
            exit_info["code"] = int(code) & 0xFF if -2**63 <= int(code) < 2**63 else 255
        else:
            _say_exit_message(code)
            exit_info["code"] = 1
    except KeyboardInterrupt as exc:
        exit_info.update(code=None, signal="SIGINT", exception="KeyboardInterrupt")
        _trim_chain(exc)
        _print_uncaught(exc)  # python hands an uncaught Ctrl-C to sys.excepthook too (rich's, loguru's)
    except ImportError as exc:
        if module is not None and _trim(exc.__traceback__) is None:
            # runpy's own: no such module (``pkg.missing`` too, once ``pkg`` imported), or a package without a
            # ``__main__``: one line and exit status 1, as python's ``-m`` says it (a launcher reports the status:
            # accelerate's "returned non-zero exit status 1"), not a traceback through runpy
            print(f"{sys.executable}: {exc}", file=sys.stderr)
            exit_info.update(code=1, exception=f"ImportError: {exc}")
        else:
            exit_info.update(_exception_info(exc))
    except BaseException as exc:  # noqa: BLE001 - report it exactly as python would
        exit_info.update(_exception_info(exc))
    return int(exit_info["code"] or 0)


def _run(module: str | None, target: str, rest: list[str]) -> None:
    """Run the module (``-m``, ``target`` is its name) or the script at ``target``, as python would, with ``rest``
    as its arguments."""
    if module is not None:
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file
        if not getattr(sys.flags, "safe_path", False):  # PYTHONSAFEPATH=1: python puts no folder first
            sys.path[0] = os.getcwd()
        own_frames.hide(sys._getframe())  # the module's stack begins above this frame (and runpy's for it)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *rest]
        if not getattr(sys.flags, "safe_path", False):  # PYTHONSAFEPATH=1: not the script's folder either
            sys.path[0] = os.path.dirname(os.path.realpath(target))  # python resolves symlinks here
        run_script(target)


def _flush_io() -> None:
    """Flush ``sys.stderr`` and ``sys.stdout`` as python does once the script's code returns or raises (its
    ``flush_io``): a partial line comes before the traceback, and is not lost where a Ctrl-C ends the process by
    SIGINT before python's last flush. An error of the flush is dropped, as python drops it."""
    for name in ("stderr", "stdout"):
        stream = getattr(sys, name, None)
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: python goes on too
            pass


def _at_exit(agent: bootstrap.Agent | None, exit_info: dict) -> None:
    """The process is ending as python ends it: record the exit; a Ctrl-C then dies of SIGINT, as python does, so
    the parent sees a signal exit (128+2). A child the script forked, ending through here too, leaves it alone."""
    if agent is not None and os.getpid() != agent.pid:
        return
    bootstrap.finish_agent(agent, exit_info)
    if exit_info["signal"] == "SIGINT":
        _flush_io()  # what the atexit handlers printed: python flushes it before it dies of the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _trim_chain(exc: BaseException) -> None:
    """Trim the traceback of ``exc`` (launcher and wrapper frames) and of the exceptions it chains."""
    own_frames.trim_chain(exc, top=_trim)


def _say_exit_message(message: object) -> None:
    """``sys.exit("message")``: the message on stderr, as python prints it, on fd 2 where ``sys.stderr`` is None."""
    if sys.stderr is not None:
        print(message, file=sys.stderr)
        return
    try:
        os.write(2, f"{message}\n".encode(errors="backslashreplace"))
    except OSError:
        pass


def _print_uncaught(exc: BaseException) -> str:
    """Hand ``exc`` to ``sys.excepthook`` as python does with an uncaught exception; returns its traceback text."""
    tb = exc.__traceback__  # the default excepthook prints the exception's own traceback
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # noqa: BLE001
        sys.stderr.write(text)
    return text


def _exception_info(exc: BaseException) -> dict:
    _trim_chain(exc)
    text = _print_uncaught(exc)
    message = protocol.exception_line("".join(traceback.format_exception_only(type(exc), exc))) or type(exc).__name__
    return {"code": 1, "exception": message[:500], "traceback": text[-20000:]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
