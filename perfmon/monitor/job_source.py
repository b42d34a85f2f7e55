"""Every rank of a job as one source: each rank's agent live (its socket, back-filled from its recording),
or its recording; messages come out tagged with the rank that sent them (:data:`RANK_KEY`).

Ranks are found as they appear (``RUN/rank-K/``): torchrun starts its workers after the rendezvous, and
restarts them under new dirs. Commands go to every rank, or to the ranks a command names.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from perfmon import paths, protocol
from perfmon.analysis.job import ATTEMPT_KEY, RANK_KEY
from perfmon.analysis.profile_window import summarised
from perfmon.messages.commands import Command
from perfmon.monitor.sources import LiveSource, ReplaySource, Source, wait_for_socket
from perfmon.recording import READ_CHUNK, RecordingReader

POLL_S = 0.25
_DONE = object()
_OPENED = object()


def _attempt(rank_dir: Path) -> int:
    """Which attempt a rank dir holds: 0, or N for torchrun's restart N (``rank-K.restartN``)."""
    _, _, after = rank_dir.name.partition(".restart")
    return int(after) if after.isdigit() else 0


class _FollowedRecording(Source):
    """A rank's recording read as it grows, while its process lives (no socket to reach it by): over at the
    exit record, or once the process is gone and the file read to its end."""

    def __init__(self, rank_dir: Path, pid: int, closed: threading.Event) -> None:
        self.run_dir = rank_dir
        self.reader = RecordingReader(rank_dir / "events.jsonl")
        self.pid = pid
        self._closed = closed

    @property
    def skipped(self) -> int:  # type: ignore[override]
        return self.reader.skipped

    def messages(self) -> Iterator[dict[str, Any]]:
        while not self._closed.is_set():
            alive = paths.pid_alive(self.pid)  # before the read: what it wrote before it ended is in this one
            batch = self.reader.read_new(READ_CHUNK)
            for msg in batch:
                yield msg
                if protocol.is_exit(msg):
                    return
            if not batch:
                if not alive:
                    return
                self._closed.wait(POLL_S)


class JobSource(Source):
    """The ranks under ``run_dir``. ``follow``: a running job (live sockets, growing recordings) until
    ``alive()`` turns False and every rank's stream is over; else the recordings as they are."""

    def __init__(self, run_dir: Path, runtime_dir: Path | None = None, alive: Callable[[], bool] | None = None,
                 follow: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.runtime_dir = runtime_dir
        self.alive = alive or (lambda: False)
        self.follow = follow
        self.mode = "attached" if follow else "replay"  # type: ignore[misc]
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=10_000)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._ranks: dict[int, Source] = {}  # each rank's source, once opened
        self._threads: dict[Path, threading.Thread] = {}
        self.skipped = 0
        #: Multi-node: the hub that brings the other nodes' ranks (:mod:`perfmon.monitor.multinode`).
        self.remote: Any = None

    # -- the merged stream ---------------------------------------------------------------
    def messages(self) -> Iterator[dict[str, Any]]:
        running = 0
        while not self._closed.is_set():
            launcher_alive = self.follow and self.alive()  # read before the scan: no rank dir is missed
            running += self._scan()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _DONE:
                    running -= 1
                elif item is _OPENED:
                    running += 1
                else:
                    yield item
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if running == 0 and not launcher_alive:
                running += self._scan()  # a rank that appeared as the launcher ended
                if running == 0:
                    return

    def _scan(self) -> int:
        """Start a reader for each rank dir not read yet; returns how many were started."""
        started = 0
        for rank, rank_dir in paths.rank_dirs(self.run_dir):
            if rank_dir in self._threads:
                continue
            thread = threading.Thread(target=self._read_rank, args=(rank, rank_dir), daemon=True,
                                      name=f"perfmon-rank-{rank}")
            self._threads[rank_dir] = thread
            thread.start()
            started += 1
        return started

    def _read_rank(self, rank: int, rank_dir: Path) -> None:
        try:
            source = self._open(rank_dir)
            if source is None:
                return
            with self._lock:
                self._ranks[rank] = source
            attempt = _attempt(rank_dir)
            for msg in summarised(source.messages()):  # windows analysed from their traces
                msg[RANK_KEY] = rank
                if attempt:
                    msg[ATTEMPT_KEY] = attempt
                self._put(msg)
            self.skipped += getattr(source, "skipped", 0)
        except OSError:
            pass
        finally:
            self._put(_DONE)

    def _put(self, item: Any) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def _open(self, rank_dir: Path) -> Source | None:
        """The rank's live socket when its agent listens, else its recording (followed while it runs)."""
        if not self.follow:
            return ReplaySource(rank_dir)
        pid = self._pid_of(rank_dir)
        if pid is None:  # closed, or the job ended before this rank's agent said hello: what there is
            return None if self._closed.is_set() else ReplaySource(rank_dir)
        try:
            socket_dir = self.runtime_dir or paths.runtime_dir(create=False)
        except paths.RuntimeDirError:
            socket_dir = None
        if socket_dir is not None:
            sock = socket_dir / f"{pid}.sock"
            if wait_for_socket(sock, lambda: paths.pid_alive(pid) and not self._closed.is_set(), timeout=30.0):
                live = LiveSource(sock, rank_dir)
                try:
                    live.connect()
                    return live
                except OSError:
                    pass
        return _FollowedRecording(rank_dir, pid, self._closed)

    def _pid_of(self, rank_dir: Path) -> int | None:
        """The rank's pid, from the hello its agent records first (waits for it while the job runs)."""
        reader = RecordingReader(rank_dir / "events.jsonl")
        while not self._closed.is_set():
            for msg in reader.read_new(1 << 16):
                pid = protocol.hello_pid(msg)
                if pid is not None:
                    return pid
            if not self.alive():
                return None
            self._closed.wait(POLL_S)
        return None

    # -- other nodes' ranks (multi-node: the hub calls these) --------------------------------------
    def deliver(self, msg: dict[str, Any]) -> None:
        """A message of a rank on another node (tagged with its rank by that node's relay)."""
        if isinstance(msg.get(RANK_KEY), int) and not isinstance(msg.get(RANK_KEY), bool):
            self._put(msg)

    def remote_opened(self) -> None:
        self._put(_OPENED)

    def remote_closed(self) -> None:
        self._put(_DONE)

    # -- commands ------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        if self.remote is not None and self.remote.relays:
            return True
        with self._lock:
            return any(getattr(s, "connected", False) for s in self._ranks.values())

    def ranks_connected(self) -> list[int]:
        with self._lock:
            return sorted(r for r, s in self._ranks.items() if getattr(s, "connected", False))

    def send(self, command: Command) -> bool:
        """Send to the ranks in ``command.ranks`` (default: every rank); True if any took it."""
        targets = command.ranks
        local = replace(command, ranks=None)  # the agents get the command, not the routing
        with self._lock:
            sources = [(r, s) for r, s in self._ranks.items() if targets is None or r in targets]
        sent = False
        for _, source in sources:
            sent = source.send(local) or sent
        if self.remote is not None:  # the other nodes' relays pass it to their ranks (those named, or all)
            sent = self.remote.send(command) or sent
        return sent

    def close(self) -> None:
        self._closed.set()
        if self.remote is not None:
            self.remote.close()
        with self._lock:
            sources = list(self._ranks.values())
        for source in sources:
            source.close()
