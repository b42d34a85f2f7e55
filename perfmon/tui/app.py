"""The Textual dashboard: a view over a :class:`~perfmon.analysis.state.RunState` fed by a source.

Three thread workers feed it: the source pump (folds messages into the state under a lock and
posts :class:`StateChanged` at most every ``COALESCE_S``), the process waiter and the output
tail. Widgets are redrawn only when what they show changed: on those messages, on a 2 Hz check for
data that arrived after the pump's last post, and on a 1 Hz tick (elapsed time, the rules engine,
the age of the profiler window).

Layout: the header (four lines: command, rates and the worst finding, run details, vital signs),
a view bar, one view at a time (number keys: overview, device, model, ops, findings, output), the
key footer. Which panels a view shows is CSS (``#body.-<view>``), with the screen's size classes
(``-wide``/``-narrow``, ``-tall``/``-short``) deciding what else fits in the overview.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer

from perfmon.analysis.rules import Config, Engine, evaluate_once
from perfmon.analysis.state import RunState
from perfmon.monitor.sources import PacedReplaySource, ReplaySource
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.device import DeviceInfo, DevicePanel
from perfmon.tui.widgets.dialogs import DETACH, STOP, HelpScreen, QuitScreen
from perfmon.tui.widgets.findings import FindingsInfo, FindingsPanel, FindingsSummary
from perfmon.tui.widgets.header import HeaderInfo, RunHeader
from perfmon.tui.widgets.host import HostInfo, HostPanel
from perfmon.tui.widgets.logpanel import MAX_LINES, LogPanel, OutputTail, last_frame
from perfmon.tui.widgets.model import ModelInfo, ModelPanel
from perfmon.tui.widgets.ops import SORTS, OpsInfo, OpsPanel
from perfmon.tui.widgets.phases import SPANS, PhaseInfo, PhasesPanel
from perfmon.tui.widgets.views import VIEW_IDS, VIEWS, ViewBar, ViewBarInfo

if TYPE_CHECKING:
    from perfmon.monitor.sources import Source

COALESCE_S = 0.5
OUTPUT_S = 1.0  # new output lines at most this often: each write lays the screen out again
TICK_S = 1.0
LOG_POLL_S = 0.25

QUIT, DETACHED, STOPPED = "quit", "detached", "stopped"
NOT_CONNECTED = "not connected: replay/finished run"

VIEW_GROUP = Binding.Group("view", compact=True)
REPLAY_GROUP = Binding.Group("replay", compact=True)
REPLAY_HELP = ("space + - [ ]", "replay: pause/play, faster, slower, start, end")
#: Commands to the agent: key -> (command name, footer label, help line).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "p": ("profile", "Profile", "profiler window at the next step (ops view)"),
    "c": ("empty_cache", "Free cache", "empty the CUDA caching allocator's cache"),
    "f": ("count_flops", "FLOPs", "count one step's FLOPs (MFU, model view)"),
    "m": ("memory_snapshot", "Mem snapshot", "record 5 steps, save a CUDA memory snapshot"),
    "e": ("export", "Export", "export the last window's top ops to a file"),
}
#: The dashboard's keys. To add one: a Binding here (the tooltip is its help line) and an ``action_*``.
KEYS: list[Binding] = [
    Binding("q", "request_quit", "Quit", tooltip="quit (asks first if the job runs)"),
    Binding("ctrl+c", "request_quit", "Quit", show=False, priority=True, tooltip="same as q"),
    Binding("ctrl+q", "request_quit", "Quit", show=False, priority=True, tooltip="same as q"),
    Binding("d", "detach", "Detach", tooltip="detach: exit, leave the job running"),
    *(Binding(str(i), f"view('{view}')", "View", show=i == 1, key_display=f"1-{len(VIEWS)}" if i == 1 else None,
              group=VIEW_GROUP, tooltip=f"views: {label}")
      for i, (view, label) in enumerate(VIEWS, 1)),
    *(Binding(key, f"command('{name}')", label, show=key == "p", tooltip=text)
      for key, (name, label, text) in COMMANDS.items()),
    Binding("s", "cycle_sort", "Sort", tooltip="ops view: sort by self, total, calls, FLOPs"),
    Binding("t", "cycle_span", "Span", tooltip="chart span: " + ", ".join(s for s, _ in SPANS)),
    Binding("question_mark", "help", "Help", key_display="?", tooltip="this help"),
    Binding("space", "replay('toggle_pause')", "Pause", group=REPLAY_GROUP, tooltip="replay: pause / play"),
    Binding("plus", "replay('faster')", "Faster", key_display="+", group=REPLAY_GROUP, tooltip="replay: faster"),
    Binding("minus", "replay('slower')", "Slower", key_display="-", group=REPLAY_GROUP, tooltip="replay: slower"),
    Binding("left_square_bracket", "replay('restart')", "Start", key_display="[", group=REPLAY_GROUP,
            tooltip="replay: back to the start"),
    Binding("right_square_bracket", "replay('seek_end')", "End", key_display="]", group=REPLAY_GROUP,
            tooltip="replay: jump to the end"),
]
SCROLL_HELP = ("↑↓ PgUp PgDn Home End", "scroll the output, move in findings")
ENTER_HELP = ("Enter", "findings: open or close evidence and fix")


def _while_composed(method: Callable[..., None]) -> Callable[..., None]:
    """A handler that draws: a no-op once the screen's widgets are gone (a message late in shutdown)."""

    @functools.wraps(method)
    def wrapper(self: PerfmonApp, *args: object) -> None:
        try:
            method(self, *args)
        except NoMatches:
            if self.is_running and not self._bg_stop.is_set():
                raise

    return wrapper


class TrainingProcessLike(Protocol):
    """What the app needs of :class:`perfmon.monitor.launch.TrainingProcess`."""

    pid: int

    def poll(self) -> int | None: ...
    def stop(self) -> None: ...


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
    """Complete new lines of ``RUN/output.log``."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines


class PerfmonApp(App[None]):
    """The live dashboard. After :meth:`run`, :attr:`outcome` says how it ended."""

    CSS_PATH = str(Path(__file__).with_name("app.tcss"))
    TITLE = "perfmon"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = KEYS
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (34, "-tall")]

    def __init__(
        self,
        state: RunState,
        source: Source | None,
        run_dir: Path | None,
        process: TrainingProcessLike | None = None,
        rules: Config | None = None,
    ) -> None:
        super().__init__()
        self.state = state
        self.source = source
        self.run_dir = run_dir if run_dir is not None else getattr(source, "run_dir", None)
        self.process = process
        self.lock = threading.Lock()  # guards ``state``: the pump writes, the UI reads
        self.stream_ended = source is None
        self.stream_error: str | None = None
        self.process_ended = False
        self.refreshes = 0  # data refreshes done (diagnostics and tests)
        self._last_refresh = -1e9
        self.clock: Callable[[], float] = time.time  # wall clock for elapsed time (tests pin it)
        self._dirty = False
        self._outcome: str | None = None
        self._was_live = False
        self._bg_stop = threading.Event()
        self._job_over = threading.Event()
        self.engine = Engine(rules)
        self.findings: FindingsInfo | None = None
        self.view = "overview"
        self.commands_sent: list[dict[str, object]] = []  # what the command keys sent (diagnostics and tests)
        self._last_result: dict[str, object] | None = None
        if process is not None:
            self.mode = "launched"
        else:
            self.mode = {"ReplaySource": "replay", "PacedReplaySource": "replay", "LiveSource": "attached"}.get(
                type(source).__name__, "")

    # -- outcome ----------------------------------------------------------------------------
    @property
    def outcome(self) -> str:
        """``"quit"`` (job over), ``"detached"`` (job left running) or ``"stopped"`` (stop asked)."""
        if self._outcome is not None:
            return self._outcome
        return QUIT if self.job_ended else DETACHED

    @property
    def job_ended(self) -> bool:
        """The job is over: exit seen, process gone, or (no process) the stream ended."""
        return self.state.exit is not None or self.process_ended or (self.process is None and self.stream_ended)

    # -- layout -----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield ViewBar(id="views")
        with Vertical(id="body", classes="-overview"):
            yield PhasesPanel(id="phases")
            with Horizontal(id="resources"):
                yield DevicePanel(id="device")
                yield HostPanel(id="host")
            yield ModelPanel(id="model")
            yield OpsPanel(id="ops")
            yield FindingsSummary(id="summary")
            yield FindingsPanel(id="findings")
            yield LogPanel(id="log")
        yield Footer()

    def on_mount(self) -> None:
        for panel, title in (("#phases", "step phases"), ("#device", "device"), ("#host", "host"),
                             ("#model", "model"), ("#ops", "top ops"), ("#summary", "findings"),
                             ("#findings", "findings")):
            self.query_one(panel).border_title = title
        self.query_one("#findings", FindingsPanel).border_subtitle = "↑↓ move · Enter opens"
        self.query_one(LogPanel).log_widget.focus()
        self.refresh_data()
        self.set_interval(TICK_S, self._tick)
        self.set_interval(COALESCE_S, self._flush)
        if self.source is not None:
            self._pump()
        if self.process is not None:
            self._watch_process()
        if self.run_dir is not None or self.source is not None:
            self._tail_output()

    def on_unmount(self) -> None:
        self._stop_background()

    # -- data -> widgets --------------------------------------------------------------------
    @_while_composed
    def refresh_data(self) -> None:
        """Rebuild what the widgets show from the state; unchanged widgets are not redrawn."""
        phases = self.query_one("#phases", PhasesPanel)
        ops = self.query_one("#ops", OpsPanel)
        log = self.query_one(LogPanel)
        span = phases.span_index
        with self.lock:
            self._dirty = False
            header = self._header_info()
            info = PhaseInfo.from_state(self.state, span)
            device = DeviceInfo.from_state(self.state, span)
            host = HostInfo.from_state(self.state, span)
            model = ModelInfo.from_state(self.state)
            ops_info = OpsInfo.from_state(self.state, ops.sort_index, self.now())
            capturing = self.state.profiling is not None
            results = self._new_results()
            exit_ = self.state.exit
            exception = exit_.exception if exit_ else None
            where = last_frame(exit_.traceback) if exit_ else None
        self.query_one(RunHeader).info = header
        phases.info = info
        self.query_one("#device", DevicePanel).info = device
        self.query_one("#resources").set_class(device.no_gpu is not None, "-no-gpu")
        self.query_one("#host", HostPanel).info = host
        self.query_one("#model", ModelPanel).info = model
        ops.info = ops_info
        self._update_bar(capturing=capturing)
        log.exception, log.where = exception, where
        for result in results:
            self._toast(result)
        self.refreshes += 1
        self._last_refresh = time.monotonic()
        if self.live != self._was_live:
            self._was_live = self.live
            self.refresh_bindings()  # the job ended (or connected): the footer drops (or offers) d and p c f m e
        if self.job_ended:
            self._job_over.set()
            if isinstance(self.screen, QuitScreen):  # asked to quit while it ran: the question is moot now
                self.finish(QUIT)

    def now(self) -> float:
        """The time the dashboard shows: the replay clock (recording time) in a replay, else the wall clock."""
        if isinstance(self.source, PacedReplaySource) and self.source.position is not None:
            return self.source.position
        return self.clock()

    @property
    def live(self) -> bool:
        """Watching a running job, not a recording: commands and detach mean something (a live
        connection that dropped keeps its keys, and says "not connected" when one is pressed)."""
        if self.job_ended:
            return False
        if self.process is not None:
            return True
        return not isinstance(self.source, ReplaySource) or bool(getattr(self.source, "connected", False))

    def _header_info(self) -> HeaderInfo:
        now = self.now()
        info = HeaderInfo.from_state(
            self.state, self.mode, stream_ended=self.stream_ended and self.process is None, now=now,
            findings=self.findings, data_warn=self.engine.cfg.data_warn,
        )
        if isinstance(self.source, PacedReplaySource):
            src = self.source
            where = "end" if src.at_end else fmt.duration((src.position or 0) - (self.state.meta.get("start") or 0))
            info = replace(info, mode=f"replay {src.speed:g}x {'⏸' if src.paused else '▶'} {where}")
        if self.stream_error:
            return replace(info, mode=f"{info.mode} · {self.stream_error}".strip(" ·"))
        return info

    def action_replay(self, control: str) -> None:
        """space + - [ ]: replay controls (pause, speed, start, end)."""
        if isinstance(self.source, PacedReplaySource):
            getattr(self.source, control)()
            self.refresh_data()

    @_while_composed
    def _flush(self) -> None:
        """Catch data that arrived after the pump's last post (the pump posts on a leading edge)."""
        if self._dirty:
            self.refresh_data()

    @_while_composed
    def _tick(self) -> None:
        """Once a second: the rules, the elapsed time of a running job and the profiler window's age."""
        if not self.stream_ended:
            self.update_findings()
        if not self._dirty and time.monotonic() - self._last_refresh > TICK_S / 2:
            ops = self.query_one("#ops", OpsPanel)
            with self.lock:
                header = self._header_info() if not self.job_ended else None
                ops_info = OpsInfo.from_state(self.state, ops.sort_index, self.now())
            if header is not None:
                self.query_one(RunHeader).info = header
            ops.info = ops_info

    @_while_composed
    def update_findings(self) -> None:
        """Run the rules: the engine (hysteresis) while the stream goes on, one final evaluation at its end."""
        cfg = self.engine.cfg
        with self.lock:
            if self.stream_ended:
                active = evaluate_once(self.state, cfg)
            else:
                self.engine.update(self.state)
                active = self.engine.active
            evaluated = self.state.steps >= cfg.warmup_steps + cfg.min_steps
        findings = FindingsInfo.from_findings(active, evaluated)
        if findings == self.findings:
            return
        self.findings = findings
        self.query_one("#findings", FindingsPanel).info = findings
        self.query_one("#summary", FindingsSummary).info = findings
        with self.lock:
            header = self._header_info()
        self.query_one(RunHeader).info = header
        self._update_bar()

    def _update_bar(self, capturing: bool | None = None) -> None:
        bar = self.query_one(ViewBar)
        findings = self.findings.rows if self.findings else ()
        bar.info = ViewBarInfo(
            current=self.view, findings=len(findings), severity=findings[0].severity if findings else "",
            capturing=bar.info.capturing if capturing is None else capturing,
            span=self.query_one("#phases", PhasesPanel).span[0],
        )

    def _new_results(self) -> list[dict[str, object]]:
        """Command results that came in since the last call (call with the state lock held)."""
        results = list(self.state.command_results)
        new = results
        if self._last_result is not None:
            for i in range(len(results) - 1, -1, -1):
                if results[i] is self._last_result:
                    new = results[i + 1:]
                    break
        if results:
            self._last_result = results[-1]
        return new

    def _toast(self, result: dict[str, object]) -> None:
        """One command result as a toast; an error when the command failed.

        A profiler window's progress is drawn by the ops view itself (capture marker, then the table):
        its acknowledgement is not toasted, and its result only briefly, so no toast sits on the table.
        """
        name = str(result.get("name") or "command")
        text = str(result.get("message") or result.get("error") or f"{name}: done")
        ok = result.get("ok") is not False
        if name == "profile" and ok and result.get("done") is False:
            return
        timeout = 2.5 if name == "profile" and ok else 5.0 if result.get("done") is False else 8.0
        self.notify(text, title=name, severity="information" if ok else "error", timeout=timeout)

    def on_state_changed(self, _: StateChanged) -> None:
        if time.monotonic() - self._last_refresh >= COALESCE_S * 0.8:
            self.refresh_data()  # else the next _flush draws it: at most ~2 redraws a second

    def on_stream_ended(self, message: StreamEnded) -> None:
        self.stream_ended = True
        self.stream_error = message.error
        self.update_findings()
        self.refresh_data()

    def on_process_exited(self, _: ProcessExited) -> None:
        self.process_ended = True
        self.refresh_data()

    @_while_composed
    def on_output_lines(self, message: OutputLines) -> None:
        self.query_one(LogPanel).add_lines(message.lines)

    # -- workers ----------------------------------------------------------------------------
    @work(thread=True, exit_on_error=False, group="source")
    def _pump(self) -> None:
        """Fold the source's messages into the state; post at most every COALESCE_S."""
        assert self.source is not None
        last_post = 0.0
        error: str | None = None
        try:
            for msg in self.source.messages():
                with self.lock:
                    self.state.apply(msg)
                    if msg.get("type") == "reset":  # replay restarted: findings start over too
                        self.engine = Engine(self.engine.cfg)
                    self._dirty = True
                now = time.monotonic()
                if now - last_post >= COALESCE_S:
                    last_post = now
                    self.post_message(StateChanged())
                if self._bg_stop.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - a broken stream ends it; the dashboard stays
            error = f"stream error: {type(exc).__name__}: {exc}"
        self.post_message(StreamEnded(error))

    @work(thread=True, exit_on_error=False, group="process")
    def _watch_process(self) -> None:
        """Wait for the launched process; polls so that detaching never waits on it."""
        assert self.process is not None
        while (code := self.process.poll()) is None:
            if self._bg_stop.wait(LOG_POLL_S):
                return
        with self.lock:
            self.state.process_exited(code)
        self.post_message(ProcessExited(code))

    @work(thread=True, exit_on_error=False, group="output")
    def _tail_output(self) -> None:
        """Poll ``RUN/output.log`` 4 times a second; post new complete lines at most every OUTPUT_S.

        Ends once the job is over and the file is read to its end.
        """
        tail: OutputTail | None = None
        while tail is None:  # an attached source learns its run dir from the agent's hello
            run_dir = self.run_dir or getattr(self.source, "run_dir", None) or self.state.meta.get("run_dir")
            if run_dir:
                tail = OutputTail(Path(run_dir) / "output.log")
            elif self._job_over.is_set() or self._bg_stop.wait(LOG_POLL_S):
                return
        pending: list[str] = []
        last_post = 0.0
        while True:
            ended = self._job_over.is_set()
            lines = tail.read()
            pending.extend(lines)
            if ended and not lines:
                pending.extend(tail.flush())
            now = time.monotonic()
            if pending and (ended or now - last_post >= OUTPUT_S):
                self.post_message(OutputLines(pending[-MAX_LINES:]))
                pending, last_post = [], now
            if ended and not lines:
                return
            if self._bg_stop.wait(LOG_POLL_S):
                return

    def _stop_background(self) -> None:
        self._bg_stop.set()
        if self.source is not None:
            try:
                self.source.close()
            except Exception:  # noqa: BLE001 - closing on the way out must not fail the exit
                pass

    # -- actions ----------------------------------------------------------------------------
    def finish(self, outcome: str) -> None:
        """Leave the dashboard with ``outcome``."""
        self._outcome = outcome
        self._stop_background()
        self.exit()

    def action_request_quit(self) -> None:
        """q / ctrl+c: quit at once when the job is over, else ask."""
        if isinstance(self.screen, QuitScreen):
            return
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        if self.job_ended:
            self.finish(QUIT)
            return
        pid = self.state.meta.get("pid") or (self.process.pid if self.process else "")
        can_stop = self.process is not None or bool(getattr(self.source, "connected", False))
        self.push_screen(QuitScreen(can_stop=can_stop, pid=str(pid), launched=self.process is not None),
                         self._quit_choice)

    def _quit_choice(self, choice: str | None) -> None:
        if choice == STOP and self.process is not None and not self.job_ended:
            self.process.stop()
            self.finish(STOPPED)
        elif choice == STOP and self.source is not None and not self.job_ended:
            try:  # attached: the job's own agent delivers the SIGINT (the socket admits only this user)
                sent = self.source.send({"name": "stop", "id": len(self.commands_sent) + 1})
            except Exception:  # noqa: BLE001
                sent = False
            if sent:
                self.finish(STOPPED)
            else:
                self.notify(NOT_CONNECTED, title="stop", severity="warning")
        elif choice in (STOP, DETACH):
            self.finish(QUIT if self.job_ended else DETACHED)

    def action_detach(self) -> None:
        """d: exit, leaving the job running."""
        self.finish(QUIT if self.job_ended else DETACHED)

    def action_cycle_span(self) -> None:
        """t: next chart span (step time, GPU utilization, CPU)."""
        phases = self.query_one("#phases", PhasesPanel)
        phases.span_index = (phases.span_index + 1) % len(SPANS)
        self.refresh_data()

    def action_view(self, view: str) -> None:
        """1..6: show a view; focus goes where its keys work."""
        if view not in VIEW_IDS:
            return
        self.view = view
        body = self.query_one("#body")
        for other in VIEW_IDS:
            body.set_class(other == view, f"-{other}")
        if view in ("overview", "output"):
            self.query_one(LogPanel).log_widget.focus()
        elif view == "findings":
            self.query_one(FindingsPanel).list.focus()
        else:
            self.set_focus(None)
        self.refresh_bindings()
        self._update_bar()

    def action_cycle_sort(self) -> None:
        """s (ops view): next sort order of the top ops."""
        ops = self.query_one("#ops", OpsPanel)
        ops.sort_index = (ops.sort_index + 1) % len(SORTS)
        with self.lock:
            ops.info = OpsInfo.from_state(self.state, ops.sort_index, self.now())

    def action_command(self, name: str) -> None:
        """p c f m e: a command to the agent; its results come back as toasts."""
        cmd: dict[str, object] = {"name": name, "id": len(self.commands_sent) + 1}
        sent = False
        if self.source is not None and not self.job_ended:
            try:
                sent = self.source.send(cmd)
            except Exception:  # noqa: BLE001 - a broken socket is "not connected"
                sent = False
        if not sent:
            self.notify(NOT_CONNECTED, title=name, severity="warning")
            return
        self.commands_sent.append(cmd)
        if name == "profile":
            self.action_view("ops")
        elif name == "count_flops":
            self.action_view("model")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys of the dashboard do nothing under a dialog; s only sorts in the ops view."""
        if action in ("view", "command", "cycle_sort", "cycle_span") and len(self.screen_stack) > 1:
            return False
        if action == "cycle_sort":
            return self.view == "ops"
        if action == "replay":
            return isinstance(self.source, PacedReplaySource)
        if action in ("command", "detach") and not self.live:
            return False  # a replay or a finished job: no job to command or to leave running
        return True

    def action_help(self) -> None:
        """?: the key list."""
        if not isinstance(self.screen, HelpScreen | QuitScreen):
            self.push_screen(HelpScreen(self.key_help()))

    def key_help(self) -> list[tuple[str, str]]:
        """(keys, description) per action (per group for the view keys), from :data:`KEYS`, plus scrolling."""
        seen: dict[str, tuple[list[str], str]] = {}
        for binding in KEYS:
            if binding.group is VIEW_GROUP:
                keys, _ = seen.setdefault("views", ([], ", ".join(label for _, label in VIEWS)))
                keys[:] = [f"1 … {len(VIEWS)}"]
                continue
            if binding.group is REPLAY_GROUP:
                continue  # one row, and only in a replay
            keys, text = seen.setdefault(binding.action, ([], binding.tooltip or binding.description))
            keys.append(binding.key_display or binding.key)
        rows = [(", ".join(keys), text) for keys, text in seen.values()]
        replay = [REPLAY_HELP] if isinstance(self.source, PacedReplaySource) else []
        return [*rows, *replay, ENTER_HELP, SCROLL_HELP]
