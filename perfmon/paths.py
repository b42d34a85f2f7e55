"""Where things live: the per-user runtime dir (sockets, discovery files) and run dirs."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path


class RuntimeDirError(RuntimeError):
    """The runtime dir exists but is not safely ours."""


def runtime_dir(create: bool = True) -> Path:
    """Per-user dir for sockets and discovery files, mode 0700, owned by us."""
    base = os.environ.get("PERFMON_RUNTIME_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "perfmon"
    else:
        path = Path("/tmp") / f"perfmon-{os.getuid()}"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeDirError(f"{path} is not a directory owned by this user")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)
    return path


def socket_path(pid: int) -> Path:
    return runtime_dir() / f"{pid}.sock"


def discovery_path(pid: int) -> Path:
    return runtime_dir() / f"{pid}.json"


def default_run_dir(target: str, root: Path | None = None, now: float | None = None) -> Path:
    """``./perfmon-runs/<timestamp>-<script>/``, made unique if it already exists."""
    root = root or Path.cwd() / "perfmon-runs"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(target).stem if target.endswith(".py") else target) or "run"
    candidate = root / f"{stamp}-{name}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = root / f"{stamp}-{name}-{n}"
    return candidate
