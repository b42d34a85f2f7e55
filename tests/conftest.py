"""Session setup shared by every test module."""

from __future__ import annotations

import os
import signal


def pytest_configure(config: object) -> None:
    # A suite started in the background by a non-interactive shell (`make test &`, some CI runners) inherits
    # SIGINT ignored, and so would every job the tests launch: Ctrl-C and `stop` tests could then never stop
    # them. Python reinstates its own handler here, so children start with SIGINT at its default, as from a
    # terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # pytest-xdist's workers (`make test` runs two) have COLUMNS=80 and LINES=24 in their environment: a terminal a
    # test starts (tmux) would hand them to the dashboard, which then draws 80x24 whatever the terminal's size
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
