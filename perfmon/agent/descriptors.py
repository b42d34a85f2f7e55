"""Descriptors the agent holds in the script's process, and whether they are still the agent's.

A script may close every descriptor it inherited (``os.closerange(3, N)``, daemon-style code) and then open files
of its own, which get the same numbers. A write, read or close on such a number would be on the script's file: the
agent checks a descriptor's file (device and inode) before it uses one it has held for a while, and lets go of one
that is no longer its own without closing it.
"""

from __future__ import annotations

import os

Fingerprint = tuple[int, int]


def fingerprint(fd: int) -> Fingerprint | None:
    """The file ``fd`` refers to (device, inode); None if it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def still_ours(fd: int, taken: Fingerprint | None) -> bool:
    """``fd`` still refers to the file it did when ``taken`` was taken."""
    return taken is not None and fingerprint(fd) == taken
