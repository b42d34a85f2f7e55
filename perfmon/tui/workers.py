"""The dashboard's background loops: follow the source, wait for the launched process, tail the output.

Each runs on a thread of its own (the app's thin ``@work`` methods call them), blocks only on what
it follows or on ``stop``, and tells the UI what happened with the typed messages below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from textual.message import Message

from perfmon import paths
from perfmon.analysis.job import JobState
from perfmon.analysis.profile_window import summarised
from perfmon.analysis.state import RunState
from perfmon.monitor.sources import Source
from perfmon.tail import CURSOR_UP, OUTPUT_LINES, OutputTail, available

COALESCE_S = 1.0  # state changes are posted at most this often: the dashboard redraws about once a second
OUTPUT_S = 1.0  # new output lines at most this often: each write lays the screen out again
POLL_S = 0.25  # process and output polls; also how soon a loop sees ``stop``

Post = Callable[[Message], object]


class StateChanged(Message):
    """New messages were folded into the state (coalesced)."""


class StreamEnded(Message):
    """The source's stream is over; ``error`` says why when it broke."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__()
        self.error = error


class ProcessExited(Message):
    """The launched training process ended."""

    def __init__(self, returncode: int) -> None:
        super().__init__()
        self.returncode = returncode


class OutputLines(Message):
    """Complete new lines of the script's output (``RUN/output.log``, ``RUN/stderr.log``)."""

    def __init__(self, lines: list[str], partial: str = "") -> None:
        super().__init__()
        self.lines = lines
        self.partial = partial  # the line being written (a progress bar's), "" if none


class TrainingProcessLike(Protocol):
    """What the app needs of :class:`perfmon.monitor.launch.TrainingProcess`."""

    pid: int

    def poll(self) -> int | None: ...
    def stop(self) -> None: ...
    def forward(self, sig: int) -> None: ...


def follow_source(source: Source, fold: Callable[[dict[str, Any]], None], post: Post,
                  stop: threading.Event) -> None:
    """``fold`` each of the source's messages into the state; post :class:`StateChanged` on a leading
    edge, at most every COALESCE_S (the app's periodic flush draws what came after), then
    :class:`StreamEnded`."""
    last_post = 0.0
    error: str | None = None
    try:
        for msg in summarised(source.messages()):  # windows analysed from their traces
            fold(msg)
            now = time.monotonic()
            if now - last_post >= COALESCE_S:
                last_post = now
                post(StateChanged())
            if stop.is_set():
                return
    except Exception as exc:  # noqa: BLE001 - a broken stream ends it; the dashboard stays
        error = f"stream error: {type(exc).__name__}: {exc}"
    post(StreamEnded(error))


def wait_for_exit(process: TrainingProcessLike, state: RunState | JobState, lock: threading.Lock, post: Post,
                  stop: threading.Event) -> None:
    """Wait for the launched process, then fold its exit into the state and post :class:`ProcessExited`.

    Polls, so that detaching never waits on the process.
    """
    while (code := process.poll()) is None:
        if stop.wait(POLL_S):
            return
    with lock:
        state.process_exited(code)
    post(ProcessExited(code))


#: The panel's one line where the run dir holds no output: a ``perfmon.instrument()`` run's goes to its own stdout.
NOT_CAPTURED = ("[perfmon] the script's output is not captured in this run: it goes where the job's stdout and stderr "
                "go (a perfmon.instrument() run; perfmon SCRIPT captures it)")



def tail_output(run_dir: Callable[[], Any], post: Post, stop: threading.Event,
                job_over: threading.Event) -> None:
    """Poll the script's stdout and stderr (``RUN/output.log``, ``RUN/stderr.log``) every POLL_S; post their new
    complete lines (:class:`OutputLines`, in the order the polls found them) at most every OUTPUT_S. Ends once the
    job is over and both files are read to their end.

    ``run_dir()`` is asked until it knows the run dir: an attached source learns it from the agent's hello.
    """
    tails: list[OutputTail] = []
    while not tails:
        where = run_dir()
        if where:
            files = [Path(where) / name for name in (paths.OUTPUT_LOG, paths.STDERR_LOG)]
            tails = [OutputTail(path) for path in files]
            if not any(available(path) for path in files):  # said, not an empty panel that looks like no output
                post(OutputLines([NOT_CAPTURED]))
        elif job_over.is_set() or stop.wait(POLL_S):
            return
    pending: list[str] = []
    last_post = 0.0
    shown = ""  # the partial line the panel shows
    redraw = ""  # the latest redraw of a bar under another (nested tqdm bars), until an ordinary line comes
    while True:
        ended = job_over.is_set()  # before the read: what the job wrote before it ended is in this one
        lines = [line for tail in tails for line in tail.read()]
        if ended and not lines:
            lines.extend(line for tail in tails for line in tail.flush())
        for line in lines:
            # a bar drawn on the line below another ends by moving the cursor back up (tqdm's nested bars, each
            # redraw a "line" of its own): shown as the progress line, not a line of the log each time
            if line.rstrip("\r").endswith(CURSOR_UP):
                redraw = line
            else:
                pending.append(line)
                redraw = ""
        # a progress bar (tqdm writes to stderr) redraws one line with \r until the epoch ends it
        partial = next((p for p in (tail.partial() for tail in reversed(tails)) if p), "") or redraw
        now = time.monotonic()
        if (pending or partial != shown) and (ended or now - last_post >= OUTPUT_S):
            post(OutputLines(pending[-OUTPUT_LINES:], partial))
            pending, last_post, shown = [], now, partial
        if ended and not lines:
            return
        if stop.wait(POLL_S):
            return
