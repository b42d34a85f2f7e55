"""Where things live: the per-user runtime dir (sockets, discovery files) and run dirs."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path

#: What to do about an unusable runtime dir, for the one line that reports it.
RUNTIME_DIR_FIX = "set PERFMON_RUNTIME_DIR to a private dir"


class RuntimeDirError(RuntimeError):
    """The runtime dir exists but is not safely ours (or cannot be made): nothing in it is used."""

    def __init__(self, path: Path, problem: str, fix: str = RUNTIME_DIR_FIX) -> None:
        super().__init__(f"runtime dir {path} {problem}")
        self.path = path
        self.problem = problem
        self.fix = fix


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


#: The longest path a Unix socket may have (Linux's ``sun_path`` holds 108 bytes, its end a NUL).
SOCKET_PATH_MAX = 107


def socket_overflow(directory: Path) -> int | None:
    """How long, in bytes, the longest socket path perfmon makes in ``directory`` would be, where that is too long
    for a Unix socket; None where every one fits."""
    longest = len(os.fsencode(directory / f"{'9' * 7}.sock"))  # pids go up to 2**22: seven digits
    return None if longest <= SOCKET_PATH_MAX else longest


def runtime_dir(create: bool = True) -> Path:
    """Per-user dir for sockets and discovery files, mode 0700, owned by us.

    Raises :class:`RuntimeDirError` (never follows, never chmods) when the path is a symlink or
    not a directory, is owned by another user, or others can write to it: such a dir is not used
    at all. A dir of ours that others can only read is tightened to 0700.
    """
    path = configured_runtime_dir()
    longest = socket_overflow(path)
    if longest is not None:
        raise RuntimeDirError(path, f"is too long for a socket's path ({longest} bytes with the socket's name; "
                                    f"at most {SOCKET_PATH_MAX})", fix="set PERFMON_RUNTIME_DIR to a private dir with a shorter path")
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
    return f"perfmon: {exc}: not using it; {consequence} ({exc.fix})"


def ignores_signal(pid: int, signum: int) -> bool:
    """The process ignores ``signum`` (``SigIgn`` of /proc/PID/status: a job a script or a non-interactive shell
    started in the background, ``cmd &``, ignores SIGINT); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def pid_alive(pid: int) -> bool:
    """A process with this pid runs (another user's counts: it exists, we may not signal it). A zombie does not:
    a monitor killed with -9 whose parent never reaps it is gone for every purpose here."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such pid, or none could be: larger than a pid_t
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): existing is all we know


def socket_path(pid: int) -> Path:
    return runtime_dir() / f"{pid}.sock"


def discovery_path(pid: int) -> Path:
    return runtime_dir() / f"{pid}.json"


def default_run_dir(target: str, root: Path | None = None, now: float | None = None, claim: bool = False) -> Path:
    """``./perfmon-runs/<timestamp>-<script>/``, made unique if it already exists. ``claim``: create it, atomically,
    so that processes choosing at the same second (workers that each call ``perfmon.instrument()``) never share
    one; else only name it (the launcher creates it once the command line is known to be good)."""
    root = root or Path.cwd() / "perfmon-runs"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(target).stem if target.endswith(".py") else target) or "run"
    n = 0
    while True:
        n += 1
        candidate = root / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")
        if not claim:
            if not candidate.exists():
                return candidate
            continue
        root.mkdir(parents=True, exist_ok=True)
        try:
            candidate.mkdir()  # atomic: of two processes making the same name, one gets FileExistsError
            return candidate
        except FileExistsError:
            pass


#: Set by ``perfmon torchrun``: the job's workers record in ``RUN/rank-K/`` even when there is one of them.
RANKS_ENV = "PERFMON_RANKS"
#: Set by ``perfmon accelerate launch``: a process that no launcher gave a ``RANK`` (accelerate's simple launcher
#: starts one) records as rank 0 of a world of one, as under ``perfmon torchrun --nproc_per_node 1``. perfmon's
#: own variable: ``RANK``/``WORLD_SIZE`` would change what accelerate does in the script. The agent removes it.
SOLE_RANK_ENV = "PERFMON_SOLE_RANK"
#: Set by the launcher for the process it starts: its own pid.
LAUNCHER_ENV = "PERFMON_LAUNCHER_PID"
SAMPLE_INTERVAL_ENV = "PERFMON_SAMPLE_INTERVAL"


def sample_interval(env: Mapping[str, str]) -> float:
    """The job's telemetry interval in seconds as the launcher passes it (0: no sampling; default 1)."""
    try:
        return float(env.get(SAMPLE_INTERVAL_ENV) or 1.0)
    except ValueError:
        return 1.0


RANK_DIR_PREFIX = "rank-"
#: The job dir of the ranks a script spawned itself (``torch.multiprocessing.spawn``), inside the script's run dir.
SPAWNED_RANKS = "ranks"
#: What a launched script writes, in its run dir: its stdout, and its stderr (each its own, as without perfmon).
OUTPUT_LOG = "output.log"
STDERR_LOG = "stderr.log"


def stderr_log(run_dir: Path) -> Path:
    """Where the script's stderr is: ``stderr.log``, or ``output.log`` where both streams went there (a headless
    run into one terminal or ``2>&1`` log, and runs recorded before the split)."""
    path = Path(run_dir) / STDERR_LOG
    return path if path.exists() else Path(run_dir) / OUTPUT_LOG
#: A multi-rank job's launcher status (torchrun's exit), in the job dir: ``{"schema": 1, "returncode": int}``. The
#: ranks may all exit 0 from their own SIGTERM handlers while torchrun exits 1: the report reads it from here.
LAUNCHER_EXIT = "launcher-exit.json"


def trace_analysis(trace: Path) -> Path:
    """Where a monitor keeps its analysis of a profiler trace (``RUN/traces/T`` → ``RUN/analysis/T.summary.json``):
    written once, read by every later reader, and what keeps a window's numbers once its trace is gone."""
    return trace.parent.parent / "analysis" / (trace.name + ".summary.json")


def _env_int(env: dict[str, str] | os._Environ[str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.isdigit() else None


def placement(env: dict[str, str] | os._Environ[str] | None = None) -> dict[str, int | str | None]:
    """Where this process sits in a multi-process job, from the launcher's environment (torchrun, Slurm
    through torchrun, or any launcher that sets ``RANK``/``WORLD_SIZE``): rank, local rank, world size,
    node (torchrun's ``GROUP_RANK``) and the job's id. All None outside such a job."""
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK")
    world = _env_int(env, "WORLD_SIZE")
    if (rank is None or world is None) and env.get(SOLE_RANK_ENV) == "1":
        return {"rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node": 0,
                "job_id": f"{os.getppid()}"}
    if rank is None or world is None:
        return {"rank": None, "local_rank": _env_int(env, "LOCAL_RANK"), "world_size": None,
                "local_world_size": None, "node": None, "job_id": None}
    node = _env_int(env, "GROUP_RANK")
    if node is None:
        node = _env_int(env, "SLURM_NODEID")
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    slurm = env.get("SLURM_JOB_ID")
    if slurm and env.get("SLURM_STEP_ID"):
        slurm = f"{slurm}.{env['SLURM_STEP_ID']}"  # each srun step of an allocation is a job of its own
    job_id = (run_id if run_id and run_id != "none" else slurm) or f"{os.getppid()}"
    return {"rank": rank, "local_rank": _env_int(env, "LOCAL_RANK"), "world_size": world,
            "local_world_size": _env_int(env, "LOCAL_WORLD_SIZE"), "node": node, "job_id": job_id}


def is_ranked(where: dict[str, int | str | None], env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """This process records as one rank of a job (``RUN/rank-K/``): a world of more than one, or
    ``perfmon torchrun`` said so."""
    env = os.environ if env is None else env
    world = where.get("world_size")
    return where.get("rank") is not None and (env.get(RANKS_ENV) == "1" or (isinstance(world, int) and world > 1))


def rank_dir(job_dir: Path, rank: int) -> Path:
    return job_dir / f"{RANK_DIR_PREFIX}{rank}"


def job_run_dir(target: str, job_id: str, root: Path | None = None, started: float | None = None) -> Path:
    """The run dir every rank of one job agrees on without talking:
    ``./perfmon-runs/<date>-<script>-job<id>[-<HHMMSS>]/`` (torchrun's run id, else Slurm's job and step id, else
    the launcher's pid on this node; ``started``: when the launcher of the ranks started, so that a job run
    again under the same id gets a dir of its own)."""
    root = root or Path.cwd() / "perfmon-runs"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(target).stem if target.endswith(".py") else target) or "run"
    ident = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_id)[:40]
    if started is None:
        return root / f"{time.strftime('%Y%m%d')}-{name}-job{ident}"
    return root / f"{time.strftime('%Y%m%d', time.localtime(started))}-{name}-job{ident}-" \
                  f"{time.strftime('%H%M%S', time.localtime(started))}"


def rank_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The ranks recorded under a job's run dir, by rank (empty for a single-process run); a rank that
    torchrun restarted is read from its latest attempt (``rank-K.restartN``)."""
    latest: dict[int, tuple[int, Path]] = {}
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = re.fullmatch(rf"{RANK_DIR_PREFIX}(\d+)(?:\.restart(\d+))?", entry.name)
        if match is None or not entry.is_dir():
            continue
        rank, attempt = int(match.group(1)), int(match.group(2) or 0)
        if rank not in latest or attempt > latest[rank][0]:
            latest[rank] = (attempt, entry)
    return [(rank, latest[rank][1]) for rank in sorted(latest)]


def launched_alone(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """This process is the one ``perfmon SCRIPT`` started: not a rank of ``perfmon torchrun``, nor a process the
    job started (which inherits its environment), nor a script that called ``perfmon.instrument()``."""
    env = os.environ if env is None else env
    return env.get(LAUNCHER_ENV) == str(os.getppid()) and env.get(RANKS_ENV) != "1"
