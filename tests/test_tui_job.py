"""The dashboard over a multi-rank job: the ranks view, the rank selector, commands to every rank or one,
and SVG snapshots of the all-ranks view (a recorded 4-rank DDP job whose rank 2 loads data slowly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tui_fixtures import START, screen_text, wait_until, write_job, write_recording

from perfmon import protocol
from perfmon.analysis.job import JobState
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.sources import ReplaySource
from perfmon.tui.app import PerfmonApp
from perfmon.tui.widgets.ranks import RanksPanel

CLOCK = START + 150.0


def job_app(tmp_path: Path, source: Any = None, **kw: Any) -> PerfmonApp:
    job_dir = write_job(tmp_path / "job", **kw)
    app = PerfmonApp(RunState(), source or JobSource(job_dir, follow=False), job_dir, job=JobState())
    app.clock = lambda: CLOCK
    return app


async def job_loaded(pilot: Any) -> None:
    """Every rank's recording is read and the final findings are drawn."""
    app = pilot.app
    await wait_until(pilot, lambda: app.stream_ended and len(app.job.ranks) == 4
                     and all(s.steps == 3000 for s in app.job.ranks.values()) and app.findings is not None)
    for _ in range(3):
        await pilot.pause()


class ConnectedJob(JobSource):
    """A recorded job read as if its agents were live (the stream goes on): connected, the commands sent
    recorded."""

    mode = "attached"

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, alive=lambda: True, follow=True)
        self.sent: list[Command] = []

    @property
    def connected(self) -> bool:
        return True

    def send(self, command: Command) -> bool:
        self.sent.append(command)
        return True


async def test_ranks_view_lists_every_rank_marks_the_slowest_and_names_the_straggler(tmp_path: Path) -> None:
    app = job_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await job_loaded(pilot)
        await pilot.press("7")
        await pilot.pause()
        info = app.query_one(RanksPanel).info
        assert [r.rank for r in info.rows] == [0, 1, 2, 3]
        assert info.slowest == 2 and info.selected == 0 and info.world_size == 4
        straggler = next(f for f in info.findings if f.id == "straggler")
        assert straggler.evidence["rank"] == 2 and straggler.evidence["phase"] == "data"
        text = screen_text(app)
        assert "4/4 ranks on 1 node" in text and "← slowest" in text
        assert "rank 0 of 4" in text
        # the job's findings are in the list every rank's views show
        assert app.findings is not None and "straggler" in [f.id for f in app.findings.rows]


async def test_r_switches_every_panel_to_the_next_rank(tmp_path: Path) -> None:
    app = job_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await job_loaded(pilot)
        assert app.state is app.job.ranks[0]
        await pilot.press("r")
        await pilot.pause()
        assert app.selected == 1 and app.state is app.job.ranks[1]
        assert "rank 1 of 4" in screen_text(app)
        await pilot.press("r", "r")
        await pilot.pause()
        assert app.selected == 3 and app.state.meta.pid == app.job.ranks[3].meta.pid
        await pilot.press("r")  # past the last rank: back to the first
        assert app.selected == 0


async def test_p_profiles_every_rank_at_one_step_and_c_goes_to_the_rank_shown(tmp_path: Path) -> None:
    job_dir = write_job(tmp_path / "job", exit=None)
    source = ConnectedJob(job_dir)
    app = PerfmonApp(RunState(), source, job_dir, job=JobState())
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: len(app.job.ranks) == 4 and all(s.steps == 3000 for s in app.job.ranks.values()),
                         timeout=60)  # 4 x 3,000 steps replayed: seconds on a loaded host
        await pilot.press("p")
        profile = source.sent[-1]
        assert profile.name == "profile" and profile.ranks is None  # every rank
        # ahead of the furthest rank by a tick and a half of steps (what it saw is up to an agent's tick old): each
        # starts at that same step
        rate = max(s.steps_per_s() or 0.0 for s in app.job.ranks.values())
        assert rate > 0 and profile.at_step is not None
        assert rate * (protocol.PUBLISH_TICK_S + 0.5) <= profile.at_step - 3000 <= rate * 3 + 2
        await pilot.press("1", "r", "c")
        assert source.sent[-1] == Command("empty_cache", id=2, ranks=(1,))
        await pilot.press("7", "c")  # from the ranks view: the whole job
        assert source.sent[-1] == Command("empty_cache", id=3)


async def test_single_run_offers_no_rank_keys(tmp_path: Path) -> None:
    run_dir = write_recording(tmp_path / "run")
    app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.stream_ended)
        assert app.check_action("next_rank", ()) is False
        assert app.check_action("view", ("ranks",)) is False
        await pilot.press("7", "r")
        assert app.view == "overview" and app.selected is None
        assert not any("rank" in keys for keys, _ in app.key_help())
        assert "7 ranks" not in screen_text(app)


def test_ranks_view_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(job_app(tmp_path, device="gpu"), press=["7"], terminal_size=(120, 40), run_before=job_loaded)


def test_ranks_view_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(job_app(tmp_path), press=["7"], terminal_size=(80, 24), run_before=job_loaded)


async def test_a_warning_one_rank_of_a_job_recorded_is_shown_though_the_job_never_recorded_its_end(tmp_path):
    """A job's replay (its perfmon killed with it: no rank recorded an exit) where rank 0 alone warned: the warning
    is in the output panel. A warning held for the other ranks, as headless mode holds one, would never be said:
    the stream is over, so nothing would ever look again."""
    import json

    from perfmon.tui.widgets.logpanel import LogPanel

    job_dir = write_job(tmp_path / "job", world=2, slow=1, steps=100, exit=None)
    events = job_dir / "rank-0" / "events.jsonl"
    seq = len(events.read_text().splitlines()) + 1
    warning = protocol.message("event", seq=seq, kind="warning", message="only rank 0 says this", t=START + 5.0)
    with events.open("a") as f:
        f.write(json.dumps(warning) + "\n")
    app = PerfmonApp(RunState(), JobSource(job_dir, follow=False), job_dir, job=JobState())
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.stream_ended and len(app.job.ranks) == 2)
        await wait_until(pilot, lambda: any("only rank 0 says this" in str(line)
                                            for line in app.query_one(LogPanel).log_widget.lines))
        assert not app.job.ended  # (the case: nothing ends the job)
