"""Regenerate the dashboard screenshots from the test fixture: ``python screenshots/make.py``.

Writes, here, SVGs of the H100 fixture (``dashboard-120x40``, ``dashboard-80x24`` and one per
view: ``device-``, ``model-``, ``ops-``, ``findings-``) and of the CPU-only fixture
(``dashboard-cpu-120x40``, ``dashboard-cpu-80x24``), of an 8-rank job's ranks view (``ranks-``), and PNGs beside them when ``rsvg-convert``
(apt: librsvg2-bin) is installed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from tui_fixtures import START, loaded, write_job, write_recording  # noqa: E402

from perfmon.analysis.job import JobState  # noqa: E402
from perfmon.analysis.state import RunState  # noqa: E402
from perfmon.monitor.job_source import JobSource  # noqa: E402
from perfmon.monitor.sources import ReplaySource  # noqa: E402
from perfmon.tui.app import PerfmonApp  # noqa: E402

#: (name, terminal size, recording options, keys pressed before the picture)
SHOTS: list[tuple[str, tuple[int, int], dict[str, Any], list[str]]] = [
    ("dashboard-120x40", (120, 40), {"device": "gpu", "window_peaks": True}, []),
    ("dashboard-80x24", (80, 24), {"device": "gpu", "window_peaks": True}, []),
    ("dashboard-cpu-120x40", (120, 40), {}, []),
    ("dashboard-cpu-80x24", (80, 24), {}, []),
    ("device-80x24", (80, 24), {"device": "gpu", "window_peaks": True, "throttled": True}, ["2"]),
    ("device-4gpus-120x40", (120, 40), {"device": "gpu", "window_peaks": True, "gpus": 4, "throttled": True}, ["2"]),
    ("model-80x24", (80, 24), {"device": "gpu", "window_peaks": True}, ["3"]),
    ("ops-120x40", (120, 40), {"device": "gpu", "window_peaks": True}, ["4"]),
    ("findings-80x24", (80, 24), {"device": "gpu", "window_peaks": True, "throttled": True}, ["5", "enter"]),
]


async def _capture(app: PerfmonApp, name: str, size: tuple[int, int], keys: list[str],
                   ready: Callable[[Any], Awaitable[None]]) -> Path:
    app.clock = lambda: START + 150.0
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        for key in keys:
            await pilot.press(key)
        await pilot.pause()
        svg = HERE / f"{name}.svg"
        svg.write_text(app.export_screenshot())
        await pilot.press("q")
    return svg


async def shoot(name: str, size: tuple[int, int], options: dict[str, Any], keys: list[str]) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = write_recording(Path(tmp) / "run", **options)
        return await _capture(PerfmonApp(RunState(), ReplaySource(run_dir), run_dir), name, size, keys, loaded)


async def shoot_job(name: str, size: tuple[int, int], keys: list[str]) -> Path:
    """An 8-rank DDP job on two nodes (four H100s each) whose rank 5 loads data slowly."""
    with tempfile.TemporaryDirectory() as tmp:
        job_dir = write_job(Path(tmp) / "job", world=8, slow=5, device="gpu", window_peaks=True)
        app = PerfmonApp(RunState(), JobSource(job_dir, follow=False), job_dir, job=JobState())

        async def ready(pilot: Any) -> None:
            while not (app.stream_ended and len(app.job.ranks) == 8 and app.findings is not None):
                await pilot.pause(0.05)

        return await _capture(app, name, size, keys, ready)


def to_png(svg: Path) -> None:
    if not shutil.which("rsvg-convert"):
        print("rsvg-convert not found: no PNG for", svg.name)
        return
    # librsvg drops leading non-breaking spaces of a text run unless told to preserve space
    text = svg.read_text().replace("<svg ", '<svg xml:space="preserve" ', 1)
    png = svg.with_suffix(".png")
    png.write_bytes(subprocess.run(["rsvg-convert", "-w", "1200"], input=text.encode(), capture_output=True, check=True).stdout)
    print("wrote", png.relative_to(HERE.parent))


def main() -> None:
    for name, size, options, keys in SHOTS:
        svg = asyncio.run(shoot(name, size, options, keys))
        print("wrote", svg.relative_to(HERE.parent))
        to_png(svg)
    for name, size, keys in (("ranks-120x40", (120, 40), ["7"]), ("ranks-80x24", (80, 24), ["7"])):
        svg = asyncio.run(shoot_job(name, size, keys))
        print("wrote", svg.relative_to(HERE.parent))
        to_png(svg)


if __name__ == "__main__":
    main()
