"""Regenerate the dashboard screenshots from the test fixture: ``python screenshots/make.py``.

Writes, here, SVGs of the H100 fixture (``dashboard-120x40``, ``dashboard-80x24`` and one per
view: ``device-``, ``model-``, ``ops-``, ``findings-``) and of the CPU-only fixture
(``dashboard-cpu-120x40``, ``dashboard-cpu-80x24``), and PNGs beside them when ``rsvg-convert``
(apt: librsvg2-bin) is installed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from tui_fixtures import START, loaded, write_recording  # noqa: E402

from perfmon.analysis.state import RunState  # noqa: E402
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


async def shoot(name: str, size: tuple[int, int], options: dict[str, Any], keys: list[str]) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = write_recording(Path(tmp) / "run", **options)
        app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir)
        app.clock = lambda: START + 150.0
        async with app.run_test(size=size) as pilot:
            await loaded(pilot)
            for key in keys:
                await pilot.press(key)
            await pilot.pause()
            svg = HERE / f"{name}.svg"
            svg.write_text(app.export_screenshot())
            await pilot.press("q")
    return svg


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


if __name__ == "__main__":
    main()
