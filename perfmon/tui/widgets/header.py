"""Run header: command line, pid, state, elapsed time, step and rates."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from perfmon.state import RunState
from perfmon.tui.widgets import fmt

CPU_ONLY = "CPU only — no GPU"


@dataclass(frozen=True)
class HeaderInfo:
    """What the header shows; equal values mean nothing to redraw."""

    command: str
    pid: str
    status: str
    kind: str  # running | ok | failed | ended
    elapsed: str
    step: str
    steps_s: str
    samples_s: str
    device: str
    cpu_only: bool
    details: str
    mode: str

    @classmethod
    def from_state(
        cls, state: RunState, mode: str = "", stream_ended: bool = False, now: float | None = None
    ) -> HeaderInfo:
        """Derive the header from ``state`` (call with the state lock held)."""
        meta = state.meta
        argv = meta.get("argv")
        if isinstance(argv, list) and argv:
            command = shlex.join(str(a) for a in argv)
        else:
            command = str(meta.get("script") or "(waiting for the job…)")
        status, kind = state.status, "running"
        if state.exit is not None:
            if status == "exited 0":
                kind = "ok"
            else:
                kind = "failed"
                if state.exit.exception and state.exit.code not in (None, 0):
                    status = f"{status}, exit {state.exit.code}"
        elif stream_ended:
            status, kind = "stream ended, no exit recorded", "ended"
        if state.exit is None and stream_ended and state.last_end is not None:
            now = state.last_end  # a finished stream without exit: stop the clock at the last step
        elapsed = state.elapsed(now if now is not None else time.time())
        cuda = meta.get("cuda")
        if cuda is False:
            device = CPU_ONLY
        elif cuda:
            device = str(meta.get("gpu") or "CUDA")
        else:
            device = ""
        details = " · ".join(
            f"{label} {meta[key]}" for key, label in (("host", "host"), ("python", "python"), ("torch", "torch"))
            if meta.get(key)
        )
        pid = meta.get("pid")
        return cls(
            command=command,
            pid=str(pid) if pid is not None else fmt.DASH,
            status=status,
            kind=kind,
            elapsed=fmt.duration(elapsed),
            step=fmt.count(state.steps),
            steps_s=fmt.rate(state.steps_per_s()),
            samples_s=fmt.rate(state.samples_per_s()),
            device=device,
            cpu_only=cuda is False,
            details=details,
            mode=mode,
        )


class HeaderView:
    """Rich renderable for :class:`HeaderInfo` (three lines)."""

    def __init__(self, info: HeaderInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        info, st = self.info, self.styles
        if info is None:
            yield Text("perfmon — waiting for the job…", style=st["label"])
            return
        marker = {"running": "●", "ok": "✔", "failed": "✘", "ended": "■"}[info.kind]
        line2 = Text()
        for label, value in (
            ("step", info.step), ("steps/s", info.steps_s), ("samples/s", info.samples_s),
            ("elapsed", info.elapsed),
        ):
            line2.append(f"{label} ", st["label"]).append(value, st["value"]).append("  ")
        line3 = Text()
        line3.append("pid ", st["label"]).append(info.pid, st["value"])
        if info.device:
            line3.append(" · ", st["label"]).append(info.device, st["cpu"] if info.cpu_only else st["value"])
        if info.details:
            line3.append(" · " + info.details, st["label"])
        for left, right in (
            (Text(info.command, style=st["command"]), Text(f"{marker} {info.status}", style=st[info.kind])),
            (line2, Text("")),
            (line3, Text(info.mode, style=st["label"])),
        ):
            grid = Table.grid(expand=True, padding=(0, 0, 0, 1))
            grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
            grid.add_column(no_wrap=True, justify="right")
            grid.add_row(left, right)
            yield grid


class RunHeader(Widget):
    """The top lines of the dashboard."""

    COMPONENT_CLASSES = {
        "header--command", "header--label", "header--value", "header--cpu",
        "header--running", "header--ok", "header--failed", "header--ended",
    }

    info: reactive[HeaderInfo | None] = reactive(None)

    def render(self) -> HeaderView:
        styles = {name.split("--", 1)[1]: self.get_component_rich_style(name) for name in self.COMPONENT_CLASSES}
        return HeaderView(self.info, styles)
