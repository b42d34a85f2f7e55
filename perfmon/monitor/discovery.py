"""Finding live runs on this machine: the agents' discovery files in the runtime dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from perfmon import paths, protocol

#: The types of a discovery record's fields (each may also be missing or null): a file that says otherwise was not
#: written by an agent, and is left out instead of failing ``perfmon ls`` or ``attach`` with a traceback.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "start": (int, float), "updated": (int, float), "run_dir": str, "socket": str, "script": str, "host": str,
    "job_dir": str, "argv": list, "rank": int, "node": int, "world_size": int, "steps": int, "monitors": int,
    "protocol": int,
}


def _well_formed(info: Any) -> bool:
    return isinstance(info, dict) and all(
        info.get(k) is None or (isinstance(info[k], t) and not isinstance(info[k], bool)) for k, t in _FIELD_TYPES.items())


def live_runs() -> list[dict[str, Any]]:
    """Discovery records of agents that are still running (stale files are removed).

    An unsafe runtime dir is not read (its files could be anyone's): no runs, and one line on
    stderr says why."""
    try:
        rt = paths.runtime_dir(create=False)
    except paths.RuntimeDirError as exc:
        print(paths.unusable_line(exc, "no live runs can be listed"), file=sys.stderr, flush=True)
        return []
    if not rt.is_dir():
        return []
    runs = []
    for f in sorted(rt.glob("*.json")):
        try:
            info = json.loads(f.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        if not _well_formed(info):
            continue
        if not paths.pid_alive(pid):
            for stale in (f, Path(str(info.get("socket", "")))):
                try:
                    stale.unlink(missing_ok=True)
                except OSError:
                    pass
            continue
        runs.append(info)
    return runs


def group_jobs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Live runs with the ranks of one job folded into one entry: ``{"job_dir", "ranks": [run, ...], ...}``
    (the lowest rank's fields, steps summed as the lowest rank's); single runs as they are."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for run in runs:
        job_dir = run.get("job_dir")
        if isinstance(job_dir, str) and job_dir:
            if job_dir not in jobs:
                jobs[job_dir] = []
                out.append({"job_dir": job_dir, "ranks": jobs[job_dir]})
            jobs[job_dir].append(run)
        else:
            out.append(run)
    for entry in out:
        ranks = entry.get("ranks")
        if isinstance(ranks, list):
            ranks.sort(key=lambda r: r.get("rank") or 0)
            first = ranks[0]
            entry.update({k: first.get(k) for k in ("pid", "start", "argv", "script", "steps", "monitors",
                                                    "world_size")})
            entry["run_dir"] = entry["job_dir"]
    return out


def job_alive(job_dir: Path) -> bool:
    """Some rank of the job at ``job_dir`` still runs on this machine."""
    resolved = str(Path(job_dir).resolve())
    return any(str(Path(r.get("job_dir") or "").resolve()) == resolved for r in live_runs() if r.get("job_dir"))


class AttachError(Exception):
    """No such live run: the message is for the user."""


def _spawned_job(run: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live job of the ranks ``run`` spawned itself (torch.multiprocessing.spawn: ``RUN/ranks/``), if any."""
    if run.get("ranks") or not run.get("run_dir"):
        return None
    ranks_dir = (Path(run["run_dir"]) / paths.SPAWNED_RANKS).resolve()
    for entry in runs:
        if any(Path(k.get("run_dir", "")).resolve().parent == ranks_dir for k in entry.get("ranks") or ()):
            return entry
    return None


def _run_below(pid: int, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live run of a process that ``pid`` started, directly or not (None: none)."""
    import psutil

    try:
        below = {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return None
    for r in runs:
        if int(r["pid"]) in below or any(int(k.get("pid", -1)) in below for k in r.get("ranks") or ()):
            return r
    return None


def find_run(target: str | None) -> dict[str, Any]:
    """The live run named by a pid or a run dir (or the only live run); a rank's pid or dir, or a job's dir,
    names its whole job (an entry with ``ranks``)."""
    runs = group_jobs(live_runs())
    # a script whose ranks it spawned itself are live (torch.multiprocessing.spawn) stands for their job
    spawners = {id(r): job for r in runs if (job := _spawned_job(r, runs)) is not None}

    def chosen(r: dict[str, Any]) -> dict[str, Any]:
        return spawners.get(id(r), r)

    for entry in runs:
        for rank in entry.get("ranks") or ():
            if target is not None and (target == str(rank.get("pid")) or (not target.isdigit() and Path(
                    target).resolve() == Path(rank.get("run_dir", "")).resolve())):
                return entry
    if target is None:
        runs = [r for r in runs if id(r) not in spawners]  # each job once: its ranks' entry
        if len(runs) == 1:
            return runs[0]
        if not runs:
            raise AttachError("no live perfmon runs on this machine (perfmon ls)")
        raise AttachError(f"{len(runs)} live runs: name one by pid or run dir (perfmon ls)")
    if target.isdigit():
        for r in runs:
            if int(r["pid"]) == int(target):
                return chosen(r)
        if paths.pid_alive(int(target)):
            below = _run_below(int(target), runs)
            if below is not None:  # perfmon's launcher (``perfmon --headless train.py &`` then ``$!``), a shell
                return chosen(below)
            raise AttachError(f"pid {target} is not a perfmon run (start it with perfmon, or call perfmon.instrument())")
        ended = _ended_run(int(target))
        if ended is not None:
            raise AttachError(f"pid {target} has ended; its run: perfmon replay {ended} or perfmon report {ended}")
        raise AttachError(f"no process with pid {target} (a run that ended is read by perfmon replay RUN_DIR or "
                          "perfmon report RUN_DIR)")
    path = Path(target).resolve()
    for r in runs:
        if Path(r.get("run_dir", "")).resolve() == path:
            return chosen(r)
    if path.is_dir():
        if (path / "events.jsonl").exists() or paths.rank_dirs(path):
            raise AttachError(f"{target}: this run is not live any more; use perfmon replay {target} or perfmon report {target}")
        raise AttachError(f"{target}: no recording (events.jsonl) in this directory")
    raise AttachError(f"{target}: no such pid or run directory")


def _ended_run(pid: int, root: Path | None = None, newest: int = 50) -> Path | None:
    """The run dir under ``./perfmon-runs`` (the default place) whose recording began with ``pid``'s hello, among
    the ``newest`` run dirs; None where there is none."""
    root = root or Path.cwd() / "perfmon-runs"
    try:
        dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name, reverse=True)[:newest]
    except OSError:
        return None
    for d in dirs:
        try:
            with open(d / "events.jsonl", "rb") as f:
                first = json.loads(f.readline(1 << 16) or b"{}")
        except (OSError, ValueError):
            continue
        if isinstance(first, dict) and protocol.hello_pid(first) == pid:
            return d
    return None
