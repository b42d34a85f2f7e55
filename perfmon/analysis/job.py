"""A multi-process job (torchrun, Slurm, any launcher): one :class:`RunState` per rank, and the rows of the
all-ranks table that the dashboard, headless mode and the report share.

A job's run dir holds ``rank-K/`` per rank, each an ordinary recording. Live, the monitor reads every
rank's stream; messages carry the rank they came from in :data:`RANK_KEY` (added by the job source,
never by an agent).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfmon import paths
from perfmon.analysis.records import Step
from perfmon.analysis.state import RECENT_STEPS, RunState
from perfmon.messages import Reset, parse
from perfmon.protocol import ALL_PHASES

#: The key a job source adds to each message: which rank sent it.
RANK_KEY = "_rank"
#: ... and which attempt of it (torchrun restarts a failed job's workers: ``rank-K.restartN``).
ATTEMPT_KEY = "_attempt"


class JobState:
    """Every rank's state, folded from one merged stream (messages tagged with :data:`RANK_KEY`)."""

    def __init__(self) -> None:
        self.ranks: dict[int, RunState] = {}
        self.attempts: dict[int, int] = {}  # the attempt each rank's state is of
        self.returncode: int | None = None  # the launcher's (torchrun's) exit status, once it ended

    def rank(self, rank: int) -> RunState:
        """The state of ``rank`` (made empty on first use)."""
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RunState()
        return state

    def apply(self, msg: dict[str, Any]) -> None:
        """Fold one message of the merged stream into the state of the rank it is tagged with (parsed once,
        here: the tags are the job source's, the rest is the rank's own message)."""
        rank = msg.get(RANK_KEY)
        if not isinstance(rank, int):
            return
        m = parse(msg)
        if isinstance(m, Reset):  # a replay restarting: every rank starts over
            self.ranks.clear()
            self.attempts.clear()
            return
        attempt = msg.get(ATTEMPT_KEY)
        attempt = attempt if isinstance(attempt, int) else 0
        known = self.attempts.get(rank, attempt)
        if attempt < known:
            return  # the end of an attempt torchrun has replaced
        if attempt > known:
            self.ranks[rank] = RunState()  # a restarted worker: a new process, its own numbering
        self.attempts[rank] = attempt
        self.rank(rank).apply(m)

    def process_exited(self, returncode: int) -> None:
        """The job's launcher ended: ranks that recorded no exit of their own ended with it."""
        self.returncode = returncode
        for state in self.ranks.values():
            if state.exit is None:
                state.process_exited(returncode)

    @property
    def world_size(self) -> int:
        """The world size the ranks reported (or how many ranks were seen)."""
        sizes = [s.meta.world_size for s in self.ranks.values() if s.meta.world_size]
        return max(sizes) if sizes else len(self.ranks)

    @property
    def ended(self) -> bool:
        """Every rank the job has recorded its exit (the launcher may still be tearing down)."""
        return bool(self.ranks) and len(self.ranks) >= self.world_size and all(
            s.exit is not None for s in self.ranks.values())

    def failed_rank(self) -> tuple[int, RunState] | None:
        """The rank that took the job down: the first to exit with an error of its own (not the SIGTERM
        torchrun sends the others when one fails)."""
        failed = [(s.exit.t or 0.0, r, s) for r, s in self.ranks.items()
                  if s.exit is not None and (s.exit.exception or (s.exit.code not in (0, None)))
                  and s.exit.signal not in ("SIGTERM", "SIGINT")]
        if not failed:
            return None
        _, rank, state = min(failed, key=lambda x: (x[0], x[1]))
        return rank, state


@dataclass(frozen=True)
class RankRow:
    """One rank in the all-ranks table and the report's ``ranks``: steady-state numbers (past warm-up,
    outside profiler windows) so that ranks compare like for like."""

    rank: int
    node: int | None
    host: str | None
    steps: int
    step_ms: float | None  # median step time
    mean_ms: float | None = None  # mean step time: the phases add up to it (what ranks are compared by)
    steady: int = 0  # the steps these numbers come from
    phases: dict[str, float] = field(default_factory=dict)  # mean ms per step of each phase
    # median ms of each phase: a rank's typical step (a wait now and then, at a barrier while rank 0 evaluates
    # between steps, lifts its mean only); empty where not known
    phases_median: dict[str, float] = field(default_factory=dict)
    allocated_bytes: float | None = None  # the allocator's peak allocated (CUDA), else None
    util_gpu: float | None = None  # its GPU's utilization now, %
    cpu_percent: float | None = None
    rss_bytes: float | None = None
    roots: tuple[str, ...] = ()  # the model's top-level classes (DataParallel, DistributedDataParallel...)
    comm_share: float | None = None  # communication kernels' share of busy GPU time, last profiler window
    status: str = "running"
    steps_per_s: float | None = None  # over the recent steps
    samples_per_s: float | None = None

    @property
    def memory_bytes(self) -> float | None:
        """The rank's memory in the tables: CUDA peak allocated where there is a GPU, else its RSS."""
        return self.allocated_bytes or self.rss_bytes or None


#: which steps a rank's row describes (:func:`steady_steps`), as its tables say it
STEADY_WORDS = f"the last {RECENT_STEPS} steps past warm-up"


def steady_steps(state: RunState, warmup: int = 30, min_steps: int = 20) -> list[Step]:
    """The rank's recent steps past warm-up and outside windows; a short run keeps all but its first two."""
    kept = [s for s in state.recent if not s.windowed]
    past = [s for s in kept if s.i > warmup]
    return past if len(past) >= min_steps else [s for s in kept if s.i > 2]


def rank_row(rank: int, state: RunState, warmup: int = 30, min_steps: int = 20) -> RankRow:
    steps = steady_steps(state, warmup, min_steps)
    durations = [s.dur for s in steps]
    meta = state.meta
    gpu = None
    if state.gpus:
        local = meta.local_rank if meta.local_rank is not None and meta.local_rank < len(state.gpus) else 0
        gpu = state.gpus[local]
    cm = state.cuda_mem
    host = state.recent_host()
    breakdown = state.profiles[-1].breakdown if state.profiles else None
    comm = breakdown.communication if breakdown is not None else None
    return RankRow(
        rank=rank, node=meta.node, host=meta.host, steps=state.steps,
        step_ms=statistics.median(durations) if durations else None,
        mean_ms=sum(durations) / len(durations) if durations else None, steady=len(durations),
        phases={p: sum(s.ms(p) for s in steps) / len(steps) for p in ALL_PHASES} if steps else {},
        phases_median={p: statistics.median(s.ms(p) for s in steps) for p in ALL_PHASES} if steps else {},
        allocated_bytes=(cm.peak_allocated_bytes if cm else None) or state.peaks.allocated_bytes,
        util_gpu=gpu.util_gpu if gpu else None,
        cpu_percent=host.cpu_percent if host else None, rss_bytes=host.rss_bytes if host else None,
        roots=tuple(state.model.roots) if state.model else (),
        comm_share=comm,
        status=state.status, steps_per_s=state.steps_per_s(), samples_per_s=state.samples_per_s(),
    )


def rank_rows(job: JobState, warmup: int = 30, min_steps: int = 20) -> list[RankRow]:
    return [rank_row(r, job.ranks[r], warmup, min_steps) for r in sorted(job.ranks)]


def work_ms(rows: list[RankRow], typical: bool = False) -> dict[int, float]:
    """Each rank's own work per step (ms): its mean step less the backward time beyond the quickest rank's
    (``typical``: of its median step and phases).

    In DDP the fast ranks wait for the slowest one inside backward (the gradient all-reduce), so every rank's
    step takes as long; the wait is what a rank's backward takes beyond the least any rank's takes."""
    def step(r: RankRow) -> float | None:
        return r.step_ms if typical else r.mean_ms

    def phases(r: RankRow) -> dict[str, float]:
        return r.phases_median if typical else r.phases

    timed = [r for r in rows if step(r) is not None and phases(r)]
    if not timed:
        return {}
    least = min(phases(r).get("backward", 0.0) for r in timed)
    return {r.rank: (step(r) or 0.0) - (phases(r).get("backward", 0.0) - least) for r in timed}


def rank_gaps(rows: list[RankRow]) -> dict[int, float]:
    """How much more each rank does per step than the median of the other ranks, as a fraction: the larger
    of its mean step's excess (ranks that do not wait for each other) and its work's (:func:`work_ms`). Where
    the ranks' typical (median) steps are known, no more than those show: a rank that waits now and then (at a
    barrier while rank 0 evaluates or saves between steps, which lands in its next step) does not hold the
    job back, and a rank that does is slower in most of its steps."""
    gaps = _gaps(rows, typical=False)
    if gaps and all(r.phases_median and r.step_ms for r in rows if r.rank in gaps):
        usual = _gaps(rows, typical=True)
        gaps = {r: min(g, usual.get(r, g)) for r, g in gaps.items()}
    return gaps


def _gaps(rows: list[RankRow], typical: bool) -> dict[int, float]:
    work = work_ms(rows, typical)
    if len(work) < 2:
        return {}
    timed = [r for r in rows if r.rank in work]

    def others(rank: int, value: dict[int, float]) -> float:
        return max(1e-9, statistics.median([v for r, v in value.items() if r != rank]))  # idle ranks: no division by 0

    step = {r.rank: (r.step_ms if typical else r.mean_ms) or 0.0 for r in timed}
    return {r: max(step[r] / others(r, step) - 1.0, work[r] / others(r, work) - 1.0) for r in work}


def slowest(rows: list[RankRow]) -> RankRow | None:
    """The rank the others wait for: the largest :func:`rank_gaps` (None with fewer than two ranks)."""
    gaps = rank_gaps(rows)
    if not gaps:
        return None
    rank = max(gaps, key=lambda r: (gaps[r], -r))
    return next(r for r in rows if r.rank == rank)


def throughput(rows: list[RankRow]) -> tuple[float | None, float | None]:
    """The job's pace: steps/s of its slowest rank (they step together) and samples/s of every rank together."""
    steps = [r.steps_per_s for r in rows if r.steps_per_s]
    samples = [r.samples_per_s for r in rows if r.samples_per_s]
    return (min(steps) if steps else None), (sum(samples) if samples else None)


def load_job(run_dir: Path) -> JobState:
    """Every rank's recording under ``run_dir`` (``rank-K/events.jsonl``)."""
    from perfmon.analysis.report import ReportError, load_recording

    job = JobState()
    ranks = paths.rank_dirs(Path(run_dir))
    if not ranks:
        raise ReportError(f"{run_dir}: no rank recordings (rank-K/events.jsonl) in this directory")
    for rank, path in ranks:
        try:
            job.ranks[rank] = load_recording(path)
        except ReportError:
            continue  # a rank that never started its agent: the others still tell the story
    if not job.ranks:
        raise ReportError(f"{run_dir}: none of its rank dirs holds a recording")
    job.returncode = launcher_returncode(Path(run_dir))
    return job


def launcher_returncode(run_dir: Path) -> int | None:
    """The job's launcher's exit status, where the launcher recorded it (``paths.LAUNCHER_EXIT``)."""
    try:
        value = json.loads((run_dir / paths.LAUNCHER_EXIT).read_text()).get("returncode")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: How much of the end of a rank's recording :func:`ranks_stepping` reads: a stepping rank writes a ``steps``
#: message every second, a rank that does not only its readings (~1 KiB a second).
STEPPING_TAIL = 64 * 1024


def ranks_stepping(job_dir: Path) -> bool:
    """A rank of the job in ``job_dir`` trains (its recording has steps). The ranks a script spawned are followed
    from then on: processes spawned to preprocess, or a start that failed, leave the script's own run on show."""
    for _, rank_dir in paths.rank_dirs(Path(job_dir)):
        try:
            with open(rank_dir / "events.jsonl", "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - STEPPING_TAIL))
                if b'"rows":[[' in f.read():  # a steps message with a row (not one of time outside steps only)
                    return True
        except OSError:
            continue
    return False


def stepping_spawn(spawned: list[Any]) -> Path | None:
    """Of the jobs a script spawned (``RunState.spawned``), the first whose ranks step: the one monitors follow."""
    return next((Path(s.job_dir) for s in spawned if ranks_stepping(Path(s.job_dir))), None)


def spawned_ranks(run_dir: Path) -> Path | None:
    """The job of the ranks the script recorded in ``run_dir`` spawned itself (``RUN/ranks/``), if it did."""
    ranks = Path(run_dir) / paths.SPAWNED_RANKS
    return ranks if (Path(run_dir) / "events.jsonl").is_file() and is_job_dir(ranks) else None


def is_job_dir(run_dir: Path) -> bool:
    """A multi-rank job's run dir (``rank-K/`` inside, no recording of its own)."""
    run_dir = Path(run_dir)
    return not (run_dir / "events.jsonl").exists() and bool(paths.rank_dirs(run_dir))



#: How long a warning some ranks said waits for the job's other ranks to say it too, so that it is one line for
#: all of them (ranks start, and reach the same place, seconds apart on a busy host).
WARNING_HOLD_S = 10.0


class WarningFeed:
    """The agent's warnings not yet taken, of one run or of every rank of a job: ``(who, text)`` pairs, ``who``
    being "" for one run and "ranks 0, 1" for the ranks of a job that said the same text (eight ranks warning alike
    make one). A job's warning that not every rank has said yet is held up to :data:`WARNING_HOLD_S` for the
    others, unless the job has ended. A state replaced (a restarted rank) or reset (a replay that starts over) is
    read from its start."""

    def __init__(self, hold_s: float = WARNING_HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: dict[int | None, tuple[RunState, int]] = {}  # by rank (None: the one run)
        self._held: dict[str, tuple[list[int | None], float]] = {}  # text: the ranks that said it, since when
        self._hold_s, self._clock = hold_s, clock

    def new(self, state: RunState | None = None, job: JobState | None = None,
            final: bool = False) -> list[tuple[str, str]]:
        """What came in since the last call, less what waits for more ranks (call with the state lock held).
        ``final``: the job is over, everything held is said."""
        states = sorted(job.ranks.items()) if job is not None else [(None, state)] if state is not None else []
        now = self._clock()
        for rank, st in states:
            before = self._seen.get(rank)
            for text in st.warnings_since(before[1] if before is not None and _same_run(before[0], st) else 0):
                ranks, since = self._held.setdefault(text, ([], now))
                if rank not in ranks:
                    ranks.append(rank)
            self._seen[rank] = (st, st.warnings_seen)
        every = final or job is None or job.ended
        out: list[tuple[str, str]] = []
        for text, (ranks, since) in list(self._held.items()):
            if every or len(ranks) >= job.world_size or now - since >= self._hold_s:
                del self._held[text]
                who = sorted(ranks, key=lambda r: -1 if r is None else r)
                out.append(("" if who == [None] else f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}",
                            text))
        return out


def _same_run(before: RunState, now: RunState) -> bool:
    """``now`` is ``before``, or the same process's recording read again (a job's ranks reloaded at its end), not a
    restarted rank or another run."""
    if now is before:
        return True
    a, b = before.meta, now.meta
    return a.pid is not None and (a.pid, a.start) == (b.pid, b.start)


def warning_line(who: str, text: str) -> str:
    """``[perfmon] warning: ...``, or ``[perfmon] warning (ranks 0, 1): ...``: how every monitor says one."""
    return f"[perfmon] warning{f' ({who})' if who else ''}: {text}"
