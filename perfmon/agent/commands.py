"""Whitelisted commands from monitors, run on the training thread at the next step boundary.

A request arrives parsed (:class:`perfmon.messages.commands.Command`: the server checked its name and arguments).
The socket thread only queues it (``request``) and answers at once whether it was accepted; the work happens
in :meth:`Commands.boundary`, called from the hooks that end a step. That call costs one attribute check when
nothing is pending.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfmon import protocol
from perfmon.agent.disk import short_of_space
from perfmon.agent.native import CommandFields
from perfmon.agent.profiler_guard import ScriptProfilers
from perfmon.messages.commands import Command

Answer = Callable[[dict[str, Any]], None]

FLOPS_WAIT_STEPS = 20
FLOPS_BESIDE_MODE = ("count_flops: the script keeps a torch dispatch mode of its own on across step ends (its own "
                     "FlopCounterMode, say); perfmon does not stack its FLOP counter on it")
FLOPS_COMPILED = ("FLOPs not counted: the script runs torch.compile'd code, and the counter (a dispatch mode) makes "
                  "dynamo run that step eagerly: its random draws (dropout) and so its results would differ from "
                  "plain python's. Count them in a run without torch.compile: the model's FLOPs are the same")
#: Commands that may wait for a step end at once, and how far ahead one may ask for a step (a multi-rank window
#: asks a second and a half ahead): a monitor that sent thousands (or one for step 10**12) had the training thread
#: scan them at every step end, 270x slower steps for the rest of the run.
MAX_QUEUED = 16
MAX_STEPS_AHEAD = 1_000_000
#: Traces of periodic windows kept on disk (--profile-keep; 0: all).
DEFAULT_PROFILE_KEEP = 20
SCRIPT_PROFILING = ("the script runs its own torch.profiler: perfmon's profiler windows wait while it records "
                    "(one profiler at a time; the script's comes first)")


def _dispatch_modes() -> list[Any] | None:
    """The torch dispatch modes on now, innermost last (None where this torch has no such stack to read)."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:
        return None
    return list(_get_current_dispatch_mode_stack())


def _release_trackers(counter: Any) -> None:
    """A FlopCounterMode left without its ``__exit__`` (its mode is not perfmon's to pop): its module tracker's
    global forward hooks go all the same (torch >= 2.5 has one)."""
    tracker = getattr(counter, "mod_tracker", None)
    if tracker is not None:
        try:
            tracker.__exit__()
        except Exception:  # noqa: BLE001, S110 - nothing more to release
            pass


def _close_counter(counter: Any) -> bool | None:
    """End perfmon's FlopCounterMode where torch allows it (torch pops dispatch modes by position): True, popped
    (it was innermost, or this torch has no stack to read); None, a mode of the script's is on above it (a later
    step end); False, the script's own mode exit already popped it (its module trackers are released)."""
    stack = _dispatch_modes()
    entry = getattr(counter, "mode", None) or counter  # an inner mode (torch >= 2.5), or the counter itself
    if stack is None or (stack and stack[-1] is entry):
        counter.__exit__(None, None, None)
        return True
    if entry in stack:
        return None
    _release_trackers(counter)
    return False


class Commands(CommandFields):
    """The commands' queue and state. What a step's end looks at (``boundaries``, ``pending``, ``window``,
    ``flops_mode``, ``memory``, ``_next_every``, ``_next_time``) is its base's: C struct members where the C hot
    path was built, so the C hooks count a boundary and see that nothing is due without a Python call."""

    def __init__(self, agent: Any, config: dict[str, Any]) -> None:
        self.agent = agent
        self.run_dir: Path = agent.run_dir
        self.wait = int(config.get("wait", 1))
        self.warmup = int(config.get("warmup", 1))
        self.active = int(config.get("active", 3))
        self.profile_memory = bool(config.get("profile_memory"))
        keep = config.get("profile_keep")
        self.profile_keep = DEFAULT_PROFILE_KEEP if keep is None else int(keep)
        self._periodic_traces: Any = None  # perfmon.agent.profiler.PeriodicTraces, made with the first window
        self.every = int(config.get("every") or 0)
        self.interval = float(config.get("interval") or 0)
        self.count_flops_at_start = bool(config.get("count_flops"))
        self.boundaries = 0
        self.window: Any = None
        self.flops_mode: Any = None
        self.last_profile: dict[str, Any] | None = None
        #: The memory_snapshot flow (allocation history for N steps, then a snapshot), made at the first request.
        self.memory: Any = None  # perfmon.agent.memory_history.MemorySnapshots
        #: (what to run, the command that asked for it: None for the agent's own work, where to answer)
        self._queue: list[tuple[str, Command | None, Answer]] = []
        self._lock = threading.Lock()
        self.pending = self.count_flops_at_start
        #: torch's intra-op threads as the training thread sees them (OpenMP keeps the count per thread: the
        #: sampler's own thread would read its own); read at install and refreshed at a step end on request
        self.torch_threads: int | None = None
        self._next_every = self.every if self.every else None
        self._next_time = time.monotonic() + self.interval if self.interval else None
        #: the script's own torch.profiler sessions (reported by the hooks): perfmon's windows give way to them
        self.script_profilers = ScriptProfilers(self._give_way)
        self._flops_waited = 0  # step ends a FLOP count has waited for the script's own dispatch mode to end
        self._window_answer: Answer = lambda r: None
        self._window_thread: int | None = None  # the thread that drives the open window: the training thread
        self._said: set[str] = set()  # warnings given once: why periodic windows were skipped
        if self.count_flops_at_start:
            # not at the first boundary: a loop is learned over its first steps, and without a DataLoader the first
            # step's end is confirmed only at the next optimizer.step(), with nothing of that step left to count
            # but the update (a count of 0 FLOPs); the third step is counted whole
            self._queue.append(("count_flops", Command("count_flops", at_step=2), self._warn_unless_ok))

    # -- socket thread -------------------------------------------------------------------------
    def request(self, command: Command, reply: Callable[[bytes], None]) -> None:
        """Answer ``command`` now, or queue it for the next step boundary and say so."""
        name = command.name

        def answer(fields: dict[str, Any]) -> None:
            reply(protocol.encode(protocol.message("event", kind="command_result", name=name, id=command.id,
                                                   **fields)))

        refusal = self._flooded(command)
        if refusal is not None:
            answer({"ok": False, "done": True, "message": refusal})
            return
        torch = sys.modules.get("torch")
        cuda = bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
        if name == "empty_cache" and not cuda:
            answer({"ok": True, "done": True, "message": "no CUDA device: nothing to free"})
            return
        if name == "memory_snapshot":
            if not cuda:
                answer({"ok": False, "done": True, "message": "memory snapshot: n/a (no CUDA device)"})
                return
            if self.memory is None:
                from perfmon.agent.memory_history import MemorySnapshots

                self.memory = MemorySnapshots(self.run_dir / "memory", lambda: self.boundaries,
                                              self.agent.record_error)
            refusal = self.memory.check(command, queued=any(q[0] == name for q in self._queue))
            if refusal is not None:
                answer(refusal)
                return
            self._at_next_step_end(name, command, answer)
            answer(self.memory.accepted(command))
            return
        if name == "export":
            answer(self.export())
            return
        if name == "log_metrics":
            refusal = self._check_wandb()
            if refusal is not None:
                answer({"ok": False, "done": True, "message": refusal})
                return
            with self._lock:  # the script's wandb is used from its own thread only: at the step boundary
                self._queue = [q for q in self._queue if q[0] != name]  # only the newest numbers matter
                self._queue.append((name, command, answer))
                self.pending = True
            return
        if name == "profile" and (self.window is not None or any(q[0] == "profile" for q in self._queue)):
            answer({"ok": False, "done": True, "message": "busy: a profiler window is already being captured"})
            return
        if self.agent.instrumentation is None and name in ("profile", "count_flops"):
            answer({"ok": False, "done": True, "message": "torch is not imported yet"})
            return
        self._at_next_step_end(name, command, answer)
        at = command.at_step
        when = f"at step {at}" if at is not None and at > self.boundaries else "at the next step boundary"
        answer({"ok": True, "done": False, "message": f"{name}: starts {when}"})

    def _flooded(self, command: Command) -> str | None:
        """Why a command is not queued: the queue is scanned on the training thread at every step end while it
        holds anything, so it stays short, and what waits in it waits for a step that will come."""
        with self._lock:
            queued = [q[0] for q in self._queue]
        if len(queued) >= MAX_QUEUED:
            return f"busy: {len(queued)} commands already wait for a step end"
        if command.name == "count_flops" and (self.flops_mode is not None or "count_flops" in queued):
            return "busy: FLOPs are already being counted"
        if command.at_step is not None and command.at_step > self.boundaries + MAX_STEPS_AHEAD:
            return f"at_step {command.at_step} is more than {MAX_STEPS_AHEAD:,} steps ahead (now {self.boundaries})"
        return None

    def _at_next_step_end(self, name: str, command: Command | None, answer: Answer) -> None:
        """Run ``_do_<name>`` on the training thread at its next step end (any thread may ask)."""
        with self._lock:
            self._queue.append((name, command, answer))
            self.pending = True

    def refresh_torch_threads(self) -> None:
        """Have the training thread read torch's thread count at its next step end (the sampler asks)."""
        with self._lock:
            if not any(q[0] == "read_threads" for q in self._queue):
                self._queue.append(("read_threads", None, lambda r: None))
                self.pending = True

    # -- training thread ---------------------------------------------------------------------------
    def read_torch_threads(self) -> None:
        """torch's intra-op thread count, read on this (the training) thread."""
        torch = sys.modules.get("torch")
        try:
            self.torch_threads = int(torch.get_num_threads()) if torch is not None else None
        except Exception:  # noqa: BLE001 - a torch half imported, or stubbed
            self.torch_threads = None

    def _do_read_threads(self, command: Command | None, answer: Answer) -> None:
        self.read_torch_threads()

    def boundary(self) -> None:
        """A step just ended on the training thread."""
        self.boundaries += 1
        self.after_count()

    def after_count(self) -> None:
        """:meth:`boundary` after its count. The C hot path counts the boundary itself and calls this only when one
        of ``pending``, ``window``, ``flops_mode``, ``memory``, ``_next_every``, ``_next_time`` is set."""
        memory = self.memory
        if (not self.pending and self.window is None and self.flops_mode is None
                and (memory is None or not memory.recording)
                and (self._next_every is None and self._next_time is None or not self._periodic_due())):
            return  # nothing to do (every step passes here: no call in the common case)
        if not self.agent.enabled:
            return  # finished, or a forked DataLoader worker that inherited the hooks
        try:
            self._boundary_work()
        except Exception as exc:  # noqa: BLE001 - a command must never break training
            self.agent.record_error("command", exc)

    def _periodic_due(self) -> bool:
        if self._next_every is not None and self.boundaries >= self._next_every:
            return True
        return self._next_time is not None and time.monotonic() >= self._next_time

    def _boundary_work(self) -> None:
        if self.window is not None:
            if self.window.step():
                self.window = None  # "stopped" is published once the trace is exported: that costs CPU too
        if self.flops_mode is not None:
            self._finish_flops()
        if self.memory is not None and self.memory.recording:
            self.memory.boundary()  # one more step of allocation history; the snapshot after the last
        with self._lock:
            queue, self._queue = self._queue, []
            # a window asked for at a later step (every rank of a job starts it at the same step) waits
            later = [q for q in queue if q[1] is not None and q[1].at_step is not None
                     and q[1].at_step > self.boundaries]
            self._queue = later
            self.pending = bool(later)
        waiting = {id(q) for q in later}
        for item in queue:
            if id(item) not in waiting:
                name, command, answer = item
                getattr(self, f"_do_{name}")(command, answer)
        if self.window is None and self._periodic_due():
            why = self._why_no_window()
            if why is None:
                self._start_window("periodic", lambda r: None)
            else:  # this one is skipped; the next is due as usual
                self._say_once(*why)
            if self._next_every is not None:
                self._next_every = self.boundaries + self.every
            if self._next_time is not None:
                self._next_time = time.monotonic() + self.interval

    def _start_window(self, reason: str, answer: Answer) -> None:
        from perfmon.agent.profiler import PeriodicTraces, ProfilerWindow

        if self._periodic_traces is None:
            self._periodic_traces = PeriodicTraces(self.profile_keep)

        def publish(msg: dict[str, Any] | None) -> None:
            if msg is not None:
                self.last_profile = msg
                self.agent.publish(msg)
                if reason == "periodic":  # (on the export thread) asked-for windows' traces are never dropped
                    try:
                        self._periodic_traces.add(msg["trace"], msg["step"])
                    except Exception as exc:  # noqa: BLE001 - the window still ends, and is answered
                        self.agent.record_error("profile-keep", exc)
            self._window_event("stopped", "profile")
            if msg is None:
                answer({"ok": False, "done": True, "message": "profiler window failed (see agent errors)"})
            else:
                answer({"ok": True, "done": True, "trace": msg["trace"],
                        "message": f"profile ready: {Path(msg['trace']).name if msg['trace'] else 'no trace written'}"})

        window = ProfilerWindow(self.run_dir / "traces", self.wait, self.warmup, self.active,
                                lambda: self.boundaries, publish, self.agent.record_error, reason,
                                self.script_profilers.own, self.profile_memory)
        window.start()
        self.window = window
        self._window_answer = answer
        self._window_thread = threading.get_ident()
        self.agent.publish(protocol.message("event", kind="profile_started", reason=reason,
                                            steps=window.total, t=time.time()))
        self._window_event("started", "profile")

    def _window_event(self, edge: str, what: str) -> None:
        # steps inside a window run slower (profiler, FLOP counter): rules must not read them
        self.agent.publish(protocol.message("event", kind=f"window_{edge}", what=what, t=time.time()))

    def _do_profile(self, command: Command | None, answer: Answer) -> None:
        if self.window is not None:
            answer({"ok": False, "done": True, "message": "busy: a profiler window is already being captured"})
            return
        why = self._why_no_window()
        if why is not None:  # the answer says why (no warning besides)
            answer({"ok": False, "done": True, "message": why[1]})
            return
        self._start_window("on demand", answer)

    def _why_no_window(self) -> tuple[str, str] | None:
        """Why a profiler window cannot start now, (kind, text); None: it can."""
        if self.script_profilers.busy:
            return "script profiling", SCRIPT_PROFILING
        short = short_of_space(self.run_dir)  # a trace is MBs, a GPU model's tens of them
        if short is not None:
            return "disk", f"no profiler window: {short}"
        return None

    def _do_give_way(self, command: Command | None, answer: Answer) -> None:
        self._give_way()

    def _warn_unless_ok(self, result: dict[str, Any]) -> None:
        """The answer to what perfmon asked of itself (the FLOP count at start): nobody reads it, so a failure is
        a warning."""
        if not result.get("ok", True):
            self.agent.warn(str(result.get("message")))

    def _give_way(self) -> None:
        """The script opens a profiler session of its own: perfmon's open window stops first, its trace dropped.
        On the training thread, where the windows run (the script's session opens there, as a rule); one opened on
        another thread has the window stopped at the training thread's next step end (a profiler is driven from
        the thread that started it)."""
        if self.window is not None and threading.get_ident() != self._window_thread:
            self._at_next_step_end("give_way", None, lambda r: None)
            return
        window, self.window = self.window, None
        if window is None:
            return
        window.abort()
        self._window_event("stopped", "profile")
        self._window_answer({"ok": False, "done": True, "message": "profiler window given up: " + SCRIPT_PROFILING})
        if window.reason == "periodic":  # nobody asked for it: nobody gets an answer
            self._say_once("script profiling", SCRIPT_PROFILING)

    def _say_once(self, kind: str, text: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            self.agent.warn(text)

    @staticmethod
    def _check_wandb() -> str | None:
        """Why a ``log_metrics`` cannot be logged (None: it can): no active wandb run in this process. (Its
        ``metrics``, a small dict of numbers, were checked when the command was parsed.)"""
        wandb = sys.modules.get("wandb")
        if wandb is None or getattr(wandb, "run", None) is None:
            return "--wandb: the script has no active wandb run (wandb.init) to log into"
        return None

    def _do_log_metrics(self, command: Command | None, answer: Answer) -> None:
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None)
        if run is None:
            answer({"ok": False, "done": True, "message": "--wandb: the script's wandb run has finished"})
            return
        metrics = dict(command.metrics or {}) if command is not None else {}
        run.log(metrics, commit=False)  # joins the script's next wandb.log step
        answer({"ok": True, "done": True, "message": f"{len(metrics)} metrics logged to wandb"})

    def _do_empty_cache(self, command: Command | None, answer: Answer) -> None:
        torch = sys.modules["torch"]
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved()
        answer({"ok": True, "done": True, "reserved_before": before, "reserved_after": after,
                "message": f"empty_cache: reserved {before / 2**20:,.0f} MiB -> {after / 2**20:,.0f} MiB"})

    def _do_memory_snapshot(self, command: Command | None, answer: Answer) -> None:
        short = short_of_space(self.run_dir)  # a snapshot of a large model's allocator runs to hundreds of MB
        if short is not None:
            answer({"ok": False, "done": True, "message": f"no memory snapshot: {short}"})
            return
        if self.memory is not None and command is not None:  # always made by request
            self.memory.begin(command, answer)

    def _do_count_flops(self, command: Command | None, answer: Answer) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        if _dispatch_modes():
            # the script has a dispatch mode of its own on at this step end (its FlopCounterMode around whole
            # steps, say): torch pops modes by position, so its exit would pop perfmon's counter and leave its own
            self._flops_waited += 1
            if self._flops_waited > FLOPS_WAIT_STEPS:
                answer({"ok": False, "done": True, "message": FLOPS_BESIDE_MODE})
                return
            self._at_next_step_end("count_flops", command, answer)
            return
        self._flops_waited = 0
        inst = self.agent.instrumentation
        if inst is not None and inst.runs_compiled():
            answer({"ok": False, "done": True, "message": FLOPS_COMPILED})
            return
        mode = FlopCounterMode(display=False)
        self._window_event("started", "flops")
        mode.__enter__()
        self.flops_mode = (mode, answer, self.boundaries)

    def _finish_flops(self) -> None:
        mode, answer, started = self.flops_mode
        closed = _close_counter(mode)
        if closed is None:
            return  # the script entered a mode of its own after perfmon's and is still in it: a later step end
        self.flops_mode = None
        self._window_event("stopped", "flops")
        if not closed:
            answer({"ok": False, "done": True, "message": FLOPS_BESIDE_MODE})
            return
        flops = int(mode.get_total_flops()) // max(1, self.boundaries - started)  # steps it spanned (1 as a rule)
        self.agent.publish(protocol.message("model", flops_per_step=flops, flops_counted_at=time.time()))
        answer({"ok": True, "done": True, "flops_per_step": flops, "message": f"FLOPs per step: {flops:,}"})

    def export(self) -> dict[str, Any]:
        """The last window's trace file; the monitor writes the top-ops table from its analysis of it."""
        prof = self.last_profile
        if prof is None:
            return {"ok": False, "done": True, "message": "no profiler window yet: press p first"}
        return {"ok": True, "done": True, "trace": prof["trace"], "message": f"trace {prof['trace']}"}

    def finish(self) -> None:
        """The job is ending: close any open window or FLOP counter cleanly."""
        if self.window is not None:
            self.window.abort()
            self.window = None
        if self.flops_mode is not None:
            mode = self.flops_mode[0]
            try:
                if _close_counter(mode) is None:  # under a mode of the script's: not perfmon's to pop
                    _release_trackers(mode)
            except Exception:  # noqa: BLE001
                pass
            self.flops_mode = None
        if self.memory is not None:
            self.memory.finish()  # recording perfmon started: save what it has, turn it off
