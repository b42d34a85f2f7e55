"""``perfmon serve``: the dashboard in a real headless browser (Debian's chromium, driven by Playwright).

The page draws the terminal on a canvas, so the test reads what it shows the way the browser gets it: the
websocket's terminal output, replayed into a terminal emulator (pyte) at the size the page asked for.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_e2e import PERFMON, REPO, env, listening, perfmon, wait_for  # noqa: F401  (env: private runtime dir)
from tui_fixtures import write_recording

from perfmon.monitor.serve import ServeError, make_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class Screen:
    """The terminal the page shows, rebuilt from the websocket's frames."""

    def __init__(self) -> None:
        import pyte

        self.pyte = pyte
        self.screen: Any = None
        self.stream: Any = None
        self.pending: list[bytes] = []

    def sent(self, payload: Any) -> None:
        """A frame the page sent: the first resize sets the screen's size."""
        try:
            msg = json.loads(payload)
        except (TypeError, ValueError):
            return
        if isinstance(msg, list) and msg and msg[0] == "resize" and self.screen is None:
            self.screen = self.pyte.Screen(int(msg[1]["width"]), int(msg[1]["height"]))
            self.stream = self.pyte.ByteStream(self.screen)
            for data in self.pending:
                self.stream.feed(data)

    def received(self, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else payload.encode()
        if payload and isinstance(payload, str) and payload.startswith("["):
            return  # a JSON control packet, not terminal output
        if self.stream is None:
            self.pending.append(data)
        else:
            self.stream.feed(data)

    def text(self) -> str:
        return "\n".join(self.screen.display) if self.screen is not None else ""


def pumping(page: Any, cond: Any, what: str, timeout: float = 90.0) -> Any:
    """``wait_for`` that lets Playwright deliver its events meanwhile (the sync API runs them only inside its
    own calls)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        page.wait_for_timeout(100)


def step_shown(text: str) -> int | None:
    match = re.search(r"step ([\d,]+)\s+steps/s", text)
    return int(match.group(1).replace(",", "")) if match else None


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt install chromium)")
def test_dashboard_in_a_browser_follows_the_job_and_its_keys_work(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    pytest.importorskip("pyte")
    playwright = pytest.importorskip("playwright.sync_api")
    run = tmp_path / "run"
    job = subprocess.Popen([*PERFMON, "--headless", "--run-dir", str(run), str(REPO / "demos" / "train_mlp.py"),
                            "--steps", "100000"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        pid = wait_for(lambda: next((json.loads(line)["pid"] for line in _lines(run / "events.jsonl")
                                     if '"hello"' in line), None), "the job's hello")
        port = free_port()
        served = Served([str(pid)], env, port, cwd=tmp_path)
        server = served.proc
        url = wait_for(lambda: served.url(), "the URL with its token")
        screen = Screen()
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 820})
            page.on("websocket", lambda ws: (ws.on("framesent", screen.sent),
                                             ws.on("framereceived", screen.received)))
            page.goto(url)
            first = pumping(page, lambda: step_shown(screen.text()), "a step count on the page")
            pumping(page, lambda: (step_shown(screen.text()) or 0) > first, "the step count to advance on the page")
            assert "step phases" in screen.text() and "attached" in screen.text()
            page.click("#terminal")  # keys go to the terminal once it has the focus, as for a person
            page.keyboard.press("p")  # a key in the page: a profiler window, and the ops view shows it
            pumping(page, lambda: any('"type":"profile"' in line.replace(" ", "")
                                      for line in _lines(run / "events.jsonl")), "the profiler window in the recording")
            pumping(page, lambda: "top ops" in screen.text() and "window: step" in screen.text(),
                    "the ops view with the window in the page")
            assert re.search(r"aten::\w+", screen.text())
            page.screenshot(path=str(tmp_path / "browser.png"))
            browser.close()
        assert (tmp_path / "browser.png").stat().st_size > 10_000
        assert job.poll() is None  # the browser watched; the job goes on
    finally:
        for proc in (server, job):
            if proc is not None and proc.poll() is None:
                proc.send_signal(2)
        for proc in (server, job):
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


# -- without a browser -------------------------------------------------------------------------------
class Served:
    """``perfmon serve`` in the background; its stderr lines as they come."""

    def __init__(self, args: list[str], environ: dict[str, str], port: int, cwd: Path | None = None) -> None:
        import threading

        self.port = port
        self.proc = subprocess.Popen([*PERFMON, "serve", *args, "--port", str(port)], env=environ, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        wait_for(lambda: listening(port) or self.proc.poll() is not None, "the server")
        assert self.proc.poll() is None, "".join(self.lines)

    def url(self) -> str | None:
        """The URL printed at start (with its token)."""
        return next((w for line in self.lines for w in line.split() if "?token=" in w), None)

    def close(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_beyond_loopback_every_request_needs_the_token(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    run = write_recording(tmp_path / "run")
    port = free_port()
    served = Served([str(run), "--host", "0.0.0.0"], env, port)
    try:
        url = wait_for(served.url, "the URL with its token")
        token = url.split("?token=", 1)[1]
        assert len(token) >= 24  # a random one: none was given
        assert get(f"http://127.0.0.1:{port}/")[0] == 403
        assert get(f"http://127.0.0.1:{port}/?token=wrong")[0] == 403
        assert get(f"http://127.0.0.1:{port}/static/css/xterm.css")[0] == 403
        status, page = get(f"http://127.0.0.1:{port}/?token={token}")
        assert status == 200 and "textual-terminal" in page
        assert any("keep it private" in line for line in served.lines)
    finally:
        served.close()


def test_a_given_token_is_the_one_checked(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    port = free_port()
    served = Served([str(write_recording(tmp_path / "run")), "--host", "0.0.0.0", "--token", "s3cret-s3cret"],
                    env, port)
    try:
        assert get(f"http://127.0.0.1:{port}/?token=s3cret-s3cret")[0] == 200
        assert get(f"http://127.0.0.1:{port}/?token=s3cret")[0] == 403
    finally:
        served.close()


def test_loopback_needs_the_token_too_and_prints_the_ssh_line(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    """Any web page the user opens could reach localhost: without the token (or from another origin) nothing."""
    port = free_port()
    server = make_server(str(write_recording(tmp_path / "run")), port=port)
    assert server.token and "replay" in server.command  # a recording: each tab replays it
    assert any(f"ssh -L {port}:127.0.0.1:{port}" in line for line in server.lines)
    served = Served([str(tmp_path / "run")], env, port)
    try:
        url = wait_for(served.url, "the URL with its token")
        assert url.startswith(f"http://localhost:{port}/?token=")
        token = url.split("?token=", 1)[1]
        assert get(f"http://127.0.0.1:{port}/")[0] == 403
        assert get(f"http://127.0.0.1:{port}/?token={token}")[0] == 200
        evil = urllib.request.Request(f"http://127.0.0.1:{port}/?token={token}", headers={"Origin": "http://evil.example"})
        try:
            status = urllib.request.urlopen(evil, timeout=10).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == 403
        assert any("ssh -L" in line for line in served.lines)
    finally:
        served.close()


def test_a_recording_served_on_every_address_names_the_machine_and_no_job(tmp_path: Path) -> None:
    """0.0.0.0 is no address to open; and a recording has no job to stop or to go on."""
    import socket

    server = make_server(str(write_recording(tmp_path / "run")), host="0.0.0.0", port=free_port(), host_given=True)
    assert server.lines[1].startswith(f"  open http://{socket.gethostname()}:")
    assert "the recording" in server.lines[0] and not any("job" in line for line in server.lines[1:])


def test_a_short_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="at least 12"):
        make_server(str(write_recording(tmp_path / "run")), port=free_port(), token="")


@pytest.mark.parametrize(("target", "message"), [
    ("999999999", "no process with pid"),
    ("{tmp}/nothing", "no such pid or run directory"),
    ("{tmp}", "no recording"),
])
def test_nothing_to_serve_is_one_line(target: str, message: str, tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    res = perfmon(["serve", target.format(tmp=tmp_path), "--port", str(free_port())], env)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def test_a_host_beyond_loopback_must_be_said(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="--host"):
        make_server(str(write_recording(tmp_path / "run")), host="0.0.0.0", port=free_port())


def test_without_textual_serve_the_command_says_what_to_install(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    code = ("import sys; sys.modules['textual_serve'] = None; sys.modules['textual_serve.server'] = None\n"
            "from perfmon.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "serve", str(write_recording(tmp_path / "run"))], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "perfmon[web]" in res.stderr
