"""The dashboard's shell: its layout, the state it shows, how that reaches the widgets, how it ends.

Three thread workers feed it (:mod:`perfmon.tui.workers`): the source pump, the process waiter and
the output tail. Widgets are redrawn only when what they show changed: on the workers' messages (state
changes come at most every ``COALESCE_S``), on a periodic check for data that arrived after the pump's last
post, and on a 1 Hz tick (elapsed time, the rules engine, the age of the profiler window).

Layout: the header (four lines: command, rates and the worst finding, run details, vital signs),
a view bar, one view at a time (overview, device, model, ops, findings, output), the key footer.
Which panels a view shows is CSS (``#body.-<view>``), with the screen's size classes
(``-wide``/``-narrow``, ``-tall``/``-short``) deciding what else fits in the overview.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import Footer

from perfmon import messages
from perfmon.analysis.job import JobState, WarningFeed, rank_rows, stepping_spawn
from perfmon.analysis.rules import Config, Engine, evaluate_job, evaluate_once
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command
from perfmon.monitor.launch import stdin_hint
from perfmon.monitor.sources import Source
from perfmon.tui import workers
from perfmon.tui.mode import Mode
from perfmon.tui.results import ResultFeed, say_warnings, toast
from perfmon.tui.widgets.device import DeviceInfo, DevicePanel
from perfmon.tui.widgets.dialogs import QuitScreen
from perfmon.tui.widgets.findings import FindingsInfo, FindingsPanel, FindingsSummary
from perfmon.tui.widgets.header import HeaderInfo, RunHeader
from perfmon.tui.widgets.host import HostInfo, HostPanel
from perfmon.tui.widgets.logpanel import LogPanel, last_frame
from perfmon.tui.widgets.model import ModelInfo, ModelPanel
from perfmon.tui.widgets.ops import OpsInfo, OpsPanel
from perfmon.tui.widgets.phases import PhaseInfo, PhasesPanel
from perfmon.tui.widgets.ranks import RanksInfo, RanksPanel
from perfmon.tui.widgets.views import ViewBar, ViewBarInfo

TICK_S = 1.0
QUIT, DETACHED, STOPPED = "quit", "detached", "stopped"
#: perfmon got SIGTERM: it went on to the launched job, and the dashboard left; perfmon waits for the job to end.
SIGNALLED = "signalled"
#: The launched script spawned its ranks (torch.multiprocessing.spawn): the launcher reopens the dashboard on them.
SPAWNED = "spawned"


def while_composed(method: Callable[..., None]) -> Callable[..., None]:
    """A handler that draws: a no-op once the screen's widgets are gone (a message late in shutdown)."""

    @functools.wraps(method)
    def wrapper(self: DashboardShell, *args: object) -> None:
        try:
            method(self, *args)
        except NoMatches:
            if self.is_running and not self._bg_stop.is_set():
                raise

    return wrapper


class DashboardShell(App[None]):
    """The dashboard without its keys (:class:`perfmon.tui.app.PerfmonApp` adds them)."""

    CSS_PATH = str(Path(__file__).with_name("app.tcss"))
    TITLE = "perfmon"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (34, "-tall")]

    def __init__(
        self,
        state: RunState,
        source: Source | None,
        run_dir: Path | None,
        process: workers.TrainingProcessLike | None = None,
        rules: Config | None = None,
        job: JobState | None = None,
    ) -> None:
        super().__init__()
        self.state = state
        #: A multi-rank job: every rank's state; ``state`` is then the selected rank's (``r`` cycles).
        self.job = job
        self.selected: int | None = None
        self._chosen = False  # the user picked a rank with r
        self.notice: str | None = None  # said once as the dashboard opens (a multi-node job's role)
        self._engines: dict[int, Engine] = {}
        self.source = source
        self.run_dir = run_dir if run_dir is not None else getattr(source, "run_dir", None)
        self.process = process
        self.mode = Mode(source, launched=process is not None)
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
        self.cuda = False  # the job has a CUDA device: the footer offers the keys that act on one (c, m)
        self._bg_stop = threading.Event()
        self._job_over = threading.Event()
        self.engine = Engine(rules)
        self.findings: FindingsInfo | None = None
        self.view = "overview"
        self.commands_sent: list[Command] = []  # what the command keys sent (diagnostics and tests)
        self._results = ResultFeed()
        # the agent's warnings: every rank's in a job, whichever is on show; said as they come (a refresh
        # comes with new data, and a stream that ends would leave a held one unsaid)
        self._warnings = WarningFeed(hold_s=0.0)
        self.spawned_job: Path | None = None  # the job of ranks the script spawned, to reopen on (SPAWNED)

    # -- outcome ----------------------------------------------------------------------------
    @property
    def outcome(self) -> str:
        """``"quit"`` (job over), ``"detached"`` (job left running), ``"stopped"`` (stop asked) or
        ``"signalled"`` (SIGTERM passed on to the job)."""
        if self._outcome is not None:
            return self._outcome
        return QUIT if self.job_ended else DETACHED

    @property
    def job_ended(self) -> bool:
        """The job is over: exit seen, process gone, or (no process) the stream ended."""
        ended_alone = self.process is None and self.stream_ended
        if self.job is not None:  # one rank's exit is not the job's: the launcher's, or every rank's stream
            return self.process_ended or ended_alone
        return self.state.exit is not None or self.process_ended or ended_alone

    @property
    def live(self) -> bool:
        """Watching a running job, not a recording (see :meth:`Mode.live`)."""
        return self.mode.live(self.job_ended)

    def now(self) -> float:
        """The time the dashboard shows: the replay clock in a paced replay, else the wall clock."""
        return self.mode.now(self.clock)

    def finish(self, outcome: str) -> None:
        """Leave the dashboard with ``outcome``."""
        self._outcome = outcome
        self._stop_background()
        self.exit()

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
            yield RanksPanel(id="ranks")
            yield LogPanel(id="log")
        yield Footer(compact=True)  # a GPU job's keys fit in 80 columns

    def on_mount(self) -> None:
        for panel, title in (("#phases", "step phases"), ("#device", "device"), ("#host", "host"),
                             ("#model", "model"), ("#ops", "top ops"), ("#summary", "findings"),
                             ("#findings", "findings"), ("#ranks", "ranks")):
            self.query_one(panel).border_title = title
        self.query_one("#findings", FindingsPanel).border_subtitle = "↑↓ move · Enter opens"
        if self.mode.player is not None:  # the output has no times: a replay shows it whole from the start
            self.query_one(LogPanel).border_title = "output (its last lines as the run left them: not played in time)"
        self.query_one(LogPanel).log_widget.focus()
        if self.notice:
            self.notify(self.notice.removeprefix("perfmon: "), title="perfmon", timeout=15, markup=False)
        self.refresh_data()
        self.set_interval(TICK_S, self._tick)
        self.set_interval(workers.COALESCE_S, self._flush)
        if self.source is not None:
            self._pump()
        if self.process is not None:
            self._watch_process()
        if self.run_dir is not None or self.source is not None:
            self._tail_output()

    def on_unmount(self) -> None:
        self._stop_background()

    # -- data -> widgets --------------------------------------------------------------------
    @while_composed
    def refresh_data(self) -> None:
        """Rebuild what the widgets show from the state; unchanged widgets are not redrawn."""
        phases = self.query_one("#phases", PhasesPanel)
        ops = self.query_one("#ops", OpsPanel)
        log = self.query_one(LogPanel)
        span = phases.span_index
        view = self.view
        # Only the panels the current view shows are derived (a view switch refreshes at once): at ~2 redraws a
        # second, deriving hidden panels was a good part of the dashboard's CPU.
        shows = {"phases": view == "overview", "resources": view in ("overview", "device"),
                 "model": view in ("model", "device"), "ops": view == "ops",
                 "ranks": view == "ranks" and self.job is not None}
        with self.lock:
            self._dirty = False
            header = self._header_info()
            info = PhaseInfo.from_state(self.state, span, self.now()) if shows["phases"] else None
            device = DeviceInfo.from_state(self.state, span) if shows["resources"] else None
            host = HostInfo.from_state(self.state, span) if shows["resources"] else None
            model = ModelInfo.from_state(self.state, self.engine.cfg.memory_pressure) if shows["model"] else None
            ops_info = OpsInfo.from_state(self.state, ops.sort_index, self.now()) if shows["ops"] else None
            ranks = RanksInfo.from_job(self.job, self.selected, self.engine.cfg) if shows["ranks"] and self.job else None
            capturing = self.state.profiling is not None
            results = self._results.new(self.state.command_results)
            warnings = self._warnings.new(self.state, self.job)  # a job: every rank's, whichever is on show
            exit_ = self.state.exit
            exception = exit_.exception if exit_ else None
            where = last_frame(exit_.traceback) if exit_ else None
            # a job this dashboard launched has /dev/null for stdin (the dashboard reads the keys)
            launched = self.process is not None and not getattr(self.process, "inherit_stdin", True)
            hint = stdin_hint(exception) if launched else None
            cuda = self.state.meta.cuda is True
            # the job this dashboard launched failed before its first step: nothing to watch, and the terminal it
            # leaves holds the script's output and traceback (a single process; ranks have their own)
            failed_early = (self.process is not None and self.job is None and not self.state.spawned
                            and self.state.steps == 0 and self.state.exit_status not in (0, None))
        self.query_one(RunHeader).info = header
        if info is not None:
            phases.info = info
        if device is not None and host is not None:
            self.query_one("#device", DevicePanel).info = device
            self.query_one("#resources").set_class(device.no_gpu is not None, "-no-gpu")
            self.query_one("#host", HostPanel).info = host
        if model is not None:
            self.query_one("#model", ModelPanel).info = model
        if ops_info is not None:
            ops.info = ops_info
        if ranks is not None:
            self.query_one("#ranks", RanksPanel).info = ranks
        self._update_bar(capturing=capturing)
        log.exception, log.where, log.hint = exception, where, hint
        for result in results:
            toast(self, result)
        say_warnings(self, warnings, log)
        self.refreshes += 1
        self._last_refresh = time.monotonic()
        if self.live != self._was_live or cuda != self.cuda:
            self._was_live, self.cuda = self.live, cuda
            self.refresh_bindings()  # job ended (or connected, or found its GPU): the footer drops or offers d p c f m
        if self.job_ended:
            self._job_over.set()
            if isinstance(self.screen, QuitScreen):  # asked to quit while it ran: the question is moot now
                self.finish(QUIT)
            elif failed_early:  # a typo, a missing file: its traceback, as plain python leaves it
                self.finish(QUIT)

    def _header_info(self) -> HeaderInfo:
        info = HeaderInfo.from_state(
            self.state, self.mode.label(self.state.meta.start),
            stream_ended=self.stream_ended and self.process is None, now=self.now(),
            findings=self.findings, data_warn=self.engine.cfg.data_warn,
        )
        if self.job is not None:
            where = f"rank {self.selected} of {self.job.world_size}" if self.selected is not None else "no rank yet"
            info = replace(info, mode=f"{info.mode} · {where}".strip(" ·"))
        if self.stream_error:
            return replace(info, mode=f"{info.mode} · {self.stream_error}".strip(" ·"))
        return info

    @while_composed
    def _flush(self) -> None:
        """Catch data that arrived after the pump's last post (the pump posts on a leading edge)."""
        if self._dirty:
            self.refresh_data()

    @while_composed
    def _tick(self) -> None:
        """Once a second: the rules, the elapsed time of a running job and the profiler window's age."""
        if self.job is None and self.process is not None and self.state.spawned and not self.job_ended:
            self.spawned_job = stepping_spawn(self.state.spawned)
            if self.spawned_job is not None:
                self.finish(SPAWNED)  # the launcher follows the ranks from here (monitor.dashboard)
                return
        if not self.stream_ended:
            self.update_findings()
        # a stream that stalled, or nothing new: the clock and the window's age still move (a redraw that
        # refresh_data already made this second is not repeated: every redraw of the screen costs CPU)
        if not self._dirty and time.monotonic() - self._last_refresh > TICK_S * 0.9:
            ops = self.query_one("#ops", OpsPanel)
            with self.lock:
                header = self._header_info() if not self.job_ended else None
                ops_info = OpsInfo.from_state(self.state, ops.sort_index, self.now()) if self.view == "ops" else None
            if header is not None:
                self.query_one(RunHeader).info = header
            if ops_info is not None:
                ops.info = ops_info

    @while_composed
    def update_findings(self) -> None:
        """Run the rules: the engine (hysteresis) while the stream goes on, one final evaluation at its
        end."""
        cfg = self.engine.cfg
        with self.lock:
            if self.stream_ended:
                active = evaluate_once(self.state, cfg)
            else:
                self.engine.update(self.state)
                active = self.engine.active
            # live, a finding shows once it has held for a few evaluations: until then "none" is no answer yet
            evaluated = (self.state.steps >= cfg.warmup_steps + cfg.min_steps
                         and (self.stream_ended or self.engine.settled))
            if self.job is not None:  # the findings across ranks (a straggler) come first in every rank's list
                across = evaluate_job(rank_rows(self.job, cfg.warmup_steps, cfg.min_steps), cfg)
                active = sorted([*across, *active], key=lambda f: f.rank, reverse=True)
            # over once its exit is known: a job that ended at once may leave its stream open a while longer
            over = self.stream_ended or (self.job is None and self.state.exit is not None)
            stepped = self.state.steps > 0 or self.job is not None
        findings = FindingsInfo.from_findings(active, evaluated, ended=over, stepped=stepped)
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
            ranks=self.job is not None,
        )

    # -- messages from the workers ----------------------------------------------------------
    def on_state_changed(self, _: workers.StateChanged) -> None:
        if time.monotonic() - self._last_refresh >= workers.COALESCE_S * 0.8:
            self.refresh_data()  # else the next _flush draws it: at most ~2 redraws a second

    def on_stream_ended(self, message: workers.StreamEnded) -> None:
        self.stream_ended = True
        self.stream_error = message.error
        self.update_findings()
        self.refresh_data()

    def on_process_exited(self, _: workers.ProcessExited) -> None:
        self.process_ended = True
        self.refresh_data()

    @while_composed
    def on_output_lines(self, message: workers.OutputLines) -> None:
        log = self.query_one(LogPanel)
        log.add_lines(message.lines)
        log.progress = message.partial

    # -- workers ----------------------------------------------------------------------------
    @work(thread=True, exit_on_error=False, group="source")
    def _pump(self) -> None:
        assert self.source is not None
        workers.follow_source(self.source, self._fold, self.post_message, self._bg_stop)

    def _fold(self, msg: dict[str, Any]) -> None:
        """One message into the state (on the pump's thread; read before taking the lock)."""
        if self.job is not None:
            with self.lock:
                self.job.apply(msg)
                lowest = min(self.job.ranks, default=None)
                if lowest is not None and not self._chosen and self.selected != lowest:
                    self._select(lowest)  # until the user picks one: the lowest rank (ranks start in any order)
                self._dirty = True
            return
        parsed = messages.parse(msg)
        with self.lock:
            self.state.apply(parsed)
            if isinstance(parsed, messages.Reset):  # replay restarted: findings start over too
                self.engine = Engine(self.engine.cfg)
            self._dirty = True

    def _select(self, rank: int) -> None:
        """Show ``rank`` in every per-rank panel (call with the lock held); each rank keeps its own findings."""
        assert self.job is not None
        if self.selected is not None:
            self._engines[self.selected] = self.engine
        self.selected = rank
        self.state = self.job.rank(rank)
        self.engine = self._engines.get(rank) or Engine(self.engine.cfg)
        self._results = ResultFeed()
        self._results.new(self.state.command_results)  # what this rank answered before is not news

    @work(thread=True, exit_on_error=False, group="process")
    def _watch_process(self) -> None:
        assert self.process is not None
        target = self.job if self.job is not None else self.state
        workers.wait_for_exit(self.process, target, self.lock, self.post_message, self._bg_stop)

    @work(thread=True, exit_on_error=False, group="output")
    def _tail_output(self) -> None:
        workers.tail_output(self._output_dir, self.post_message, self._bg_stop, self._job_over)

    def _output_dir(self) -> Any:
        """The run dir once known: given, from the source, or from the agent's hello."""
        return self.run_dir or getattr(self.source, "run_dir", None) or self.state.meta.run_dir

    def _stop_background(self) -> None:
        self._bg_stop.set()
        if self.source is not None:
            try:
                self.source.close()
            except Exception:  # noqa: BLE001 - closing on the way out must not fail the exit
                pass
