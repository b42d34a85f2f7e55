"""Where things live: the per-user runtime dir (sockets, discovery files) and run dirs."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

#: What to do about an unusable runtime dir, for the one line that reports it.
RUNTIME_DIR_FIX = "set PERFMON_RUNTIME_DIR to a private dir"


class RuntimeDirError(RuntimeError):
    """The runtime dir exists but is not safely ours (or cannot be made): nothing in it is used."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"runtime dir {path} {problem}")
        self.path = path
        self.problem = problem


def configured_runtime_dir() -> Path:
    """The runtime dir's path: $PERFMON_RUNTIME_DIR, else $XDG_RUNTIME_DIR/perfmon, else /tmp/perfmon-<uid>."""
    base = os.environ.get("PERFMON_RUNTIME_DIR")
    if base:
        return Path(base)
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "perfmon"
    return Path("/tmp") / f"perfmon-{os.getuid()}"


def _unsafe(path: Path, st: os.stat_result) -> str | None:
    """What makes ``path`` (its lstat is ``st``) unsafe for sockets and discovery files; None if nothing."""
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"is a symlink (to {os.readlink(path)})"
        except OSError:
            return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"is owned by uid {st.st_uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        problems.append(f"has mode {mode:04o} (others can write to it)")
    return ", ".join(problems) or None


def runtime_dir(create: bool = True) -> Path:
    """Per-user dir for sockets and discovery files, mode 0700, owned by us.

    Raises :class:`RuntimeDirError` (never follows, never chmods) when the path is a symlink or
    not a directory, is owned by another user, or others can write to it: such a dir is not used
    at all. A dir of ours that others can only read is tightened to 0700.
    """
    path = configured_runtime_dir()
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # a file or a dangling symlink is in the way: the check below names it
        except OSError as exc:
            raise RuntimeDirError(path, f"cannot be created ({exc.strerror or exc})") from None
    try:
        st = path.lstat()
    except FileNotFoundError:
        if create:
            raise RuntimeDirError(path, "cannot be created (removed meanwhile)") from None
        return path
    except OSError as exc:
        raise RuntimeDirError(path, f"cannot be examined ({exc.strerror or exc})") from None
    problem = _unsafe(path, st)
    if problem is not None:
        raise RuntimeDirError(path, problem)
    if stat.S_IMODE(st.st_mode) != 0o700:
        _tighten(path, st)
    return path


def _tighten(path: Path, st: os.stat_result) -> None:
    """chmod 0700 the very dir that was checked (no symlink swapped in meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise RuntimeDirError(path, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise RuntimeDirError(path, "was replaced while being checked")
        os.fchmod(fd, 0o700)
    except OSError as exc:
        raise RuntimeDirError(path, f"cannot be made private ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def unusable_line(exc: RuntimeDirError, consequence: str) -> str:
    """The one line on stderr for a runtime dir that is not used: what is wrong, what follows, the fix."""
    return f"perfmon: {exc}: not using it; {consequence} ({RUNTIME_DIR_FIX})"


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
