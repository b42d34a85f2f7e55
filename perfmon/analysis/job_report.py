"""Summaries of a multi-rank job: the report JSON (the single-run keys for the job, plus ``ranks`` and
``world_size``), the headless status line and the summary table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from perfmon import paths
from perfmon.analysis.job import STEADY_WORDS, JobState, RankRow, load_job, rank_rows, slowest
from perfmon.analysis.report import (
    _fmt_ms,
    build_summary,
    format_duration,
    format_saved_finding,
    outside_line,
    write_summary,
)
from perfmon.analysis.rules import Config, evaluate_job, evaluate_once
from perfmon.protocol import ALL_PHASES, PHASE_SHORT


def job_findings(job: JobState, cfg: Config | None = None) -> list[dict[str, Any]]:
    """The job's findings: those across ranks first, then each rank's own (one entry per finding that says
    the same of several ranks, naming the ranks it holds on)."""
    cfg = cfg or Config()
    out = [f.to_json() for f in evaluate_job(rank_rows(job, cfg.warmup_steps, cfg.min_steps), cfg)]
    by_kind: dict[tuple[str, str], dict[str, Any]] = {}
    for rank in sorted(job.ranks):
        for f in evaluate_once(job.ranks[rank], cfg):
            # one entry per finding that says the same of each rank, its figures aside: rank 1's "Biggest phase:
            # other" is not rank 0's "Biggest phase: backward" (the first rank's figures stand for the others)
            kind = (f.id, _FIGURES.sub("#", f.title))
            entry = by_kind.get(kind)
            if entry is None:
                entry = by_kind[kind] = {**f.to_json(), "rank": rank, "ranks": []}
            entry["ranks"].append(rank)
    return out + list(by_kind.values())


_FIGURES = re.compile(r"\d[\d,.]*")


def _exit(job: JobState) -> dict[str, Any]:
    failed = job.failed_rank()
    if failed is not None:
        rank, state = failed
        assert state.exit is not None
        # the job's exception and signal are the failed rank's: the others' are what its failure did to them (a
        # peer's closed connection, torchrun's SIGTERM)
        return {"exit_code": state.exit_status if job.returncode is None else _status(job.returncode),
                "exception": state.exit.exception, "signal": state.exit.signal,
                "failed_rank": {"rank": rank, "exit_code": state.exit_status, "exception": state.exit.exception,
                                "signal": state.exit.signal}}
    if job.returncode is not None:
        return {"exit_code": _status(job.returncode), "failed_rank": None}
    codes = [s.exit_status for s in job.ranks.values() if s.exit is not None]
    worst = max(codes, key=lambda c: c != 0) if codes else None
    return {"exit_code": worst if len(codes) == len(job.ranks) else None, "failed_rank": None}


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def build_job_summary(job: JobState, run_dir: Path | None, cfg: Config | None = None) -> dict[str, Any]:
    """The job's report JSON: the lowest rank's summary as the job's (in data-parallel training every rank
    runs the same steps), with the job's exit, its findings, ``world_size`` and ``ranks``."""
    cfg = cfg or Config()
    ranks = sorted(job.ranks)
    summaries = {r: build_summary(job.ranks[r], evaluate_once(job.ranks[r], cfg)) for r in ranks}
    out = dict(summaries[ranks[0]])
    out.update(_exit(job))
    out["complete"] = all(s["complete"] for s in summaries.values())
    out["run_dir"] = str(run_dir) if run_dir is not None else out["run_dir"]
    out["world_size"] = job.world_size
    out["nodes"] = len({job.ranks[r].meta.node for r in ranks})
    out["findings"] = job_findings(job, cfg)
    out["ranks"] = [{
        "rank": r, "node": job.ranks[r].meta.node, "hostname": job.ranks[r].meta.host,
        "local_rank": job.ranks[r].meta.local_rank, "pid": s["pid"], "steps": s["steps"],
        "step_ms": s["step_ms"], "phases": s["phases"], "device": s["device"], "host": s["host"],
        "exit_code": s["exit_code"], "exception": s["exception"], "signal": s["signal"], "run_dir": s["run_dir"],
    } for r, s in summaries.items()]
    return out


def write_job_summaries(job: JobState, run_dir: Path, cfg: Config | None = None) -> dict[str, Any]:
    """RUN/summary.json for the job and RUN/rank-K/summary.json for each rank; returns the job's."""
    cfg = cfg or Config()
    for state in job.ranks.values():
        if state.meta.run_dir:
            write_summary(Path(state.meta.run_dir), build_summary(state, evaluate_once(state, cfg)))
    summary = build_job_summary(job, run_dir, cfg)
    write_summary(run_dir, summary)
    return summary


def job_status(job: JobState) -> str:
    """One line: running, exited 0, or which rank failed and how."""
    failed = job.failed_rank()
    if failed is not None:
        rank, state = failed
        return f"rank {rank} {state.status}" + (f" (job exit {_status(job.returncode)})" if job.returncode else "")
    if job.returncode is not None:
        return "exited 0" if job.returncode == 0 else f"exited {_status(job.returncode)}"
    if job.ended:
        return "exited " + ",".join(sorted({str(s.exit_status) for s in job.ranks.values()}))
    return "running"


def rank_table(rows: list[RankRow]) -> list[str]:
    """The all-ranks table as text lines (headless summary and report)."""
    slow = slowest(rows)
    head = f"  {'rank':>4} {'node':>4} {'steps':>7} {'p50 ms':>9}" + "".join(
        f" {PHASE_SHORT[p]:>7}" for p in ALL_PHASES) + f" {'mem':>9}  status"
    lines = [head]
    for r in rows:
        mem = f"{r.memory_bytes / 2**30:.2f}G" if r.memory_bytes else "n/a"
        mark = " <- slowest" if slow is not None and r.rank == slow.rank else ""
        node = "?" if r.node is None else str(r.node)
        lines.append(f"  {r.rank:>4} {node:>4} {r.steps:>7} {_fmt_ms(r.step_ms):>9}" + "".join(
            f" {_fmt_ms(r.phases.get(p)):>7}" for p in ALL_PHASES) + f" {mem:>9}  {r.status}{mark}")
    return lines


def format_job_summary(job: JobState, summary: dict[str, Any]) -> str:
    s = summary
    argv = " ".join(s["argv"]) or s["script"] or "?"
    nodes = s["nodes"]
    here = f"{len(s['ranks'])} of {s['world_size']} ranks here, on" if len(s["ranks"]) < s["world_size"] else \
        f"{s['world_size']} rank{'s' if s['world_size'] != 1 else ''} on"
    lines = [
        f"perfmon job summary: {argv}  ({here} {nodes} node{'s' if nodes != 1 else ''})",
        f"  run dir   {s['run_dir']}",
        f"  status    {job_status(job)}",
        f"  steps     {s['steps']} (rank {min(job.ranks)}) in {format_duration(s['elapsed_s'])}",
        *([line + f" (rank {min(job.ranks)})"] if (line := outside_line(s["outside_steps"])) else []),
        "",
        f"  per rank (mean ms per step of each phase, {STEADY_WORDS})",
        *rank_table(rank_rows(job)),
    ]
    failed = s.get("failed_rank")
    if failed:
        lines += ["", f"  rank {failed['rank']} failed: {failed['exception'] or failed['signal'] or failed['exit_code']}",
                  f"  its traceback: {paths.stderr_log(Path(s['run_dir']))}"]
    if s["findings"]:
        lines += ["", "  findings"]
        for f in s["findings"]:
            ranks = f.get("ranks")
            where = f" (ranks {', '.join(map(str, ranks))})" if ranks else ""
            lines.append(format_saved_finding({**f, "title": f["title"] + where}))
    return "\n".join(lines)


def job_status_line(job: JobState) -> str:
    """One line for headless logs: the job's steps and the ranks' median step times."""
    rows = rank_rows(job)
    if not rows:
        return "[perfmon] waiting for the ranks to start"
    slow = slowest(rows)
    per_rank = " ".join(f"r{r.rank} {r.steps}@{_fmt_ms(r.step_ms)}ms" for r in rows)
    tail = f" | slowest rank {slow.rank}" if slow is not None else ""
    return f"[perfmon] {len(rows)}/{job.world_size} ranks | {per_rank}{tail}"


def wait_for_ranks(run_dir: Path, timeout: float, poll: float = 1.0) -> None:
    """Until every rank's recording ends with its exit (or its process is gone), at most ``timeout`` s."""
    import time

    from perfmon.recording import recording_ended

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(recording_ended(d) for _, d in paths.rank_dirs(run_dir)):
            return
        time.sleep(poll)


def job_report_main(run_dir: Path, as_json: bool, rules: Config | None = None, write: bool = False,
                    wait: float = 0.0) -> int:
    if wait > 0:
        wait_for_ranks(run_dir, wait)
    job = load_job(run_dir)
    summary = write_job_summaries(job, run_dir, rules) if write else build_job_summary(job, run_dir, rules)
    if write:
        return 0
    print(json.dumps(summary, indent=2) if as_json else format_job_summary(job, summary))
    return 0
