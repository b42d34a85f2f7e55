"""Starting the training process under the agent, and ending it on the user's word.

The job runs in its own session (a terminal hang-up does not reach it), its stdout goes to
``RUN/output.log`` and its stderr to ``RUN/stderr.log`` (both to ``output.log``, in the order written, where
headless perfmon's own stdout and stderr are one file: a terminal, ``> log 2>&1``); its stdin is perfmon's when headless, else /dev/null
(the dashboard owns the terminal). The monitor is only
a reader: if it dies, the job goes on and its recording stays complete. Signals sent to perfmon that
would have reached the script under plain python (SIGTERM, SIGUSR1, SIGUSR2) are passed on to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfmon import paths, protocol
from perfmon.analysis.state import RunState
from perfmon.monitor.host_feed import HostFeed
from perfmon.recording import ends_with_exit, tail_bytes
from perfmon.tail import hold as hold_for_tails


class LaunchError(Exception):
    """Bad target or options: one line for the user, exit status 2."""


#: The launchers perfmon follows every rank of: what follows ``perfmon`` on the command line, and the module that
#: runs it with the agent around each worker.
LAUNCHERS = {"torchrun": "perfmon.agent.torchrun", "accelerate": "perfmon.agent.accelerate_launch"}


@dataclass
class Target:
    script: str | None
    module: str | None
    args: list[str] = field(default_factory=list)
    #: ``perfmon torchrun ...`` or ``perfmon accelerate launch ...``: ``args`` are the launcher's whole command
    #: line after its name (its options, script, script args); its workers record as ranks.
    launcher: str | None = None

    @property
    def torchrun(self) -> bool:
        return self.launcher == "torchrun"

    @property
    def ranked(self) -> bool:
        """The job is a launcher's workers, each recording as a rank (``RUN/rank-K/``)."""
        return self.launcher is not None

    @property
    def name(self) -> str:
        if self.launcher is not None:
            found = launcher_script(self.launcher, self.args)
            return found[0] if found else self.launcher
        return self.module or self.script or "run"

    def agent_argv(self) -> list[str]:
        head = ["-m", self.module] if self.module else [self.script or ""]
        return [*head, *self.args]

    def command(self, python: str) -> list[str]:
        """The job's command line: the agent around the script, or the launcher with the agent around each
        worker."""
        if self.launcher is not None:
            return [python, "-m", LAUNCHERS[self.launcher], *self.args]
        return [python, "-m", "perfmon.agent", *self.agent_argv()]


def launcher_script(launcher: str, argv: list[str]) -> tuple[str, bool] | None:
    """The script (or module: True) a launcher's command line names, or None."""
    return torchrun_script(argv) if launcher == "torchrun" else accelerate_script(argv)


def accelerate_script(argv: list[str]) -> tuple[str, bool] | None:
    """The script (or ``-m`` module) in an ``accelerate launch ...`` command line (``argv`` from ``launch``):
    the first word that names a ``.py`` file, else the word after ``-m``. For the run dir's name and early
    checks only: the job parses the line with accelerate's own parser, whose options this does not know."""
    words = argv[1:] if argv[:1] == ["launch"] else argv
    for i, word in enumerate(words):
        if word == "--":
            break
        if word.endswith(".py") and not word.startswith("-") and not (i and words[i - 1].startswith("--config")):
            return word, False
        if word in ("-m", "--module") and i + 1 < len(words) and not words[i + 1].startswith("-"):
            return words[i + 1], True
    return None


#: torchrun options that are flags (torch.distributed.run's store_true options; every other option takes a value).
_TORCHRUN_FLAGS = {"-h", "--help", "--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m",
                   "--module", "--virtual-local-rank", "--virtual_local_rank"}


def torchrun_script(argv: list[str]) -> tuple[str, bool] | None:
    """The script (or ``-m`` module) in a torchrun command line, by torchrun's conventions: options come
    first, ``--opt=value`` or ``--opt value``; None when there is none. For the run dir's name and early
    checks only: the job's torchrun parses the line itself."""
    at = _script_index(argv)
    if at is None:
        return None
    return argv[at], any(a in ("-m", "--module") for a in argv[:at])


def torchrun_options(argv: list[str]) -> list[str]:
    """torchrun's own options: the command line up to the script."""
    at = _script_index(argv)
    return argv if at is None else argv[:at]


def _script_index(argv: list[str]) -> int | None:
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return i
        if "=" not in arg and arg not in _TORCHRUN_FLAGS and not (len(arg) > 2 and arg[1] != "-"):  # -t3: joined
            i += 1  # its value
        i += 1
    return None


def check_target(target: Target, python: str | None) -> None:
    """Fail early, with one clear line, on a missing or unreadable script or module."""
    if target.launcher == "accelerate":
        _check_accelerate(target, python)
        return
    if target.torchrun:
        found = torchrun_script(target.args)
        options = set(torchrun_options(target.args))
        if {"--no-python", "--no_python"} & options:
            raise LaunchError("perfmon torchrun runs Python training scripts; --no-python starts a program perfmon "
                              "cannot instrument")
        if {"--run-path", "--run_path"} & options:
            raise LaunchError("perfmon torchrun runs each worker as python -m perfmon.agent SCRIPT: --run-path "
                              "cannot be combined with it (leave it out: the script runs as __main__ either way)")
        if found is None:
            raise LaunchError("perfmon torchrun: no training script given (perfmon torchrun [torchrun options] "
                              "SCRIPT [ARGS...])")
        if not found[1]:
            check_target(Target(script=found[0], module=None), python)
        elif python is not None:
            check_interpreter(python)
        return
    if target.script is not None:
        path = Path(target.script)
        if not path.exists():
            raise LaunchError(f"can't open file '{target.script}': No such file or directory")
        if path.is_dir() and not (path / "__main__.py").is_file():  # with one, python runs the folder: so do we
            raise LaunchError(f"can't find '__main__' module in '{target.script}' (a directory, not a Python script)")
        if not os.access(path, os.R_OK):
            raise LaunchError(f"can't read file '{target.script}': Permission denied")
    elif target.module is not None and python is None:
        top = target.module.split(".")[0]
        saved = sys.path[:]
        sys.path[:0] = [os.getcwd()]  # python -m looks in the cwd first; the perfmon script's dir is not it
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path[:] = saved
        if not found:
            raise LaunchError(f"No module named '{top}'")
    if python is not None:
        check_interpreter(python)


def _check_accelerate(target: Target, python: str | None) -> None:
    if target.args[:1] != ["launch"]:
        raise LaunchError("perfmon follows `accelerate launch` (perfmon accelerate launch [options] SCRIPT [ARGS...]); "
                          "accelerate's other commands need no perfmon: run them as they are")
    options = set(target.args)
    if {"--no_python", "--no-python"} & options:
        raise LaunchError("perfmon accelerate launch runs Python training scripts; --no_python starts a program "
                          "perfmon cannot instrument")
    found = accelerate_script(target.args)
    if found is None and all(word.startswith("-") for word in target.args[1:]):
        raise LaunchError("perfmon accelerate launch: no training script given (perfmon accelerate launch "
                          "[accelerate options] SCRIPT [ARGS...])")
    if found is not None and not found[1]:  # (a script not named .py: accelerate's own parser finds it)
        check_target(Target(script=found[0], module=None), python)
    if importlib.util.find_spec("accelerate") is None and python is None:
        raise LaunchError(f"accelerate is not installed in {sys.executable}: pip install accelerate (or name the "
                          "interpreter that has it: perfmon --python PATH accelerate launch ...)")
    if python is not None:
        check_interpreter(python)


def check_interpreter(python: str) -> None:
    """``--python EXE`` must be an interpreter that can import perfmon's agent (one line if not)."""
    exe = shutil.which(python) or python
    if not os.path.exists(exe):
        raise LaunchError(f"--python {python}: no such interpreter")
    if os.path.abspath(exe) == os.path.abspath(sys.executable):  # not realpath: venvs share one binary
        return
    try:
        probe = subprocess.run([exe, "-c", "import perfmon.agent"], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise LaunchError(f"--python {python}: cannot run it ({exc.strerror or exc})") from None
    except subprocess.TimeoutExpired:
        return  # a slow interpreter: let the job start and speak for itself
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"it exited {probe.returncode} without a word: is it python?"])[-1]
        if "No module named" in last and "perfmon" in last:
            raise LaunchError(f"--python {python} has no perfmon installed: {exe} -m pip install perfmon "
                              "(or this checkout: pip install -e PATH)")
        raise LaunchError(f"--python {python} cannot import perfmon: {last}")


def same_destination() -> bool:
    """Our stdout and stderr are one file: a terminal, or both redirected to one log or pipe (`2>&1`)."""
    try:
        out, err = os.fstat(1), os.fstat(2)
    except OSError:
        return False
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


def plain_python(executable: str) -> str:
    """The interpreter as one types it: ``venv/bin/python`` rather than the ``venv/bin/python3.11`` a console
    script's shebang may name, where both are the same file (the script's ``sys.executable`` is then what it is
    under ``python train.py``)."""
    folder, name = os.path.split(executable)
    plain = os.path.join(folder, "python")
    if name == "python" or not name.startswith("python"):
        return executable
    try:
        return plain if os.path.samefile(plain, executable) else executable
    except OSError:
        return executable


def _private_runtime_dir() -> Path | None:
    """A fresh private runtime dir (0700, ours, a new name: nothing to trust) whose sockets fit a socket's path:
    under $TMPDIR, else under /tmp (a $TMPDIR too long for one). None where neither can be made."""
    for base in (None, "/tmp"):
        try:
            private = Path(tempfile.mkdtemp(prefix="perfmon-", dir=base))
        except OSError:
            continue
        if paths.socket_overflow(private) is None:
            return private
        shutil.rmtree(private, ignore_errors=True)
    return None


class TrainingProcess:
    """The launched job: ``python -m perfmon.agent TARGET ARGS`` in its own session."""

    def __init__(self, target: Target, run_dir: Path, python: str | None = None,
                 env: dict[str, str] | None = None, inherit_stdin: bool = False,
                 combined_output: bool = False) -> None:
        self.target = target
        #: the job's stdout and stderr both go to RUN/output.log, in the order it wrote them (headless, where
        #: ours are one file: two files copied by polls interleaved them by the poll, not as written)
        self.combined_output = combined_output
        #: the job reads perfmon's stdin (headless: piped input reaches the script as under plain python); else
        #: /dev/null (the dashboard owns the terminal's keys)
        self.inherit_stdin = inherit_stdin
        self.extra_env = env or {}
        self.run_dir = run_dir
        self.python = python or plain_python(sys.executable)
        self.popen: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self._lock_fd: int | None = None  # the run dir, open and flock()ed by this launch
        self._stops = 0
        #: signals perfmon itself escalated to (a repeated stop): the job dying of one is not re-raised on perfmon
        self.escalated: set[int] = set()
        #: Where the job's socket and discovery file go (chosen at start); None: no socket at all.
        self.runtime_dir: Path | None = None
        self._private_runtime: Path | None = None  # made for this job alone; removed when it ends
        #: the job's host and GPU telemetry, read here rather than inside it (None: the job samples for itself)
        self.host_feed: HostFeed | None = None
        #: the handlers :func:`signals_to` hands back at its end, taken before the job started (None: not held)
        self.handlers_before: dict[int, Any] | None = None
        #: the signals perfmon was started ignoring (a script's `perfmon train.py &` ignores SIGINT and SIGQUIT)
        self.ignored: frozenset[int] = frozenset()
        self._early: list[int] = []  # signals that came while the job was being started

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def socket_path(self) -> Path:
        if self.runtime_dir is None:  # no safe dir anywhere: a path that never appears (the monitor reads the recording)
            return self.run_dir / ".no-socket"
        return self.runtime_dir / f"{self.pid}.sock"

    def _choose_runtime_dir(self) -> dict[str, str]:
        """The runtime dir for the job, and the environment it needs for it.

        An unsafe shared runtime dir (a symlink, another user's, writable by others) is never used:
        one line on stderr says so, and the job gets a fresh private dir of its own, so this
        monitor still talks to it live while ``perfmon ls``/``attach`` elsewhere do not see it.
        """
        try:
            self.runtime_dir = paths.runtime_dir()
            return {}
        except paths.RuntimeDirError as exc:
            problem = exc
        private = _private_runtime_dir()
        consequence = ("perfmon ls/attach will not see this run" if private is not None
                       else "live attach disabled, the monitor reads the recording")
        print(paths.unusable_line(problem, consequence), file=sys.stderr, flush=True)
        if private is None:
            return {}
        self.runtime_dir = self._private_runtime = private
        return {"PERFMON_RUNTIME_DIR": str(private)}

    def _lock_run_dir(self) -> None:
        """Hold an exclusive lock on the run dir for this launcher's life (``flock`` on the directory itself: the
        kernel lets go however the launcher ends, a detach, a crash, SIGKILL); another launcher holding it is said.
        Two launches into one run dir at the same moment both found it free of a recording, and mixed their output,
        recordings and summaries."""
        try:
            fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise LaunchError(f"cannot create run dir {self.run_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LaunchError(f"run dir {self.run_dir} is in use by another perfmon launch; choose another "
                              "--run-dir") from None
        except OSError:  # a filesystem without flock: the recording check below is all there is
            os.close(fd)
            return
        self._lock_fd = fd  # held open, and so locked, until this process ends

    def _job_ended(self) -> None:
        if self._private_runtime is not None:
            shutil.rmtree(self._private_runtime, ignore_errors=True)
            self._private_runtime = None

    def output_files(self) -> str:
        """Where the script's stdout and stderr go, as a user reads it."""
        if self.combined_output:
            return f"{self.run_dir / paths.OUTPUT_LOG} (stdout and stderr)"
        return f"{self.run_dir / paths.OUTPUT_LOG}, {paths.STDERR_LOG}"

    def start(self) -> TrainingProcess:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"cannot create run dir {self.run_dir}: {exc.strerror or exc}") from None
        self._lock_run_dir()
        if (self.run_dir / "events.jsonl").exists() or any(
                (d / "events.jsonl").exists() for _, d in paths.rank_dirs(self.run_dir)):
            raise LaunchError(f"run dir {self.run_dir} already holds a recording; choose another --run-dir")
        try:
            # an earlier launch's status (a job that recorded nothing, in a run dir used again) is not this one's
            (self.run_dir / paths.LAUNCHER_EXIT).unlink(missing_ok=True)
            log = open(self.run_dir / paths.OUTPUT_LOG, "ab")
            try:
                errlog = log if self.combined_output else open(self.run_dir / paths.STDERR_LOG, "ab")
            except OSError:
                log.close()
                raise
            for name in (paths.OUTPUT_LOG, paths.STDERR_LOG):  # readable here whatever the script deletes
                hold_for_tails(self.run_dir / name)
        except OSError as exc:
            raise LaunchError(f"cannot create run dir {self.run_dir}: {exc.strerror or exc}") from None
        env = dict(os.environ, **self.extra_env, PERFMON_RUN_DIR=str(self.run_dir.resolve()),
                   KINETO_LOG_LEVEL=os.environ.get("KINETO_LOG_LEVEL", "6"),
                   **{paths.LAUNCHER_ENV: str(os.getpid())})  # while this launcher waits, it writes summary.json
        env.update(self._choose_runtime_dir())
        interval = paths.sample_interval(env)
        # one process we start ourselves and can reach: this launcher samples it (torchrun's ranks sample for
        # themselves: their pids are not ours to know here)
        feed = interval > 0 and not self.target.ranked and self.runtime_dir is not None
        if feed:
            env["PERFMON_SAMPLER"] = "launcher"
        else:
            env.pop("PERFMON_SAMPLER", None)
        self._hold_signals()
        try:
            self.popen = subprocess.Popen(
                self.target.command(self.python),
                stdin=None if self.inherit_stdin else subprocess.DEVNULL, stdout=log, stderr=errlog,
                start_new_session=True, env=env,
            )
        except OSError as exc:
            self._job_ended()
            self._release_signals()
            raise LaunchError(f"cannot start {self.python}: {exc.strerror or exc}") from None
        finally:
            log.close()
            errlog.close()
        if self.handlers_before is not None:  # the job inherited what perfmon ignores: from here perfmon passes
            for s in self.ignored:  # those on too (a script may handle one), as signals_to will
                self.handlers_before[s] = signal.SIG_IGN
                signal.signal(s, self._early_signal)
        early, self._early = self._early, []
        for signum in early:  # the job is there now: it gets them as signals_to would have given them
            _handlers(self)[signum](signum, None)
        if feed:
            pid = self.popen.pid  # a zombie still "lives" until reaped: its socket is gone by then, and the feed ends
            self.host_feed = HostFeed(pid, self.socket_path, lambda: self.returncode is None and paths.pid_alive(pid),
                                      interval).start()
        return self

    def _hold_signals(self) -> None:
        """From just before the job starts until :func:`signals_to` takes over, the signals it passes on reach the
        job too: perfmon dying of a SIGTERM there left the job, in a session of its own, training unseen."""
        try:
            # one perfmon was started ignoring (a shell's `&` ignores SIGINT) stays ignored: the job inherits that,
            # as plain python would (a handled signal is reset to its default in the exec'd job)
            self.ignored = frozenset(s for s in HANDLED if signal.getsignal(s) is signal.SIG_IGN)
            before = {s: signal.getsignal(s) for s in HANDLED if s not in self.ignored}
            for s in before:
                signal.signal(s, self._early_signal)
        except ValueError:  # not the main thread: python allows no handler here
            return
        self.handlers_before = before

    def _early_signal(self, signum: int, frame: Any) -> None:
        if self.popen is None:
            self._early.append(signum)
        elif self.popen.poll() is None:
            _handlers(self)[signum](signum, frame)
        else:  # the job ended and nothing took over (a caller that never waited on it): the signal is perfmon's
            self._early.append(signum)
            self._release_signals()

    def _release_signals(self) -> None:
        """The job could not start: perfmon's own handlers come back, and what came meanwhile is perfmon's."""
        before, self.handlers_before = self.handlers_before, None
        for s, handler in (before or {}).items():
            signal.signal(s, handler)
        early, self._early = self._early, []
        for signum in early:
            os.kill(os.getpid(), signum)

    def poll(self) -> int | None:
        if self.popen is None:
            return None
        rc = self.popen.poll()
        if rc is not None:
            self.returncode = rc
            self._job_ended()
        return rc

    def wait(self) -> int:
        assert self.popen is not None
        self.returncode = self.popen.wait()
        self._job_ended()
        return self.returncode

    def alive(self) -> bool:
        return self.poll() is None

    def stop(self) -> int:
        """Ask the job to stop: SIGINT first (KeyboardInterrupt), then SIGTERM, then SIGKILL; returns the signal."""
        sig = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)[min(self._stops, 2)]
        self._stops += 1
        if sig != signal.SIGINT:  # a Ctrl-C is what plain python gets too; these are perfmon's own
            self.escalated.add(sig)
        self._signal(sig)
        return sig

    def pause(self) -> None:
        """Stop the job where it is (Ctrl-Z on perfmon): SIGSTOP, since the kernel drops SIGTSTP's default stop
        for the job's process group (a session of its own, so an orphaned group)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def forward(self, sig: int) -> None:
        """Pass on a signal that perfmon got (one of :data:`FORWARDED`), as it is: what it would have done to the
        script run by plain python, the script's own handler included. perfmon never escalates it. To the job's
        process only, as ``kill PID`` is: its DataLoader workers (or a launcher's ranks) die of a SIGTERM that
        reaches them, and the script with them, where its handler would have saved and exited 0."""
        if self.poll() is None:  # once reaped, its pid may be another process's
            self._signal(sig, group=False)

    def _signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the job's process group (a stop, as a terminal's Ctrl-C), or to its process alone."""
        try:
            (os.killpg if group else os.kill)(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


#: Signals perfmon passes on to the job it launched, as they are: plain python would have got them (``kill PID``,
#: ``timeout``, ``docker stop``, a scheduler's preemption notice), and scripts handle them (a checkpoint, then exit).
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@contextmanager
def signals_to(proc: TrainingProcess) -> Iterator[None]:
    """While perfmon (its main thread) waits on ``proc``: Ctrl-C stops the job as it would stop it without perfmon
    (SIGINT to its process group; SIGTERM, then SIGKILL, if repeated), Ctrl-\\ quits it (SIGQUIT to its process
    group: perfmon then dies of it too, the job's core dumped where the limits allow), the :data:`FORWARDED` signals go on to it
    as they are, and Ctrl-Z suspends the job with perfmon (``fg`` or ``bg`` resumes both), as it would suspend
    plain python. The previous handlers (those before the job started) come back after."""
    handlers = _handlers(proc)
    held = proc.handlers_before or {}
    previous = {s: held.get(s, signal.getsignal(s)) for s in handlers}
    for s, handler in handlers.items():
        signal.signal(s, handler)
    try:
        yield
    finally:
        proc.handlers_before = None
        for s, handler in previous.items():
            signal.signal(s, handler)


def _handlers(proc: TrainingProcess) -> dict[int, Callable[[int, Any], None]]:
    """What :func:`signals_to` does with each signal it handles."""

    def stop(signum: int, frame: Any) -> None:
        if signal.SIGINT in proc.ignored:  # started ignoring it, plain python never stops for one: it goes on to
            proc._signal(signal.SIGINT)  # the job as it is (ignored there too, or the script's own handler's)
            return
        sent = proc.stop()
        if sent != signal.SIGINT:  # past what plain python does with a Ctrl-C: say so (os.write: a handler may
            try:  # run inside a print of ours, and a buffered write there would raise "reentrant call")
                os.write(2, f"\n[perfmon] Ctrl-C again: {signal.Signals(sent).name} sent to the job\n".encode())
            except OSError:
                pass

    def forward(signum: int, frame: Any) -> None:
        proc.forward(signum)

    def quit_(signum: int, frame: Any) -> None:  # Ctrl-\: at a terminal, plain python's whole group dies of it
        if proc.poll() is None:
            proc._signal(signal.SIGQUIT)

    def suspend(signum: int, frame: Any) -> None:
        proc.pause()
        os.kill(os.getpid(), signal.SIGSTOP)  # SIGSTOP: stops us even where our process group is orphaned
        proc.resume()  # continued (fg, bg, kill -CONT): so is the job

    return {signal.SIGINT: stop, signal.SIGQUIT: quit_, signal.SIGTSTP: suspend, **{s: forward for s in FORWARDED}}


#: The signals :func:`signals_to` handles.
HANDLED = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, *FORWARDED)


#: What a script dies of when it reads a stdin that is /dev/null: input()'s EOFError (a truncated pickle's or a
#: closed pipe's say otherwise) and pdb's quit (breakpoint()).
_READ_STDIN = ("EOFError: EOF when reading a line", "bdb.BdbQuit", "BdbQuit")


def stdin_hint(exception: str | None) -> str | None:
    """What to do, where a job the dashboard launched (its stdin /dev/null: the dashboard owns the keyboard)
    died reading its stdin; None for any other end."""
    if not exception or exception.strip() not in _READ_STDIN:
        return None
    return ("the script read its stdin (input(), breakpoint()), which is /dev/null under the dashboard: it owns "
            "the keyboard. Run it with perfmon --headless, where stdin is the terminal's, or give the value as an "
            "argument")


def summary_failed(exc: BaseException, run_dir: Path) -> str:
    """The line said where perfmon could not summarise a run (a bug of perfmon's, never the job's)."""
    return (f"perfmon: could not summarise the run ({type(exc).__name__}: {exc}); a perfmon bug, please report "
            f"it. The recording is whole: perfmon report {run_dir}")


#: What ``finalize_recording`` (and ``finalize_job``) return where the analysis failed: said on stderr already,
#: nothing to print (compared by identity).
SUMMARY_FAILED: dict[str, Any] = {"summary_failed": True}


def guarded_summary(build: Callable[[], dict[str, Any] | None], run_dir: Path) -> dict[str, Any] | None:
    """``build()``; where the analysis fails, the line that says so (on stderr) and ``SUMMARY_FAILED``: a bug of
    perfmon's analysis never changes perfmon's exit status, which is the job's."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001
        print(summary_failed(exc, run_dir), file=sys.stderr, flush=True)
        return SUMMARY_FAILED


def print_summary(text: Callable[[], str], run_dir: Path, err: Any, prefix: str = "") -> None:
    """Print the summary ``text()`` makes; where the analysis fails, the one line that says so instead: the
    job's exit status stands whatever perfmon's analysis does."""
    try:
        line = text()
    except Exception as exc:  # noqa: BLE001
        line = summary_failed(exc, run_dir)
    print(prefix + line, file=err, flush=True)


def _last_seq(written: bytes) -> int | None:
    """The ``seq`` of the last complete line of a recording's tail."""
    line = written.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        seq = protocol.decode(line).get("seq")
    except protocol.DecodeError:
        return None
    return seq if isinstance(seq, int) else None


def finalize_recording(run_dir: Path, state: RunState, returncode: int, rules: Any = None,
                       complete: bool = True, lock: Any = None) -> dict[str, Any] | None:
    """Fold the process exit into ``state``; if the agent died without recording its exit
    (SIGKILL, os._exit), append the exit record; then write summary.json (analysis stays outside the job),
    from ``state`` when it saw the whole stream, else from the recording. ``lock``: held while ``state`` is read or
    changed (a dashboard still drawing it), not while a recording is read again."""
    from perfmon.analysis.report import build_summary, write_summary

    def summarise(of: RunState) -> dict[str, Any] | None:
        def write() -> dict[str, Any]:
            findings = None
            if rules is not None:
                from perfmon.analysis.rules import evaluate_once

                findings = evaluate_once(of, rules)
            summary = build_summary(of, findings)
            write_summary(run_dir, summary)
            return summary

        return guarded_summary(write, run_dir)  # the job's exit is recorded first, whatever the analysis does

    with lock if lock is not None else contextlib.nullcontext():
        state.process_exited(returncode)
        events = run_dir / "events.jsonl"
        tail = tail_bytes(events)
        if tail is None:
            return None
        written = tail[: tail.rfind(b"\n") + 1]  # a partial last line is not a record
        if not ends_with_exit(written):
            assert state.exit is not None
            msg = protocol.message(
                "event", kind="exit", seq=state.last_seq + 1, t=time.time(), code=state.exit.code,
                signal=state.exit.signal, exception=None, traceback=None, recorded_by="monitor",
            )
            try:
                with open(events, "ab") as f:
                    if not tail.endswith(b"\n"):
                        f.write(b"\n")  # the agent died mid-line: keep our record on a line of its own
                    f.write(protocol.encode(msg))
            except OSError:
                pass
        # the live stream summarised a fast job: the recording is exact, unless it stopped early (a full disk); and
        # a stream cut short (the script closed the agent's socket) saw less than the recording holds
        recorded_seq = _last_seq(written)
        if (complete and not (state.bulk_steps and not state.recording_stopped)
                and (recorded_seq is None or recorded_seq <= state.last_seq)):
            return summarise(state)
    from perfmon.analysis.report import ReportError, load_recording

    try:
        recorded = load_recording(run_dir)
    except ReportError:
        return None
    recorded.process_exited(returncode)
    return summarise(recorded)


