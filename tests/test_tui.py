"""Pilot tests of the dashboard, fed from recordings written by tests/tui_fixtures.py."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tui_fixtures import (
    ARGV,
    PID,
    START,
    TRACEBACK,
    attached_without_socket,
    loaded,
    output_lines,
    screen_text,
    wait_until,
    write_recording,
)

from perfmon import protocol
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command
from perfmon.monitor.sources import ReplaySource, Source
from perfmon.tail import OutputTail
from perfmon.tui.app import PerfmonApp
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import SPANS
from perfmon.tui.widgets.dialogs import HelpScreen, QuitScreen
from perfmon.tui.widgets.logpanel import LogPanel, clean_line, last_frame
from perfmon.tui.widgets.phases import PhasesPanel

PHASE_ROWS = (*protocol.ALL_PHASES, "step")


class FakeProcess:
    """Test double for perfmon.monitor.launch.TrainingProcess: records stop(); wait() blocks until end()."""

    def __init__(self, run_dir: Path) -> None:
        self.pid = PID
        self.run_dir = run_dir
        self.inherit_stdin = False  # launched by the dashboard: stdin /dev/null
        self.stops = 0
        self.forwarded: list[int] = []
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self) -> int:
        self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def stop(self) -> None:
        self.stops += 1

    def forward(self, sig: int) -> None:
        self.forwarded.append(sig)

    def end(self, returncode: int) -> None:
        self.returncode = returncode
        self._done.set()


def make_app(tmp_path: Path, exit: str | None = "ok", process: bool = False, **kw: Any) -> PerfmonApp:
    run_dir = write_recording(tmp_path / "run", exit=exit, **kw)
    proc = FakeProcess(run_dir) if process else None
    app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir, proc)
    app.clock = lambda: START + 150.0
    return app


def row_tokens(text: str, name: str) -> list[list[str]]:
    """Tokens after the phase name of each table row for ``name``."""
    rows = []
    for line in text.splitlines():
        tokens = line.replace("│", " ").replace("■", " ").split()
        if len(tokens) >= 9 and tokens[0] == name and tokens[8].endswith("%"):
            rows.append(tokens[1:9])
    return rows


async def test_header_shows_run(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert " ".join(ARGV) in text
        assert "step 3,000" in text
        assert f"pid {PID}" in text
        assert "exited 0" in text
        assert "CPU only — no GPU" in text
        assert f"elapsed {fmt.duration(app.state.elapsed())}" in text
        # the run is over: the whole run's rates, as its summary gives them
        assert f"steps/s {fmt.rate(app.state.steps_per_s(recent=False))}" in text
        assert f"samples/s {fmt.rate(app.state.samples_per_s(recent=False))}" in text


async def test_header_running_and_unknown_rates(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True, steps=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "● running" in text
        assert "steps/s —" in text and "samples/s —" in text
        assert "elapsed 0:02:30" in text  # the pinned clock: START + 150 s
        app.process.end(0)


async def test_phases_match_state(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        recent, total = app.state.phase_stats(recent=True), app.state.phase_stats(recent=False)
        for phase in PHASE_ROWS:
            expected = [
                text_of for s in (recent[phase], total[phase])
                for text_of in (fmt.ms(s.mean_ms), fmt.ms(s.p50_ms), fmt.ms(s.p95_ms), fmt.share(s.share))
            ]
            assert row_tokens(text, phase) == [expected], phase
        assert row_tokens(text, "optimizer")[0][0] == "3.50"  # the fixture's constant optimizer time
        assert row_tokens(text, "step")[0][3] == "100%"
        left_out = app.state.windowed_steps
        assert left_out > 0  # the fixture's profiler window: those steps are not in the statistics
        assert f"since step 2 ({fmt.count(3000 - left_out - 1)})" in text  # step 1 (warm-up) left out too
        assert f"{left_out} profiled steps left out" in text  # beside the share bar


async def test_log_shows_output(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        log = app.query_one(LogPanel).log_widget
        lines = output_lines(app.run_dir)
        assert list(log.lines)[-3:] == lines[-3:]
        assert "loading dataset: 96,000 samples" in log.lines  # colour codes stripped
        text = screen_text(app)
        assert "training done" in text and "step  3000  loss" in text


async def test_log_follows_growing_output(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        log = app.query_one(LogPanel).log_widget
        with open(app.run_dir / "output.log", "a") as f:
            f.write("epoch 2 starts\nhalf a li")
        await wait_until(pilot, lambda: "epoch 2 starts" in log.lines)
        assert "half a li" not in log.lines
        with open(app.run_dir / "stderr.log", "a") as f:  # the script's stderr, a file of its own: shown too
            f.write("train.py:12: UserWarning: slow loader\n")
        await wait_until(pilot, lambda: "train.py:12: UserWarning: slow loader" in log.lines)
        app.process.end(0)
        await wait_until(pilot, lambda: "half a li" in log.lines)  # flushed once the job is over


async def test_a_line_longer_than_the_panel_ends_in_an_ellipsis_until_scrolled_to_its_end(tmp_path: Path) -> None:
    """Cut silently at the panel's edge, "warning at step 375" read as "warning at step 3"."""
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        log = app.query_one(LogPanel).log_widget
        long_line = "UserWarning: slow batch at step " + "3" * 30 + " of epoch 12 " + "x" * 40
        with open(app.run_dir / "output.log", "a") as f:
            f.write(f"short line\n\n{long_line}\n")  # a blank line between: nothing to cut on either side
        await wait_until(pilot, lambda: long_line in log.lines)
        await pilot.pause()
        width = log.scrollable_content_region.width

        def shown(text: str) -> str:
            return next(line for line in screen_text(app).splitlines() if text in line)

        row = shown("UserWarning: slow batch")
        assert "…" in row and long_line[: width - 1] in row and long_line[: width] not in row, row
        assert "…" not in shown("short line")
        assert row.rstrip(" │").endswith(long_line[width - 2] + "…")  # the newest line shows, whole rows above it
        log.scroll_to(x=len(long_line) - width, animate=False, immediate=True)  # ←→ to its end: all of it shows
        await pilot.pause()
        row = shown("x" * 10)
        assert row.rstrip(" │").endswith("x" * 40) and "…" + long_line[len(long_line) - width + 1:] in row, row
        rows = screen_text(app).splitlines()
        blank = rows[rows.index(row) - 1]
        assert "…" not in blank, blank  # scrolled sideways, the blank line showed one


async def test_a_progress_bar_redrawn_on_one_line_shows_before_its_line_ends(tmp_path: Path) -> None:
    """tqdm redraws its bar with \\r on stderr and ends the line only when the epoch ends: the panel shows the bar's
    latest redraw under the log meanwhile, and the finished bar joins the log."""
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        panel = app.query_one(LogPanel)
        bar = panel.query_one("#progress")
        with open(app.run_dir / "stderr.log", "a") as f:
            f.write("epoch 3:  10%|#         | 14/141\repoch 3:  50%|#####     | 70/141")
        await wait_until(pilot, lambda: panel.has_class("-progress"))
        assert "epoch 3:  50%|#####     | 70/141" in screen_text(app) and "14/141" not in screen_text(app)
        assert not any("70/141" in line for line in panel.log_widget.lines)
        with open(app.run_dir / "stderr.log", "a") as f:
            f.write("\repoch 3: 100%|##########| 141/141\n")
        await wait_until(pilot, lambda: "epoch 3: 100%|##########| 141/141" in panel.log_widget.lines)
        await wait_until(pilot, lambda: not panel.has_class("-progress") and not bar.display)


async def test_nested_progress_bars_redraw_the_progress_line_instead_of_filling_the_log(tmp_path: Path) -> None:
    """tqdm's inner bar (under an outer one) is drawn as \\n, \\r, bar, cursor up: each redraw came out as a log
    line of its own, a hundred lines for three epochs."""
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        panel = app.query_one(LogPanel)
        with open(app.run_dir / "stderr.log", "a") as f:
            f.write("\repochs:   0%|          | 0/3\n\rbatches:  10%|#         | 6/60\x1b[A"
                    "\n\rbatches:  50%|#####     | 30/60\x1b[A")
        await wait_until(pilot, lambda: "batches:  50%" in screen_text(app))
        assert not any("batches" in line for line in panel.log_widget.lines)
        with open(app.run_dir / "stderr.log", "a") as f:
            f.write("\n\rbatches:  90%|######### | 54/60\x1b[A\nepoch 0 loss 0.5\n")
        await wait_until(pilot, lambda: "epoch 0 loss 0.5" in panel.log_widget.lines)
        assert not any("batches" in line for line in panel.log_widget.lines)


async def test_failed_run_shows_exception(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit="failed")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "failed: ValueError, exit 1" in text
        assert "✘ ValueError: boom  at train.py:37 in main" in text
        assert app.query_one(LogPanel).has_class("-failed")
        assert 'raise ValueError("boom")' in text  # the traceback, from a combined output.log (older runs)


@pytest.mark.parametrize(("exception", "launched", "hinted"), [
    ("EOFError: EOF when reading a line", True, True),  # input() under the dashboard
    ("bdb.BdbQuit", True, True),  # breakpoint()
    ("EOFError: EOF when reading a line", False, False),  # replayed, or attached: its stdin is not known here
    ("ValueError: boom", True, False),
])
async def test_a_script_that_died_reading_stdin_is_told_why(tmp_path: Path, exception: str, launched: bool,
                                                            hinted: bool) -> None:
    app = make_app(tmp_path, exit="failed", process=launched)
    events = app.run_dir / "events.jsonl"
    events.write_text(events.read_text().replace('"ValueError: boom"', json.dumps(exception)))
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert f"✘ {exception}" in text
        assert ("/dev/null under the dashboard" in text) is hinted
        assert ("perfmon --headless" in text) is hinted


async def test_ok_run_has_no_exception_banner(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        assert not app.query_one(LogPanel).has_class("-failed")
        assert "✘" not in screen_text(app)


async def test_help_screen(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        for key, words in (("q, ctrl+c, ctrl+q", "quit"), ("d", "detach"), ("t", "chart span"), ("?", "help")):
            assert re.search(rf"(^|\s){re.escape(key)}\s{{2,}}[^│█]*{words}", text, re.M), key
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        assert app.is_running


@pytest.mark.parametrize("running", [True, False], ids=["running", "finished"])
async def test_help_says_which_keys_act_only_while_the_job_runs(tmp_path: Path, running: bool) -> None:
    """Help on a finished run (or a replay) listed p, c, f, m and d as if they worked there; they do nothing."""
    app = make_app(tmp_path, exit=None, process=True) if running else make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        rows = dict((keys, text) for keys, text in app.key_help())
        not_here = [keys for keys, text in rows.items() if text.startswith("act on a running job: not")]
        # e too is a command, but the monitor exports from what it has: here too
        assert not_here == ([] if running else ["d, p, c, f, m"])
        if running:
            app.process.end(0)


async def test_q_on_finished_run_quits(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "quit"


async def test_q_on_running_job_then_detach(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        assert "[s]   stop training" in screen_text(app)
        await pilot.pause()
        footer = screen_text(app).splitlines()[-1]  # the dialog's keys, not the dashboard's (q did nothing here)
        assert "s Stop training" in footer and "d Detach" in footer and "Quit" not in footer, footer
        await pilot.press("d")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "detached"
    assert app.process.stops == 0


async def test_q_on_running_job_then_stop(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("s")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "stopped"
    assert app.process.stops == 1


@pytest.fixture
def survivable_signals() -> Iterator[None]:
    """SIGTERM and SIGUSR1 handled by a no-op while a test sends them to itself: if the dashboard installs no handler
    of its own, the test fails instead of killing pytest."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


async def test_signals_to_perfmon_go_on_to_the_launched_job(tmp_path: Path, survivable_signals: None) -> None:
    """SIGUSR1 sent to perfmon reaches the job and the dashboard stays; SIGTERM reaches it too, and the dashboard
    leaves (the terminal restored) with the outcome that has perfmon wait for the job, never escalating."""
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        os.kill(os.getpid(), signal.SIGUSR1)
        await wait_until(pilot, lambda: app.process.forwarded == [signal.SIGUSR1])
        assert app.is_running
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(pilot, lambda: not app.is_running)
    assert app.process.forwarded == [signal.SIGUSR1, signal.SIGTERM]
    assert app.outcome == "signalled" and app.process.stops == 0


async def test_sigterm_to_an_attached_dashboard_detaches(tmp_path: Path, survivable_signals: None) -> None:
    run_dir = write_recording(tmp_path / "run", exit=None)  # followed, no process of ours: someone else's job
    app = PerfmonApp(RunState(), ReplaySource(run_dir, follow=True, poll=0.05), run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.steps == 3000)
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "detached"


async def test_escape_cancels_then_job_ends_and_dashboard_stays(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, QuitScreen)
        assert app.is_running and app.process.stops == 0
        assert "d Detach" in screen_text(app).splitlines()[-1]
        app.process.end(-9)
        await wait_until(pilot, lambda: app.process_ended)
        await wait_until(pilot, lambda: "Detach" not in screen_text(app).splitlines()[-1])  # the footer follows
        text = screen_text(app)
        assert "killed by SIGKILL" in text and "step 3,000" in text
        assert app.is_running  # stays with the final numbers
        await pilot.press("q")  # the job is over: no question
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "quit"


async def test_job_ending_while_the_quit_dialog_is_open_quits(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        app.process.end(0)
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "quit" and app.process.stops == 0


async def test_ctrl_c_asks_even_from_help(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("ctrl+c")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("escape")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+c")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("ctrl+c")  # a second one does not stack dialogs
        assert len(app.screen_stack) == 2
        await pilot.press("escape")
        app.process.end(0)


async def test_d_detaches_directly(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None, process=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("d")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "detached"
    assert app.process.stops == 0


async def test_attached_job_cannot_be_stopped_from_dialog(tmp_path: Path) -> None:
    run_dir = write_recording(tmp_path / "run", exit=None)
    app = PerfmonApp(RunState(), attached_without_socket(run_dir), run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.steps == 3000)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        assert f"kill -INT {PID}" in screen_text(app)
        await pilot.press("s")  # not offered: nothing happens
        assert isinstance(app.screen, QuitScreen) and app.is_running
        await pilot.press("d")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "detached"


class ConnectedReplay(ReplaySource):
    """A recording followed like a live socket: connected, commands recorded (the edge a CPU test lacks)."""

    mode = "attached"
    connected = True

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, follow=True, poll=0.05)
        self.sent: list[Command] = []

    def send(self, command: Command) -> bool:
        self.sent.append(command)
        return True


async def test_attached_monitor_stops_the_job_through_its_agent(tmp_path: Path) -> None:
    run_dir = write_recording(tmp_path / "run", exit=None)
    source = ConnectedReplay(run_dir)
    app = PerfmonApp(RunState(), source, run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.steps == 3000)
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.pause()
        text = screen_text(app)
        assert "its agent sends" in text and f"SIGINT to pid {PID}, like Ctrl-C" in text
        await pilot.press("s")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "stopped"
    assert [c.name for c in source.sent] == ["stop"]


async def test_stream_without_exit(tmp_path: Path) -> None:
    app = make_app(tmp_path, exit=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert "stream ended, no exit recorded" in text
        assert f"elapsed {fmt.duration(app.state.last_end - START)}" in text
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running)
    assert app.outcome == "quit"


async def test_t_cycles_sparkline_span(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        panel = app.query_one(PhasesPanel)
        assert panel.info is not None
        one_minute = panel.info.series
        assert one_minute == tuple(app.state.step_series.values(60.0))
        assert "last 1 min" in screen_text(app)
        await pilot.press("t")
        assert panel.span == SPANS[1]
        assert panel.info.series == tuple(app.state.step_series.values(600.0))
        assert len(panel.info.series) > len(one_minute)  # the fixture runs for about two minutes
        assert "last 10 min" in screen_text(app)
        for _ in range(len(SPANS) - 1):
            await pilot.press("t")
        assert panel.span == SPANS[0]


@pytest.mark.parametrize("exit", ["ok", "failed"])
async def test_small_terminal(tmp_path: Path, exit: str) -> None:
    app = make_app(tmp_path, exit=exit)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        text = screen_text(app)
        assert len(text.splitlines()) == 24
        for needed in (" ".join(ARGV), "step 3,000", "steps/s", "elapsed", "CPU only — no GPU", "step time, last 1 min",
                       "q Quit", "? Help"):
            assert needed in text, needed
        assert "d Detach" not in text  # the job is over: nothing to detach from
        for phase in PHASE_ROWS:
            assert len(row_tokens(text, phase)) == 1, phase
        if exit == "ok":
            assert "exited 0" in text and "training done" in text
        else:
            assert "failed: ValueError" in text and "✘ ValueError: boom" in text
            assert "ValueError: boom" in text.split("✘ ValueError: boom", 1)[1]  # the traceback's last line too
        await pilot.press("question_mark")
        assert "detach" in screen_text(app)


class BurstSource(Source):
    """Many small messages as fast as possible."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.run_dir = None

    def messages(self) -> Iterator[dict[str, Any]]:
        yield protocol.message("hello", seq=1, script="burst.py", argv=["burst.py"], pid=1, start=START, cuda=False)
        for i in range(1, self.n + 1):
            row = [i, START + i * 1e-4, 0.1, 0.02, 0.03, 0.03, 0.01, 0.01, 1]
            yield protocol.message("steps", seq=i + 1, fields=list(protocol.STEP_FIELDS), rows=[row])


async def test_updates_are_coalesced(tmp_path: Path) -> None:
    app = PerfmonApp(RunState(), BurstSource(20_000), None)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.stream_ended, timeout=30)
        assert app.state.steps == 20_000
        assert app.refreshes < 100  # not one redraw per message
        assert "step 20,000" in screen_text(app)


class BrokenSource(Source):
    """A stream that breaks after the hello."""

    run_dir = None

    def messages(self) -> Iterator[dict[str, Any]]:
        yield protocol.message("hello", seq=1, script="x.py", argv=["x.py"], pid=7, start=START, cuda=False)
        raise OSError("connection reset")


async def test_broken_stream_is_reported(tmp_path: Path) -> None:
    app = PerfmonApp(RunState(), BrokenSource(), None)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.stream_ended)
        text = screen_text(app)
        assert "stream error: OSError: connection reset" in text
        assert "x.py" in text
        assert app.is_running


def test_output_tail_and_cleaning(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    tail = OutputTail(path)
    assert tail.read() == []  # not there yet
    path.write_bytes(b"one\ntw")
    assert tail.read() == ["one"]
    with open(path, "ab") as f:
        f.write(b"o\n")
    assert tail.read() == ["two"]
    path.write_bytes(b"new\n")  # truncated and rewritten
    assert tail.read() == ["new"]
    assert clean_line("\x1b[31mred\x1b[0m") == "red"
    assert clean_line("epoch 1:  10%\repoch 1: 100%\r") == "epoch 1: 100%"
    assert last_frame(None) is None
    assert last_frame(TRACEBACK) == "train.py:37 in main"


@pytest.mark.parametrize("launched, recorded", [(True, True), (True, False), (False, True)],
                         ids=["launched", "no-rank-yet", "replay"])
async def test_a_launched_script_that_spawns_its_ranks_hands_over_to_the_ranks_dashboard(
        tmp_path: Path, launched: bool, recorded: bool) -> None:
    """The script's agent says it spawned its ranks (torch.multiprocessing.spawn): once a rank steps, the launched
    dashboard leaves with SPAWNED, and the launcher reopens it on the ranks' job (monitor.dashboard). Before any
    rank steps (a start that failed, processes that preprocess), and in a replay, it stays."""
    from perfmon.tui.shell import SPAWNED

    app = make_app(tmp_path, exit=None, process=launched)
    if recorded:
        (tmp_path / "run" / "ranks" / "rank-0").mkdir(parents=True)
        (tmp_path / "run" / "ranks" / "rank-0" / "events.jsonl").write_text(
            '{"seq":1,"v":1,"type":"hello"}\n{"seq":2,"v":1,"type":"steps","fields":[],"rows":[[1]]}\n')
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        app.state.apply({"v": protocol.VERSION, "type": "event", "kind": "ranks", "seq": 10 ** 9,
                         "job_dir": str(tmp_path / "run" / "ranks"), "world_size": 2, "t": START})
        assert [s.world_size for s in app.state.spawned] == [2]
        for _ in range(100 if launched and recorded else 30):  # the once-a-second tick (1.5 s: it came and went)
            if not app.is_running:
                break
            await pilot.pause(0.05)
        assert (app.outcome == SPAWNED) == (launched and recorded)
        if launched:
            app.process.end(0)



def only_log_app() -> Any:
    """An app with the output panel alone, styled as the dashboard's."""
    from textual.app import App

    import perfmon.tui

    class OnlyLog(App[None]):
        CSS_PATH = str(Path(perfmon.tui.__file__).parent / "app.tcss")

        def compose(self):
            yield LogPanel()

    return OnlyLog()

async def test_output_follows_its_tail_when_long_lines_bring_a_horizontal_scrollbar() -> None:
    """At 80x24, the first lines wider than the panel add a horizontal scrollbar, which takes a line of the view:
    the output stopped following new lines (the end had moved one line) until End was pressed. A view the user
    scrolled up still stays where it is."""
    app = only_log_app()
    async with app.run_test(size=(80, 24)) as pilot:
        panel = app.query_one(LogPanel)
        log = panel.log_widget
        for step in range(40):
            panel.add_lines([f"step {step} line {k} " + "x" * (150 if step >= 20 else 10) for k in range(5)])
            await pilot.pause()
        panel.add_lines(["done"])
        await pilot.pause()
        await pilot.pause()
        assert log.line_count == 201 and log.scroll_y == log.max_scroll_y > 0
        log.scroll_to(y=log.max_scroll_y - 20, animate=False, immediate=True)
        panel.add_lines(["more"] * 5)
        await pilot.pause()
        assert log.max_scroll_y - log.scroll_y == 25


async def test_a_view_scrolled_up_stays_on_its_lines_once_the_panel_is_full() -> None:
    """The panel keeps the last 5,000 lines: once full, each new line pushes the oldest out, and a view scrolled up
    to read a line kept that line in place (it drifted up a line with every new one)."""
    from perfmon.tail import OUTPUT_LINES

    app = only_log_app()
    async with app.run_test(size=(80, 24)) as pilot:
        panel = app.query_one(LogPanel)
        log = panel.log_widget
        panel.add_lines([f"line {i}" for i in range(OUTPUT_LINES)])
        await pilot.pause()
        log.scroll_to(y=4000, animate=False, immediate=True)
        await pilot.pause()
        assert log.lines[int(log.scroll_y)] == "line 4000"
        panel.add_lines([f"new {i}" for i in range(30)])
        await pilot.pause()
        assert log.line_count == OUTPUT_LINES and log.lines[0] == "line 30"
        assert log.lines[int(log.scroll_y)] == "line 4000"
        # blank lines and a form feed are one line each (Log splits what it is given): the view still stays
        panel.add_lines(["", "epoch 2", "", "page\fbreak"])
        await pilot.pause()
        assert log.lines[-4:] == [" ", "epoch 2", " ", "page break"]
        assert log.lines[int(log.scroll_y)] == "line 4000"


async def test_arrow_keys_scroll_a_long_line_sideways_a_few_columns_at_a_time() -> None:
    app = only_log_app()
    async with app.run_test(size=(80, 24)) as pilot:
        panel = app.query_one(LogPanel)
        log = panel.log_widget
        panel.add_lines(["x" * 300])
        log.focus()
        await pilot.pause()
        await pilot.press("right", "right")
        assert log.scroll_x == 2 * log.SIDEWAYS
        await pilot.press("left")
        assert log.scroll_x == log.SIDEWAYS
        for _ in range(60):
            await pilot.press("right")
        assert log.scroll_x == log.max_scroll_x > 0


TORCH_RAISED = (
    "Traceback (most recent call last):\n"
    '  File "/home/ada/proj/crash.py", line 12, in <module>\n'
    "    loss = model(x).sum()\n"
    '  File "/home/ada/proj/crash.py", line 7, in forward\n'
    "    return self.fc(x)\n"
    '  File "/home/ada/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1779, in _wrapped_call_impl\n'
    "    return self._call_impl(*args, **kwargs)\n"
    '  File "/home/ada/.venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 134, in forward\n'
    "    return F.linear(input, self.weight, self.bias)\n"
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x65 and 64x256)\n"
)


@pytest.mark.parametrize("traceback, where", [
    (None, None),
    ("ValueError: no frames\n", None),
    (TRACEBACK, "train.py:37 in main"),
    (TORCH_RAISED, "crash.py:7 in forward"),  # the script's line, not torch's linear.py
    (TORCH_RAISED.replace("/home/ada/.venv/lib/python3.11/site-packages", "/usr/lib/python3/dist-packages"),
     "crash.py:7 in forward"),
    ('  File "/usr/lib/python3.11/json/decoder.py", line 355, in raw_decode\n'
     '  File "<frozen runpy>", line 88, in _run_code\n', "<frozen runpy>:88 in _run_code"),  # no own frame
])
def test_the_failure_banner_points_at_the_scripts_own_line(traceback, where):
    assert last_frame(traceback) == where
