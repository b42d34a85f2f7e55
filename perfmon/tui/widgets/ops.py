"""Ops panel: the top ops of the last profiler window, sortable, with its age and a capture marker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive

from perfmon.analysis.state import RunState
from perfmon.messages import Breakdown, OpStat
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.fmt import Num
from perfmon.tui.widgets.styled import StyledWidget

#: Sort orders, cycled by the ``s`` key: (label, op key).
SORTS: tuple[tuple[str, str], ...] = (("self time", "self_ms"), ("total time", "total_ms"), ("calls", "calls"),
                                      ("FLOPs", "flops"))
EMPTY = "no profiler window yet — p captures one (a live job)"
WIDTHS = {"calls": 7, "self_ms": 9, "total_ms": 10, "self_cpu_ms": 8, "share": 7, "flops": 8}
SHAPES_MIN = 24


@dataclass(frozen=True)
class OpRow:
    name: str
    calls: int
    self_ms: float
    total_ms: float
    self_cpu_ms: float
    flops: int
    share: float
    shapes: str

    @classmethod
    def of(cls, op: OpStat) -> OpRow:
        return cls(
            name=op.name if op.name is not None else "?", calls=op.calls or 0, self_ms=op.self_ms or 0.0,
            total_ms=op.total_ms or 0.0, self_cpu_ms=op.self_cpu_ms or 0.0, flops=int(op.flops or 0),
            share=op.share or 0.0, shapes=op.shapes or "",
        )


@dataclass(frozen=True)
class OpsInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    rows: tuple[OpRow, ...]  # sorted
    sort: str
    step: int | None
    active_steps: int | None
    reason: str | None
    device: str | None
    age: str | None
    syncs: Num
    busy: Num
    ops_total: int | None
    trace: str | None
    capturing: str | None  # "started at step N" while a window is being captured
    windows: int
    kernels: tuple[OpRow, ...] = ()  # a GPU window analysed from its trace: top kernels by device time
    breakdown: Breakdown | None = None  # idle / compute / communication ... (HTA's definitions)
    columns: tuple[str, ...] = ("total_ms", "flops")  # optional columns this window has
    error: str | None = None  # the trace could not be analysed

    @classmethod
    def from_state(cls, state: RunState, sort_index: int = 0, now: float | None = None) -> OpsInfo:
        """Derive the panel from ``state`` (call with the state lock held)."""
        capturing = None
        if state.profiling is not None:
            capturing = f"capturing a profiler window (from step {fmt.count(state.profiling.step)})…"
        if not state.profiles:
            label = SORTS[sort_index % len(SORTS)][0]
            return cls((), label, None, None, None, None, None, None, None, None, None, capturing, 0)
        prof = state.profiles[-1]
        ops = prof.top_ops
        # windows analysed from their trace have no inclusive time or FLOPs per op: no such columns or sorts
        columns = tuple(k for k in ("total_ms", "flops") if any(k in op.given for op in ops)) if ops else (
            "total_ms", "flops")
        sorts = [s for s in SORTS if s[1] in ("self_ms", "calls", *columns)]
        label, key = sorts[sort_index % len(sorts)]
        rows = [OpRow.of(op) for op in ops]
        rows.sort(key=lambda r: (getattr(r, key), r.self_ms), reverse=True)
        t = prof.t
        age = fmt.ago(max(0.0, now - t)) if t is not None and now is not None else None
        return cls(
            rows=tuple(rows), sort=label, step=prof.step, active_steps=prof.active_steps,
            reason=prof.reason or None, device=prof.device or None, age=age, syncs=prof.syncs_per_step,
            busy=prof.device_busy, ops_total=prof.ops_total, trace=prof.trace or None, capturing=capturing,
            windows=len(state.profiles), kernels=tuple(OpRow.of(k) for k in prof.top_kernels),
            breakdown=prof.breakdown, columns=columns, error=prof.analysis_error or None,
        )


class OpsView:
    """Rich renderable for :class:`OpsInfo`, cut to ``height`` lines."""

    def __init__(self, info: OpsInfo | None, styles: dict[str, Style], height: int) -> None:
        self.info = info
        self.styles = styles
        self.height = height

    def titles(self) -> list[Text]:
        """The capture marker (while a window is being captured), then what the shown window is."""
        st, info = self.styles, self.info
        lines = []
        if info is not None and info.capturing:
            lines.append(Text("● " + info.capturing, st["capturing"], no_wrap=True, overflow="ellipsis"))
        if info is None or info.step is None:
            return lines or [Text(EMPTY, st["label"])]
        line = Text(no_wrap=True, overflow="ellipsis")
        lines.append(line)
        line.append("last window: " if info.capturing else "window: ", st["label"])
        line.append("step ", st["label"]).append(fmt.count(info.step), st["value"])
        details = [f"{info.active_steps} steps" if info.active_steps else None, info.reason, info.device]
        line.append("".join(f" · {d}" for d in details if d), st["label"])
        if info.age:
            line.append(" · ", st["label"]).append(info.age, st["value"])
        line.append(" · sort: ", st["label"]).append(info.sort, st["sort"]).append(" (s)", st["label"])
        return lines

    def columns(self, width: int) -> tuple[list[tuple[str, str]], int, bool]:
        """(header, op key) of the number columns, the name width, whether shapes fit."""
        assert self.info is not None
        info = self.info
        cols = [("calls", "calls"), ("self ms", "self_ms")]
        if "total_ms" in info.columns:
            cols.append(("total ms", "total_ms"))
        if info.device == "cuda" and width >= 100 and "total_ms" in info.columns:
            cols.append(("cpu ms", "self_cpu_ms"))  # summarised by the job (older recordings): CPU time too
        cols.append(("share", "share"))
        if "flops" in info.columns:
            cols.append(("FLOPs", "flops"))
        nums = sum(WIDTHS[key] for _, key in cols)
        longest = max((len(r.name) for r in info.rows), default=0) + 1
        name_w = max(16, min(44, longest, width - nums))
        shapes = width - name_w - nums - 2 >= SHAPES_MIN and any(r.shapes for r in info.rows)
        if not shapes:  # the names may have the width the shapes would have taken
            name_w = max(16, min(longest, width - nums))
        return cols, name_w, shapes

    def table(self, width: int, rows_room: int) -> list[Text]:
        st, info = self.styles, self.info
        assert info is not None
        cols, name_w, shapes = self.columns(width)
        sort_key = dict((label, key) for label, key in SORTS)[info.sort]
        head = Text(("op (device time of its kernels)" if info.kernels else "op").ljust(name_w)[:name_w],
                    st["heading"], no_wrap=True)
        for label, key in cols:
            mark = "▼" if key == sort_key else ""
            head.append((mark + label).rjust(WIDTHS[key]), st["sort"] if mark else st["heading"])
        if shapes:
            head.append("  input shapes", st["heading"])
        lines = [head]
        shown = info.rows if len(info.rows) <= rows_room else info.rows[: max(0, rows_room - 1)]
        for r in shown:
            line = Text(no_wrap=True, overflow="ellipsis")
            name = r.name if len(r.name) < name_w else r.name[: name_w - 2] + "…"
            line.append(name.ljust(name_w), st["name"])
            for _, key in cols:
                value = getattr(r, key)
                text = (fmt.count(value) if key == "calls" else fmt.share(value) if key == "share" else
                        (fmt.si(value) if value else fmt.DASH) if key == "flops" else fmt.ms(value))
                line.append(text.rjust(WIDTHS[key]), st["sorted"] if key == sort_key else st["value"])
            if shapes and r.shapes:
                line.append("  " + r.shapes, st["label"])
            lines.append(line)
        if len(shown) < len(info.rows):
            lines.append(Text(f"… {len(info.rows) - len(shown)} more (taller terminal or another sort)", st["label"]))
        room = rows_room - len(shown) - 1
        if info.kernels and room >= 3:  # what ran on the GPU, each kernel once (not added to its op's time)
            lines.append(Text("kernel".ljust(name_w) + "calls".rjust(WIDTHS["calls"]) + "device ms".rjust(
                WIDTHS["self_ms"] + 2) + "share".rjust(WIDTHS["share"]), st["heading"], no_wrap=True))
            for k in info.kernels[: room - 1]:
                line = Text(no_wrap=True, overflow="ellipsis")
                line.append((k.name if len(k.name) < name_w else k.name[: name_w - 2] + "…").ljust(name_w), st["name"])
                line.append(fmt.count(k.calls).rjust(WIDTHS["calls"]), st["value"])
                line.append(fmt.ms(k.self_ms).rjust(WIDTHS["self_ms"] + 2), st["value"])
                line.append(fmt.share(k.share).rjust(WIDTHS["share"]), st["value"])
                lines.append(line)
        return lines

    def footer(self) -> Text:
        st, info = self.styles, self.info
        assert info is not None
        line = Text(no_wrap=True, overflow="ellipsis")
        if info.device == "cpu":  # host<->device syncs do not exist without a device
            line.append("syncs/step ", st["label"]).append("n/a (CPU run)", st["value"])
        else:
            line.append("syncs/step ", st["label"]).append(fmt.num(info.syncs, digits=1), st["value"])
        line.append(" · device busy ", st["label"]).append(fmt.share(info.busy) if info.busy is not None else fmt.NA,
                                                            st["value"])
        b = info.breakdown
        if b is not None:
            for label, value in (("compute", b.compute), ("comm", b.communication), ("overlap", b.comm_compute_overlap)):
                if value is not None:
                    line.append(f" · {label} ", st["label"]).append(fmt.share(value), st["value"])
        if info.ops_total is not None:
            line.append(" · ", st["label"]).append(fmt.count(info.ops_total), st["value"]).append(" ops", st["label"])
            if info.ops_total > len(info.rows):  # the window's every op, of which the top few are kept and sorted
                line.append(f", top {len(info.rows)} kept", st["label"])
        line.append(" · trace ", st["label"])
        line.append(Path(info.trace).name if info.trace else fmt.NA, st["value"])
        return line

    def lines(self, width: int) -> list[Text]:
        info = self.info
        lines = self.titles()
        if info is None or not info.rows:
            if info is not None and info.error:
                lines.append(Text(f"trace not analysed: {info.error}", self.styles["label"]))
            elif info is not None and info.step is not None:
                lines.append(Text("the window recorded no ops", self.styles["label"]))
            return lines
        room = max(1, self.height - len(lines) - 2)  # titles, column heads, footer
        return [*lines, *self.table(width, room), self.footer()]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.lines(width)[: max(1, self.height)]:
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


class OpsPanel(StyledWidget):
    """Top ops of the last profiler window; ``info`` and ``sort_index`` are its state."""

    COMPONENT_CLASSES = {
        "ops--label", "ops--value", "ops--name", "ops--heading", "ops--sort", "ops--sorted", "ops--capturing",
    }

    info: reactive[OpsInfo | None] = reactive(None)
    sort_index: reactive[int] = reactive(0)

    @property
    def sort(self) -> tuple[str, str]:
        return SORTS[self.sort_index % len(SORTS)]

    def render(self) -> OpsView:
        styles = self.component_styles()
        return OpsView(self.info, styles, self.content_size.height or 24)
