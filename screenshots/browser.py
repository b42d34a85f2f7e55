"""The browser view for the README: ``python screenshots/browser.py`` (needs chromium and playwright).

Starts ``demos/train_mlp.py`` under ``perfmon --headless``, serves it with ``perfmon serve``, opens the page
in headless chromium and saves ``browser-120x40.png`` here once the dashboard shows steps.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PERFMON = [sys.executable, "-m", "perfmon.cli"]


def main() -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs chromium (apt install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        job = subprocess.Popen([*PERFMON, "--headless", "--run-dir", str(run), str(HERE.parent / "demos" / "train_mlp.py"),
                                "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = None
        try:
            while not (run / "events.jsonl").exists():
                time.sleep(0.2)
            pid = json.loads((run / "events.jsonl").read_text().splitlines()[0])["pid"]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = subprocess.Popen([*PERFMON, "serve", str(pid), "--port", str(port)], stderr=subprocess.PIPE,
                                      text=True)
            assert server.stderr is not None
            url = next(w for line in server.stderr for w in line.split() if "?token=" in w)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                # 120x40 cells at the page's 16px font
                page = browser.new_page(viewport={"width": 1210, "height": 800})
                page.goto(url)
                page.wait_for_timeout(20_000)  # warm-up past, findings held
                page.screenshot(path=str(HERE / "browser-dashboard.png"))
                browser.close()
            print("wrote screenshots/browser-dashboard.png")
        finally:
            for proc in (server, job):
                if proc is not None:
                    proc.send_signal(2)
                    proc.wait(timeout=60)


if __name__ == "__main__":
    main()
