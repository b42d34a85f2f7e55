"""The job source: every rank's stream merged and tagged, ended when the job is, commands to the ranks named."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tui_fixtures import write_job

from perfmon.analysis.job import RANK_KEY, JobState
from perfmon.messages.commands import Command
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.sources import Source


def drain(source: JobSource, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every message until the stream ends (fails instead of hanging)."""
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: out.extend(source.messages()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the job source did not end"
    return out


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_recorded_job_is_every_rank_tagged_with_its_rank(tmp_path: Path) -> None:
    job_dir = write_job(tmp_path / "job", world=3, steps=200, telemetry=False, profile=False)
    msgs = drain(JobSource(job_dir, follow=False))
    job = JobState()
    for msg in msgs:
        job.apply(msg)
    assert {m[RANK_KEY] for m in msgs} == {0, 1, 2}
    assert {r: s.steps for r, s in job.ranks.items()} == {0: 200, 1: 200, 2: 200}
    assert job.ended and job.world_size == 3


def test_a_followed_job_whose_ranks_died_unrecorded_ends(tmp_path: Path) -> None:
    """Ranks whose agents were killed (no exit record, no socket) while the launcher is gone: the stream ends
    once their recordings are read, instead of waiting for them for ever."""
    job_dir = write_job(tmp_path / "job", world=2, steps=100, exit=None, telemetry=False, profile=False)
    pid = dead_pid()
    for rank in (0, 1):
        events = job_dir / f"rank-{rank}" / "events.jsonl"
        lines = events.read_text().splitlines()
        hello = json.loads(lines[0])
        hello["pid"] = pid
        events.write_text("\n".join([json.dumps(hello), *lines[1:]]) + "\n")
    msgs = drain(JobSource(job_dir, runtime_dir=tmp_path, alive=lambda: False, follow=True))
    assert sum(len(m.get("rows", [])) for m in msgs if m.get("type") == "steps") == 200


class _Rank(Source):
    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.connected = True

    def send(self, command: Command) -> bool:
        self.sent.append(command)
        return True


def test_commands_go_to_every_rank_or_those_named(tmp_path: Path) -> None:
    source = JobSource(tmp_path, follow=False)
    ranks = {0: _Rank(), 1: _Rank(), 2: _Rank()}
    source._ranks.update(ranks)
    assert source.send(Command("profile", at_step=50))
    assert [len(r.sent) for r in ranks.values()] == [1, 1, 1]
    assert ranks[2].sent[0] == Command("profile", at_step=50)
    assert source.send(Command("empty_cache", ranks=(1,)))
    assert [len(r.sent) for r in ranks.values()] == [1, 2, 1]
    assert ranks[1].sent[-1] == Command("empty_cache")  # the agents get the command, not the routing
    assert source.ranks_connected() == [0, 1, 2]


def test_other_nodes_ranks_arrive_through_deliver_and_keep_the_stream_open(tmp_path: Path) -> None:
    source = JobSource(tmp_path, alive=lambda: False, follow=True)
    source.remote_opened()  # a relay connected: its stream is not over until it closes
    source.deliver({"type": "hello", "seq": 1, "pid": 9, RANK_KEY: 5})
    source.deliver({"type": "hello", "seq": 1, "pid": 9})  # untagged: not a rank's, dropped
    source.deliver({"type": "hello", "seq": 1, "pid": 9, RANK_KEY: True})
    got: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: got.extend(source.messages()), daemon=True)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive()  # the relay's stream goes on
    source.remote_closed()
    thread.join(10)
    assert not thread.is_alive()
    assert [m[RANK_KEY] for m in got] == [5]


def test_a_restarted_rank_replaces_its_first_attempt(tmp_path: Path) -> None:
    """torchrun restarts a job's workers: the new attempt (rank-K.restart1, numbering from 1 again) is the
    rank's state from its first message; what the old attempt still sends is dropped."""
    job_dir = write_job(tmp_path / "job", world=2, steps=300, telemetry=False, profile=False)
    again = write_job(tmp_path / "again", world=2, steps=120, telemetry=False, profile=False)
    (again / "rank-1").rename(job_dir / "rank-1.restart1")
    job = JobState()
    for msg in drain(JobSource(job_dir, follow=False)):
        job.apply(msg)
    assert job.attempts == {0: 0, 1: 1}
    assert job.ranks[0].steps == 300 and job.ranks[1].steps == 120  # the restart's own count, not the old one's
    old = {"type": "steps", "seq": 10**6, RANK_KEY: 1, "fields": ["i"], "rows": [[999]]}
    job.apply(old)  # a late message of attempt 0
    assert job.ranks[1].steps == 120


def test_the_job_summary_says_the_time_outside_steps(tmp_path: Path) -> None:
    """The headless job summary (torchrun, accelerate launch) had no "outside" line where a single run's has one:
    evaluation between epochs showed only in the JSON."""
    from perfmon import protocol
    from perfmon.analysis.job_report import build_job_summary, format_job_summary

    job_dir = write_job(tmp_path / "job", world=2, steps=100, telemetry=False, profile=False)
    job = JobState()
    for msg in drain(JobSource(job_dir, follow=False)):
        job.apply(msg)
    text = format_job_summary(job, build_job_summary(job, job_dir))
    assert "outside" not in text
    extra = protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=[], seq=10_000,
                             outside={"evaluation_ms": 1_000.0})
    job.apply({**extra, RANK_KEY: 0})
    text = format_job_summary(job, build_job_summary(job, job_dir))
    line = next(line for line in text.splitlines() if line.strip().startswith("outside"))
    assert "evaluation" in line and "of wall time" in line and "(rank 0)" in line, text
