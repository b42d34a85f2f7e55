"""Step phases: recent and since-start timings, a stacked share bar and a step-time chart."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.reactive import reactive

from perfmon.analysis.metrics import PhaseStat, PhaseStats
from perfmon.analysis.report import NO_LOADER, NO_STEPS, no_steps
from perfmon.analysis.state import RunState
from perfmon.protocol import ALL_PHASES
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import SPANS, resample, spark_rows, stacked_bar
from perfmon.tui.widgets.styled import StyledWidget

ROWS = (*ALL_PHASES, "step")
NAME_W, NUM_W, SHARE_W, GAP = 12, 6, 7, 3
SECTION_W = 3 * NUM_W + SHARE_W
TABLE_W = NAME_W + 2 * SECTION_W + GAP
TABLE_LINES = 2 + len(ROWS)
SIDE_CHART_MIN = 30  # chart beside the table when at least this many columns are left
BAR_MIN = 12  # cells the share bar keeps when notes share its line


@dataclass(frozen=True)
class PhaseInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    recent: tuple[tuple[str, PhaseStat], ...]  # (phase or "step", its stats), as metrics.phase_stats gives them
    total: tuple[tuple[str, PhaseStat], ...]
    recent_n: int
    total_n: int
    series: tuple[float, ...]  # the step time's means, a bar each
    span: str
    device_timed: bool = False
    notes: str = ""  # time outside steps, closure evaluations: one line under the bar when there is any
    ended: bool = False  # the job is over (with no step: say why there may be none)
    no_steps: str = NO_STEPS  # what to say then
    since: str = "since start"  # or "since step 2": the whole-run figures leave step 1 (warm-up) out
    extent: tuple[float, float] | None = None  # the fastest and slowest single step in the chart's span

    @classmethod
    def from_state(cls, state: RunState, span_index: int = 0, now: float | None = None) -> PhaseInfo:
        """Derive the panel from ``state`` (call with the state lock held)."""
        label, seconds = SPANS[span_index % len(SPANS)]
        first_left_out = state.first_step_left_out() is not None
        return cls(
            recent=tuple(state.phase_stats(recent=True).items()),
            total=tuple(state.phase_stats(recent=False).items()),
            recent_n=sum(1 for s in state.recent if not s.windowed),
            total_n=state.totals["step"].hist.n - first_left_out,
            series=tuple(state.step_series.values(seconds)),
            extent=state.step_series.extent(seconds),
            since="since step 2" if first_left_out else "since start",
            span=label,
            device_timed=state.device_timed,
            notes=notes_line(state, now),
            ended=state.exit is not None,
            no_steps=no_steps(state),
        )

    def stats(self, recent: bool = True) -> PhaseStats:
        """The stats back as ``{phase: PhaseStat}``."""
        return dict(self.recent if recent else self.total)


def notes_line(state: RunState, now: float | None = None) -> str:
    """Time outside training steps and closure evaluations, in words ("" when there is none); ``now``: the
    dashboard's clock (a replay's is the recording's time)."""
    parts = []
    shares = state.outside_shares(now)
    if shares:
        kinds = ", ".join(f"{k} {fmt.share(v)}" for k, v in shares.items() if v >= 0.0005)  # shown as >= 0.1%
        if kinds:
            parts.append(f"outside steps: {kinds} of wall time")
    closures = state.closures_per_step()
    if closures:
        parts.append(f"{closures:.1f} closure evaluations/step")
    prefetch = state.prefetch_share()
    if prefetch:
        parts.append(f"a prefetching thread fetches {fmt.share(prefetch)} of the time")
    if state.windowed_steps:
        parts.append(f"{fmt.count(state.windowed_steps)} profiled steps left out")
    if state.no_loader():
        parts.append(NO_LOADER)
    return " · ".join(parts)


class PhasesView:
    """Rich renderable for :class:`PhaseInfo`."""

    def __init__(self, info: PhaseInfo | None, styles: dict[str, Style], chart_height: int) -> None:
        self.info = info
        self.styles = styles
        self.chart_height = chart_height

    def table_lines(self) -> list[Text]:
        st, info = self.styles, self.info
        assert info is not None
        recent, total = info.stats(True), info.stats(False)
        timing = " (device time)" if info.device_timed else ""
        head = Text(" " * NAME_W, no_wrap=True)
        head.append(f"last {fmt.count(info.recent_n)} steps{timing}".center(SECTION_W, " "), st["heading"])
        head.append(" " * GAP)
        head.append(f"{info.since} ({fmt.count(info.total_n)})".center(SECTION_W, " "), st["heading"])
        cols = Text("phase".ljust(NAME_W), st["heading"], no_wrap=True)
        for i in range(2):
            cols.append("".join(h.rjust(NUM_W) for h in ("mean", "p50", "p95")) + "share".rjust(SHARE_W), st["heading"])
            if i == 0:
                cols.append(" " * GAP)
        lines = [head, cols]
        for p in ROWS:
            line = Text(no_wrap=True)
            if p == "step":
                line.append("  step".ljust(NAME_W), st["step"])
            else:
                line.append("■ ", st[p]).append(p.ljust(NAME_W - 2), st["name"])
            for i, stats in enumerate((recent, total)):
                s = stats.get(p, PhaseStat())
                nums = "".join(fmt.ms(v).rjust(NUM_W) for v in (s.mean_ms, s.p50_ms, s.p95_ms))
                line.append(nums, st["step"] if p == "step" else st["value"])
                line.append(fmt.share(s.share).rjust(SHARE_W), st["share"])
                if i == 0:
                    line.append(" " * GAP)
            lines.append(line)
        return lines

    def bar_line(self, width: int) -> Text:
        """The stacked share bar; the notes (time outside steps, ...) share its line, so the height never changes."""
        assert self.info is not None
        recent = self.info.stats(True)
        shares = [(p, recent[p].share or 0.0) for p in ALL_PHASES if p in recent]
        notes = self.info.notes
        bar_w = max(BAR_MIN, width - len(notes) - 2) if notes else width
        line = Text(no_wrap=True)
        cells = stacked_bar(shares, bar_w)
        if not cells:
            line.append("─" * bar_w, self.styles["heading"])
        for p, n in cells:
            line.append("█" * n, self.styles[p])
        if notes:
            room = max(0, width - bar_w - 2)
            line.append("  ").append(notes if len(notes) <= room else notes[: max(0, room - 1)] + "…", self.styles["heading"])
        return line

    def chart_label(self) -> Text:
        assert self.info is not None
        st, series, span = self.styles, self.info.series, self.info.span
        label = Text(no_wrap=True, overflow="ellipsis")
        label.append("step time, " if span == "whole run" else "step time, last ", st["heading"])
        label.append(span, st["span"])
        if series:  # the single steps' range: the bars are means (a second's, or more), which hide a spike
            low, high = self.info.extent or (min(series), max(series))
            label.append(f": {fmt.ms_range(low, high)}", st["heading"])
        return label

    def chart_lines(self, width: int, height: int) -> list[Text]:
        """The label line, then ``height`` rows of chart; with height 1, label and chart share a line."""
        st, series = self.styles, self.info.series if self.info else ()
        label = self.chart_label()
        if height <= 1:
            label.append("  ")
            room = width - label.cell_len
            if room < 10:
                return [label]
            if not series:
                return [label.append("waiting for steps…", st["heading"])]
            return [label.append(spark_rows(resample(series, room), 1)[0], st["chart"])]
        label.truncate(width, overflow="ellipsis")
        if not series:
            return [label, Text("waiting for steps…", st["heading"])] + [Text("")] * (height - 1)
        return [label] + [Text(r, st["chart"], no_wrap=True) for r in spark_rows(resample(series, width), height)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if self.info is None or not (self.info.total_n or self.info.notes):
            text = self.info.no_steps if self.info is not None and self.info.ended else "waiting for steps…"
            yield Text(text, self.styles["heading"])
            return
        table = self.table_lines()
        side = width - TABLE_W - GAP
        if side >= SIDE_CHART_MIN:
            chart = self.chart_lines(side, TABLE_LINES - 1)
            for row, extra in zip(table, chart, strict=False):
                row.align("left", TABLE_W)
                row.append(" " * GAP).append_text(extra)
            lines = table
        else:
            lines = table + self.chart_lines(width, self.chart_height)
        lines.append(self.bar_line(width))
        for line in lines:
            line.truncate(width)
            yield from line.render(console)
            yield Segment.line()


class PhasesPanel(StyledWidget):
    """Phase timings panel; ``info`` and ``span_index`` are its state."""

    COMPONENT_CLASSES = {
        *(f"phases--{p}" for p in ALL_PHASES),
        "phases--step", "phases--name", "phases--value", "phases--share", "phases--heading",
        "phases--chart", "phases--span",
    }

    info: reactive[PhaseInfo | None] = reactive(None)
    span_index: reactive[int] = reactive(0)

    @property
    def span(self) -> tuple[str, float | None]:
        return SPANS[self.span_index % len(SPANS)]

    def chart_height(self) -> int:
        """Rows of the step-time chart when it sits below the table."""
        return 4 if self.app.size.height >= 32 else 1

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        side = width - TABLE_W - GAP
        if side >= SIDE_CHART_MIN:
            return TABLE_LINES + 1
        chart = self.chart_height()
        return TABLE_LINES + 1 + chart + (1 if chart > 1 else 0)

    def render(self) -> PhasesView:
        styles = self.component_styles()
        return PhasesView(self.info, styles, self.chart_height())
