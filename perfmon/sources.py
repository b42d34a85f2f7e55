"""Where the monitor's messages come from: a live agent socket or a recording, one interface.

A live source connects, reads the greeting (a ``hello`` with ``live_seq``), back-fills
everything up to ``live_seq`` from ``RUN/events.jsonl`` and then streams. Every message
carries ``seq``: a gap (the agent dropped lines for a slow monitor) is refilled from the
recording, which the agent always writes before it sends.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perfmon import protocol


class RecordingReader:
    """Reads complete lines of a growing ``events.jsonl`` from where it left off."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.skipped = 0
        self.errors: list[str] = []
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        """Messages appended since the last call; a trailing partial line waits for its end."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > protocol.MAX_LINE:
            self.skipped += 1
            self._partial = b""
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(protocol.decode(line))
            except protocol.DecodeError as exc:
                self.skipped += 1
                if len(self.errors) < 10:
                    self.errors.append(str(exc))
        return out


class Source:
    """The interface: a blocking message iterator, commands back, close."""

    run_dir: Path | None = None
    skipped = 0

    def messages(self) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def send(self, command: dict[str, Any]) -> bool:
        return False

    def close(self) -> None:
        pass


class ReplaySource(Source):
    """A recording; with ``follow``, keeps reading as it grows until ``close()``."""

    def __init__(self, run_dir: Path, follow: bool = False, poll: float = 0.25) -> None:
        self.run_dir = Path(run_dir)
        self.follow = follow
        self.poll = poll
        self.reader = RecordingReader(self.run_dir / "events.jsonl")
        self._closed = threading.Event()

    @property
    def skipped(self) -> int:  # type: ignore[override]
        return self.reader.skipped

    def messages(self) -> Iterator[dict[str, Any]]:
        while True:
            batch = self.reader.read_new()
            yield from batch
            if self._closed.is_set() or (not self.follow and not batch):
                return
            if not batch:
                self._closed.wait(self.poll)

    def close(self) -> None:
        self._closed.set()


class LiveSource(Source):
    """A running agent's socket, back-filled from its recording."""

    def __init__(self, socket_path: Path, run_dir: Path | None = None, timeout: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.run_dir = Path(run_dir) if run_dir else None
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._closed = False
        self._last_seq = 0
        self._reader: RecordingReader | None = None
        self._pending: list[dict[str, Any]] = []
        self.skipped = 0
        self.connected = False

    def connect(self) -> None:
        """Connect (raises OSError if the agent is not there)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.socket_path))
        sock.settimeout(None)
        self._sock = sock
        self.connected = True

    def messages(self) -> Iterator[dict[str, Any]]:
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        buf = b""
        sock = self._sock
        while not self._closed:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if len(buf) > protocol.MAX_LINE:
                self.skipped += 1
                buf = b""
            for line in lines:
                if not line.strip():
                    continue
                try:
                    msg = protocol.decode(line)
                except protocol.DecodeError:
                    self.skipped += 1
                    continue
                yield from self._sequence(msg)
        self.connected = False
        # The agent is gone: whatever it recorded after our last line is in the file.
        yield from self._backfill(None)

    def _sequence(self, msg: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if msg.get("type") == "hello" and "live_seq" in msg:
            if self.run_dir is None and msg.get("run_dir"):
                self.run_dir = Path(msg["run_dir"])
            yield from self._backfill(int(msg["live_seq"]))
            yield msg
            return
        seq = msg.get("seq")
        if isinstance(seq, int):
            if seq <= self._last_seq:
                return
            if seq > self._last_seq + 1:
                yield from self._backfill(seq - 1)
            self._last_seq = max(self._last_seq, seq)
        yield msg

    def _backfill(self, upto: int | None) -> Iterator[dict[str, Any]]:
        """Messages with seq in (last_seq, upto] from the recording (upto None: all of it)."""
        if self.run_dir is None:
            return
        if self._reader is None:
            self._reader = RecordingReader(self.run_dir / "events.jsonl")
        items = [*self._pending, *self._reader.read_new()]
        self._pending = []
        for msg in items:
            seq = msg.get("seq")
            if not isinstance(seq, int) or seq <= self._last_seq:
                continue
            if upto is not None and seq > upto:
                self._pending.append(msg)  # newer than asked: keep for a later gap or the end
                continue
            self._last_seq = seq
            yield msg

    def send(self, command: dict[str, Any]) -> bool:
        if self._sock is None or not self.connected:
            return False
        data = protocol.encode(protocol.message("command", **command))
        try:
            with self._send_lock:
                self._sock.sendall(data)
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def wait_for_socket(path: Path, alive: Any, timeout: float = 60.0, poll: float = 0.02) -> bool:
    """Wait until ``path`` exists (the agent is listening) or ``alive()`` turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        if not alive():
            return False
        time.sleep(poll)
    return False
