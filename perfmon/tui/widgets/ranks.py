"""Ranks view: every rank of a multi-rank job in one table (the slowest marked, the selected one pointed at),
the job's totals and the findings that compare ranks (straggler, memory imbalance, communication)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive

from perfmon.analysis.job import STEADY_WORDS, JobState, RankRow, rank_rows, slowest, throughput
from perfmon.analysis.job_report import job_status
from perfmon.analysis.rules import Config, Finding, evaluate_job
from perfmon.protocol import ALL_PHASES, PHASE_SHORT
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.styled import LinesPanel

#: (heading, width) of the table's columns after the rank; GPU and CPU, then the status, only where they fit.
_COLUMNS = (("node", 4), ("step", 7), ("p50 ms", 7), *((PHASE_SHORT[p], 6) for p in ALL_PHASES), ("mem", 7),
            ("GPU", 5), ("CPU", 5))
_CORE = len(_COLUMNS) - 2
_STATUS_W = 14


@dataclass(frozen=True)
class RanksInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    rows: tuple[RankRow, ...]
    findings: tuple[Finding, ...]
    selected: int | None
    slowest: int | None
    world_size: int
    status: str

    @classmethod
    def from_job(cls, job: JobState, selected: int | None, cfg: Config | None = None) -> RanksInfo:
        """Derive the panel from ``job`` (call with the state lock held)."""
        cfg = cfg or Config()
        rows = rank_rows(job, cfg.warmup_steps, cfg.min_steps)
        slow = slowest(rows)
        return cls(rows=tuple(rows), findings=tuple(evaluate_job(rows, cfg)), selected=selected,
                   slowest=slow.rank if slow is not None else None, world_size=job.world_size,
                   status=job_status(job))


def _mem(row: RankRow) -> str:
    mem = row.memory_bytes
    return fmt.nbytes(mem, short=True) if mem else fmt.NA


class RanksView:
    """Rich renderable for :class:`RanksInfo`."""

    def __init__(self, info: RanksInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def lines(self, width: int) -> list[Text]:
        st, info = self.styles, self.info
        if info is None or not info.rows:
            return [Text("waiting for the ranks to start…", st["label"])]
        nodes = {r.node for r in info.rows}
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"{len(info.rows)}/{info.world_size} ranks", st["value"])
        head.append(f" on {len(nodes)} node{'s' if len(nodes) != 1 else ''} · ", st["label"])
        head.append(info.status, st["value"])
        if info.slowest is not None:
            head.append(" · slowest ", st["label"]).append(f"rank {info.slowest}", st["slow"])
        steps_s, samples_s = throughput(list(info.rows))
        pace = Text("job ", st["label"], no_wrap=True, overflow="ellipsis")
        pace.append(fmt.rate(steps_s), st["value"]).append(" steps/s · ", st["label"])
        pace.append(fmt.rate(samples_s), st["value"]).append(" samples/s, all ranks together", st["label"])
        out = [head, pace, Text("")]
        table_w = 6 + sum(w + 1 for _, w in _COLUMNS)
        columns = _COLUMNS if width >= table_w + 2 else _COLUMNS[:_CORE]
        status = width >= table_w + 2 + _STATUS_W
        heading = Text("  rank", st["heading"], no_wrap=True, overflow="ellipsis")
        for name, w in columns:
            heading.append(f" {name:>{w}}", st["heading"])
        if status:
            heading.append("  status", st["heading"])
        out.append(heading)
        for row in info.rows:
            line = Text(no_wrap=True, overflow="ellipsis")
            mark = "▶ " if row.rank == info.selected else "  "
            line.append(mark, st["selected"])
            line.append(f"{row.rank:>4}", st["slow"] if row.rank == info.slowest else st["value"])
            cells = ["?" if row.node is None else str(row.node), fmt.count(row.steps), fmt.ms(row.step_ms),
                     *(fmt.ms(row.phases.get(p)) for p in ALL_PHASES), _mem(row), fmt.pct(row.util_gpu),
                     fmt.pct(row.cpu_percent)]
            for (_, w), cell in zip(columns, cells, strict=False):
                line.append(f" {cell:>{w}}", st["value"])
            if status:
                line.append(f"  {row.status}", st["label"])
            if row.rank == info.slowest:
                line.append("  ← slowest" if status else " ←", st["slow"])
            out.append(line)
        out.append(Text(f"phases: mean ms per step, {STEADY_WORDS} · r selects the rank the other views show",
                        st["label"], no_wrap=True, overflow="ellipsis"))
        out.append(Text(""))
        if not info.findings:
            out.append(Text("no finding across ranks", st["label"]))
        for f in info.findings:
            title = Text(no_wrap=False)
            title.append(f"{f.severity.upper()} ", st.get(f.severity, st["value"])).append(f.title, st["value"])
            out.append(title)
            out.append(Text(f"  fix: {f.fix}", st["fix"]))
        wrapped: list[Text] = []
        for line in out:
            wrapped.extend(line.wrap(Console(width=max(20, width)), max(20, width)) if not line.no_wrap else [line])
        return wrapped

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.lines(width):
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


class RanksPanel(LinesPanel):
    """The all-ranks table; ``info`` is its state."""

    COMPONENT_CLASSES = {
        "ranks--label", "ranks--value", "ranks--heading", "ranks--slow", "ranks--selected", "ranks--fix",
        "ranks--critical", "ranks--warn", "ranks--info",
    }

    info: reactive[RanksInfo | None] = reactive(None)
    VIEW = RanksView
