"""Host panel: the trainer's CPU and RSS, its DataLoader workers, the system's CPU and memory."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive

from perfmon.analysis.state import RunState
from perfmon.messages import HostSample, children_name
from perfmon.messages.facts import CHILDREN, LOADER_WORKERS
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import LABEL_W, SPANS, span_words, spark, stacked_bar
from perfmon.tui.widgets.fmt import Num, number
from perfmon.tui.widgets.styled import LinesPanel


@dataclass(frozen=True)
class HostInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    host: HostSample
    series: tuple[float, ...]
    span: str
    peak_rss: Num
    children: str = LOADER_WORKERS  # what the trainer's child processes are (messages.children_name)

    @classmethod
    def from_state(cls, state: RunState, span_index: int = 0) -> HostInfo | None:
        """Derive the panel from ``state`` (call with the state lock held); None before the first sample."""
        if state.host is None:
            return None
        label, seconds = SPANS[span_index % len(SPANS)]
        return cls(
            host=state.host,
            series=tuple(state.series["cpu"].values(seconds)),
            span=label,
            peak_rss=number(state.peaks.rss_bytes),
            children=children_name(state.host.workers, state.model.loaders if state.model is not None else ()),
        )


class HostView:
    """Rich renderable for :class:`HostInfo`."""

    def __init__(self, info: HostInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def lines(self, width: int) -> list[Text]:
        st, info = self.styles, self.info
        if info is None:
            return [Text("waiting for host telemetry…", st["label"])]
        h = info.host
        cpus = h.cpu_count
        cpu = Text("CPU".ljust(LABEL_W), st["label"], no_wrap=True)
        cpu.append("trainer ", st["label"]).append(fmt.pct(h.cpu_percent).rjust(4), st["value"]).append("  ")
        suffix = f"  {span_words(info.span)}"
        room = width - cpu.cell_len - len(suffix)
        if room >= 8:
            hi = max(100.0, *(info.series or (0.0,)))  # a process may use several cores: > 100%
            cpu.append(spark(info.series, room, 0.0, hi) if info.series else "·" * room, st["chart"])
            cpu.append(suffix, st["span"])
        system = Text(" " * LABEL_W, no_wrap=True, overflow="ellipsis")
        system.append("system ", st["label"]).append(fmt.pct(h.system_cpu_percent), st["value"])
        system.append(f" of {fmt.num(cpus)} CPUs", st["label"])
        if h.usable_cpus is not None and cpus and h.usable_cpus < cpus:  # a CPU quota or an affinity mask
            system.append(" (", st["label"]).append(f"{h.usable_cpus:g}", st["value"]).append(" usable)", st["label"])
        system.append(" · load ", st["label"])
        system.append(fmt.num(h.load1, digits=2), st["value"])
        rss = Text("RSS".ljust(LABEL_W), st["label"], no_wrap=True, overflow="ellipsis")
        rss.append("trainer ", st["label"]).append(fmt.nbytes(h.rss_bytes), st["value"])
        rss.append(" · peak ", st["label"]).append(fmt.nbytes(info.peak_rss), st["value"])
        rss.append(" · threads ", st["label"]).append(fmt.num(h.threads), st["value"])
        if h.torch_threads is not None:
            rss.append(" · torch ", st["label"]).append(fmt.num(h.torch_threads), st["value"])
        workers = h.workers
        loader = Text(" " * LABEL_W, no_wrap=True, overflow="ellipsis")
        if workers:
            name = {LOADER_WORKERS: "workers", CHILDREN: "child process" if workers == 1 else "child processes"}.get(
                info.children, "workers and others")  # a rank a framework started is no DataLoader's
            loader.append(f"{workers:.0f} {name} ", st["label"])
            loader.append(fmt.nbytes(h.workers_rss_bytes), st["value"])
            loader.append(" · CPU ", st["label"]).append(fmt.pct(h.workers_cpu_percent), st["value"])
        else:
            loader.append("no DataLoader workers" if workers == 0 else "workers n/a", st["label"])
        loader.append(" · read ", st["label"]).append(rate_bytes(h.io_read_bps), st["value"])
        used, total, avail = number(h.mem_used_bytes), number(h.mem_total_bytes), h.mem_available_bytes
        ram = Text("RAM".ljust(LABEL_W), st["label"], no_wrap=True, overflow="ellipsis")
        tail = Text(no_wrap=True)
        tail.append(f" {fmt.gib(used)}/{fmt.gib(total)} GiB", st["value"])
        tail.append(" · avail ", st["label"]).append(fmt.nbytes(avail), st["value"])
        tail.append(" · swap ", st["label"]).append(fmt.nbytes(h.swap_used_bytes), st["value"])
        bar_w = max(0, min(24, width - LABEL_W - tail.cell_len))
        if total and used is not None and bar_w >= 6:
            trainer = min(used, (number(h.rss_bytes) or 0) + (number(h.workers_rss_bytes) or 0))
            parts = [("trainer", trainer), ("used", max(0.0, used - trainer)), ("free", max(0.0, total - used))]
            for key, n in stacked_bar(parts, bar_w):
                ram.append({"trainer": "█", "used": "▒", "free": "░"}[key] * n, st[key])
        ram.append_text(tail)
        return [cpu, system, rss, loader, ram]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.lines(width):
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


def rate_bytes(bps: Num) -> str:
    return fmt.NA if bps is None else f"{fmt.nbytes(bps)}/s"


class HostPanel(LinesPanel):
    """Host telemetry; ``info`` is its state."""

    COMPONENT_CLASSES = {
        "host--label", "host--value", "host--chart", "host--span", "host--trainer", "host--used", "host--free",
    }

    info: reactive[HostInfo | None] = reactive(None)
    VIEW = HostView
