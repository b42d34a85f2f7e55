"""Session setup shared by every test module."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from perfmon.monitor.launch import HANDLED


def pytest_configure(config: object) -> None:
    # A suite started in the background by a non-interactive shell (`make test &`, some CI runners) inherits
    # SIGINT and SIGQUIT ignored, and so would every job the tests launch: Ctrl-C, Ctrl-\ and `stop` tests could
    # then never stop them (the job ignores what perfmon passes on, as plain python started so would). Python
    # reinstates its own handler here, so children start with both at their defaults, as from a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    # pytest-xdist's workers (`make test` runs two) have COLUMNS=80 and LINES=24 in their environment: a terminal a
    # test starts (tmux) would hand them to the dashboard, which then draws 80x24 whatever the terminal's size
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    # A test that starts a job in-process (`TrainingProcess(...).start()` without `signals_to`) leaves perfmon's
    # early handlers installed in this worker; chained from test to test they once turned a late SIGINT into an
    # ignored KeyboardInterrupt at the end of the session. Each test gets back the handlers it started with.
    before = {s: signal.getsignal(s) for s in HANDLED}
    yield
    for s, handler in before.items():
        if handler is not None and signal.getsignal(s) is not handler:
            try:
                signal.signal(s, handler)
            except ValueError:  # not the main thread (a worker never runs tests off it; stay harmless anyway)
                pass
