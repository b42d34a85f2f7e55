"""The launcher's feed of host and GPU readings, read by the agent's publisher at its own ticks.

The server hands the connection over at its first ``sample`` line; from then on no thread of the job wakes for a
reading: the publisher, awake anyway for the steps, takes whatever readings came since its last tick.
"""

from __future__ import annotations

import socket

from perfmon import protocol
from perfmon.agent.descriptors import fingerprint, still_ours

#: The most one ``recv`` takes: a tick's readings (~0.5 kB each) fit many times over.
READ_SIZE = 65536


class FeedReader:
    """Complete lines from a non-blocking socket, and whether the other end closed it."""

    def __init__(self, sock: socket.socket, pending: bytes = b"") -> None:
        self.sock = sock
        self._buf = bytearray(pending)
        self.closed = False
        self._taken = fingerprint(sock.fileno())

    def lines(self) -> list[bytes]:
        """Every complete line that came; ``closed`` is set once the launcher is gone (or sent a line too long)."""
        if not self.closed and not still_ours(self.sock.fileno(), self._taken):  # the script closed it (closerange)
            self._let_go()
        while not self.closed:
            try:
                chunk = self.sock.recv(READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            if len(chunk) < READ_SIZE:  # all there was: no second call (and its exception, cold) to learn that
                break
        *done, rest = bytes(self._buf).split(b"\n")
        self._buf = bytearray(rest)
        if len(rest) > protocol.MAX_LINE:
            self.closed = True
        return done

    def close(self) -> None:
        if not still_ours(self.sock.fileno(), self._taken):
            self._let_go()
            return
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _let_go(self) -> None:
        """Forget the descriptor without closing it: its number may be one of the script's files now."""
        self.closed = True
        try:
            self.sock.detach()
        except OSError:
            pass
