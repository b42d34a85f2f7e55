"""The view bar: which view is shown (number keys switch), findings count, capture marker, chart span."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive

from perfmon.tui.widgets.styled import StyledWidget

#: The views, switched by the keys 1..N: (id, label).
VIEWS: tuple[tuple[str, str], ...] = (
    ("overview", "overview"), ("device", "device"), ("model", "model"), ("ops", "ops"),
    ("findings", "findings"), ("output", "output"),
)
#: A multi-rank job adds the all-ranks view (key 7).
RANKS_VIEW = ("ranks", "ranks")
VIEW_IDS = (*(v for v, _ in VIEWS), RANKS_VIEW[0])
#: Labels where the full ones do not fit (a job's seven views at 80 columns).
SHORT_LABELS = {"overview": "over", "device": "dev", "findings": "find", "output": "out"}


@dataclass(frozen=True)
class ViewBarInfo:
    """What the bar shows; equal values mean nothing to redraw."""

    current: str = "overview"
    findings: int = 0
    severity: str = ""  # worst finding's
    capturing: bool = False
    span: str = ""
    ranks: bool = False  # a multi-rank job: the ranks view is offered


class ViewBarView:
    """Rich renderable for :class:`ViewBarInfo` (one line)."""

    def __init__(self, info: ViewBarInfo, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def _tabs(self, short: bool) -> Text:
        """The view tabs; ``short``: abbreviated labels (the current view's stays whole)."""
        st, info = self.styles, self.info
        tabs = Text(no_wrap=True, overflow="ellipsis")
        for i, (view, label) in enumerate((*VIEWS, RANKS_VIEW) if info.ranks else VIEWS, 1):
            active = view == info.current
            label = SHORT_LABELS.get(view, label) if short and not active else label
            tabs.append(f" {i} ", st["active-key"] if active else st["key"])
            tabs.append(f"{label} ", st["active"] if active else st["name"])
            if view == "findings" and info.findings:
                tabs.append(f"{info.findings} ", st.get(info.severity, st["name"]))
            if view == "ops" and info.capturing:
                tabs.append("● ", st["capturing"])
            tabs.append(" ")
        return tabs

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        st, info = self.styles, self.info
        right = Text(no_wrap=True)
        if info.span:
            right.append("span ", st["name"]).append(info.span, st["span"])
        tabs = self._tabs(short=False)
        if tabs.cell_len + right.cell_len > options.max_width:
            tabs = self._tabs(short=True)
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        grid.add_column(no_wrap=True, justify="right")
        grid.add_row(tabs, right)
        yield grid


class ViewBar(StyledWidget):
    """One line under the header; ``info`` is its state."""

    COMPONENT_CLASSES = {
        "views--key", "views--name", "views--active-key", "views--active", "views--span", "views--capturing",
        "views--critical", "views--warn", "views--info",
    }

    info: reactive[ViewBarInfo] = reactive(ViewBarInfo)

    def render(self) -> ViewBarView:
        styles = self.component_styles()
        return ViewBarView(self.info, styles)
