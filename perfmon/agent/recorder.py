"""The run's recording: ``RUN/events.jsonl``, append-only, written by the agent itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from perfmon import protocol
from perfmon.agent.descriptors import fingerprint, still_ours
from perfmon.agent.disk import reserve_bytes, short_of_space

#: Bytes written, or seconds, between two looks at the free space (a statvfs: about a microsecond); the time
#: for a slow run, whose script may fill the disk itself meanwhile.
CHECK_EVERY = 4 << 20
CHECK_EVERY_S = 60.0


class Recorder:
    """Appends encoded lines; on any OS error (disk full, unwritable dir) it stops, once, loudly. It also stops
    before the disk is full: a long run of fast steps records ~72 bytes a step, and the disk it fills is the one
    the script prints its log to and saves its checkpoints on (a write there would fail in the script)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "events.jsonl"
        self.error: str | None = None
        self.bytes_written = 0
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None  # the file self._fd was opened on
        self.reopened = False  # the script closed our descriptor (os.closerange): the recording went on in a new one
        self.reserve = reserve_bytes()
        self._unchecked, self._check_at = 0, time.monotonic() + CHECK_EVERY_S
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._open()
        except OSError as exc:
            self._fail(exc)
            return
        self._check_space()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._fd, self._inode = fd, fingerprint(fd)

    def _still_ours(self) -> bool:
        """Our descriptor is still the recording (see :mod:`perfmon.agent.descriptors`)."""
        return self._fd is not None and still_ours(self._fd, self._inode)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def write(self, data: bytes) -> bool:
        """Append whole lines; returns False once recording has stopped."""
        if self._fd is None:
            return False
        if not self._still_ours():  # forgotten, never closed (the number may be the script's now); opened again
            self._fd = None
            self.reopened = True
            try:
                self._open()
            except OSError as exc:
                self._fail(exc)
                return False
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self.bytes_written += len(data)
        except OSError as exc:
            self._fail(exc)
            return False
        self._unchecked += len(data)
        if self._unchecked >= CHECK_EVERY or time.monotonic() >= self._check_at:
            self._check_space()
        return self._fd is not None

    def _check_space(self) -> None:
        self._unchecked, self._check_at = 0, time.monotonic() + CHECK_EVERY_S
        short = short_of_space(self.run_dir, self.reserve)
        if short is not None:
            self.error = f"{protocol.RECORDING_STOPPED} {short}; training continues"
            self.close()

    def _fail(self, exc: OSError) -> None:
        self.error = f"{protocol.RECORDING_STOPPED} {exc.strerror or exc} ({self.path}); training continues"
        self.close()

    def write_json(self, name: str, obj: Any) -> bool:
        """Write ``RUN/name`` atomically (temp file + rename)."""
        target = self.run_dir / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        try:
            tmp.write_text(json.dumps(obj, indent=2) + "\n")
            os.replace(tmp, target)
            return True
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False

    def close(self) -> None:
        if self._fd is not None:
            if self._still_ours():  # else the number is not ours to close any more
                try:
                    os.close(self._fd)
                except OSError:
                    pass
            self._fd = None

