"""perfmon ends as its job ended: the exit code, or death by the job's signal (seen by a parent as -N)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from perfmon.monitor.exit_like import DiedOf, exit_status


@pytest.mark.parametrize("returncode, status, died_of", [
    (0, 0, None),
    (1, 1, None),
    (3, 3, None),
    (-signal.SIGTERM, 143, signal.SIGTERM),
    (-signal.SIGINT, 130, signal.SIGINT),
    (-signal.SIGKILL, 137, signal.SIGKILL),
    (-signal.SIGSEGV, 139, signal.SIGSEGV),
])
def test_exit_status_is_the_shells_and_keeps_the_signal(returncode, status, died_of):
    got = exit_status(returncode)
    assert got == status
    assert (got.signum if isinstance(got, DiedOf) else None) == died_of
    # a signal perfmon escalated to itself (a repeated stop) is a status: dying of SIGKILL reads as the OOM killer
    own = exit_status(returncode, sent={signal.SIGTERM, signal.SIGKILL})
    assert own == status and isinstance(own, DiedOf) == (died_of not in (None, signal.SIGTERM, signal.SIGKILL))


def _exit_like(status: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from perfmon.monitor.exit_like import DiedOf, exit_like; "
            f"print('summary', flush=False); exit_like({status})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("status, returncode", [
    ("0", 0),
    ("2", 2),
    ("DiedOf(signal.SIGTERM)", -signal.SIGTERM),
    ("DiedOf(signal.SIGINT)", -signal.SIGINT),
    ("DiedOf(signal.SIGKILL)", -signal.SIGKILL),
    ("DiedOf(signal.SIGSEGV)", -signal.SIGSEGV),
])
def test_perfmon_dies_of_the_jobs_signal_after_flushing_its_output(status, returncode):
    res = _exit_like(status.replace("signal.", "__import__('signal')."))
    assert res.returncode == returncode, res.stderr
    assert res.stdout == "summary\n"  # the summary printed before the signal is not lost in a buffer


def test_perfmon_dies_of_the_signal_even_where_it_handled_it():
    """perfmon handles SIGTERM and SIGINT itself (to pass them on); dying of them must not run those handlers."""
    code = ("import signal; from perfmon.monitor.exit_like import DiedOf, exit_like; "
            "signal.signal(signal.SIGTERM, lambda *a: print('handler ran')); "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
            "exit_like(DiedOf(signal.SIGTERM))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGTERM and "handler ran" not in res.stdout

