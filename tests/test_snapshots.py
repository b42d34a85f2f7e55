"""SVG snapshots of the dashboard over the fixture recordings (update with --snapshot-update).

The clock is pinned (elapsed time of a running job, the profiler window's age); a running job's
live rules are switched off (``NO_RULES``) so that what the engine's hysteresis shows does not
depend on timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tui_fixtures import START, attached_without_socket, loaded, write_recording

from perfmon.analysis.rules import Config
from perfmon.analysis.state import RunState
from perfmon.monitor.sources import ReplaySource
from perfmon.tui.app import PerfmonApp

CLOCK = START + 150.0
RUNNING_CLOCK = START + 123.0  # just after the running recording's last step: the job is not quiet
NO_RULES = Config(min_steps=10**9)


def finished_app(tmp_path: Path, exit: str = "ok", **kw: Any) -> PerfmonApp:
    run_dir = write_recording(tmp_path / "run", exit=exit, **kw)
    app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir)
    app.clock = lambda: CLOCK
    return app


def running_app(tmp_path: Path, **kw: Any) -> PerfmonApp:
    run_dir = write_recording(tmp_path / "run", exit=None, **kw)
    app = PerfmonApp(RunState(), attached_without_socket(run_dir), run_dir, rules=NO_RULES)
    app.clock = lambda: RUNNING_CLOCK
    return app


async def running_loaded(pilot) -> None:
    await loaded(pilot, steps=3000)


def test_finished_run_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), terminal_size=(120, 40), run_before=loaded)


def test_finished_run_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), terminal_size=(80, 24), run_before=loaded)


def test_failed_run_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, exit="failed"), terminal_size=(80, 24), run_before=loaded)


def test_help_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), press=["question_mark"], terminal_size=(80, 24), run_before=loaded)


def test_quit_dialog_on_running_job_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(running_app(tmp_path), press=["q"], terminal_size=(120, 40), run_before=running_loaded)


# -- GPU run: overview and each view ----------------------------------------------------------
def test_gpu_overview_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, device="gpu"), terminal_size=(120, 40), run_before=loaded)


def test_gpu_overview_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, device="gpu"), terminal_size=(80, 24), run_before=loaded)


def test_gpu_device_view_80x24(snap_compare, tmp_path: Path) -> None:
    app = finished_app(tmp_path, device="gpu", throttled=True)
    assert snap_compare(app, press=["2"], terminal_size=(80, 24), run_before=loaded)


def test_four_gpus_device_view_120x40(snap_compare, tmp_path: Path) -> None:
    app = finished_app(tmp_path, device="gpu", gpus=4, throttled=True)
    assert snap_compare(app, press=["2"], terminal_size=(120, 40), run_before=loaded)


def test_gpu_model_view_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, device="gpu"), press=["3"], terminal_size=(80, 24), run_before=loaded)


def test_gpu_ops_view_120x40(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path, device="gpu"), press=["4"], terminal_size=(120, 40), run_before=loaded)


def test_ops_sorted_by_calls_80x24(snap_compare, tmp_path: Path) -> None:
    app = finished_app(tmp_path, device="gpu")
    assert snap_compare(app, press=["4", "s", "s"], terminal_size=(80, 24), run_before=loaded)


def test_findings_expanded_80x24(snap_compare, tmp_path: Path) -> None:
    app = finished_app(tmp_path, device="gpu", throttled=True)
    assert snap_compare(app, press=["5", "enter"], terminal_size=(80, 24), run_before=loaded)


# -- CPU run: no GPU, the model without a memory budget; a window being captured ---------------
def test_cpu_device_view_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), press=["2"], terminal_size=(80, 24), run_before=loaded)


def test_cpu_model_view_80x24(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(finished_app(tmp_path), press=["3"], terminal_size=(80, 24), run_before=loaded)


def test_ops_capturing_80x24(snap_compare, tmp_path: Path) -> None:
    app = running_app(tmp_path, capturing=True)
    assert snap_compare(app, press=["4"], terminal_size=(80, 24), run_before=running_loaded)
