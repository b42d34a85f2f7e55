"""A run followed with no screen: what ``perfmon serve --prometheus`` exports (the browser tabs each run
their own dashboard; the metrics need one state that lives as long as the server)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from perfmon.analysis.job import JobState, is_job_dir, load_job
from perfmon.analysis.profile_window import summarised
from perfmon.analysis.report import load_recording, run_dir_of
from perfmon.analysis.state import RunState
from perfmon.monitor.discovery import AttachError, find_run, job_alive
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.sources import LiveSource, Source


class Follower:
    """Folds a source into a state (or a job) on a daemon thread, under ``lock``."""

    def __init__(self, source: Source | None, endpoint: Any, job: JobState | None = None,
                 state: RunState | None = None) -> None:
        self.source = source
        self.endpoint = endpoint
        self.lock = threading.Lock()
        self.job = job
        self.state = state
        if job is not None:
            endpoint.watch(self.lock, job=job)
        else:
            endpoint.watch(self.lock, lambda: self.state)
        if source is not None:
            threading.Thread(target=self._run, name="perfmon-metrics-follow", daemon=True).start()

    def _run(self) -> None:
        assert self.source is not None
        try:
            for msg in summarised(self.source.messages()):
                with self.lock:
                    if self.job is not None:
                        self.job.apply(msg)
                    elif self.state is not None:
                        self.state.apply(msg)
        except OSError:
            pass

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        self.endpoint.close()


def follow_for_metrics(target: str | None, endpoint: Any) -> Follower:
    """Follow the live run or job named by ``target`` (as ``perfmon attach`` finds it), or load a recording."""
    try:
        run = find_run(target)
    except AttachError:
        if target is None or target.isdigit():
            raise
        path = run_dir_of(Path(target))
        if is_job_dir(path):
            return Follower(None, endpoint, job=load_job(path))
        return Follower(None, endpoint, state=load_recording(path))
    if run.get("ranks"):
        job_dir = Path(run["job_dir"])
        return Follower(JobSource(job_dir, alive=lambda: job_alive(job_dir)), endpoint, job=JobState())
    source = LiveSource(Path(run["socket"]), Path(run["run_dir"]))
    source.connect()
    return Follower(source, endpoint, state=RunState())
