"""``torch.multiprocessing.spawn``'s processes (the DDP tutorial's launcher), each followed as a rank of one job.

The job ``perfmon SCRIPT`` started calls ``mp.spawn(fn, args, nprocs)``: each process runs ``fn(i, *args)`` in an
interpreter that perfmon's launcher never started. The job hands them ``fn`` wrapped in :func:`run_rank`, which
starts an agent that records as rank ``i`` of ``nprocs`` in ``RUN/ranks/rank-i/`` (a job's run dir, as ``perfmon
torchrun`` writes one) and finishes it when ``fn`` returns or raises; what ``fn`` does, returns and raises is
unchanged. The job's own recording says where the ranks are (an ``event`` of kind ``ranks``), so that its monitors
follow them.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmon import paths, protocol
from perfmon.agent.native import HOT

#: The event a spawning job publishes (``job_dir``, ``world_size``).
EVENT = "ranks"


@dataclass(frozen=True)
class RankSpec:
    """What a spawned process needs to record as a rank (pickled to it with the function)."""

    job_dir: str
    world_size: int
    target: str
    argv: tuple[str, ...]


def follow(agent: Any, fn: Callable[..., Any], nprocs: int) -> Callable[..., Any]:
    """Say where the ranks will record, and return what each should run instead of ``fn``."""
    # a job dir of their own each time the script spawns (train, then evaluate): RUN/ranks, RUN/ranks-2, ...
    job_dir, n = Path(agent.run_dir) / paths.SPAWNED_RANKS, 1
    while job_dir.exists():
        n += 1
        job_dir = Path(agent.run_dir) / f"{paths.SPAWNED_RANKS}-{n}"
    job_dir.mkdir(parents=True)
    for name in (paths.OUTPUT_LOG, paths.STDERR_LOG):  # the ranks write where the script does: the job's output
        link = job_dir / name
        if not link.is_symlink() and not link.exists():
            os.symlink(Path("..") / name, link)
    spec = RankSpec(str(job_dir), int(nprocs), str(agent.meta.get("script") or "python"),
                    tuple(agent.meta.get("argv") or ()))
    agent.publish(protocol.message("event", kind=EVENT, t=time.time(), job_dir=str(job_dir), world_size=int(nprocs)))
    start = functools.partial(start_rank, spec)
    if HOT is not None:  # no frame of perfmon's in a rank's traceback
        return functools.partial(HOT.run_rank, start, finish_rank, fn)
    return functools.partial(run_rank, start, finish_rank, fn)


def run_rank(start: Callable[[int], Any], finish: Callable[[Any, BaseException | None], None],
             fn: Callable[..., Any], i: int, *args: Any) -> Any:
    """``_hot.run_rank`` in Python (where the C hooks were not built): its frame shows in a rank's traceback."""
    token = start(i)
    try:
        result = fn(i, *args)
    except BaseException as exc:
        finish(token, exc)
        raise
    finish(token, None)
    return result


def start_rank(spec: RankSpec, i: int) -> Any:
    """In a spawned process, before ``fn``: an agent recording rank ``i`` (None if it cannot start)."""
    from perfmon import _api
    from perfmon.agent import bootstrap

    inherited = _api.get_agent()
    if inherited is not None:  # start_method="fork": the parent's agent came along, silenced
        bootstrap.forget_inherited(inherited)
    return bootstrap.start_agent(spec.target, list(spec.argv),
                                 rank=(Path(spec.job_dir), i, spec.world_size))


def finish_rank(agent: Any, exc: BaseException | None) -> None:
    """After ``fn``: record how the rank ended (``exc``: what it raised, which goes on to torch's wrapper)."""
    from perfmon.agent import bootstrap

    info: dict[str, Any] = {"code": 0, "signal": None, "exception": None, "traceback": None}
    if isinstance(exc, SystemExit):
        info["code"] = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    elif isinstance(exc, KeyboardInterrupt):
        info.update(code=None, signal="SIGINT", exception="KeyboardInterrupt")
    elif exc is not None:
        message = protocol.exception_line("".join(traceback.format_exception_only(type(exc), exc)))
        info.update(code=1, exception=(message or type(exc).__name__)[:500],
                    traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:])
    bootstrap.finish_agent(agent, info)
