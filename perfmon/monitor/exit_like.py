"""perfmon ends as its job ended: with its exit code, or of the signal that killed it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Collection
from typing import NoReturn

# Signals whose default action dumps core: perfmon re-raising one must not leave a core file of its own.
_CORE_DUMPING = frozenset(getattr(signal, name) for name in (
    "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV", "SIGSYS", "SIGXCPU", "SIGXFSZ")
    if hasattr(signal, name))


class DiedOf(int):
    """The shell's 128+N for a job that died of signal N, which keeps N: ``perfmon`` then dies of N itself, so a
    parent sees what it sees of plain python (``returncode == -N``; an interactive shell prints "Terminated")."""

    signum: int

    def __new__(cls, signum: int) -> DiedOf:
        status = super().__new__(cls, 128 + signum)
        status.signum = signum
        return status


def exit_status(returncode: int, sent: Collection[int] = ()) -> int:
    """What perfmon exits with for a job that ended with ``returncode`` (Popen's: -N for signal N). A signal that
    perfmon ``sent`` on its own (the SIGTERM, then SIGKILL, of a repeated stop) is an exit status, 128+N: perfmon
    dying of SIGKILL would read as an out-of-memory kill."""
    if returncode >= 0:
        return returncode
    return 128 - returncode if -returncode in sent else DiedOf(-returncode)


def exit_like(status: int) -> NoReturn:
    """Exit with ``status``; a ``DiedOf`` dies of its signal, as GNU ``timeout`` does for the command it ran (no
    core file: perfmon did not crash)."""
    if not isinstance(status, DiedOf):
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signum = status.signum
    try:
        if signum in _CORE_DUMPING:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    except (OSError, ValueError):
        pass
    os._exit(int(status))  # a signal whose default is not to end the process (never seen: the job died of it)
