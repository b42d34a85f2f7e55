"""How the job is started: the interpreter it runs on."""

from __future__ import annotations

import os

from perfmon.monitor.launch import plain_python


def test_the_job_runs_on_the_python_one_types(tmp_path):
    """A console script whose shebang names python3.11 runs the job on the venv's ``python`` where it is the same
    file, so the script's ``sys.executable`` reads as under ``python train.py``."""
    (tmp_path / "python3.11").write_text("")
    assert plain_python(str(tmp_path / "python3.11")) == str(tmp_path / "python3.11")  # no python beside it
    os.symlink(tmp_path / "python3.11", tmp_path / "python")
    assert plain_python(str(tmp_path / "python3.11")) == str(tmp_path / "python")
    (tmp_path / "python3").write_text("")  # another interpreter, not the same file
    os.remove(tmp_path / "python")
    (tmp_path / "python").write_text("")
    assert plain_python(str(tmp_path / "python3")) == str(tmp_path / "python3")
    assert plain_python("/opt/pypy/bin/pypy3") == "/opt/pypy/bin/pypy3"


SIGNAL_IN_THE_START_WINDOW = """
import os, signal, sys
from pathlib import Path
from perfmon.monitor.launch import Target, TrainingProcess, signals_to
proc = TrainingProcess(Target(sys.argv[1], None), Path(sys.argv[2])).start()
print("job", proc.popen.pid, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # the launcher is still getting ready: signals_to is not there yet
with signals_to(proc):
    code = proc.wait()
print("job ended", code, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def test_a_sigterm_before_the_launcher_is_ready_still_reaches_the_job(tmp_path):
    """From the moment the job starts, a SIGTERM to perfmon reaches it: perfmon dying of one in the moment before it
    handled signals left the job, in a session of its own, training unseen. Its handlers come back after."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(60)\n")
    res = subprocess.run([sys.executable, "-c", SIGNAL_IN_THE_START_WINDOW, str(script), str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=60)
    pid = int(res.stdout.split()[1])
    try:
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[1] == f"job ended {-signal.SIGTERM} True"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def perfmon_ignoring(*names: str) -> list[str]:
    """The command line of a ``perfmon`` started with the signals ``names`` ignored, as a shell's ``&`` (or a
    supervisor) starts one; perfmon's own arguments follow."""
    import sys

    ignore = "".join(f"signal.signal(signal.{name}, signal.SIG_IGN)\n" for name in names)
    return [sys.executable, "-c", "import os, signal, sys\n" + ignore
            + "os.execv(sys.executable, [sys.executable, '-m', 'perfmon.cli', *sys.argv[1:]])\n"]


def test_signals_perfmon_was_started_ignoring_stay_ignored_in_the_job(tmp_path):
    """A shell's `perfmon train.py &` ignores SIGINT (and a supervisor may ignore SIGTERM): plain python inherits
    that, so the job does too (perfmon's own handlers, installed before the job started, reset them to default)."""
    import subprocess

    script = tmp_path / "reads.py"
    script.write_text("import signal\nprint([signal.getsignal(s) == signal.SIG_IGN for s in "
                      "(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)], flush=True)\n")
    res = subprocess.run([*perfmon_ignoring("SIGINT", "SIGTERM"), "--headless", "--run-dir", str(tmp_path / "run"),
                          str(script)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "[True, True, False]"


COUNTS_SIGINTS = """
import signal, sys, time
from pathlib import Path
got = Path(sys.argv[1])
signal.signal(signal.SIGINT, lambda *_: got.write_text(str(int(got.read_text() or 0) + 1)))
got.write_text("0")
deadline = time.monotonic() + 120  # a test that failed leaves no job behind for long
while got.read_text() != "3" and time.monotonic() < deadline:
    time.sleep(0.01)
print("got 3", flush=True)
"""


def test_sigint_to_a_perfmon_started_ignoring_it_is_passed_on_never_escalated(tmp_path):
    """Plain python started ignoring SIGINT (`perfmon train.py &` in a script) never stops for one: perfmon
    passes each on to the job as it is (here to the script's own handler) and never escalates to SIGTERM and
    SIGKILL, as it does for a repeated Ctrl-C."""
    import signal
    import subprocess
    import time

    script, got = tmp_path / "counts.py", tmp_path / "got"
    script.write_text(COUNTS_SIGINTS)
    proc = subprocess.Popen([*perfmon_ignoring("SIGINT"), "--headless", "--run-dir", str(tmp_path / "run"),
                             str(script), str(got)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        for n in range(3):
            deadline = time.monotonic() + 90
            while not (got.exists() and got.read_text() == str(n)):  # the script's handler counted the last
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError(f"no count {n}: {proc.communicate()[1]}")
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines()[0] == "got 3"
    assert "again" not in err  # no "Ctrl-C again: SIGTERM sent to the job"


SIGINT_IGNORED_IN_THE_START_WINDOW = """
import os, signal, sys, time
from pathlib import Path
from perfmon.monitor.launch import Target, TrainingProcess, signals_to
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell's `&` leaves it
proc = TrainingProcess(Target(sys.argv[1], None), Path(sys.argv[2])).start()
ready = Path(sys.argv[2]) / "ready"
while not ready.exists() and proc.poll() is None:  # the script's own handler is in place
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGINT)  # the launcher is still getting ready: signals_to is not there yet
with signals_to(proc):
    code = proc.wait()
print("job ended", code, signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
"""

HANDLES_SIGINT = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, lambda *_: os._exit(3))
(Path(os.environ["PERFMON_RUN_DIR"]) / "ready").touch()
time.sleep(20)  # without the SIGINT
"""


def test_a_sigint_a_perfmon_ignoring_it_gets_before_it_is_ready_still_reaches_the_scripts_handler(tmp_path):
    """The SIGINT of a perfmon started ignoring it goes on to the job from the moment the job starts, as the other
    signals do: the script's own handler runs, as under plain python. perfmon ignores it again after."""
    import subprocess
    import sys

    script = tmp_path / "handles.py"
    script.write_text(HANDLES_SIGINT)
    res = subprocess.run([sys.executable, "-c", SIGINT_IGNORED_IN_THE_START_WINDOW, str(script),
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "job ended 3 True", res.stdout + res.stderr
