"""The script's output (tails of ``RUN/output.log`` and ``RUN/stderr.log``) and, when the job failed, its exception."""

from __future__ import annotations

import re
from collections.abc import Iterable

from rich.cells import cell_len
from rich.segment import Segment
from rich.text import Text
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.strip import Strip
from textual.widgets import Log, Static

from perfmon.tail import OUTPUT_LINES as MAX_LINES

_ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
#: A frame of an installed library or of Python itself, not of the user's code.
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d+(\.\d+)?[/\\]|^<")


#: What str.splitlines() breaks a line at besides \n and \r (Log.write_lines splits each line it is given).
_LINE_BREAKS = str.maketrans({c: " " for c in "\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(line: str) -> str:
    """``line`` as exactly one line of the Log: an empty one stays (a blank line of the script's output vanished),
    one with a form feed or another break ``splitlines`` knows is not split."""
    return line.translate(_LINE_BREAKS) or " "


def clean_line(line: str) -> str:
    """What a terminal would show: no colour codes, only the text after the last carriage return."""
    line = _ANSI.sub("", line.rstrip("\r"))
    return line.rsplit("\r", 1)[-1]


def last_frame(traceback: str | None) -> str | None:
    """``script.py:42 in step`` for the innermost frame of a Python traceback in the user's own code (a
    RuntimeError raised in torch's linear.py is the script's line that called the model), else the innermost."""
    frames = [m.groups() for line in (traceback or "").splitlines() if (m := _FRAME.match(line))]
    if not frames:
        return None
    own = [f for f in frames if not _LIBRARY.search(f[0])]
    path, lineno, func = (own or frames)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{lineno} in {func}"


class OutputLog(Log):
    """The script's lines; one that goes on past an edge shows ``…`` there (←→ scroll it): cut silently, "at
    step 375" read as "at step 3"."""

    COMPONENT_CLASSES = {"outputlog--more"}
    #: columns a ← or → moves: a long line (a tqdm bar, a traceback's path) is read in a few keys, not a hundred
    SIDEWAYS = 8

    def action_scroll_left(self) -> None:
        self._sideways(-self.SIDEWAYS)

    def action_scroll_right(self) -> None:
        self._sideways(self.SIDEWAYS)

    def _sideways(self, columns: int) -> None:
        if not self.allow_horizontal_scroll:
            raise SkipAction()
        self.scroll_relative(x=columns, animate=False)

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width  # the strip is as wide as size, the scrollbar drawn over it
        lines = self.lines
        row = scroll_y + y
        if width < 3 or row >= len(lines):
            return strip
        # text cut on the left: a blank line (kept as one space) hides nothing there, and shows no …
        left, right = scroll_x > 0 and bool(lines[row][:scroll_x].strip()), cell_len(lines[row]) > scroll_x + width
        if not (left or right):
            return strip
        more = Strip([Segment("…", self.get_component_rich_style("outputlog--more"))], 1)
        return Strip.join([more if left else strip.crop(0, 1), strip.crop(1, width - 1),
                           more if right else strip.crop(width - 1, width), strip.crop(width, strip.cell_length)])


class LogPanel(Vertical):
    """Output tail with an exception banner; ``exception``, ``where`` and ``hint`` (what to do) are its state."""

    exception: reactive[str | None] = reactive(None, init=False)
    where: reactive[str | None] = reactive(None, init=False)
    hint: reactive[str | None] = reactive(None, init=False)
    progress: reactive[str] = reactive("", init=False)  # the line being written: a tqdm bar, until its newline

    def compose(self) -> ComposeResult:
        yield Static(id="exception")
        yield OutputLog(max_lines=MAX_LINES, id="output")
        yield Static(id="progress", markup=False)

    def watch_progress(self, progress: str) -> None:
        shown = clean_line(progress)
        self.query_one("#progress", Static).update(shown)
        self.set_class(bool(shown.strip()), "-progress")

    def on_mount(self) -> None:
        self.border_title = "output"

    @property
    def log_widget(self) -> OutputLog:
        return self.query_one("#output", OutputLog)

    following = True  # the view shows the tail (cleared when lines come while the user looks further up)

    def add_lines(self, lines: Iterable[str]) -> None:
        """Append complete lines of output; a view at the tail stays at the tail."""
        log = self.log_widget
        # Within a line of the end: the horizontal scrollbar a first long line brings takes a line of the view,
        # which moves the end one line further (Log's own check then stopped following for good)
        self.following = log.max_scroll_y - log.scroll_y <= 1
        new = [one_line(clean_line(line)) for line in lines]  # one Log line each: the count below is exact
        before = log.line_count
        log.write_lines(new, scroll_end=False)
        if self.following:
            self._follow_tail()
            self.call_after_refresh(self._follow_tail)  # once the scrollbar is laid out too
        elif dropped := before + len(new) - log.line_count:  # the oldest lines made room: the view stays on
            log.scroll_to(y=max(0, log.scroll_y - dropped), animate=False, immediate=True)  # the lines it showed

    def on_resize(self) -> None:
        """Panels above appeared or the view changed: a log that followed its tail keeps following it."""
        if self.following:
            self.call_after_refresh(self._follow_tail)

    def _follow_tail(self) -> None:
        self.log_widget.scroll_end(animate=False, immediate=True, x_axis=False)

    def _update_banner(self) -> None:
        banner = self.query_one("#exception", Static)
        log = self.log_widget
        if log.is_vertical_scroll_end:  # keep the tail in view when the banner takes a line
            self.call_after_refresh(log.scroll_end, animate=False, x_axis=False)
        if self.exception:
            text = Text("✘ ", style="bold").append(self.exception, style="bold")
            if self.where:
                text.append(f"  at {self.where}")
            if self.hint:
                text.append(f"\n{self.hint}", style="not bold")
            banner.update(text)
        self.set_class(bool(self.exception), "-failed")

    def watch_exception(self) -> None:
        self._update_banner()

    def watch_where(self) -> None:
        self._update_banner()

    def watch_hint(self) -> None:
        self._update_banner()
