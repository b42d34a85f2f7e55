"""Watching a multi-rank job that perfmon launched (``perfmon torchrun ...``): follow every rank, and
when the launcher ends, complete each rank's recording and write the job's summaries."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from perfmon import paths
from perfmon.analysis.job import JobState, WarningFeed, load_job, rank_rows, warning_line
from perfmon.analysis.job_report import format_job_summary, job_status_line, write_job_summaries
from perfmon.analysis.report import ReportError
from perfmon.analysis.rules import Config, evaluate_job
from perfmon.monitor.exit_like import exit_status
from perfmon.monitor.headless import ScriptOutput
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.launch import (
    SUMMARY_FAILED,
    TrainingProcess,
    finalize_recording,
    guarded_summary,
    print_summary,
    signals_to,
)


def job_source(proc: TrainingProcess) -> JobSource:
    return JobSource(proc.run_dir, proc.runtime_dir, proc.alive, follow=True)


def start_nodes(proc: TrainingProcess, source: JobSource) -> tuple[Any, str | None]:
    """A multi-node job: this node's hub or relay (:mod:`perfmon.monitor.multinode`), and one line that says
    which; (None, None) for a job on one node."""
    from perfmon.monitor import multinode

    if not proc.target.torchrun:  # several machines are torchrun's (`perfmon accelerate launch` refuses them)
        return None, None
    try:
        node = multinode.start(proc.target.args, source, lambda: job_source(proc), proc.alive)
    except OSError as exc:
        return None, f"perfmon: multi-node: cannot set up ({exc.strerror or exc}); this node's ranks only"
    if node is None:
        return None, None
    ep = node.ep if isinstance(node, multinode.Relay) else multinode.endpoint(proc.target.args)
    if isinstance(node, multinode.Hub):
        return node, (f"perfmon: multi-node job: this node is the hub; the other nodes' ranks arrive on "
                      f"{ep.host}:{ep.hub_port} (authenticated with the job secret)")
    return node, (f"perfmon: multi-node job: relaying this node's ranks to the hub at {ep.host}:{ep.hub_port}; "
                  "every rank shows on that node's dashboard")


def follow_job(source: JobSource, job: JobState, lock: threading.Lock) -> threading.Thread:
    """Fold every rank's messages into ``job`` on a daemon thread."""

    def run() -> None:
        for msg in source.messages():
            with lock:
                job.apply(msg)

    thread = threading.Thread(target=run, name="perfmon-follow-job", daemon=True)
    thread.start()
    return thread


def finalize_job(run_dir: Path, job: JobState, returncode: int, rules: Config | None = None,
                 lock: Any = None) -> dict[str, Any] | None:
    """The launcher ended: a rank whose agent died without recording its exit gets one (the job's
    status), every rank's summary.json and the job's are written from the recordings. ``lock``: held while ``job``
    is read or changed (a dashboard still drawing it), not while the recordings are read."""
    held = lock if lock is not None else contextlib.nullcontext()
    with held:
        job.process_exited(returncode)
        ranks = dict(job.ranks)
    try:  # what `perfmon report RUN` reads for the job's status later (the ranks' own exits may differ)
        (run_dir / paths.LAUNCHER_EXIT).write_text(json.dumps({"schema": 1, "returncode": returncode}) + "\n")
    except OSError:
        pass
    for rank, rank_dir in paths.rank_dirs(run_dir):
        state = ranks.get(rank)
        if state is not None and (rank_dir / "events.jsonl").exists():
            finalize_recording(rank_dir, state, returncode, rules, complete=False, lock=lock)
    try:
        recorded = load_job(run_dir)
    except ReportError:
        return None
    recorded.returncode = returncode
    for rank, state in ranks.items():  # ranks of other nodes (multi-node hub): as their stream told
        recorded.ranks.setdefault(rank, state)
    with held:
        job.ranks = recorded.ranks
    return guarded_summary(lambda: write_job_summaries(recorded, run_dir, rules), run_dir)


class SpawnedRanks:
    """The ranks a launched script spawned itself (``torch.multiprocessing.spawn``) seen as a job: their dir
    (``RUN/ranks/``) and, for everything else (its life, its end, the signals it gets), the script's process."""

    def __init__(self, proc: TrainingProcess, job_dir: Path) -> None:
        self._proc = proc
        self.run_dir = job_dir

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)


def other_spawns(spawned: list[Any], followed: Path) -> list[str]:
    """A line for each job of spawned ranks the monitor did not follow (``RunState.spawned``), saying where it is."""
    return [f"perfmon: the script spawned other ranks too: perfmon report {s.job_dir}" for s in spawned
            if Path(s.job_dir) != followed]


def run_headless_job(proc: TrainingProcess, interval: float, err: Any = None, rules: Config | None = None,
                     exports: Any = None, tail: ScriptOutput | None = None) -> int:
    """``perfmon --headless torchrun ...``: torchrun's stdout and stderr on ours, the job's status lines and new job
    findings on stderr, the job summary at the end. ``tail``: the output already being copied (the ranks of a
    script that spawned them: :class:`SpawnedRanks`, one node)."""
    err = err or sys.stderr
    cfg = rules or Config()
    job = JobState()
    lock = threading.Lock()
    spawned = tail is not None
    tail = tail or ScriptOutput(proc.run_dir, combined=proc.combined_output)
    fresh = tail.fresh_line if err is sys.stderr else str  # the script's output is copied to our own streams
    said: set[tuple[str, Any]] = set()
    warnings = WarningFeed()
    with signals_to(proc):
        source = job_source(proc)
        if exports is not None:  # one label set / series per rank
            exports.watch(lock, job=job, cfg=rules, send=source.send)
        node, line = start_nodes(proc, source) if not spawned else (None, None)
        if line:
            print(fresh() + line, file=err, flush=True)
        follower = follow_job(source, job, lock)
        next_status = next_rules = time.monotonic() + 1.0
        next_status += interval - 1.0
        relay_said: str | None = None
        while proc.alive():
            tail.pump()
            tail.break_job_streams(source.send, frozenset(source.ranks_connected()))
            relay_error = getattr(node, "error", None)  # a relay that cannot reach or convince the hub
            if relay_error and relay_error != relay_said:
                relay_said = relay_error
                print(f"{fresh()}[perfmon] multi-node: {relay_error} (retrying)", file=err, flush=True)
            now = time.monotonic()
            if now >= next_rules:
                with lock:
                    found = evaluate_job(rank_rows(job, cfg.warmup_steps, cfg.min_steps), cfg)
                    said_now = warnings.new(job=job)
                for who, text in said_now:
                    print(fresh() + warning_line(who, text), file=err, flush=True)
                for finding in found:
                    key = (finding.id, finding.evidence.get("rank"))
                    if key not in said:
                        said.add(key)
                        print(f"{fresh()}[perfmon] finding [{finding.severity}] {finding.id}: {finding.title}\n"
                              f"      fix: {finding.fix}", file=err, flush=True)
                next_rules = now + 5.0
            if now >= next_status:
                with lock:
                    line = job_status_line(job)
                print(fresh() + line, file=err, flush=True)
                next_status = now + interval
            time.sleep(0.1)
        returncode = proc.wait()
        follower.join(timeout=10.0)
        if exports is not None:
            exports.close()
        source.close()
        if node is not None:
            node.close()
        tail.drain()
        with lock:
            for who, text in warnings.new(job=job, final=True):  # the job's last seconds: said here, or never
                print(fresh() + warning_line(who, text), file=err, flush=True)
            summary = finalize_job(proc.run_dir, job, returncode, rules)
            if summary is not None and summary is not SUMMARY_FAILED:  # (a failure is said already)
                print_summary(lambda: format_job_summary(job, summary), proc.run_dir, err, fresh())
            elif summary is None:
                print(f"{fresh()}perfmon: no rank recorded anything (see {paths.stderr_log(proc.run_dir)})", file=err, flush=True)
        return exit_status(returncode, proc.escalated)
