"""The run's recording: ``RUN/events.jsonl``, append-only, written by the agent itself."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Recorder:
    """Appends encoded lines; on any OS error (disk full, unwritable dir) it stops, once, loudly."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "events.jsonl"
        self.error: str | None = None
        self.bytes_written = 0
        self._fd: int | None = None
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail(exc)

    @property
    def active(self) -> bool:
        return self._fd is not None

    def write(self, data: bytes) -> bool:
        """Append whole lines; returns False once recording has stopped."""
        if self._fd is None:
            return False
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self.bytes_written += len(data)
            return True
        except OSError as exc:
            self._fail(exc)
            return False

    def _fail(self, exc: OSError) -> None:
        self.error = f"recording stopped: {exc.strerror or exc} ({self.path}); training continues"
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
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
