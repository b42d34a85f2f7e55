"""Synthetic but realistic recordings for the dashboard tests (deterministic: stable snapshots)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from perfmon import protocol

if TYPE_CHECKING:
    from textual.pilot import Pilot

    from perfmon.tui.app import PerfmonApp

START = 1_760_000_000.0
STARTUP_S = 3.0
PID = 4242
ARGV = ["train.py", "--lr", "3e-4"]
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/ada/proj/train.py", line 61, in <module>\n'
    "    main()\n"
    '  File "/home/ada/proj/train.py", line 37, in main\n'
    '    raise ValueError("boom")\n'
    "ValueError: boom\n"
)


def step_row(i: int) -> list[float | int]:
    """Step ``i``'s phases (ms): a data-loading slowdown in the second half and periodic spikes."""
    wave = 3.0 * (1 + math.sin(i / 120.0))
    data = 2.0 + (i % 7) * 0.25 + wave + (6.0 if i > 1500 else 0.0) + (40.0 if i % 250 == 0 else 0.0)
    forward = 9.0 + (i % 5) * 0.4
    backward = 16.0 + (i % 3) * 0.8
    optimizer = 3.5
    other = 0.7 + (i % 4) * 0.1
    dur = data + forward + backward + optimizer + other
    return [round(x, 3) for x in (dur, data, forward, backward, optimizer, other)]


def write_recording(
    run_dir: Path,
    steps: int = 3000,
    batch: int = 100,
    exit: str | None = "ok",
    output: bool = True,
    samples: int = 32,
) -> Path:
    """Write ``run_dir/events.jsonl`` (and ``output.log``); ``exit`` is "ok", "failed" or None (running)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    seq = 0

    def msg(type_: str, **fields: object) -> bytes:
        nonlocal seq
        seq += 1
        return protocol.encode(protocol.message(type_, seq=seq, **fields))

    lines = [
        msg(
            "hello", script="train.py", argv=ARGV, pid=PID, start=START, run_dir=str(run_dir),
            python="3.11.7", torch="2.13.0+cpu", cuda=False, host="gpu-box-07", rank=0,
        )
    ]
    log = ["perfmon: recording to " + run_dir.name, "\x1b[1mloading dataset\x1b[0m: 96,000 samples"]
    t = START + STARTUP_S
    rows: list[list[float | int]] = []
    for i in range(1, steps + 1):
        dur, data, forward, backward, optimizer, other = step_row(i)
        t += dur / 1000.0
        rows.append([i, round(t, 6), dur, data, forward, backward, optimizer, other, samples])
        if len(rows) == batch:
            lines.append(msg("steps", fields=list(protocol.STEP_FIELDS), rows=rows))
            rows = []
        if i % 250 == 0:
            log.append(f"step {i:5d}  loss {2.5 / (1 + i / 500):.4f}  lr 3.0e-04")
    if rows:
        lines.append(msg("steps", fields=list(protocol.STEP_FIELDS), rows=rows))
    if exit == "ok":
        lines.append(msg("event", kind="exit", code=0, t=round(t + 0.4, 6), agent_errors={}))
        log.append("training done")
    elif exit == "failed":
        lines.append(msg(
            "event", kind="exit", code=1, exception="ValueError: boom", traceback=TRACEBACK,
            t=round(t + 0.4, 6), agent_errors={},
        ))
        log.extend(TRACEBACK.rstrip("\n").splitlines())
    (run_dir / "events.jsonl").write_bytes(b"".join(lines))
    if output:
        (run_dir / "output.log").write_text("\n".join(log) + "\n")
    return run_dir


def output_lines(run_dir: Path) -> list[str]:
    """The lines of ``output.log`` as written."""
    return (run_dir / "output.log").read_text().splitlines()


# -- driving the app -------------------------------------------------------------------------
def screen_text(app: PerfmonApp) -> str:
    """What the terminal shows now, as plain text."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def wait_until(pilot: Pilot, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until ``cond()`` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await pilot.pause(0.01)
    await pilot.pause()


async def loaded(pilot: Pilot, steps: int | None = None) -> None:
    """The recording is read (or ``steps`` steps are in, for a stream that goes on) and the output shown."""
    from perfmon.tui.widgets.logpanel import LogPanel
    from perfmon.tui.widgets.phases import PhasesPanel

    app = pilot.app
    log = app.query_one(LogPanel).log_widget
    out = app.run_dir / "output.log"
    want = len(output_lines(app.run_dir)) if out.exists() else 0

    def ready() -> bool:
        if steps is None:
            data = app.stream_ended  # the app redraws from the final state on this
        else:
            info = app.query_one(PhasesPanel).info
            data = info is not None and info.total_n >= steps
        return data and log.line_count >= want and log.scroll_y == log.max_scroll_y

    await wait_until(pilot, ready)
