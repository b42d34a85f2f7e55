"""The script's stdout and stderr in a job perfmon launched: files in the run dir (``output.log``, ``stderr.log``),
which a full disk must never turn into an error of the script's (plain python printing to a terminal would not
fail)."""

from __future__ import annotations

import errno
import io
import sys
from collections.abc import Callable

FULL_DISK = ("the run dir has no room left (a full disk, a file size limit): the script's output is no longer kept in "
             "RUN/output.log and RUN/stderr.log, nor shown from there; the script goes on as under plain python")
#: Errors of a write that found no room: the copy stops, the script goes on.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class _KeepGoing(io.FileIO):
    """fd 1 or 2 as a file that takes every write: what a full disk refuses is dropped and counted."""

    lost = 0  # bytes dropped, both streams
    on_first_loss: Callable[[], None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        try:
            return super().write(data)
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            n = len(memoryview(data).cast("B"))
            first = _KeepGoing.lost == 0
            _KeepGoing.lost += n
            if first and _KeepGoing.on_first_loss is not None:
                _KeepGoing.on_first_loss()
            return n


def keep_going_on_full_disk(on_first_loss: Callable[[], None]) -> None:
    """Re-open ``sys.stdout`` and ``sys.stderr`` (when they are fds 1 and 2) on writers that drop what a full disk
    refuses instead of raising it into the script; ``on_first_loss`` is called once, at the first dropped write.
    The streams keep their encoding, errors and line buffering (stdout's is line-buffered by the launch)."""
    _KeepGoing.on_first_loss = on_first_loss
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        try:
            if not isinstance(old, io.TextIOWrapper) or old.fileno() != fd:
                continue
            old.flush()
            raw = _KeepGoing(fd, "w", closefd=False)
            raw.name = getattr(old.buffer, "name", fd)  # "<stdout>", as python names it
            # unbuffered where python's was (PYTHONUNBUFFERED=1, -u: the binary layer is the FileIO itself)
            binary = raw if isinstance(old.buffer, io.FileIO) else io.BufferedWriter(raw)
            new = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors,  # type: ignore[arg-type]
                                   line_buffering=old.line_buffering, write_through=old.write_through)
            new.mode = getattr(old, "mode", "w")  # type: ignore[misc]
        except (OSError, ValueError, AttributeError):
            continue  # a closed or odd stream: left as it is
        setattr(sys, name, new)  # the old stream does not own its fd (python's std streams never do): no close
        if getattr(sys, f"__{name}__") is old:
            setattr(sys, f"__{name}__", new)


def close_output(streams: tuple[str, ...]) -> list[str]:
    """Break the job's ``streams`` (``stdout``: fd 1, ``stderr``: fd 2) as a pipe whose reader left breaks them: the
    launcher copies them from files to its own stdout or stderr, a pipe whose reader is gone (``perfmon ... | head``).
    Under plain python the script's next write there raised BrokenPipeError (SIGPIPE is ignored in python) and it
    ended; so it does here. Returns the streams broken."""
    import os

    done = []
    for name in streams:
        fd = {"stdout": 1, "stderr": 2}.get(name)
        if fd is None:
            continue
        try:
            r, w = os.pipe()
            os.close(r)  # a pipe with no reader: every write gets EPIPE
            os.dup2(w, fd)
            os.close(w)
        except OSError:
            continue
        done.append(name)
    return done
