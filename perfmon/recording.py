"""The recording (``RUN/events.jsonl``) as readers see it: its messages, from where a reader left off, and
whether it has ended. Shared by everything outside the job that reads one (monitor sources, the report, the
job's summary); the job writes it (``perfmon.agent.recorder``). Stdlib only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perfmon import paths, protocol
from perfmon.messages.steps import parse_steps
from perfmon.tail import Tail

#: Bytes of a recording one read takes where it is followed or replayed: a long run's is never held whole.
READ_CHUNK = 1 << 20


class RecordingReader:
    """Reads the messages of a growing ``events.jsonl`` from where it left off (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tail = Tail(path, max_line=protocol.MAX_LINE)  # longer: given out whole, then skipped by decode
        self.skipped = 0
        self.errors: list[str] = []

    @property
    def offset(self) -> int:
        """Bytes of the file read so far."""
        return self.tail.offset

    def read_new(self, max_bytes: int = -1) -> list[dict[str, Any]]:
        """Messages appended since the last call (at most about ``max_bytes`` of them, or the one line that
        is longer); a trailing partial line waits for its end. Empty only where the file holds no new message."""
        out: list[dict[str, Any]] = []
        while True:
            before = self.tail.offset
            for line in self.tail.lines(max_bytes):
                if not line.strip():
                    continue
                try:
                    out.append(protocol.decode(line))
                except protocol.DecodeError as exc:
                    self.skipped += 1
                    if len(self.errors) < 10:
                        self.errors.append(str(exc))
            # a chunk that gave no message (the start of one long line, lines that did not decode) is not the end
            if out or max_bytes < 0 or self.tail.offset == before:
                return out


def read_all(reader: RecordingReader, chunk: int = 1 << 22) -> Iterator[dict[str, Any]]:
    """Every message the file holds now, a bounded chunk at a time (a long run's recording is never held whole)."""
    while True:
        batch = reader.read_new(chunk)
        if not batch:
            return
        yield from batch


def recording_ended(run_dir: Path) -> bool:
    """The run's recording holds its exit record, or the process that wrote it is gone."""
    tail = tail_bytes(run_dir / "events.jsonl")
    if tail is None:
        return True
    if ends_with_exit(tail[: tail.rfind(b"\n") + 1]):
        return True
    try:
        with open(run_dir / "events.jsonl", "rb") as f:
            pid = protocol.decode(f.readline()).get("pid")
    except (OSError, protocol.DecodeError):
        return True
    return not isinstance(pid, int) or not paths.pid_alive(pid)


def ends_with_exit(complete: bytes) -> bool:
    """The last complete record is the agent's exit event (decoded, not matched as bytes)."""
    last = complete.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        msg = protocol.decode(last)
    except protocol.DecodeError:
        return False
    return protocol.is_exit(msg)


#: How much of a recording is read at a time, from its end back, for its last ``steps`` message (at most 2,000 rows,
#: ~200 KB: most often in the first read).
STEPS_TAIL = 1 << 19


def last_step(run_dir: Path) -> int | None:
    """The number of the last step the run recorded, read from the end of its recording back (None: no step in
    it yet). ``perfmon ls`` reads it here, so the job need not keep rewriting a file to say how far it is."""
    try:
        f = open(run_dir / "events.jsonl", "rb")
    except OSError:
        return None
    with f:
        end = f.seek(0, os.SEEK_END)
        carry = b""  # the end of a line that begins before the bytes read so far
        while end > 0:
            start = max(0, end - STEPS_TAIL)
            f.seek(start)
            lines = (f.read(end - start) + carry).split(b"\n")
            carry = lines.pop(0) if start > 0 else b""
            for line in reversed(lines):
                if b'"steps"' not in line:
                    continue
                try:
                    rows = parse_steps(protocol.decode(line, allowed=("steps",)), None)
                except protocol.DecodeError:
                    continue
                if rows.i:
                    return rows.i[-1]
            end = start
            if len(carry) > protocol.MAX_LINE:  # no line is this long: what it holds is no message
                carry = b""
    return None


def tail_bytes(path: Path, size: int = 1 << 16) -> bytes | None:
    """The last ``size`` bytes of the file; None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(0, end - size))
            return f.read()
    except OSError:
        return None
