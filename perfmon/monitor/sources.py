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
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from perfmon import protocol
from perfmon.messages.commands import Command
from perfmon.recording import READ_CHUNK, RecordingReader

if TYPE_CHECKING:
    from perfmon.monitor.launch import TrainingProcess


class Source:
    """The interface: a blocking message iterator, commands back, close."""

    #: What the dashboard says it watches: ``"replay"`` (a recording: no job behind it, unless the
    #: source says it is ``connected``) or ``"attached"`` (a running job's agent); "" says nothing.
    mode: ClassVar[str] = ""
    run_dir: Path | None = None
    skipped = 0

    def messages(self) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def send(self, command: Command) -> bool:
        """``command`` to the agent(s); True if sent."""
        return False

    def close(self) -> None:
        pass


class ReplaySource(Source):
    """A recording; with ``follow``, keeps reading as it grows until ``close()``."""

    mode = "replay"

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
            batch = self.reader.read_new(READ_CHUNK)
            yield from batch
            if self._closed.is_set() or (not self.follow and not batch):
                return
            if not batch:
                self._closed.wait(self.poll)

    def close(self) -> None:
        self._closed.set()


def message_time(msg: dict[str, Any]) -> float | None:
    """When a message happened (wall clock), for paced replay."""
    if msg.get("type") == "steps":
        rows = msg.get("rows")
        fields = msg.get("fields") or []
        if rows and "t" in fields and isinstance(rows[-1], list) and len(rows[-1]) == len(fields):
            t = rows[-1][fields.index("t")]
            return float(t) if isinstance(t, int | float) else None
        return None
    t = msg.get("start") if msg.get("type") == "hello" else msg.get("t")
    return float(t) if isinstance(t, int | float) else None


class PacedReplaySource(ReplaySource):
    """A recording played back in time, with controls: pause, speed, restart, jump to the end.

    Yields ``{"type": "reset"}`` (never found on a socket or in a file) when playback restarts:
    the consumer starts a fresh state.
    """

    SPEEDS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

    def __init__(self, run_dir: Path, speed: float = 60) -> None:
        super().__init__(run_dir)
        self.speed = speed
        self.paused = False
        self.at_end = False
        self.position: float | None = None  # replay clock (recording time)
        self._cond = threading.Condition()
        self._jump = False
        self._restart = False
        self._anchor: tuple[float, float] | None = None  # (recording time, monotonic) of the last (re)sync

    def _clock(self) -> float | None:
        """The replay clock: recording time now (frozen while paused)."""
        if self._anchor is None:
            return None
        rec_t, mono = self._anchor
        return rec_t if self.paused else rec_t + (time.monotonic() - mono) * self.speed

    def _wait_until(self, t: float) -> bool:
        """Sleep until the replay clock reaches ``t``; False if closed or restarted meanwhile."""
        with self._cond:
            while not self._closed.is_set() and not self._restart:
                if self._jump:
                    return True
                if self._anchor is None:
                    self._anchor = (t, time.monotonic())
                now = self._clock()
                assert now is not None
                if now >= t:
                    self.position = t
                    return True
                self.position = now
                self._cond.wait(0.25 if self.paused else min(0.25, max(0.001, (t - now) / self.speed)))
        return False

    def messages(self) -> Iterator[dict[str, Any]]:
        while not self._closed.is_set():
            batch = self.reader.read_new(READ_CHUNK)
            if not batch and not self._restart:
                self.at_end = True
                with self._cond:  # stay for restart or close
                    while not self._closed.is_set() and not self._restart:
                        self._cond.wait(0.25)
            for msg in batch:
                t = message_time(msg)
                if t is not None:
                    if self._jump:
                        self.position = t  # the clock follows a jump, so "ago" reads from the recording's end
                    elif not self._wait_until(t):
                        break
                if self._restart:
                    break
                yield msg
            if self._restart:
                with self._cond:
                    self._restart = self._jump = False
                    self.at_end = False
                    self._anchor = None
                    self.position = None
                    self.reader = RecordingReader(self.reader.path)
                yield {"type": "reset"}

    def _control(self, **changes: Any) -> None:
        with self._cond:
            now = self._clock()
            if now is not None:
                self._anchor = (now, time.monotonic())  # re-anchor the clock where it stands
            for k, v in changes.items():
                setattr(self, k, v)
            self._cond.notify_all()

    def toggle_pause(self) -> None:
        self._control(paused=not self.paused)

    def faster(self) -> None:
        self._control(speed=next((s for s in self.SPEEDS if s > self.speed), self.SPEEDS[-1]))

    def slower(self) -> None:
        self._control(speed=next((s for s in reversed(self.SPEEDS) if s < self.speed), self.SPEEDS[0]))

    def seek_end(self) -> None:
        self._control(_jump=True)

    def restart(self) -> None:
        self._control(_restart=True)

    def close(self) -> None:
        super().close()
        with self._cond:
            self._cond.notify_all()


class LiveSource(Source):
    """A running agent's socket, back-filled from its recording."""

    mode = "attached"
    BACKFILL_CHUNK = READ_CHUNK  # bytes of recording read at a time to fill a gap

    def __init__(self, socket_path: Path, run_dir: Path | None = None, timeout: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.run_dir = Path(run_dir) if run_dir else None
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._closed = False
        self._last_seq = 0
        self._reader: RecordingReader | None = None
        self._pending: deque[dict[str, Any]] = deque()  # read from the recording, not yet given out
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
        try:  # the stream is over: the socket and the recording's reader go
            sock.close()
        except OSError:
            pass
        if self._reader is not None:
            self._reader.tail.close()

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
        # A bounded chunk at a time: after a monitor was stopped for a while the gap is the whole backlog (~72
        # bytes of recording a step: 12 MiB a second at 180,000 steps/s), and read at once it took GiBs.
        pending = self._pending
        while True:
            while pending:
                seq = pending[0].get("seq")
                if isinstance(seq, int) and seq > self._last_seq:
                    if upto is not None and seq > upto:
                        return  # newer than asked: kept for a later gap or the end
                    self._last_seq = seq
                    yield pending.popleft()
                else:
                    pending.popleft()
            batch = self._reader.read_new(self.BACKFILL_CHUNK)
            if not batch:
                return
            pending.extend(batch)

    def send(self, command: Command) -> bool:
        if self._sock is None or not self.connected:
            return False
        data = command.to_line()
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


def connect(proc: TrainingProcess) -> Source:
    """The live socket once the agent listens; the recording if the agent never does."""
    if wait_for_socket(proc.socket_path, proc.alive):
        source = LiveSource(proc.socket_path, proc.run_dir)
        try:
            source.connect()
            return source
        except OSError:
            pass
    return ReplaySource(proc.run_dir, follow=True)
