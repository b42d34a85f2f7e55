"""Following a growing file: the recording (``events.jsonl``) and the script's ``output.log`` and ``stderr.log``.

One reader for all of them: new bytes, or new complete lines, since the last read. A partial last
line waits for its end; a file that shrank or was replaced is read again from its start; a cap
bounds the bytes one read takes (so one call never holds a whole large file); a tail may start
near the end of what is already there (a log shows its recent past, not all of it).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import BinaryIO

#: Files opened when they were made (the launcher's output files), for the tails of this process: a script that
#: removes its run dir before a tail first looks (``rmtree`` of its output folder before ``import torch``) leaves
#: them still readable.
_held: dict[str, BinaryIO] = {}


def hold(path: Path) -> None:
    """Keep ``path`` open for the tails of this process, which then read it even after it is deleted."""
    if not _held:
        atexit.register(_let_go)  # closed, not left to the interpreter's end (a ResourceWarning under -X dev)
    try:
        _held[os.path.abspath(path)] = open(path, "rb")  # noqa: SIM115 - held for the life of the process
    except OSError:
        pass


def available(path: Path) -> bool:
    """``path`` can be tailed here: it exists, or this process holds it (made by its launcher)."""
    return os.path.abspath(path) in _held or Path(path).exists()


def _let_go() -> None:
    while _held:
        _, f = _held.popitem()
        try:
            f.close()
        except OSError:
            pass


def _reopen(held: BinaryIO) -> BinaryIO:
    """A file description of its own on a held file (its own offset), deleted or not."""
    try:
        return open(f"/proc/self/fd/{held.fileno()}", "rb")  # noqa: SIM115 - Linux: works for a deleted file
    except OSError:
        return os.fdopen(os.dup(held.fileno()), "rb")


#: how many of the last bytes read a tail checks are still in place, to see a file rewritten since
_MARK = 32


class Tail:
    """New bytes or complete lines of a growing file, from where the last read left off.

    ``max_read``: most bytes one read takes (-1: all there is). ``max_line``: an unterminated line
    longer than this is given out as it stands (what follows comes as a line of its own), so a
    writer that never ends its line cannot grow the buffer without bound; None: no limit.
    ``near_end``: start at the first line that begins in the last ``near_end`` bytes of the file
    as it is at the first read that finds it; None: start at its beginning.
    """

    def __init__(
        self, path: Path, *, max_read: int = -1, max_line: int | None = None, near_end: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.offset = 0  # the next byte to read
        self.max_read = max_read
        self.max_line = max_line
        self._near_end = near_end
        self._skipping = False  # started mid-line: drop bytes through the next newline
        self._partial = b""
        self._ino: int | None = None
        self._file: BinaryIO | None = None
        self._mark = b""  # the last bytes read, still there unless the file was rewritten since (see read)

    def read(self, limit: int | None = None) -> bytes:
        """Bytes appended since the last call, at most ``limit`` (default ``max_read``); ``b""`` when
        there are none or the file is missing. A file that shrank or was replaced (another inode) is
        read again from its start; one that was deleted is still read to its end, from the open file (a script
        that removes its output folder, the run dir in it, must not take what it printed with it). (Use this or
        :meth:`lines`, not both: this skips their buffer.)"""
        f = self._open()
        if f is None:
            return b""
        try:
            st = os.fstat(f.fileno())
            if self._near_end is not None:  # the first read that finds the file decides where to start
                start = st.st_size - self._near_end
                # read from the byte before ``start``: if it ends a line, the line at ``start`` is kept
                self.offset, self._skipping = (start - 1, True) if start > 0 else (0, False)
                self._near_end = None
            elif st.st_size < self.offset or self._rewritten(f):
                # truncated; or truncated and written again past where we were (``open("/dev/stdout", "w")`` in a
                # script whose stdout is this file), which its size alone does not show
                self.offset, self._partial, self._skipping, self._mark = 0, b"", False, b""
            f.seek(self.offset)
            data = f.read(self.max_read if limit is None else limit)
        except OSError:
            return b""
        self.offset += len(data)
        self._mark = (self._mark + data)[-_MARK:]
        if self._skipping:
            _, newline, data = data.partition(b"\n")
            self._skipping = not newline
        return data

    def _rewritten(self, f: BinaryIO) -> bool:
        """The bytes last read are no longer where they were (one small pread a poll: an mtime can stay the same
        over a rewrite within one clock tick)."""
        mark = self._mark
        if not mark or self.offset < len(mark):
            return False
        return os.pread(f.fileno(), len(mark), self.offset - len(mark)) != mark

    def _open(self) -> BinaryIO | None:
        """The file, kept open: the one at the path, or the deleted one read so far (None: there is none)."""
        try:
            ino: int | None = os.stat(self.path).st_ino
        except OSError:
            ino = None  # gone (or not there yet): what is open is still read
        if self._file is not None and ino is not None and ino != self._ino:  # replaced: the new one from its start
            self.close()
            self.offset, self._partial, self._skipping, self._mark = 0, b"", False, b""
        if self._file is None:
            held = _held.get(os.path.abspath(self.path))
            try:
                if held is not None and (ino is None or os.fstat(held.fileno()).st_ino == ino):
                    self._file = _reopen(held)  # the file made for it, though the path may be gone
                elif ino is not None:
                    self._file = open(self.path, "rb")  # noqa: SIM115 - held across reads, closed by close()
                if self._file is not None:
                    self._ino = os.fstat(self._file.fileno()).st_ino
            except (OSError, ValueError):  # ValueError: a held file closed at exit while a thread still polls
                self._file = None
        return self._file

    def close(self) -> None:
        """Let go of the file."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def __del__(self) -> None:  # a tail nobody closed (a reader dropped mid-file) closes what it held open
        self.close()

    def lines(self, limit: int | None = None) -> list[bytes]:
        """Complete lines (without their newline) appended since the last call, from at most ``limit``
        new bytes; a trailing partial line is kept for the call that brings its end."""
        data = self.read(limit)
        if not data:
            return []
        *complete, self._partial = (self._partial + data).split(b"\n")
        if self.max_line is not None and len(self._partial) > self.max_line:
            complete.append(self._partial)
            self._partial = b""
        return complete

    @property
    def partial(self) -> bytes:
        """The unterminated last line so far, kept for the read that brings its end (a progress bar's ``\r``)."""
        return self._partial

    def flush(self) -> bytes:
        """The partial last line so far (``b""`` if none), given up: the writer is done."""
        rest, self._partial = self._partial, b""
        return rest


#: ANSI cursor up: a line that ends with it was drawn below another that is redrawn next (nested progress bars:
#: tqdm's), a redraw, not a line of the log
CURSOR_UP = "\x1b[A"

#: Lines of the script's output a reader keeps (the dashboard's log panel holds no more).
OUTPUT_LINES = 5000


class OutputTail:
    """New complete lines of one output file as text; starts near its end, survives truncation."""

    FIRST_BYTES = 256 * 1024  # how much of an existing file to show at first
    CHUNK = 4 * 1024 * 1024  # most read per call
    MAX_PARTIAL = 64 * 1024  # an unterminated line longer than this is shown as is

    def __init__(self, path: Path) -> None:
        self.tail = Tail(path, max_read=self.CHUNK, max_line=self.MAX_PARTIAL, near_end=self.FIRST_BYTES)

    def read(self) -> list[str]:
        """New complete lines since the last call (at most OUTPUT_LINES: a log panel keeps no more)."""
        return [line.decode("utf-8", "replace") for line in self.tail.lines()[-OUTPUT_LINES:]]

    def partial(self) -> str:
        """The line being written (no newline yet): a tqdm bar redrawn with ``\r`` lives there for a whole epoch.
        Only its last 4 KiB: a bar's last redraw is at its end."""
        return self.tail.partial[-4096:].decode("utf-8", "replace")

    def flush(self) -> list[str]:
        """The unterminated last line, if any."""
        rest = self.tail.flush()
        return [rest.decode("utf-8", "replace")] if rest else []
