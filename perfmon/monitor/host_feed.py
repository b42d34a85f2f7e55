"""The launcher's sampler for its job: host and GPU telemetry read from outside the training process.

What the job's own sampler thread would read (its CPU and memory from ``/proc``, its DataLoader workers, the
system, NVML) does not need to be read from inside the job, where every reading costs the job CPU under its GIL.
The launcher reads it here, for the job's pid, and sends each reading over the job's socket as a ``sample`` line;
the job appends what only it can read (the CUDA allocator, torch's threads) to the line and records it. It starts
only a job whose agent expects it (``PERFMON_SAMPLER=launcher``); if this feed stops, the job samples for itself.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfmon import protocol
from perfmon.collectors.host import HostSampler
from perfmon.collectors.nvml import NvmlSampler

#: How often to look for the job's socket while it starts.
CONNECT_POLL_S = 0.05


class HostFeed:
    """A daemon thread: connect to the job at ``socket_path``, then send a reading every ``interval`` seconds
    while ``alive()`` says the job runs."""

    def __init__(self, pid: int, socket_path: Path, alive: Callable[[], bool], interval: float = 1.0,
                 nvml_backend: Any = None) -> None:
        self.pid = pid
        self.socket_path = socket_path
        self.alive = alive
        self.interval = interval
        self.nvml_backend = nvml_backend
        self.sent = 0
        #: why the feed ended (None while it runs, or if it ended with the job)
        self.ended: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostFeed:
        self._thread = threading.Thread(target=self._run, name="perfmon-host-feed", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            self.ended = self._feed()
        except Exception as exc:  # noqa: BLE001 - the job notices the silence and samples for itself
            self.ended = f"{type(exc).__name__}: {exc}"

    def _connect(self) -> socket.socket | None:
        while not self._stop.is_set() and self.alive():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.socket_path))
                return sock
            except OSError:
                sock.close()
            self._stop.wait(CONNECT_POLL_S)
        return None

    def _feed(self) -> str | None:
        sock = self._connect()
        if sock is None:
            return None
        with sock:
            hello = _greeting(sock)
            if not isinstance(hello.get("agent_threads"), list):  # what an agent that takes a feed says first
                return "the job's agent takes no feed (an older perfmon): it samples for itself"
            threads = {int(t) for t in hello["agent_threads"] if isinstance(t, int)}
            host = HostSampler(self.pid, lambda: threads)
            nvml = NvmlSampler(self.nvml_backend, pid=self.pid)
            nvml.open()
            try:
                if [g.get("uuid") for g in nvml.static] != [g.get("uuid") for g in hello.get("gpus") or ()
                                                            if isinstance(g, dict)]:
                    return "the job sees other GPUs than this launcher: it samples for itself"
                sock.setblocking(False)
                while not self._stop.wait(self.interval) and self.alive():
                    # the job adds who sampled and its own CPU for recording it (this CPU is not the job's)
                    msg = protocol.message("sample", t=time.time(), host=host.sample(),
                                           gpus=nvml.sample() if nvml.handles else [], interval_s=self.interval)
                    _discard(sock)
                    sock.setblocking(True)
                    sock.settimeout(self.interval)
                    try:
                        sock.sendall(protocol.encode(msg))
                    except OSError:  # the job ended, or dropped this feed (it samples for itself now)
                        return None
                    sock.setblocking(False)
                    self.sent += 1
            finally:
                nvml.close()
        return None


def _greeting(sock: socket.socket, timeout: float = 30.0) -> dict[str, Any]:
    """The job's first line (its hello), read with a deadline."""
    sock.settimeout(timeout)
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the job closed its socket before its hello")
        buf += chunk
    return protocol.decode(buf.partition(b"\n")[0], allowed=("hello",))


def _discard(sock: socket.socket) -> None:
    """Read away the stream the job sent before it knew this client is a feed (it sends none after)."""
    try:
        while sock.recv(65536):
            pass
    except (BlockingIOError, InterruptedError):
        pass
