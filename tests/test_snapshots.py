"""SVG snapshots of the dashboard over the fixture recordings (update with --snapshot-update)."""

from __future__ import annotations

from pathlib import Path

from tui_fixtures import START, loaded, write_recording

from perfmon.sources import ReplaySource
from perfmon.state import RunState
from perfmon.tui.app import PerfmonApp


def finished_app(tmp_path: Path, exit: str = "ok") -> PerfmonApp:
    run_dir = write_recording(tmp_path / "run", exit=exit)
    return PerfmonApp(RunState(), ReplaySource(run_dir), run_dir)


def test_finished_run_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), terminal_size=(120, 40), run_before=loaded)


def test_finished_run_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), terminal_size=(80, 24), run_before=loaded)


def test_failed_run_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, exit="failed"), terminal_size=(80, 24), run_before=loaded)


def test_help_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), press=["question_mark"], terminal_size=(80, 24), run_before=loaded)


def test_quit_dialog_on_running_job_120x40(snap_compare, tmp_path: Path) -> None:
    run_dir = write_recording(tmp_path / "run", exit=None)
    app = PerfmonApp(RunState(), ReplaySource(run_dir, follow=True, poll=0.05), run_dir)
    app.clock = lambda: START + 150.0

    async def run_before(pilot) -> None:
        await loaded(pilot, steps=3000)

    assert snap_compare(app, press=["q"], terminal_size=(120, 40), run_before=run_before)
