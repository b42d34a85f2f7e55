"""Run header: command line, pid, state, elapsed time, step and rates, the worst finding and the vital signs."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, RenderResult
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive

from perfmon.analysis.rules import Config
from perfmon.analysis.state import RunState
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.styled import StyledWidget

if TYPE_CHECKING:
    from perfmon.tui.widgets.findings import FindingsInfo

CPU_ONLY = "CPU only — no GPU"
Pieces = tuple[tuple[str, str], ...]  # (text, style name)


def vitals(state: RunState, data_warn: float = Config.data_warn) -> Pieces:
    """The numbers that matter most, for every view: GPU, data share, MFU, CPU and RSS."""
    out: list[tuple[str, str]] = []

    def sep() -> None:
        if out:
            out.append((" │ ", "label"))

    gpus = state.gpus
    power: list[tuple[str, str]] = []  # last: the first to go on a narrow terminal
    if gpus:
        utils = [g.util_gpu for g in gpus if g.util_gpu is not None]
        used = [g.mem_used_bytes for g in gpus if g.mem_used_bytes is not None]
        total = [g.total_bytes for g in gpus if g.total_bytes is not None]
        label = "GPU " if len(gpus) == 1 else f"{len(gpus)} GPUs "
        out += [(label, "label"), (fmt.pct(sum(utils) / len(utils)) if utils else fmt.NA, "value"),
                (" mem ", "label"),
                (f"{fmt.gib(sum(used)) if used else fmt.NA}/{fmt.gib(sum(total)) if total else fmt.NA}G", "value")]
        g0 = gpus[0]
        if any(g.throttled for g in gpus):
            out.append((" ⚠ throttled", "warn"))
        watts, temp = g0.power_w, g0.temp_c
        if len(gpus) == 1 and (watts is not None or temp is not None):
            power = [("", ""), (fmt.num(watts, "W"), "value"), (" ", "label"), (fmt.num(temp, "°C"), "value")]
    elif state.samples_seen or state.meta.gpus_probed:
        out.append(("no GPU", "cpu"))
    stats = state.phase_stats(recent=True)
    data = stats["data"].share
    if data is not None:
        sep()
        out += [("data ", "label"), (fmt.share(data), "warn" if data > data_warn else "value")]
    flops = state.flops()
    if flops.mfu is not None:
        sep()
        out += [("MFU ", "label"), (fmt.share(flops.mfu), "value")]
    elif flops.achieved_flops:
        sep()
        out += [(fmt.flops_rate(flops.achieved_flops), "value")]
    host = state.host
    if host is not None:
        sep()
        out += [("CPU ", "label"), (fmt.pct(host.cpu_percent), "value"),
                (" RSS ", "label"), (fmt.nbytes(host.rss_bytes, short=True), "value")]
    if power:
        sep()
        out += power[1:]
    return tuple(out)


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
    badge: str = ""
    badge_kind: str = ""
    vitals: Pieces = ()

    @classmethod
    def from_state(
        cls, state: RunState, mode: str = "", stream_ended: bool = False, now: float | None = None,
        findings: FindingsInfo | None = None, data_warn: float = Config.data_warn,
    ) -> HeaderInfo:
        """Derive the header from ``state`` (call with the state lock held)."""
        meta = state.meta
        if meta.argv:
            command = shlex.join(meta.argv)
        else:
            command = meta.script or "(waiting for the job…)"
        status, kind = state.status, "running"
        if state.exit is not None:
            if status == "exited 0":
                kind = "ok"
            else:
                kind = "failed"
                if state.exit.exception and state.exit.code not in (None, 0):
                    status = f"{status}, exit {state.exit.code}"
        elif stream_ended and state.execed is not None:
            kind = "ended"  # the script became another program, which perfmon does not follow
        elif stream_ended:
            status, kind = "stream ended, no exit recorded", "ended"
        if state.exit is None and stream_ended and state.last_end is not None:
            now = state.last_end  # a finished stream without exit: stop the clock at the last step
        now = now if now is not None else time.time()
        elapsed = state.elapsed(now)
        quiet = state.quiet_for(now)
        live = state.exit is None and not stream_ended
        cuda = meta.cuda
        known_gpus = meta.gpus or state.gpus
        cpu_only = cuda is False or (cuda is not True and not known_gpus and meta.gpus_probed)
        if cpu_only:
            device = CPU_ONLY
        elif cuda or known_gpus:
            name = meta.gpu or (known_gpus[0].name if known_gpus else None) or "CUDA"
            device = f"{len(known_gpus)}× {name}" if len(known_gpus) > 1 else name
        else:
            device = ""
        python = meta.python_version or meta.python  # the hello's python is a path
        details = " · ".join(f"{label} {value}" for label, value in (
            ("host", meta.host), ("python", python), ("torch", meta.torch)) if value)
        pid = meta.pid
        badge, badge_kind = findings.badge if findings is not None else ("", "")
        return cls(
            command=command,
            pid=str(pid) if pid is not None else fmt.DASH,
            status=status,
            kind=kind,
            elapsed=fmt.duration(elapsed),
            step=fmt.count(state.steps),
            # the recent rate is the rate of steps that are over: a job gone quiet has none; a job that ended has
            # the whole run's (from step 2), the figure its summary and report give
            steps_s=fmt.rate(state.steps_per_s(recent=live)) if quiet is None
            else f"{fmt.DASH} (no step for {fmt.duration(quiet)})",
            samples_s=fmt.rate(state.samples_per_s(recent=live)) if quiet is None else fmt.DASH,
            device=device,
            cpu_only=cpu_only,
            details=details,
            mode=mode,
            badge=badge,
            badge_kind=badge_kind,
            vitals=vitals(state, data_warn),  # the input-bound rule's own threshold (--rules too)
        )


class HeaderView:
    """Rich renderable for :class:`HeaderInfo` (four lines)."""

    def __init__(self, info: HeaderInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        info, st = self.info, self.styles
        if info is None:
            yield Text("perfmon — waiting for the job…", style=st["label"])
            return
        marker = {"running": "●", "ok": "✔", "failed": "✘", "ended": "■"}[info.kind]
        figures = [("step", info.step), ("steps/s", info.steps_s), ("samples/s", info.samples_s),
                   ("elapsed", info.elapsed)]
        line2 = self._figures(figures)
        if line2.cell_len + 2 + len(info.badge) > options.max_width and info.samples_s == fmt.DASH:
            # narrow (a quiet job's "no step for ..."): an unknown sample rate gives way to the elapsed time
            line2 = self._figures([f for f in figures if f[0] != "samples/s"])
        line3 = Text()
        line3.append("pid ", st["label"]).append(info.pid, st["value"])
        if info.device:
            line3.append(" · ", st["label"]).append(info.device, st["cpu"] if info.cpu_only else st["value"])
        if info.details:
            line3.append(" · " + info.details, st["label"])
        line4 = Text()
        for text, style in info.vitals:
            line4.append(text, st[style])
        badge_text = Text(info.badge, style=st.get(info.badge_kind, st["label"]))
        room = options.max_width - line2.cell_len - 2
        if badge_text.cell_len > room and ": " in info.badge:  # narrow: the marker and colour tell the severity
            mark, rest = info.badge.split(" ", 1)
            short = f"{mark} {rest.split(': ', 1)[1]}"
            badge_text = Text(short if len(short) <= room else short.rsplit(" +", 1)[0],
                              style=st.get(info.badge_kind, st["label"]))
        for left, right in (
            (Text(info.command, style=st["command"]), Text(f"{marker} {info.status}", style=st[info.kind])),
            (line2, badge_text),
            (line3, Text(info.mode, style=st["label"])),
            (line4, Text("")),
        ):
            grid = Table.grid(expand=True, padding=(0, 0, 0, 1))
            grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
            grid.add_column(no_wrap=True, justify="right")
            grid.add_row(left, right)
            yield grid


    def _figures(self, figures: list[tuple[str, str]]) -> Text:
        line = Text()
        for i, (label, value) in enumerate(figures):
            line.append("  " if i else "").append(f"{label} ", self.styles["label"]).append(value, self.styles["value"])
        return line


class RunHeader(StyledWidget):
    """The top lines of the dashboard."""

    COMPONENT_CLASSES = {
        "header--command", "header--label", "header--value", "header--cpu",
        "header--running", "header--ok", "header--failed", "header--ended",
        "header--warn", "header--critical", "header--info",
    }

    info: reactive[HeaderInfo | None] = reactive(None)

    def render(self) -> HeaderView:
        styles = self.component_styles()
        return HeaderView(self.info, styles)
