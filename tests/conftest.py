"""Session setup shared by every test module."""

from __future__ import annotations

import signal


def pytest_configure(config: object) -> None:
    # A suite started in the background by a non-interactive shell (`make test &`, some CI runners) inherits
    # SIGINT ignored, and so would every job the tests launch: Ctrl-C and `stop` tests could then never stop
    # them. Python reinstates its own handler here, so children start with SIGINT at its default, as from a
    # terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
