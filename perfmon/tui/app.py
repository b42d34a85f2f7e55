"""The dashboard's keys and what they do: :class:`PerfmonApp`, over the shell (:mod:`perfmon.tui.shell`)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any, cast

from textual import events
from textual.actions import parse as parse_action
from textual.binding import Binding

from perfmon import protocol
from perfmon.analysis.profile_window import export_text
from perfmon.messages.commands import Command, CommandName
from perfmon.monitor.launch import FORWARDED
from perfmon.tui.shell import DETACHED, QUIT, SIGNALLED, STOPPED, DashboardShell
from perfmon.tui.widgets.charts import SPANS
from perfmon.tui.widgets.dialogs import DETACH, STOP, HelpScreen, QuitScreen
from perfmon.tui.widgets.findings import FindingsPanel
from perfmon.tui.widgets.logpanel import LogPanel
from perfmon.tui.widgets.ops import SORTS, OpsInfo, OpsPanel
from perfmon.tui.widgets.phases import PhasesPanel
from perfmon.tui.widgets.views import RANKS_VIEW, VIEW_IDS, VIEWS

NOT_CONNECTED = "not connected: replay/finished run"

VIEW_GROUP = Binding.Group("view", compact=True)
REPLAY_GROUP = Binding.Group("replay", compact=True)
REPLAY_HELP = ("space + - [ ]", "replay: pause/play, faster, slower, start, end")
#: Commands to the agent: key -> (command name, footer label, help line).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "p": ("profile", "Profile", "profiler window at the next step (ops view)"),
    "c": ("empty_cache", "Free cache", "empty the CUDA caching allocator's cache"),
    "f": ("count_flops", "FLOPs", "count one step's FLOPs (MFU, model view)"),
    "m": ("memory_snapshot", "Snapshot", "record 5 steps, save a CUDA memory snapshot"),
    "e": ("export", "Export", "export the last window's top ops to a file"),
}
#: Command keys the footer offers while the job runs: these always, and ``CUDA_KEYS`` where it has a CUDA device
#: (on a CPU job they still answer when pressed: nothing to free, no snapshot to take).
FOOTER_KEYS = ("p", "f")
CUDA_KEYS = ("c", "m")
_CUDA_COMMANDS = tuple((COMMANDS[key][0],) for key in CUDA_KEYS)
#: The dashboard's keys. To add one: a Binding here (the tooltip is its help line) and an ``action_*``.
KEYS: list[Binding] = [
    Binding("q", "request_quit", "Quit", tooltip="quit (asks first if the job runs)"),
    Binding("ctrl+c", "request_quit", "Quit", show=False, priority=True, tooltip="same as q"),
    Binding("ctrl+q", "request_quit", "Quit", show=False, priority=True, tooltip="same as q"),
    # second: what the footer cannot fit at 80 columns is cut from its end, and this lists every key
    Binding("question_mark", "help", "Help", key_display="?", tooltip="this help"),
    Binding("d", "detach", "Detach", tooltip="detach: exit, leave the job running"),
    *(Binding(str(i), f"view('{view}')", "View", show=i == 1,
              key_display=f"1-{len(VIEWS)}" if i == 1 else None, group=VIEW_GROUP, tooltip=f"views: {label}")
      for i, (view, label) in enumerate(VIEWS, 1)),
    Binding(str(len(VIEWS) + 1), f"view('{RANKS_VIEW[0]}')", "Ranks", tooltip="multi-rank job: every rank in a "
            "table, the job's findings (its keys act on every rank)"),
    Binding("r", "next_rank", "Rank", tooltip="multi-rank job: the next rank in every per-rank view"),
    *(Binding(key, f"command('{name}')", label, show=key in FOOTER_KEYS + CUDA_KEYS, tooltip=text)
      for key, (name, label, text) in COMMANDS.items()),
    Binding("s", "cycle_sort", "Sort", tooltip="ops view: next sort order of the top ops"),
    Binding("t", "cycle_span", "Span", tooltip="chart span: " + ", ".join(s for s, _ in SPANS)),
    Binding("space", "replay('toggle_pause')", "Pause", group=REPLAY_GROUP, tooltip="replay: pause / play"),
    Binding("plus", "replay('faster')", "Faster", key_display="+", group=REPLAY_GROUP,
            tooltip="replay: faster"),
    Binding("minus", "replay('slower')", "Slower", key_display="-", group=REPLAY_GROUP,
            tooltip="replay: slower"),
    Binding("left_square_bracket", "replay('restart')", "Start", key_display="[", group=REPLAY_GROUP,
            tooltip="replay: back to the start"),
    Binding("right_square_bracket", "replay('seek_end')", "End", key_display="]", group=REPLAY_GROUP,
            tooltip="replay: jump to the end"),
]
LIVE_ONLY = "act on a running job: not in a replay or after the job ended"
SCROLL_HELP = ("↑↓ PgUp PgDn Home End", "scroll the output (←→ sideways), move in findings")
ENTER_HELP = ("Enter", "findings: open or close evidence and fix")


class PerfmonApp(DashboardShell):
    """The live dashboard. After :meth:`run`, :attr:`outcome` says how it ended."""

    BINDINGS = KEYS

    def on_mount(self) -> None:
        try:  # the asyncio way: the handler runs in the app's loop, never inside a drawing
            loop = asyncio.get_running_loop()
            for sig in FORWARDED:
                loop.add_signal_handler(sig, self.on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such signal here
            pass

    def on_unmount(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            for sig in FORWARDED:
                loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def on_signal(self, sig: int) -> None:
        """SIGTERM, SIGUSR1 or SIGUSR2 sent to perfmon: a job it launched gets it, as plain python would have (a
        script's own handler, a checkpoint on preemption, runs). SIGTERM also closes the dashboard, restoring the
        terminal; a dashboard attached to someone else's job just detaches."""
        ended = self.job_ended
        if self.process is not None and not ended:
            self.process.forward(sig)
        if sig == signal.SIGTERM:
            self.finish(QUIT if ended else SIGNALLED if self.process is not None else DETACHED)

    def action_request_quit(self) -> None:
        """q / ctrl+c: quit at once when the job is over or this is a replay, else ask."""
        if isinstance(self.screen, QuitScreen):
            return
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        if self.job_ended or not self.live:  # a replay mid-way: its job is long gone, and its pid may be another's
            self.finish(QUIT)
            return
        pid = self.state.meta.pid or (self.process.pid if self.process else "")
        can_stop = self.process is not None or self.mode.connected
        self.push_screen(QuitScreen(can_stop=can_stop, pid=str(pid), launched=self.process is not None),
                         self._quit_choice)

    def _quit_choice(self, choice: str | None) -> None:
        if choice == STOP and self.process is not None and not self.job_ended:
            self.process.stop()
            self.finish(STOPPED)
        elif choice == STOP and self.source is not None and not self.job_ended:
            try:  # attached: the job's own agent delivers the SIGINT (the socket admits only this user)
                sent = self.source.send(Command("stop", id=len(self.commands_sent) + 1))
            except Exception:  # noqa: BLE001
                sent = False
            if sent:
                self.finish(STOPPED)
            else:
                self.notify(NOT_CONNECTED, title="stop", severity="warning")
        elif choice in (STOP, DETACH):
            self.finish(QUIT if self.job_ended else DETACHED)

    def action_replay(self, control: str) -> None:
        """space + - [ ]: replay controls (pause, speed, start, end)."""
        if self.mode.player is not None:
            getattr(self.mode.player, control)()
            self.refresh_data()

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
        self.refresh_data()  # the panels of the new view are derived only while it shows

    def action_next_rank(self) -> None:
        """r (multi-rank job): show the next rank in every per-rank panel."""
        if self.job is None:
            return
        with self.lock:
            ranks = sorted(self.job.ranks)
            if not ranks:
                return
            after = [r for r in ranks if self.selected is None or r > self.selected]
            self._select(after[0] if after else ranks[0])
            self._chosen = True
        self.findings = None
        self.update_findings()
        self.refresh_data()

    def _command_targets(self, name: str) -> dict[str, Any]:
        """Where a command goes in a multi-rank job: a profiler window on every rank at one step ahead of
        the fastest (the traces line up); the others to the rank shown, or every rank from the ranks view."""
        if self.job is None:
            return {}
        with self.lock:
            states = list(self.job.ranks.values())
            rate = max((s.steps_per_s() or 0.0 for s in states), default=0.0)
            # the step counts seen here are up to an agent's tick old: a tick and a half of steps ahead of the
            # furthest, so every rank hears of it before it gets there
            ahead = max(2, int(rate * (protocol.PUBLISH_TICK_S + 0.5)) + 1)
            top = max((s.steps for s in states), default=0)
        if name == "profile":
            return {"at_step": top + ahead}
        if self.view == RANKS_VIEW[0] or self.selected is None:
            return {}
        return {"ranks": (self.selected,)}

    def action_cycle_sort(self) -> None:
        """s (ops view): next sort order of the top ops."""
        ops = self.query_one("#ops", OpsPanel)
        ops.sort_index = (ops.sort_index + 1) % len(SORTS)
        with self.lock:
            ops.info = OpsInfo.from_state(self.state, ops.sort_index, self.now())

    def action_command(self, name: str) -> None:
        """p c f m: a command to the agent; its results come back as toasts. e: written here, from the
        monitor's analysis of the last window's trace (the job does not summarise its windows)."""
        if name == "export":
            self._export_window()
            return
        cmd = Command(cast(CommandName, name), id=len(self.commands_sent) + 1, **self._command_targets(name))
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

    def _export_window(self) -> None:
        with self.lock:
            prof = self.state.profiles[-1] if self.state.profiles else None
        run_dir = self._output_dir()
        if prof is None or not prof.top_ops:
            self.notify("no analysed profiler window yet: press p first" if self.live else
                        "this run has no analysed profiler window (--profile-every, or p while the job runs)",
                        title="export", severity="warning")
            return
        if run_dir is None:
            self.notify("no run directory to write to", title="export", severity="warning")
            return
        try:
            out = export_text(prof, Path(run_dir))
        except OSError as exc:
            self.notify(f"export failed: {exc}", title="export", severity="error", markup=False)
            return
        self.notify(f"exported {out}", title="export", markup=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys of the dashboard do nothing under a dialog; s only sorts in the ops view."""
        if action in ("view", "command", "cycle_sort", "cycle_span") and len(self.screen_stack) > 1:
            return False
        if action == "cycle_sort":
            return self.view == "ops"
        if action == "next_rank" or (action == "view" and parameters == (RANKS_VIEW[0],)):
            return self.job is not None
        if action == "replay":
            return self.mode.player is not None
        if self._needs_a_job(action, parameters):
            return False  # a replay or a finished job: no job to command or to leave running (export is ours)
        if action == "command" and parameters in _CUDA_COMMANDS and not self.cuda:
            return False  # off the footer of a CPU job; on_key still sends it
        return True

    def _needs_a_job(self, action: str, parameters: tuple[object, ...]) -> bool:
        """The key acts on a running job, and there is none here."""
        return action in ("command", "detach") and not self.live and parameters != ("export",)

    def on_key(self, event: events.Key) -> None:
        """A key that acts on a running job, pressed where there is none (a replay, a job that ended): said, not
        silently dropped (its binding is off, so the key reaches here). c and m of a CPU job: sent all the same
        (their bindings are off only to keep them out of the footer), the job answers that it has no CUDA device."""
        key = event.key
        if key in CUDA_KEYS and self.live and not self.cuda and len(self.screen_stack) == 1:
            event.stop()
            self.action_command(COMMANDS[key][0])
        elif key in COMMANDS and key != "e" and not self.live and len(self.screen_stack) == 1:
            event.stop()
            self.notify(f"{key}: no running job here ({'a replay' if self.mode.player is not None else 'it ended'}); "
                        f"{COMMANDS[key][2]} needs one", title=COMMANDS[key][0], severity="warning", markup=False)

    def action_help(self) -> None:
        """?: the key list."""
        if not isinstance(self.screen, HelpScreen | QuitScreen):
            self.push_screen(HelpScreen(self.key_help()))

    def key_help(self) -> list[tuple[str, str]]:
        """(keys, description) per action (per group for the view keys), from :data:`KEYS`, plus scrolling."""
        seen: dict[str, tuple[list[str], str]] = {}
        dead: list[str] = []  # keys that act on a running job, where there is none
        for binding in KEYS:
            if binding.group is VIEW_GROUP:
                keys, _ = seen.setdefault("views", ([], ", ".join(label for _, label in VIEWS)))
                keys[:] = [f"1 … {len(VIEWS)}"]
                continue
            if binding.group is REPLAY_GROUP:
                continue  # one row, and only in a replay
            if self.job is None and binding.action in ("next_rank", f"view('{RANKS_VIEW[0]}')"):
                continue
            _, action, params = parse_action(binding.action)
            if self._needs_a_job(action, params):
                dead.append(binding.key_display or binding.key)  # a replay, a finished job: said in one row
            keys, _ = seen.setdefault(binding.action, ([], binding.tooltip or binding.description))
            keys.append(binding.key_display or binding.key)
        rows = [(", ".join(keys), text) for keys, text in seen.values()]
        replay = [REPLAY_HELP] if self.mode.player is not None else []
        not_here = [(", ".join(dead), LIVE_ONLY)] if dead else []
        return [*rows, *not_here, *replay, ENTER_HELP, SCROLL_HELP]
