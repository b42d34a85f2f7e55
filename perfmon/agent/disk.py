"""The free space perfmon leaves to the script on the run dir's disk.

That disk is often the one the script logs to and saves its checkpoints on, and a write that fails there fails in
the script. So what the job writes for perfmon (the recording, profiler traces, memory snapshots) stops, or is not
written, once less than the reserve is free.
"""

from __future__ import annotations

import os
from pathlib import Path

RESERVE_ENV = "PERFMON_DISK_RESERVE_MB"
DEFAULT_RESERVE_MB = 256


def reserve_bytes() -> int:
    """The reserve: ``PERFMON_DISK_RESERVE_MB`` MiB (default 256)."""
    try:
        return max(0, int(float(os.environ.get(RESERVE_ENV) or DEFAULT_RESERVE_MB) * 2**20))
    except (ValueError, OverflowError):  # not a number, or inf
        return DEFAULT_RESERVE_MB * 2**20


def short_of_space(path: Path, reserve: int | None = None) -> str | None:
    """Why nothing more should be written under ``path`` (its disk has less free than the reserve), or None."""
    reserve = reserve_bytes() if reserve is None else reserve
    try:
        st = os.statvfs(path)
    except OSError:
        return None  # no answer: a failing write still stops what writes
    free = st.f_bavail * st.f_frsize
    if free >= reserve:
        return None
    return (f"{free / 2**20:.0f} MiB left on the disk of {path}, and perfmon leaves the last "
            f"{reserve / 2**20:.0f} MiB to the script ({RESERVE_ENV})")
