"""``perfmon serve [PID | RUN_DIR]``: the same dashboard in a browser, through textual-serve (the Textual
project's own server): each browser tab runs ``perfmon attach`` (a live run or job) or ``perfmon replay`` (a
recording) under Textual's web driver, so every key works as in the terminal.

It listens on 127.0.0.1 unless told otherwise (reach it from a laptop with ``ssh -L``); another address needs
``--host`` said explicitly. Every request must carry the server's token (a random one unless ``--token`` gives
it), on loopback too: any web page the user visits could otherwise open a websocket to localhost and press the
job's keys, and any other user of the machine could connect. The first page is opened with ``?token=...``,
which sets a same-site cookie for the rest; a websocket from another origin is refused as well.
"""

from __future__ import annotations

import hmac
import secrets
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

INSTALL = "pip install 'perfmon[web]' (textual-serve)"
COOKIE = "perfmon_token"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeError(Exception):
    """Nothing to serve, or the server cannot start: one line for the user."""


def dashboard_command(target: str | None) -> tuple[list[str], str]:
    """The command each browser tab runs, and what it shows (for the lines printed at start)."""
    from perfmon.analysis.job import is_job_dir
    from perfmon.analysis.report import ReportError, load_recording, run_dir_of
    from perfmon.monitor.discovery import AttachError, find_run

    cli = [sys.executable, "-m", "perfmon.cli"]
    try:
        run = find_run(target)
    except AttachError as exc:
        if target is None or target.isdigit() or not Path(target).is_dir():
            raise ServeError(str(exc)) from None
        path = run_dir_of(Path(target))
        try:
            if not is_job_dir(path):
                load_recording(path)
        except ReportError as err:
            raise ServeError(str(err)) from None
        return [*cli, "replay", str(path.resolve())], f"the recording {path}"
    if run.get("ranks"):
        return [*cli, "attach", str(run["job_dir"])], f"the job in {run['job_dir']} ({len(run['ranks'])} ranks here)"
    return [*cli, "attach", str(run["pid"])], f"pid {run['pid']} ({' '.join(run.get('argv') or [])})"


def _server_class() -> Any:
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ImportError:
        raise ServeError(f"perfmon serve needs textual-serve: {INSTALL}") from None

    class TokenServer(Server):  # type: ignore[misc, valid-type]
        """textual-serve with a token check in front of every route (when a token is set)."""

        token: str | None = None
        lines: list[str] = []

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            if self.token is not None:
                app.middlewares.append(self._check_token)
            return app

        @web.middleware
        async def _check_token(self, request: web.Request, handler: Any) -> web.StreamResponse:
            assert self.token is not None
            given = request.query.get("token") or request.cookies.get(COOKIE) or ""
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise web.HTTPForbidden(text="perfmon serve: open the URL with its ?token=... (printed at start)\n")
            origin = request.headers.get("Origin")
            if origin is not None and origin.split("://", 1)[-1] != request.host:
                raise web.HTTPForbidden(text="perfmon serve: a page of another site may not drive the dashboard\n")
            response = await handler(request)
            if request.query.get("token") and isinstance(response, web.Response):
                response.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict")
            return response

        def initialize_logging(self) -> None:
            import logging

            super().initialize_logging()
            logging.getLogger().setLevel(logging.WARNING)  # not a line per request: what perfmon prints matters

        async def on_startup(self, app: web.Application) -> None:
            for line in self.lines:
                print(line, file=sys.stderr, flush=True)

    return TokenServer


def make_server(target: str | None, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                host_given: bool = False) -> Any:
    """The server, ready to ``serve()``; raises ServeError (nothing to serve, no textual-serve, a host beyond
    loopback without saying so)."""
    server_class = _server_class()
    command, what = dashboard_command(target)
    if host not in LOOPBACK and not host_given:
        raise ServeError("serving beyond 127.0.0.1 needs --host given explicitly")
    if token is not None and len(token) < 12:
        raise ServeError("--token must be at least 12 characters (or leave it out: a random one is made)")
    if token is None:
        token = secrets.token_urlsafe(24)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as exc:
            raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose --port") from None
    # a wildcard address is no place to open: the machine's name is (what the other machine reaches it by)
    shown = "localhost" if host in LOOPBACK else socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    server = server_class(shlex.join(command), host=host, port=port, title="perfmon",
                          public_url=None if host not in LOOPBACK else f"http://localhost:{port}")
    server.token = token
    url = f"http://{shown}:{port}/?token={token}"
    lines = [f"perfmon: serving the dashboard of {what}", f"  open {url}"]
    if host in LOOPBACK:
        lines.append(f"  from another machine: ssh -L {port}:127.0.0.1:{port} {_login()}  then open that URL")
    if "attach" in command:
        lines.append("  whoever has the token can watch the job and use its keys (stop included): keep it private")
        lines.append("  Ctrl-C stops serving (the job goes on)")
    else:  # a recording: nothing to stop
        lines.append("  whoever has the token can watch the recording: keep it private")
        lines.append("  Ctrl-C stops serving")
    server.lines = lines
    return server


def _login() -> str:
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "you"
    return f"{user}@{socket.gethostname()}"
