"""Paced replay of a recording: time, pause, speed, restart, jump to the end."""

from __future__ import annotations

import threading
import time

import pytest

from perfmon import protocol
from perfmon.analysis.state import RunState
from perfmon.monitor.sources import PacedReplaySource


def recording(tmp_path, seconds=20):
    run = tmp_path / "run"
    run.mkdir()
    lines = [protocol.message("hello", seq=1, script="x.py", start=1000.0)]
    for k in range(seconds * 10):  # a steps message every 0.1 s of recording time
        t = 1000.0 + (k + 1) * 0.1
        lines.append(protocol.message("steps", seq=k + 2, fields=list(protocol.STEP_FIELDS),
                                      rows=[[k + 1, t, 100.0, 10, 20, 30, 20, 20, 8]]))
    lines.append(protocol.message("event", seq=len(lines) + 1, kind="exit", code=0, t=1000.0 + seconds * 0.1 + 0.01))
    (run / "events.jsonl").write_bytes(b"".join(protocol.encode(m) for m in lines))
    return run


class Player:
    def __init__(self, source):
        self.source, self.state, self.lock = source, RunState(), threading.Lock()
        self.resets = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        for msg in self.source.messages():
            with self.lock:
                if msg["type"] == "reset":
                    self.resets += 1
                self.state.apply(msg)

    def steps(self):
        with self.lock:
            return self.state.steps

    def wait(self, pred, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)  # polling a condition with a deadline


def test_replay_is_paced_by_recording_time_and_speed(tmp_path):
    src = PacedReplaySource(recording(tmp_path, seconds=20), speed=10)  # 2 s of recording per... 20 s -> 2 s
    p = Player(src)
    p.wait(lambda: p.steps() > 0)
    t0 = time.monotonic()
    p.wait(lambda: p.steps() >= 100)  # 10 s of recording at 10x: about 1 s
    took = time.monotonic() - t0
    assert 0.6 < took < 3.0
    src.close()


def test_pause_holds_and_resume_continues(tmp_path):
    src = PacedReplaySource(recording(tmp_path), speed=10)
    p = Player(src)
    p.wait(lambda: p.steps() >= 5)
    src.toggle_pause()
    held = p.steps()
    time.sleep(0.5)  # nothing may arrive while paused (a measured interval, not synchronisation)
    assert p.steps() <= held + 1
    src.toggle_pause()
    p.wait(lambda: p.steps() > held + 5)
    src.close()


def test_speed_steps_through_the_table(tmp_path):
    src = PacedReplaySource(recording(tmp_path), speed=10)
    src.faster()
    assert src.speed == 30
    src.slower()
    src.slower()
    assert src.speed == 5
    for _ in range(20):
        src.slower()
    assert src.speed == 1


def test_seek_end_then_restart(tmp_path):
    src = PacedReplaySource(recording(tmp_path, seconds=600), speed=1)  # would take 10 minutes
    p = Player(src)
    p.wait(lambda: p.steps() >= 1)
    src.seek_end()
    p.wait(lambda: p.state.exit is not None and src.at_end)
    assert p.steps() == 6000
    assert src.position == 1000.0 + 600 * 0.1 + 0.01  # the clock stands at the last message, not where it jumped
    src.restart()
    p.wait(lambda: p.resets == 1)
    p.wait(lambda: 0 < p.steps() < 100)  # playing again from the start, at 1x
    assert p.state.exit is None
    src.close()


async def test_replay_keys_in_the_dashboard(tmp_path):
    from perfmon.tui.app import PerfmonApp

    run = recording(tmp_path, seconds=600)
    src = PacedReplaySource(run, speed=1)
    app = PerfmonApp(RunState(), src, run)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("space")
        assert src.paused
        await pilot.press("space", "plus", "plus")
        assert not src.paused and src.speed == 5
        await pilot.press("minus")
        assert src.speed == 2
        await pilot.press("right_square_bracket")
        for _ in range(600):
            if app.state.exit is not None and src.at_end:
                break
            await pilot.pause(0.05)
        assert app.state.steps == 6000 and src.at_end
        await pilot.press("left_square_bracket")
        for _ in range(600):
            if app.state.steps < 6000:
                break
            await pilot.pause(0.05)
        assert app.state.exit is None and app.state.steps < 100
        info = app._header_info()
        assert info.mode.startswith("replay 2x ▶") and info.elapsed.startswith("0:00:0")
        await pilot.press("p")  # no job to profile: said, not silently dropped
        await pilot.pause()
        said = [n.message for n in app._notifications]
        assert any(m.startswith("p: no running job here (a replay)") for m in said), said
        assert not app.commands_sent
        await pilot.press("question_mark")
        assert ("space + - [ ]", "replay: pause/play, faster, slower, start, end") in app.key_help()
    src.close()


async def test_q_in_a_replay_mid_way_quits_at_once(tmp_path):
    """A replay before its exit record looks like a running job; q offered to stop it (with its old pid, which
    may be another process's by now). A replay has no job to stop or leave running: q quits."""
    from perfmon.tui.app import PerfmonApp
    from perfmon.tui.widgets.dialogs import QuitScreen
    from perfmon.tui.widgets.logpanel import LogPanel

    run = recording(tmp_path, seconds=600)
    src = PacedReplaySource(run, speed=1)
    app = PerfmonApp(RunState(), src, run)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("space")  # paused mid-way, no exit recorded yet
        assert app.state.exit is None
        # the output has no times to play it by: the panel says it shows the run's last lines (256 KiB, 5,000 lines)
        assert app.query_one(LogPanel).border_title == "output (its last lines as the run left them: not played in time)"
        await pilot.press("q")
        await pilot.pause()
        assert not isinstance(app.screen, QuitScreen)
        assert app.outcome == "quit"
    src.close()


async def test_replay_profile_age_is_recording_time(tmp_path):
    """A window 2 s before the end of a recording made long ago reads "2s ago", not the wall-clock age."""
    from tui_fixtures import write_recording

    from perfmon.tui.app import PerfmonApp
    from perfmon.tui.widgets.ops import OpsPanel

    run = write_recording(tmp_path / "run")  # recorded in 2026, replayed now: wall-clock age would be months
    src = PacedReplaySource(run, speed=3600)
    app = PerfmonApp(RunState(), src, run)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("right_square_bracket")
        for _ in range(600):  # a loaded machine may take a while; the jump itself is what is tested
            if app.state.exit is not None and src.at_end:
                break
            await pilot.pause(0.05)
        assert app.state.exit is not None and src.at_end
        assert app.state.profiles
        prof_t = app.state.profiles[-1].t
        age_s = src.position - prof_t
        assert 0 <= age_s < 60
        await pilot.press("4")  # the ops view (a hidden view's panel is not derived)
        app.refresh_data()
        info = app.query_one(OpsPanel).info
        assert info.age is not None and info.age.endswith("s ago") and "min" not in info.age and "h" not in info.age
        assert info.capturing is None
    src.close()


@pytest.mark.parametrize("speed, said", [("0", "0 is out of range: 1 to 3600"), ("-3", "-3 is out of range"),
                                         ("nan", "nan is out of range"), ("100000", "100000 is out of range"),
                                         ("fast", "not a number: 'fast'")])
def test_a_replay_speed_its_keys_cannot_reach_is_a_clear_error(tmp_path, capsys, speed, said):
    """0 showed a ZeroDivisionError as a stream error, -3 waited forever, nan crashed the dashboard with exit 0."""
    from perfmon.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["replay", str(tmp_path), "--speed", speed])
    assert ended.value.code == 2 and said in capsys.readouterr().err
