"""Regenerate the dashboard screenshots from the test fixture: ``python screenshots/make.py``.

Writes ``dashboard-120x40.svg`` and ``dashboard-80x24.svg`` here, and PNGs beside them when
``rsvg-convert`` (apt: librsvg2-bin) is installed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from tui_fixtures import loaded, write_recording  # noqa: E402

from perfmon.sources import ReplaySource  # noqa: E402
from perfmon.state import RunState  # noqa: E402
from perfmon.tui.app import PerfmonApp  # noqa: E402


async def shoot(size: tuple[int, int], exit: str, name: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = write_recording(Path(tmp) / "run", exit=exit)
        app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir)
        async with app.run_test(size=size) as pilot:
            await loaded(pilot)
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
    for size, exit, name in (((120, 40), "ok", "dashboard-120x40"), ((80, 24), "ok", "dashboard-80x24")):
        svg = asyncio.run(shoot(size, exit, name))
        print("wrote", svg.relative_to(HERE.parent))
        to_png(svg)


if __name__ == "__main__":
    main()
