"""The in-process agent: hot-path event buffer, step tracker, publisher thread, socket, recording.

The training thread only appends to the event buffer (``native.event_buffer``). A daemon thread drains it every ``tick``
seconds, turns events into step records, writes them to the recording and then to every
attached monitor. Nothing here raises into training: errors are counted and reported.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

from perfmon import paths, protocol
from perfmon.agent.cuda_timing import CudaResolver
from perfmon.agent.feed import FeedReader
from perfmon.agent.native import HOT, event_buffer
from perfmon.agent.output import close_output
from perfmon.agent.recorder import Recorder
from perfmon.agent.say import say
from perfmon.agent.server import Server
from perfmon.agent.steps import BEGIN, END, STEP, StepRecord, StepTracker
from perfmon.messages.commands import Command

#: Raw events kept if the publisher falls behind (oldest dropped beyond this).
EVENT_BUFFER = 500_000
#: Rows per ``steps`` message: keeps every line far below protocol.MAX_LINE.
STEPS_PER_MESSAGE = 2000
#: Most step rows one flush of the 1 s tick sends to the monitors (a sooner tick sends its share: the same rows
#: per second); the recording always has every row. Beyond this (over ~500 steps/s) the older rows reach monitors
#: as one ``bulk`` summary (count, sums, max), so a monitor's cost stays flat however fast the job steps.
LIVE_ROWS = 500
#: At exit, the publisher may take as long as its backlog needs; it is abandoned only after this many
#: seconds without any progress (a hung disk), so a loaded machine never loses steps to a timer.
STALL_S = 20.0
#: At high event rates the publisher ticks sooner, so that a flush takes about this many events: a batch that stays
#: in cache, and a buffer far from EVENT_BUFFER (the ring's alarm, WAKE_EVENTS, cuts short a tick a burst outgrows).
FLUSH_EVENTS = 20_000
MIN_TICK = 0.02
#: The longest the publisher sleeps in a job that stopped stepping: how late the first step after it shows.
IDLE_TICK = 2.0
#: Events that wake a sleeping publisher (the C ring calls it when it comes to hold this many): a sudden burst at
#: ~1M events/s after an idle stretch is flushed at FLUSH_EVENTS-sized batches, far from EVENT_BUFFER.
WAKE_EVENTS = 2 * FLUSH_EVENTS
#: Backwards back on a thread that trained before the last one did: loops training side by side in threads take
#: turns all the time; a training thread that hands over to another and back (an evaluation thread) does so once.
THREAD_RETURNS = 3
SIDE_BY_SIDE = ("backward runs on several threads in turn: training loops side by side in threads are one loop to "
                "perfmon, so their step count and phases mix them up (run each loop in a process of its own, e.g. "
                "multiprocessing or torchrun, to have each counted)")
EXECED = ("the script replaces itself with another program (os.exec*): its steps so far are recorded; perfmon does "
          "not follow the new program, whose exit is the job's")


class Agent:
    """One per training process."""

    def __init__(self, run_dir: Path, meta: dict[str, Any], tick: float = protocol.PUBLISH_TICK_S,
                 sample_interval: float | None = 1.0, fed: bool = False) -> None:
        """``fed``: the launcher sends the host and GPU readings (``sampler.Sampler.take_fed``)."""
        self.run_dir = run_dir
        self.meta = meta
        self.tick = tick
        #: what the hooks append, (code, perf_counter(), arg, CUDA mark); ``native.event_buffer``
        self.events: Any = event_buffer(EVENT_BUFFER)
        #: what the publisher sleeps on: an item from the C ring's alarm (the training thread's append, when
        #: WAKE_EVENTS pile up, or the first event after an idle stretch) or from finish(). A SimpleQueue's put runs
        #: no Python code, so a signal's handler (Ctrl-C) never runs inside the alarm and its exception is not lost.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        #: the publisher's longest sleep while nothing comes: IDLE_TICK where an event can wake it, else the tick
        self._idle_tick = tick
        if hasattr(self.events, "wake"):
            self.events.wake, self.events.wake_at = functools.partial(self._wake.put_nowait, None), WAKE_EVENTS
            self._idle_tick = max(tick, IDLE_TICK)
        self.cuda_marks = False
        self.enabled = True
        self.errors: dict[str, int] = {}
        self._unreported: list[str] = []
        self.error_messages: list[str] = []
        self.tracker = StepTracker()
        self.cuda = CudaResolver()
        self._seq = 0
        # re-entrant: code that publishes may run from inside publish() on the same thread (a signal handler; the
        # SIGTERM handler itself waits for publish to return: defer_while_publishing)
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()  # one flush at a time: the publisher's, or the final one at exit
        self._deferred: list[tuple[int, Callable[[], None]]] = []  # (thread, what): run when its publish returns
        #: what the publisher's tick published, to write (file lines) and send (monitor lines) at its end; None
        #: outside a tick. One write and one send a tick: each costs the job's cold caches more than its bytes do.
        self._batch: tuple[list[bytes], list[bytes]] | None = None
        self._batch_thread = 0
        self._discovery_monitors = 0  # monitors the discovery file says
        self._discovery_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock_offset = time.time() - time.perf_counter()
        self._warned_recording = False
        self._overflow_said = False
        self._side_by_side_said = False
        #: rows a flush sends monitors: LIVE_ROWS a tick, fewer when the publisher ticks sooner (the same rows/s)
        self._live_rows = LIVE_ROWS
        self.recorder = Recorder(run_dir)
        self.server: Server | None = None
        self._instrumentation: Any = None
        self._cuda_event: Callable[[], Any] | None = None
        self.pid = os.getpid()
        self.sample_interval = sample_interval
        self.fed = fed
        self._feed: FeedReader | None = None
        self.sampler: Any = None
        self.commands: Any = None
        #: step rows formatted by the C hot path where built (False: the Python loop; tests compare the two)
        self.c_rows = True

    @property
    def instrumentation(self) -> Any:
        """The torch hooks (``hooks.Instrumentation``), once torch is imported."""
        return self._instrumentation

    @instrumentation.setter
    def instrumentation(self, inst: Any) -> None:
        self._instrumentation = inst
        self._sync_fast_path()

    def _sync_fast_path(self) -> None:
        """Let the hooks append host-timed events straight to the buffer while that is all there is to do."""
        inst = self._instrumentation
        if inst is not None:
            inst.fast = self.events.append if self.enabled and not self.cuda_marks else None

    # -- hot path ------------------------------------------------------------------------
    def emit(self, code: int, arg: Any = None) -> None:
        """Record one raw event. Called from hooks on the training thread: keep it trivial."""
        if self.enabled:
            mark = None
            if self.cuda_marks:
                try:
                    mark = self._cuda_event()  # None while a stream captures a CUDA graph
                except Exception as exc:  # noqa: BLE001 - never into training; host times go on
                    self.cuda_marks = False
                    self._sync_fast_path()
                    self.record_error("cuda events", exc)
            self.events.append((code, time.perf_counter(), arg, mark))

    # -- the public API's entry points (perfmon.step / perfmon.phase) -------------------------
    def step(self) -> None:
        """An explicit ``perfmon.step()``: only these end steps from now on."""
        inst = self.instrumentation
        if inst is not None:
            inst.explicit_step()
        self.emit(STEP, None)
        self.boundary()

    def begin(self, phase: str) -> None:
        inst = self.instrumentation
        if inst is not None:
            inst.begin(phase)
        else:
            self.emit(BEGIN, phase)

    def end(self, phase: str) -> None:
        inst = self.instrumentation
        if inst is not None:
            inst.end(phase)
        else:
            self.emit(END, phase)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self.sample_interval:
            try:
                from perfmon.agent.sampler import Sampler

                self.sampler = Sampler(self, self.sample_interval, fed=self.fed)
                self.sampler.start()  # opens NVML first: the hello says which GPUs there are
            except Exception as exc:  # noqa: BLE001 - no telemetry; steps still flow
                self.record_error("sampler", exc)
                self.sampler = None
        self.publish(protocol.message("hello", **self.meta))
        self._report_recording_error()
        try:
            self.server = Server(
                paths.socket_path(self.pid), self._greeting, self._on_command, self._lock, self.record_error,
                on_feed=self._on_feed,
            )
            self.server.start()
            self._write_discovery()
        except paths.RuntimeDirError as exc:  # not ours to use: said once, like the launcher; not an internal error
            say(paths.unusable_line(exc, "live attach disabled"))
            self.publish(protocol.message("event", kind="warning", t=time.time(),
                                          message=f"{exc}: not using it; live attach disabled"))
            self.server = None
        except Exception as exc:  # noqa: BLE001 - no socket: training goes on, recording still works
            self.record_error("socket", exc)
            self.server = None
        if self.server is None and self.sampler is not None:  # nothing can feed it
            self.sampler.feed_lost()
        self._thread = threading.Thread(target=self._run, name="perfmon-agent", daemon=True)
        self._thread.start()
        os.register_at_fork(after_in_child=self._after_fork_child)

    def _after_fork_child(self) -> None:
        # DataLoader workers forked from the trainer inherit the patches; they must stay silent.
        self.enabled = False
        self.events = event_buffer(1)
        self._sync_fast_path()
        if self.server is not None:
            self.server.forget_in_child()

    def finish(self, exit_info: dict[str, Any]) -> None:
        """Flush everything, record the exit, have summary.json written outside the job (:meth:`write_summary`), close
        the socket."""
        if self.commands is not None:
            self.commands.finish()
        self.enabled = False
        self._sync_fast_path()
        self._stop.set()
        self._wake.put_nowait(None)
        if self.sampler is not None:
            self.sampler.stop()
        self._join_publisher()
        if "torch" in sys.modules and self.meta.get("cuda") is None:  # torch came in after the last tick
            try:  # cuda stops being None: the report tells a job that never imported torch from one without steps
                self.meta["cuda"] = bool(sys.modules["torch"].cuda.is_available())
            except Exception as exc:  # noqa: BLE001 - still record the exit
                self.meta["cuda"] = False
                self.record_error("cuda", exc)
            self.publish(protocol.message("hello", **self.meta))
        self._flush_all()
        try:
            self._read_feed()  # the readings of the last tick
        except Exception as exc:  # noqa: BLE001
            self.record_error("sampler", exc)
        self.close_feed()
        try:
            self._check_threads()  # a short run's loops side by side ended before a tick saw them
        except Exception as exc:  # noqa: BLE001
            self.record_error("publisher", exc)
        self._publish_errors()
        self.publish(protocol.message("event", kind="exit", t=time.time(), **exit_info, agent_errors=self.errors))
        self.write_summary()
        if self.server is not None:
            self.server.close()
        self.recorder.close()
        try:
            paths.discovery_path(self.pid).unlink(missing_ok=True)
        except Exception:  # noqa: BLE001
            pass

    def before_exec(self, program: str | None = None) -> None:
        """The script is about to replace itself (``os.exec*``): record its steps so far and say so. The agent
        stays as it is: an exec that fails leaves it following the script (:meth:`exec_failed`); one that succeeds
        ends its threads and closes its descriptors (close-on-exec), and the launcher records the new program's
        exit. Never raises."""
        self._flush_all()
        try:
            self._publish_errors()
            self.publish(protocol.message("event", kind="warning", message=EXECED, t=time.time()))
            self.publish(protocol.message("event", kind="exec", program=program, t=time.time()))
            paths.discovery_path(self.pid).unlink(missing_ok=True)  # `perfmon ls`: this agent is gone with it
        except Exception as exc:  # noqa: BLE001 - the exec goes on whatever happens here
            self.record_error("exec", exc)

    def _flush_all(self) -> None:
        """Every step so far to the recording (the last one too, if its optimizer ran), from the caller's thread,
        once the publisher lets go of what it holds. Never raises."""
        try:
            if self._flush_lock.acquire(timeout=STALL_S):
                try:
                    self._flush(final=True)
                finally:
                    self._flush_lock.release()
            else:
                self.record_error("publisher", TimeoutError(f"publisher stuck for {STALL_S:.0f} s"))
        except Exception as exc:  # noqa: BLE001 - the exit (or the exec) is recorded whatever happens here
            self.record_error("publisher", exc)

    def exec_failed(self, exc: BaseException) -> None:
        """The exec raised: the script goes on, and so does perfmon. Never raises."""
        try:
            self.publish(protocol.message("event", kind="exec", failed=True, t=time.time()))
            self.warn(f"the script's os.exec* failed ({type(exc).__name__}: {exc}): it goes on, and perfmon with it")
            self._write_discovery()
        except Exception as err:  # noqa: BLE001
            self.record_error("exec", err)

    def _join_publisher(self) -> None:
        """Wait for the publisher to finish what it holds, however long that takes on a loaded machine:
        give up only when it makes no progress at all for STALL_S seconds (a hung disk), never on a timer."""
        thread = self._thread
        if thread is None:
            return
        last, still = None, 0.0
        while thread.is_alive():
            thread.join(timeout=0.5)
            progress = (len(self.events), self._seq)
            still = still + 0.5 if progress == last else 0.0
            last = progress
            if still >= STALL_S:
                self.record_error("publisher", TimeoutError(f"no progress for {STALL_S:.0f} s at exit"))
                return

    def write_summary(self) -> None:
        """summary.json is analysis: written outside the job. A launcher still waiting for this process
        writes it itself; otherwise (perfmon.instrument(), a detached launcher, torchrun) a detached
        ``perfmon report RUN --write-summary`` does, so the job never loads state, rules or report."""
        launcher = os.environ.get(paths.LAUNCHER_ENV)
        if launcher == str(os.getppid()):
            return
        if os.environ.get(paths.RANKS_ENV) == "1" and launcher and launcher.isdigit() and paths.pid_alive(int(launcher)):
            return  # one rank of `perfmon torchrun`: its launcher writes every rank's summary and the job's
        try:
            import subprocess

            package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent,
                                                                           os.environ.get("PYTHONPATH")])))
            rules = ["--rules", os.environ["PERFMON_RULES"]] if os.environ.get("PERFMON_RULES") else []
            # one rank of a job: its own summary; the first rank of each node also waits for the node's other
            # ranks to end and writes the job's (one writer a node, not one a rank)
            ranked = self.meta.get("rank") is not None and self.run_dir.name.startswith(paths.RANK_DIR_PREFIX)
            job_writer = ranked and self.meta.get("local_rank") in (0, None)
            target = [str(self.run_dir.parent), "--wait-ranks", "600"] if job_writer else [str(self.run_dir)]
            writer = subprocess.Popen([sys.executable, "-m", "perfmon.cli", "report", *target, "--write-summary",
                                       *rules],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=env, start_new_session=True, close_fds=True)
            with warnings.catch_warnings():  # it outlives the job by design: no "still running" ResourceWarning
                warnings.simplefilter("ignore", ResourceWarning)  # in a script that shows them ("always")
                del writer
        except Exception as exc:  # noqa: BLE001 - the recording holds everything; summary.json is a convenience
            self.record_error("summary", exc)

    # -- publishing ------------------------------------------------------------------------
    def publish(self, msg: dict[str, Any]) -> None:
        """Number, record, then broadcast one message (the file always leads the socket)."""
        with self._lock:
            self._seq += 1
            msg["seq"] = self._seq
            self._out(protocol.encode(msg))
        self._report_recording_error()
        if self._deferred:
            self._run_deferred()

    def _out(self, data: bytes, live: bytes | None = None) -> None:
        """Record ``data``, then send it (``live`` instead, where given) to the monitors; the caller holds the lock.
        What the publisher's own tick publishes waits for the tick's end, to go out in one write and one send."""
        batch = self._batch
        if batch is not None:
            if self._batch_thread == threading.get_ident():
                batch[0].append(data)
                batch[1].append(data if live is None else live)
                return
            self._write_batch()  # another thread publishes meanwhile: the tick's lines so far go first (seq order)
        self._send(data, data if live is None else live)

    def _send(self, data: bytes, live: bytes) -> None:
        """Record ``data``, then send ``live`` to the monitors (the caller holds the lock)."""
        self.recorder.write(data)
        server = self.server
        if server is not None and server.client_count:
            server.broadcast(live)

    @contextlib.contextmanager
    def _batched(self) -> Iterator[None]:
        """What this thread publishes inside goes out at the end, in one write to the recording and one send to
        each monitor (the publisher's tick)."""
        with self._lock:
            self._batch, self._batch_thread = ([], []), threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._write_batch()
                self._batch = None
            self._report_recording_error()

    def _write_batch(self) -> None:
        """Write and send what the publisher's tick published so far (the caller holds the lock)."""
        batch = self._batch
        if batch is None or not batch[0]:
            return
        self._send(b"".join(batch[0]), b"".join(batch[1]))
        batch[0].clear()
        batch[1].clear()

    def defer_while_publishing(self, fn: Callable[[], None]) -> bool:
        """For a signal handler: when it interrupted this thread inside :meth:`publish`, run ``fn`` as soon as
        that publish returns, and say True. Finishing from inside would wait for the publisher thread, itself
        waiting for the lock this thread holds, and lose the steps that thread has in hand."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]  # both RLocks have it
            return False
        self._deferred.append((threading.get_ident(), fn))
        return True

    def _run_deferred(self) -> None:
        me = threading.get_ident()
        mine = [fn for thread, fn in self._deferred if thread == me]
        if not mine or self._lock._is_owned():  # type: ignore[attr-defined]  # still inside an outer publish
            return
        self._deferred = [(thread, fn) for thread, fn in self._deferred if thread != me]
        for fn in mine:
            fn()

    def publish_text(self, body: str, live: str | None = None) -> None:
        """Like :meth:`publish` for a message already encoded as a JSON object (without ``seq``); the
        monitors get ``live`` instead when given (the same message, with fewer rows)."""
        with self._lock:
            self._seq += 1
            head = f'{{"seq":{self._seq},'
            server = self.server
            watched = server is not None and server.client_count  # else the live text is never sent: not built
            self._out((head + body[1:] + "\n").encode(),
                      (head + live[1:] + "\n").encode() if live is not None and watched else None)
        self._report_recording_error()
        if self._deferred:
            self._run_deferred()

    def _greeting(self) -> bytes:
        from perfmon.agent.sampler import perfmon_threads

        # agent_threads: perfmon's threads here, which a launcher sampling the job from outside does not count
        # as the trainer's when it reads their CPU wait
        self._write_batch()  # (under the lock) a monitor back-fills up to live_seq from the recording: it is there
        hello = protocol.message("hello", **self.meta, live_seq=self._seq, agent_threads=sorted(perfmon_threads()))
        return protocol.encode(hello)

    def _on_feed(self, sock: socket.socket, first: dict[str, Any], pending: bytes) -> bool:
        """The launcher's feed (socket thread), at its first reading; False: not wanted (it is closed)."""
        if self._feed is not None or self._stop.is_set():
            return False
        if not self._take_sample(first):
            return False
        self._feed = FeedReader(sock, pending)
        return True

    def _take_sample(self, msg: dict[str, Any], line: bytes | None = None) -> bool:
        sampler = self.sampler
        try:
            return sampler is not None and sampler.take_fed(msg, line)
        except Exception as exc:  # noqa: BLE001 - the job samples for itself instead
            self.record_error("sampler", exc)
            return False

    def _read_feed(self) -> None:
        """Record the readings the launcher sent since the last tick; a feed that ended or sent what cannot be
        used is closed, and the job samples for itself."""
        feed = self._feed
        if feed is None:
            return
        for line in feed.lines():
            try:
                ok = self._take_sample(protocol.decode(line, allowed=("sample",)), line)
            except protocol.DecodeError:
                ok = False
            if not ok:
                feed.closed = True
                break
        if feed.closed and self.sampler is not None:
            self.sampler.feed_lost()

    def close_feed(self) -> None:
        """Stop reading the launcher's feed (the job samples for itself, or ends)."""
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def _on_command(self, command: Command, reply: Callable[[bytes], None]) -> None:
        """A command the server parsed (socket thread)."""
        if command.name == "stop":  # any monitor of this user (the socket refuses others): Ctrl-C for the job
            reply(protocol.encode(protocol.message(
                "event", kind="command_result", name="stop", id=command.id, ok=True, done=True,
                message=f"stop: SIGINT sent to pid {self.pid}")))
            os.kill(self.pid, signal.SIGINT)
            return
        if command.name == "close_output":  # the pipe the launcher copies a stream to lost its reader (`| head`)
            broken = close_output(command.streams or ())
            reply(protocol.encode(protocol.message(
                "event", kind="command_result", name="close_output", id=command.id, ok=bool(broken), done=True,
                message=f"close_output: {', '.join(broken) or 'nothing'} closed")))
            return
        if self.commands is None:
            reply(protocol.encode(protocol.message(
                "event", kind="command_result", name=command.name, id=command.id, ok=False, done=True,
                message="commands are not available (torch not instrumented)")))
            return
        self.commands.request(command, reply)

    def boundary(self) -> None:
        """A step boundary on the training thread: run pending commands and profiler windows."""
        commands = self.commands
        if commands is not None:  # it checks that the agent is on before doing anything
            commands.boundary()

    def _report_recording_error(self) -> None:
        if self.recorder.error and not self._warned_recording:
            self._warned_recording = True
            if not paths.launched_alone():  # else the launcher says it, from the warning below: once
                say(f"perfmon: {self.recorder.error}")
            self.errors["recording"] = self.errors.get("recording", 0) + 1
            # published by the publisher thread with a seq of its own (monitors drop a line whose seq they had)
            self.warn(self.recorder.error)

    def warn(self, text: str) -> None:
        """A warning for the monitors and the recording (published by the agent's thread)."""
        self._unreported.append(text)

    def record_error(self, where: str, exc: BaseException) -> None:
        """Count an internal error; keep the first few messages. Never raises."""
        first = where not in self.errors
        self.errors[where] = self.errors.get(where, 0) + 1
        if len(self.error_messages) < 20:
            self.error_messages.append(f"{where}: {type(exc).__name__}: {exc}")
        if first:  # said once per kind, by the publisher thread (never from inside publish's lock)
            self._unreported.append(f"agent internal error in {where}: {type(exc).__name__}: {exc} "
                                    "(counted; training continues)")

    def _publish_errors(self) -> None:
        while self._unreported:
            text = self._unreported.pop(0)
            self.publish(protocol.message("event", kind="warning", message=text, t=time.time()))

    # -- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        wait, last = self.tick, time.monotonic()
        while True:
            self._sleep(wait)
            if self._stop.is_set():  # after the sleep's items are taken: finish() sets it before it wakes us
                return
            try:
                with self._batched():
                    n = self._tick()
            except Exception as exc:  # noqa: BLE001 - the thread that records every step must outlive any error
                self.record_error("publisher", exc)
                n = 0
            now = time.monotonic()
            # steps held for the GPU are work still to do: no longer sleep while they wait
            waited = None if self.cuda.pending else wait
            wait, last = next_wait(n, now - last, self.tick, waited, self._idle_tick), now
            wait = self._arm_alarm(wait)
            self._live_rows = max(1, round(LIVE_ROWS * min(wait, self.tick) / self.tick))

    def _tick(self) -> int:
        """One tick's work: steps, the launcher's readings, discovery, warnings. Returns the events it took;
        never raises."""
        n = 0
        try:
            self._poll_cuda()
            if len(self.events) or self.cuda.pending:  # else a flush has nothing to do (~50 us cold)
                with self._flush_lock:
                    n = self._flush()
            if self.sampler is not None:  # after the steps: the readings were taken while they ran
                self._read_feed()
                self.sampler.check_feed()
            self._refresh_discovery()
            self._check_threads()
        except Exception as exc:  # noqa: BLE001 - the publisher must survive anything
            self.record_error("publisher", exc)
        try:
            self._publish_errors()
        except Exception:  # noqa: BLE001
            pass
        return n

    def _check_threads(self) -> None:
        """Say once when backwards keep going back to a thread that trained before another did: loops training side
        by side in threads, whose steps perfmon cannot tell apart (loops one after another, a thread each, never
        go back), however slow their steps."""
        inst = self._instrumentation
        if inst is None or self._side_by_side_said:
            return
        if inst.bounds.thread_returns >= THREAD_RETURNS:
            self._side_by_side_said = True
            self.warn(SIDE_BY_SIDE)

    def _sleep(self, seconds: float) -> None:
        """Sleep until ``seconds`` pass or the alarm rings; take every item the alarm left."""
        try:
            self._wake.get(timeout=seconds)
            while True:
                self._wake.get_nowait()
        except queue.Empty:
            pass

    def _arm_alarm(self, wait: float) -> float:
        """Before a sleep past the tick (nothing came), have the first event wake the publisher: a job that resumes
        shows at once, and a monitor's view of its step is never more than a tick old (a profiler window on every
        rank at one step counts on that). Returns the sleep to take: the tick if an event came meanwhile."""
        events = self.events
        if not hasattr(events, "wake_at"):  # no alarm: the wait never passes the tick (``_idle_tick``)
            return wait
        idle = wait > self.tick
        events.wake_at = 1 if idle else WAKE_EVENTS
        if idle and len(events):  # it came before the alarm was set: no alarm for it, so do not sleep past it
            events.wake_at = WAKE_EVENTS
            return self.tick
        return wait

    def _poll_cuda(self) -> None:
        if self._cuda_event is not None or self.instrumentation is None:
            return  # torch not (fully) imported yet, or already timing on CUDA
        torch = sys.modules["torch"]
        try:
            if self.meta.get("cuda") is None:
                self.meta["cuda"] = bool(torch.cuda.is_available())
                self.publish(protocol.message("hello", **self.meta))
            if not self.meta["cuda"]:  # torch's answer is final: stop asking at every tick
                self._cuda_event = _no_event
                return
            if torch.cuda.is_initialized():
                self._cuda_event = self.cuda.make_event
                self.cuda_marks = True
                self._sync_fast_path()
        except Exception as exc:  # noqa: BLE001
            self.record_error("cuda", exc)
            self._cuda_event = _no_event

    def _flush(self, final: bool = False) -> int:
        """Turn the buffered events into steps, record and publish them; returns how many events it took."""
        events = self.events
        batch = events.drain()  # only what is there now (the training thread appends meanwhile)
        if events.dropped and not self._overflow_said:  # the oldest were dropped: say so, once
            self._overflow_said = True
            self.warn(f"perfmon fell behind: its buffer of {events.maxlen:,} events overflowed and the oldest "
                      "were dropped, so some steps are missing from the recording (training is unaffected)")
        records = self.tracker.feed_many(batch)
        if final:
            last = self.tracker.finish(time.perf_counter())
            if last is not None:
                records.append(last)
        ready = self.cuda.resolve(records, final=final)
        outside = {f"{k}_ms": _ms(v) for k, v in self.tracker.drain_outside().items()}
        live = self._live_rows
        if len(ready) > live and ready[0][0].index == 1:  # step 1 always reaches monitors as a row of its own:
            self._publish_steps(ready[:1], outside, 0)  # the whole-run figures leave it out (warm-up), by its row
            outside, ready = {}, ready[1:]
        share = live / len(ready) if len(ready) > live else 1.0
        # bounded lines: a backlog (a slow tick, 10k steps/s) goes out as several messages; each keeps its
        # share of the LIVE_ROWS rows the monitors get, so every message they see has rows to weigh its bulk by
        for i in range(0, len(ready), STEPS_PER_MESSAGE):
            chunk = ready[i : i + STEPS_PER_MESSAGE]
            self._publish_steps(chunk, outside, len(chunk) - max(1, math.ceil(len(chunk) * share)))
            outside = {}
        if outside:  # evaluation or a checkpoint with no step after it (yet)
            self._publish_steps([], outside, 0)
        return len(batch)

    def _publish_steps(self, records: list[tuple[StepRecord, dict[str, float] | None]],
                       outside: dict[str, float], live_from: int) -> None:
        """One ``steps`` message, formatted row by row with C-level ``%`` (the agent's hot loop at high step
        rates); monitors get the rows from ``live_from`` on and a ``bulk`` summary of the ones before."""
        off = self._clock_offset
        # C-level passes (map, not generators): this runs over every step at any step rate
        with_dev = any(map(_second, records))
        with_closures = any(map(_closures, map(_first, records)))
        with_prefetch = any(map(_prefetch, map(_first, records)))
        head = _steps_head(with_closures, with_dev, with_prefetch)
        tail = (',"outside":' + json.dumps(outside, separators=(",", ":")) if outside else "") + "}"
        if HOT is not None and not with_dev and not with_closures and not with_prefetch and self.c_rows:
            # the common case in C: the same text and sums, without a Python loop over the rows
            cut = min(live_from, len(records)) if live_from > 0 else 0
            texts, sums = HOT.step_rows(records, off, cut)
            body = head + ',"rows":[' + ",".join(texts) + "]" + tail
            live = None
            if sums is not None:
                live = (head + ',"rows":[' + ",".join(texts[cut:]) + "]" + ',"bulk":'
                        + json.dumps(_bulk_of_sums(cut, sums), separators=(",", ":")) + tail)
            self.publish_text(body, live)
            return
        vals = []
        append = vals.append
        for rec, _ in records:
            ph = rec.phases
            dur = rec.end - rec.start
            d, f, b, o = ph["data"], ph["forward"], ph["backward"], ph["optimizer"]
            other = dur - d - f - b - o
            append((rec.index, rec.end + off, dur * 1e3, d * 1e3, f * 1e3, b * 1e3, o * 1e3,
                    other * 1e3 if other > 0.0 else 0.0, rec.samples or 0))
        row = _ROW + (",%d" if with_closures else "") + (",%.4f" if with_prefetch else "") + (
            "%s" if with_dev else "") + "]"
        extras: list[tuple] = []
        if with_dev or with_closures or with_prefetch:
            extras = [((rec.closures,) if with_closures else ()) + ((rec.prefetch * 1e3,) if with_prefetch else ())
                      for rec, _ in records]
            if with_dev:
                extras = [e + (_dev_text(dev),) for e, (_, dev) in zip(extras, records, strict=True)]
            texts = [row % (v + e) for v, e in zip(vals, extras, strict=True)]
        else:
            texts = list(map(row.__mod__, vals))  # one C-level pass
        body = head + ',"rows":[' + ",".join(texts) + "]" + tail
        live = None
        if live_from > 0:  # a fast job: the newest rows, and what came before them in one summary
            cut = min(live_from, len(vals))
            live = (head + ',"rows":[' + ",".join(texts[cut:]) + "]" + ',"bulk":'
                    + json.dumps(_bulk(vals[:cut], [rec.closures for rec, _ in records[:cut]] if with_closures else None,
                                       [rec.prefetch * 1e3 for rec, _ in records[:cut]] if with_prefetch else None),
                                 separators=(",", ":")) + tail)
        self.publish_text(body, live)

    # -- discovery ---------------------------------------------------------------------------
    def _refresh_discovery(self) -> None:
        """Keep ``perfmon ls``'s MONITORS current: rewrite the file, at most once a second, when a monitor came
        or went (the rename costs the job ~0.5 ms). Its step count is read from the recording's end."""
        server = self.server
        if server is None:
            return
        now = time.monotonic()
        if server.client_count != self._discovery_monitors and now - self._discovery_at >= 1.0:
            self._discovery_at = now
            self._write_discovery()

    def _write_discovery(self) -> None:
        server = self.server
        self._discovery_monitors = server.client_count if server is not None else 0
        info = {
            "pid": self.pid, "script": self.meta.get("script"), "argv": self.meta.get("argv"),
            "start": self.meta.get("start"), "rank": self.meta.get("rank"),
            "world_size": self.meta.get("world_size"), "node": self.meta.get("node"),
            "job_dir": str(self.run_dir.parent) if self.meta.get("rank") is not None
            and self.run_dir.name.startswith(paths.RANK_DIR_PREFIX) else None,
            "socket": str(paths.socket_path(self.pid)), "run_dir": str(self.run_dir),
            "protocol": protocol.VERSION, "host": socket.gethostname(),
            "steps": self.tracker.count, "monitors": self._discovery_monitors, "updated": time.time(),
        }
        path = paths.discovery_path(self.pid)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover temp file keeps its old mode under O_CREAT
            os.write(fd, json.dumps(info).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)


def _no_event() -> None:
    """No CUDA events: torch has no CUDA here, or making one failed."""
    return None


def next_wait(events: int, seconds: float, tick: float, waited: float | None = None,
              longest: float = IDLE_TICK) -> float:
    """How long the publisher sleeps after a flush of ``events`` events that came in ``seconds``: ``tick``, or
    sooner at a rate that would bring more than FLUSH_EVENTS in a tick (never under MIN_TICK). A tick that found
    nothing (it ``waited`` that long) doubles the sleep, up to ``longest``: a job that stopped stepping (evaluation,
    a checkpoint, a long data stall) pays for fewer wake-ups, each ~0.1 ms of CPU in its cold caches; a burst
    after it wakes the publisher at WAKE_EVENTS (the ring's alarm), long before the buffer could overflow."""
    if events == 0 and waited is not None:
        return max(tick, min(longest, waited * 2))
    rate = events / max(seconds, 1e-3)
    if rate * tick <= FLUSH_EVENTS:
        return tick
    return max(MIN_TICK, FLUSH_EVENTS / rate)


@functools.cache
def _steps_head(with_closures: bool, with_dev: bool, with_prefetch: bool = False) -> str:
    """A ``steps`` message up to its rows: its fields, with the optional columns the rows carry."""
    fields = list(protocol.STEP_FIELDS) + (["closures"] if with_closures else []) + (
        ["prefetch_ms"] if with_prefetch else []) + (
        ["dev_forward_ms", "dev_backward_ms", "dev_optimizer_ms"] if with_dev else [])
    return f'{{"v":{protocol.VERSION},"type":"steps","fields":{json.dumps(fields, separators=(",", ":"))}'


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


_first, _second, _closures, _prefetch = itemgetter(0), itemgetter(1), attrgetter("closures"), attrgetter("prefetch")

#: A step row without its optional columns: protocol.STEP_FIELDS, times in ms to 0.1 us.
_ROW = "[%d,%.6f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%d"


def _dev_text(dev: dict[str, float] | None) -> str:
    """The three device-time columns (ms, or null where a phase had no CUDA timing)."""
    dev = dev or {}
    return "".join("," + ("null" if (v := dev.get(p)) is None else f"{v:.4f}") for p in ("forward", "backward",
                                                                                        "optimizer"))


def _bulk(vals: list[tuple], closures: list[int] | None, prefetch: list[float] | None = None) -> dict[str, Any]:
    """What a monitor needs of rows it is not sent: count, index range, sums and max (ms), samples."""
    cols = list(zip(*vals, strict=True))
    samples = cols[8]
    out: dict[str, Any] = {
        "n": len(vals), "first_i": cols[0][0], "last_i": cols[0][-1], "first_start": round(cols[1][0] - cols[2][0] / 1e3, 6),
        "last_t": round(cols[1][-1], 6), "max_ms": round(max(cols[2]), 4),
        "sum_ms": {name: round(sum(cols[k]), 4) for name, k in _BULK_COLUMNS},
        "samples": sum(samples), "samples_steps": len(samples) - samples.count(0),
    }
    if closures is not None:
        out["closures"] = sum(closures)
        out["closure_steps"] = len(closures)
    if prefetch is not None:
        out["prefetch_ms"] = round(sum(prefetch), 4)
    return out


_BULK_COLUMNS = (("dur", 2), ("data", 3), ("forward", 4), ("backward", 5), ("optimizer", 6), ("other", 7))


def _bulk_of_sums(n: int, sums: tuple) -> dict[str, Any]:
    """:func:`_bulk` from the sums ``_hot.step_rows`` made of the same rows."""
    first_i, last_i, first_start, last_t, max_ms, *cols, samples, samples_steps = sums
    return {"n": n, "first_i": first_i, "last_i": last_i, "first_start": round(first_start, 6),
            "last_t": round(last_t, 6), "max_ms": round(max_ms, 4),
            "sum_ms": {name: round(total, 4) for (name, _), total in zip(_BULK_COLUMNS, cols, strict=True)},
            "samples": samples, "samples_steps": samples_steps}
