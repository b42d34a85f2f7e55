"""Findings: what the rules say is wrong, worst first; Enter opens one to its evidence and fix."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.styled import StyledWidget

MARKS = {"critical": "▲", "warn": "▲", "info": "●"}
WAITING = "no findings yet: the rules need a few steps past warm-up"
NONE = "no findings: nothing the rules can name is holding this run back"
TOO_SHORT = "no findings: the run had too few steps past warm-up for the rules that judge steps"
NO_STEP = "no findings: the run ended before its first step"


def evidence_value(key: str, value: Any) -> str:
    """An evidence value in words: shares as percentages, bytes in binary units, dicts as ``k=v``."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else fmt.NA
    if isinstance(value, int | float):
        if "share" in key or key in ("margin", "busy", "device_busy", "mfu"):
            return fmt.share(float(value))
        if key == "system_cpu_percent":  # the whole host's busy share
            return f"{float(value):.0f}% of the host"
        if key.endswith("cpu_percent") or key.endswith("wait_percent"):  # of one CPU: 150 is a CPU and a half
            return f"{float(value):.0f}% of a CPU"
        if key.endswith("bytes"):
            return fmt.nbytes(value)
        if isinstance(value, float):
            return f"{value:.4g}"
        return fmt.count(value)
    if isinstance(value, dict) and "share" in key:  # a ranking: "1. optimizer 51% · 2. backward 20%"
        return " · ".join(f"{n}. {k} {evidence_value(key, v)}" for n, (k, v) in enumerate(value.items(), 1))
    if isinstance(value, dict):
        return ", ".join(f"{k}={evidence_value(str(k), v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [evidence_value(key, v) for v in value[:8]]
        return ", ".join(items) + (f", … ({len(value)})" if len(value) > 8 else "")
    return str(value)


@dataclass(frozen=True)
class FindingRow:
    id: str
    severity: str
    title: str
    evidence: tuple[tuple[str, str], ...]
    fix: str
    impact: float


@dataclass(frozen=True)
class FindingsInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    rows: tuple[FindingRow, ...]  # worst first
    evaluated: bool  # the rules have had enough steps to say anything
    ended: bool = False  # the run is over: no more steps will come
    stepped: bool = True  # the run made a step

    @property
    def empty_words(self) -> str:
        """What an empty list says."""
        if self.evaluated:
            return NONE
        if not self.ended:
            return WAITING
        return TOO_SHORT if self.stepped else NO_STEP

    @classmethod
    def from_findings(cls, findings: Iterable[Any], evaluated: bool = True, ended: bool = False,
                      stepped: bool = True) -> FindingsInfo:
        """From :class:`perfmon.analysis.rules.Finding` objects (already sorted, worst first)."""
        rows = tuple(
            FindingRow(
                id=f.id, severity=f.severity, title=f.title,
                evidence=tuple((str(k), evidence_value(str(k), v)) for k, v in (f.evidence or {}).items()),
                fix=f.fix, impact=float(f.impact or 0.0),
            )
            for f in findings
        )
        return cls(rows, evaluated or bool(rows), ended, stepped)

    @property
    def worst(self) -> FindingRow | None:
        return self.rows[0] if self.rows else None

    @property
    def badge(self) -> tuple[str, str]:
        """The header badge: (text, severity), e.g. ``("▲ critical: input-bound +2", "critical")``."""
        if not self.rows:
            return "", ""
        worst = self.rows[0]
        more = f" +{len(self.rows) - 1}" if len(self.rows) > 1 else ""
        return f"{MARKS.get(worst.severity, '●')} {worst.severity}: {worst.id}{more}", worst.severity


def _styles(widget: Widget, classes: set[str]) -> dict[str, Style]:
    # partial: no background of their own, so the list's highlight shows through
    return {name.split("--", 1)[1]: widget.get_component_rich_style(name, partial=True) for name in classes}


def headline(row: FindingRow, st: dict[str, Style], open_: bool | None = None) -> Text:
    """``▸ ▲ critical  Input-bound: 27% of each step waits for data``."""
    line = Text(no_wrap=False)
    if open_ is not None:
        line.append("▾ " if open_ else "▸ ", st["muted"])
    line.append(f"{MARKS.get(row.severity, '●')} {row.severity:<9}", st.get(row.severity, st["value"]))
    line.append(row.title, st["value"])
    return line


def hanging_headline(row: FindingRow, st: dict[str, Style], open_: bool) -> Table:
    """:func:`headline` for the findings view: a title too long for one line goes on under its own start."""
    full = headline(row, st, open_)
    mark_width = 2 + len(MARKS.get(row.severity, "●")) + 1 + max(9, len(row.severity))
    grid = Table.grid(pad_edge=False)
    grid.add_column(no_wrap=True, width=mark_width)
    grid.add_column(ratio=1)
    grid.add_row(full[:mark_width], full[mark_width:])
    return grid


def details(row: FindingRow, st: dict[str, Style]) -> Table:
    grid = Table.grid(padding=(0, 1), pad_edge=False)
    grid.add_column(width=4, no_wrap=True)
    grid.add_column(style=st["label"], no_wrap=True)
    grid.add_column(ratio=1)
    for key, value in row.evidence:
        grid.add_row("", key, Text(value, st["value"]))
    grid.add_row("", Text("fix", st["fix"]), Text(row.fix, st["fix"]))
    grid.add_row("", Text("rule", st["muted"]), Text(row.id, st["muted"]))
    return grid


class FindingsList(OptionList):
    """The findings, one option each; Enter toggles the highlighted one open."""

    BINDINGS = [Binding("enter", "select", "Open/close", tooltip="open or close a finding (evidence and fix)")]


class FindingsPanel(Vertical):
    """The full findings list; ``info`` is its state, ``expanded`` the ids opened with Enter."""

    COMPONENT_CLASSES = {
        "findings--critical", "findings--warn", "findings--info", "findings--label", "findings--value",
        "findings--fix", "findings--muted",
    }

    info: reactive[FindingsInfo | None] = reactive(None, init=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expanded: set[str] = set()

    def compose(self) -> ComposeResult:
        yield Static(WAITING, id="findings-empty")
        yield FindingsList(id="findings-list")

    @property
    def list(self) -> FindingsList:
        return self.query_one(FindingsList)

    _panel_styles: dict[str, Style] | None = None
    _empty_words = WAITING

    def notify_style_update(self) -> None:
        self._panel_styles = None
        super().notify_style_update()

    def prompt(self, row: FindingRow) -> Group | Text:
        if self._panel_styles is None:
            self._panel_styles = _styles(self, self.COMPONENT_CLASSES)
        st = self._panel_styles
        open_ = row.id in self.expanded
        head = hanging_headline(row, st, open_)
        return Group(head, details(row, st)) if open_ else head

    def watch_info(self, info: FindingsInfo | None) -> None:
        rows = info.rows if info else ()
        empty = self.query_one("#findings-empty", Static)
        words = WAITING if info is None else info.empty_words
        if words != self._empty_words:  # an update lays the screen out again: only on change
            self._empty_words = words
            empty.update(words)
        self.set_class(not rows, "-empty")
        options = self.list
        ids = [r.id for r in rows]
        self.expanded &= set(ids)
        if ids == [o.id for o in options.options]:  # same findings, new numbers: keep cursor and scroll
            for r in rows:
                options.replace_option_prompt(r.id, self.prompt(r))
            return
        # the cursor stays on its finding while someone reads the list; else on the worst, first (a critical one
        # that came above the finding first highlighted was opened with the cursor on the row below it)
        current = options.highlighted_option.id if options.highlighted_option is not None else None
        options.set_options(Option(self.prompt(r), id=r.id) for r in rows)
        if rows:
            options.highlighted = ids.index(current) if current in ids and options.has_focus else 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        option_id = event.option.id
        if option_id is None or self.info is None:
            return
        self.expanded ^= {option_id}
        row = next(r for r in self.info.rows if r.id == option_id)
        self.list.replace_option_prompt(option_id, self.prompt(row))


class FindingsSummaryView:
    """Rich renderable: the worst few findings, one line each."""

    def __init__(self, info: FindingsInfo | None, styles: dict[str, Style], height: int) -> None:
        self.info = info
        self.styles = styles
        self.height = height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        st, info, width = self.styles, self.info, options.max_width
        rows = info.rows if info else ()
        if not rows:
            lines = [Text(WAITING if info is None else info.empty_words, st["muted"])]
        else:
            shown = rows if len(rows) <= self.height else rows[: max(0, self.height - 1)]
            lines = [headline(r, st) for r in shown]
            if len(shown) < len(rows):
                lines.append(Text(f"… {len(rows) - len(shown)} more: press 5", st["muted"]))
        for line in lines:
            line.no_wrap = True
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


class FindingsSummary(StyledWidget):
    """The overview's findings strip; ``info`` is its state."""

    COMPONENT_CLASSES = FindingsPanel.COMPONENT_CLASSES
    PARTIAL_STYLES = True

    MAX_LINES = 3

    info: reactive[FindingsInfo | None] = reactive(None)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        # a fixed height: the overview does not jump as findings come and go (nor race a relayout)
        return self.MAX_LINES

    def render(self) -> FindingsSummaryView:
        return FindingsSummaryView(self.info, self.component_styles(), self.MAX_LINES)
