"""The ways a job ends that python's own exit does not see, each recorded before it happens: SIGTERM, the script
killing itself with a signal, ``os._exit``, ``os.exec*`` (the script replacing itself with another program).

perfmon's SIGTERM handler is installed only when the script has none at start: on SIGTERM it records the steps so
far and the exit, then dies of the signal as python would. The script never sees it: ``signal.getsignal`` and the previous handler that
``signal.signal`` returns read SIG_DFL while it is perfmon's, as under plain python. A handler that chains the one it
found (PyTorch Lightning's signal connector) therefore chains nothing, and one that restores SIG_DFL and kills itself
dies as it means to. A forked child (a DataLoader worker, a ``multiprocessing`` process) starts with SIG_DFL, as
under plain python, leaving the parent's recording and discovery files alone.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from perfmon import paths
from perfmon.agent.stand_in import original, replaced, stand_in

_MARK = "__perfmon_sigterm__"


def is_perfmon(handler: Any) -> bool:
    """``handler`` is a perfmon SIGTERM handler (this process's agent's, or one a fork inherited)."""
    return getattr(handler, _MARK, False)


def install_sigterm(agent: Any, finish: Callable[[Any, dict[str, Any]], None]) -> None:
    """On SIGTERM, when the script has no handler of its own: ``finish(agent, exit_info)``, then die of it."""
    current = original(signal.getsignal)(signal.SIGTERM)
    if current is not signal.SIG_DFL and not is_perfmon(current):
        return

    claim = threading.Lock()  # who finishes: the handler, or the watcher where the main thread is held in C code
    exit_info = {"code": None, "signal": "SIGTERM", "exception": None, "traceback": None}

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != agent.pid:  # a forked child that inherited it: what SIG_DFL does
            _die()
            return
        if original(signal.getsignal)(signal.SIGTERM) is not handler:
            return  # called by a handler that held on to it somehow: under plain python there was nothing to call
        if agent.defer_while_publishing(lambda: handler(signum, frame)):
            return  # it landed inside publish(): finish when that returns, or the publisher's steps are lost
        if not claim.acquire(blocking=False):
            return  # the watcher is finishing: it ends the process
        finish(agent, exit_info)
        _die()

    setattr(handler, _MARK, True)
    try:
        original(signal.signal)(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return
    _watch(agent, lambda: original(signal.getsignal)(signal.SIGTERM) is handler and claim.acquire(blocking=False),
           lambda: finish(agent, exit_info))
    global _reset_at_fork
    if not _reset_at_fork:
        # A forked child gets SIG_DFL at once, as under plain python: with a Python-level handler a SIGTERM that
        # lands just before a blocking C call (a Pool worker's sem_wait: Pool.terminate() sends it) only set a flag,
        # and the worker, then Pool.__exit__'s join, waited forever
        os.register_at_fork(after_in_child=reset_inherited)
        _reset_at_fork = True
    _hide()


_reset_at_fork = False

#: How long the watcher leaves a SIGTERM to the main thread's handler before it finishes the job itself.
SIGTERM_GRACE_S = 0.5
_wakeup: list[int] = []  # the write end of the watcher's pipe, while it is python's wakeup fd


def _watch(agent: Any, claim: Callable[[], bool], finish: Callable[[], None]) -> None:
    """A thread that finishes the job on SIGTERM where the main thread cannot. Python runs a signal handler on the
    main thread at its next bytecode; a main thread held in a C call that retries on EINTR (a rank waiting for its
    peers in ``init_process_group``, a store's wait, a hung collective) never gets there, while plain python dies at
    once: torchrun then waited its 30 s and sent SIGKILL. Python's wakeup fd tells this thread that a signal came;
    if the handler has not taken it within SIGTERM_GRACE_S, the thread records the exit and dies of SIGTERM. Not
    where the script or a library set a wakeup fd already, or once the script has a SIGTERM handler of its own. It
    blocks in a read: no wake-up costs the job anything until a signal comes."""
    try:
        r, w = os.pipe()
    except OSError:
        return
    try:
        os.set_blocking(w, False)
        previous = original(signal.set_wakeup_fd)(w, warn_on_full_buffer=False)
    except (OSError, ValueError):  # not the main thread
        os.close(r)
        os.close(w)
        return
    if previous != -1:  # someone else's: theirs it stays
        original(signal.set_wakeup_fd)(previous)
        os.close(r)
        os.close(w)
        return
    _wakeup[:] = [w]

    def run() -> None:
        while True:
            try:
                got = os.read(r, 512)
            except OSError:
                return
            if not got:
                return
            if signal.SIGTERM not in got or os.getpid() != agent.pid:
                continue
            threading.Event().wait(SIGTERM_GRACE_S)
            if claim():  # the handler has not run: the main thread is held in C code
                try:
                    finish()
                finally:
                    _die_from_any_thread()

    threading.Thread(target=run, name="perfmon-sigterm", daemon=True).start()


#: signals whose default action ends the process
_FATAL = frozenset(getattr(signal, name) for name in (
    "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGABRT", "SIGKILL", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGPIPE")
    if hasattr(signal, name))


def install_self_kill(agent: Any, finish: Callable[[Any, dict[str, Any]], None]) -> None:
    """A script that kills itself with a signal it left at SIG_DFL (a preemption handler that restores SIG_DFL and
    signals itself again, as chaining code does when it found no handler to call) dies at once, as under plain
    python; its steps so far and the exit are recorded first, as for ``os._exit``."""
    real_kill = original(os.kill)

    def kill(pid: int, sig: int) -> None:
        if pid in (0, os.getpid()) and os.getpid() == agent.pid:
            try:
                if sig in _FATAL and original(signal.getsignal)(sig) is signal.SIG_DFL:
                    finish(agent, {"code": None, "signal": signal.Signals(sig).name, "exception": None,
                                   "traceback": None})
            except Exception:  # noqa: BLE001, S110 - the script asked to die now: nothing may stop it
                pass
        real_kill(pid, sig)

    os.kill = stand_in(kill, real_kill)


def install_os_exit(agent: Any, finish: Callable[[Any, dict[str, Any]], None]) -> None:
    """``os._exit(code)`` runs no ``finally`` and no ``atexit``: scripts call it to skip a slow teardown (the end of
    many distributed jobs) or from a watchdog. In the process the agent started in, the steps so far and the exit
    are recorded first; a forked child (a DataLoader worker, ``multiprocessing``) leaves with it too and stays
    silent, as does a call that python itself would refuse (not an int)."""
    real_exit = original(os._exit)

    def _exit(code: int) -> NoReturn:
        if isinstance(code, int) and os.getpid() == agent.pid:
            os._exit = real_exit
            try:
                finish(agent, {"code": code, "signal": None, "exception": None, "traceback": None})
            except BaseException:  # noqa: BLE001, S110 - the script asked to leave now: nothing may stop it
                pass
        real_exit(code)

    os._exit = stand_in(_exit, real_exit)


def install_exec(agent: Any) -> None:
    """``os.execv``/``os.execve`` (and the ``exec*`` functions built on them) replace the job with another program:
    no ``atexit`` runs, and the steps not yet flushed were lost. In the process the agent started in, the steps so far
    are recorded first, with no exit record (``agent.before_exec()``): the new program's end is the job's, and the
    launcher, its parent, records it; perfmon does not follow into the new program. An exec that fails (a bad
    ``#!`` line) leaves the script, and perfmon, going on (``agent.exec_failed``)."""
    real_execv, real_execve = original(os.execv), original(os.execve)

    def leave(path: Any, argv: Any) -> bool:
        if os.getpid() != agent.pid or not _can_exec(path, argv):  # a forked child's exec (fork + exec), or one
            return False  # bound to fail (os.execvp tries each PATH entry): the job goes on
        agent.before_exec(_program(path))
        return True

    def execv(path: Any, argv: Any, /) -> NoReturn:
        left = leave(path, argv)
        try:
            real_execv(path, argv)
        except BaseException as exc:
            if left:
                agent.exec_failed(exc)
            raise

    def execve(path: Any, argv: Any, env: Any) -> NoReturn:
        left = leave(path, argv)
        try:
            real_execve(path, argv, env)
        except BaseException as exc:
            if left:
                agent.exec_failed(exc)
            raise

    os.execv = stand_in(execv, real_execv)
    os.execve = stand_in(execve, real_execve)


def _program(path: Any) -> str | None:
    """The new program's name, as the job's status says it."""
    try:
        return os.path.basename(os.fsdecode(path)) or None
    except (TypeError, ValueError):
        return None


def _can_exec(path: Any, argv: Any) -> bool:
    """The checks the exec call makes before it replaces the process, as far as they can be made beforehand."""
    try:
        if not isinstance(argv, (list, tuple)) or not argv or not argv[0]:
            return False
        return isinstance(path, int) or (os.path.isfile(path) and os.access(path, os.X_OK))
    except (TypeError, ValueError, OSError):
        return False


def install_own_session(agent: Any) -> None:
    """perfmon starts the job as the leader of a session of its own (a terminal's hang-up or Ctrl-C reaches it only
    through perfmon); python started from a shell leads a process group in the shell's session, where
    ``os.setpgrp()`` and ``os.setpgid(0, 0)`` succeed (a script that means to ``killpg`` its children at the end
    calls them first) and fail with EPERM in a session leader. The job already is what they ask for, the leader
    of a process group of its own, and so of a session (``os.setsid()``): in the process perfmon started, they
    succeed and change nothing."""
    if not paths.launched_alone() or os.getsid(0) != os.getpid():
        return
    real_setpgid, real_setpgrp, real_setsid = os.setpgid, os.setpgrp, os.setsid

    def leads(pid: int) -> bool:
        return pid in (0, agent.pid) and os.getpid() == agent.pid and os.getsid(0) == agent.pid

    def setpgid(pid: int, pgrp: int, /) -> None:
        if leads(pid) and pgrp in (0, agent.pid):
            return None
        return real_setpgid(pid, pgrp)

    def setpgrp() -> None:
        return None if leads(0) else real_setpgrp()

    def setsid() -> None:
        return None if leads(0) else real_setsid()

    os.setpgid = stand_in(setpgid, real_setpgid)
    os.setpgrp = stand_in(setpgrp, real_setpgrp)
    os.setsid = stand_in(setsid, real_setsid)


def reset_inherited() -> None:
    """In a forked child starting an agent of its own: the inherited handler goes (the child's own replaces it), and
    so does the parent's wakeup fd (a signal the child handles would read, to the parent's watcher, as its own)."""
    try:
        if is_perfmon(original(signal.getsignal)(signal.SIGTERM)):
            original(signal.signal)(signal.SIGTERM, signal.SIG_DFL)
        if _wakeup:
            previous = original(signal.set_wakeup_fd)(-1)
            if previous not in (_wakeup[0], -1):
                original(signal.set_wakeup_fd)(previous)  # the script's own, set since: a fork keeps it, as under plain python
    except ValueError:  # not the main thread
        pass


def _die() -> None:
    original(signal.signal)(signal.SIGTERM, signal.SIG_DFL)
    original(os.kill)(os.getpid(), signal.SIGTERM)


def _die_from_any_thread() -> None:
    """Die of SIGTERM from a thread that is not the main one, where ``signal.signal`` refuses: SIG_DFL through libc
    (SIGKILL where that cannot be done: the process must end)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL
        original(os.kill)(os.getpid(), signal.SIGTERM)
        threading.Event().wait(2.0)
    finally:
        original(os.kill)(os.getpid(), signal.SIGKILL)


def _hide() -> None:
    """``signal.getsignal`` and ``signal.signal`` report SIG_DFL where perfmon's handler is, and
    ``signal.set_wakeup_fd`` no fd (-1) where the watcher's was."""
    if replaced(signal.getsignal):
        return
    real_get, real_set = signal.getsignal, signal.signal

    def getsignal(signalnum: Any) -> Any:
        handler = real_get(signalnum)
        return signal.SIG_DFL if is_perfmon(handler) else handler

    def signal_(signalnum: Any, handler: Any) -> Any:
        previous = real_set(signalnum, handler)
        return signal.SIG_DFL if is_perfmon(previous) else previous

    signal.getsignal = stand_in(getsignal, real_get)
    signal.signal = stand_in(signal_, real_set)
    real_wakeup = signal.set_wakeup_fd

    def set_wakeup_fd(fd: int, /, *, warn_on_full_buffer: bool = True) -> int:
        previous = real_wakeup(fd, warn_on_full_buffer=warn_on_full_buffer)
        return -1 if _wakeup and previous == _wakeup[0] else previous  # the watcher's: none, as under plain python

    signal.set_wakeup_fd = stand_in(set_wakeup_fd, real_wakeup)
