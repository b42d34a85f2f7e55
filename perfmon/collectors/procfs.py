"""Reading Linux's /proc files from inside a training process."""

from __future__ import annotations

import os


def read_proc(path: str, size: int = 1 << 16) -> bytes:
    """A small /proc file's bytes (its first ``size``): one open, read and close, without the file objects
    ``open()`` builds around them (in a job's cold caches, those cost a sample more than the read itself)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)
