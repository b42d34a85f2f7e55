"""Model panel: parameters, static memory, the memory budget (largest batch that fits), FLOPs and MFU."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive

from perfmon import messages
from perfmon.analysis.metrics import Flops, MemoryBudget
from perfmon.analysis.rules import Config
from perfmon.analysis.state import RunState
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import stacked_bar
from perfmon.tui.widgets.fmt import Num, number
from perfmon.tui.widgets.styled import LinesPanel

LABEL_W = 9


def _opt(flags: tuple[messages.OptimizerFlags, ...], name: str) -> str:
    for f in flags:
        if f.name == name:
            mode = "fused" if f.fused else "foreach" if f.foreach else None
            tensors = f.param_tensors
            extra = ", ".join(x for x in (mode, f"{tensors} tensors" if tensors else None) if x)
            return f"{name} ({extra})" if extra else name
    return name


def _loader(loader: messages.LoaderSettings) -> str:
    bits = [f"batch {loader.batch_size}" if loader.batch_size else None,
            f"{loader.num_workers if loader.num_workers is not None else 0} workers",
            "pin_memory" if loader.pin_memory else "no pin_memory",
            "persistent" if loader.persistent_workers else None,
            f"prefetch {loader.prefetch_factor}" if loader.prefetch_factor else None,
            loader.dataset or None]
    return ", ".join(b for b in bits if b)


@dataclass(frozen=True)
class ModelInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    params: tuple[Num, Num, Num]  # total, trainable, frozen
    by_dtype: tuple[tuple[str, int], ...]
    static: tuple[Num, Num, Num, Num]  # params, grads, optimizer, total bytes
    roots: tuple[str, ...]
    optimizers: tuple[str, ...]
    loader: str
    budget: MemoryBudget
    flops: Flops
    has_model: bool
    #: a margin below this shows as bad: what is left when the memory-pressure rule's threshold is reached
    margin_warn: float = 1.0 - Config.memory_pressure

    @property
    def steady_peak(self) -> bool:
        """The budget's peak is the steady-state per-step one (window peaks), not the one since start."""
        return self.budget.peak_source == "steady state"

    @classmethod
    def from_state(cls, state: RunState, memory_pressure: float = Config.memory_pressure) -> ModelInfo:
        """Derive the panel from ``state`` (call with the state lock held); ``memory_pressure``: the rule's
        threshold in force (``--rules``)."""
        m = state.model or messages.ModelInfo()
        b = state.memory_budget()
        f = state.flops()
        return cls(
            params=(number(m.params), number(m.trainable), number(m.frozen)),
            by_dtype=tuple(sorted(((k, int(v)) for k, v in (m.by_dtype or {}).items()),
                                  key=lambda kv: -kv[1])),
            static=(number(m.param_bytes), number(m.grad_bytes), number(m.optimizer_bytes),
                    number(m.static_bytes)),
            roots=m.roots,
            optimizers=tuple(_opt(m.optimizer_flags, o) for o in m.optimizers),
            loader=_loader(loader) if (loader := messages.training_loader(m.loaders)) else "",
            budget=b, flops=f, has_model=m.params is not None, margin_warn=1.0 - memory_pressure,
        )


class ModelView:
    """Rich renderable for :class:`ModelInfo`."""

    def __init__(self, info: ModelInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    def row(self, label: str) -> Text:
        return Text(label.ljust(LABEL_W), self.styles["label"], no_wrap=True, overflow="ellipsis")

    def wrapped(self, first: Text, text: str, width: int) -> list[Text]:
        """``text`` (muted) after ``first``'s label, wrapped under it."""
        parts = textwrap.wrap(text, max(20, width - LABEL_W)) or [""]
        lines = [first.append(parts[0], self.styles["muted"])]
        lines += [self.row("").append(part, self.styles["muted"]) for part in parts[1:]]
        return lines

    def pairs(self, line: Text, items: list[tuple[str, str]]) -> Text:
        st = self.styles
        for i, (label, value) in enumerate(items):
            if i:
                line.append(" · ", st["label"])
            if label:
                line.append(f"{label} ", st["label"])
            line.append(value, st["value"])
        return line

    def budget_lines(self, width: int) -> list[Text]:
        st, info = self.styles, self.info
        assert info is not None
        b = info.budget
        line = self.row("budget")
        peak = number(b.peak_bytes)
        if peak is None:
            return self.wrapped(line, f"n/a: {b.reason or 'waiting for allocator statistics'}", width)
        items = [("step peak" if info.steady_peak else "peak", fmt.nbytes(peak)),
                 ("activations", fmt.nbytes(number(b.activation_bytes)))]
        if b.per_sample_bytes is not None:
            items.append(("", f"{fmt.nbytes(number(b.per_sample_bytes))}/sample"))
        self.pairs(line, items)
        lines = [line]
        fits = self.row("")
        if b.batch is not None:
            fits.append("batch ", st["label"]).append(fmt.num(number(b.batch)), st["value"])
            if b.max_batch is not None:
                fits.append(" → the largest that fits ≈", st["label"]).append(fmt.num(number(b.max_batch)), st["good"])
        margin = number(b.margin)
        if margin is not None:
            fits.append(" · " if b.batch is not None else "", st["label"])
            fits.append("margin ", st["label"]).append(
                fmt.share(margin), st["bad"] if margin < info.margin_warn else st["value"])
        if fits.cell_len > LABEL_W:
            lines.append(fits)
        if b.reason:
            lines += self.wrapped(self.row(""), b.reason, width)
        capacity, static = number(b.capacity_bytes), number(b.static_bytes)
        legend = Text(no_wrap=True)
        legend.append(" █", st["static"]).append(" static ", st["label"]).append("▓", st["activation"])
        legend.append(" activations ", st["label"]).append("░", st["free"]).append(" free of ", st["label"])
        legend.append(fmt.nbytes(capacity), st["value"])
        bar_w = width - LABEL_W - legend.cell_len
        if capacity and static is not None and peak is not None and bar_w >= 10:
            bar = self.row("")
            parts = [("static", min(static, capacity)), ("activation", max(0.0, min(peak, capacity) - static)),
                     ("free", max(0.0, capacity - max(peak, static)))]
            for key, n in stacked_bar(parts, bar_w):
                bar.append({"static": "█", "activation": "▓", "free": "░"}[key] * n, st[key])
            lines.append(bar.append_text(legend))
        return lines

    def flops_lines(self, width: int = 80) -> list[Text]:
        st, info = self.styles, self.info
        assert info is not None
        f = info.flops
        line = self.row("FLOPs")
        per_step = number(f.flops_per_step)
        if per_step is None:
            return [line.append(f"n/a: {f.reason or 'not counted yet'}", st["muted"])]
        line.append(f"{fmt.si(per_step)}/step", st["value"])
        line.append(" · achieved ", st["label"]).append(fmt.flops_rate(number(f.achieved_flops)), st["value"])
        mfu = number(f.mfu)
        line.append(" · MFU ", st["label"])
        if mfu is not None:
            line.append(fmt.share(mfu), st["good"])
        else:
            line.append("n/a", st["muted"])
        second = self.row("")
        peak_tflops = number(f.peak_tflops)
        if peak_tflops:
            second.append("of peak ", st["label"]).append(fmt.flops_rate(peak_tflops * 1e12), st["value"])
            if f.peak_source:
                second.append(f" ({f.peak_source})", st["label"])
        elif f.reason:
            return [line, *self.wrapped(second, f.reason, width)]
        return [line, second] if second.cell_len > LABEL_W else [line]

    def lines(self, width: int) -> list[Text]:
        st, info = self.styles, self.info
        if info is None or not info.has_model:
            lines = [Text("waiting for model facts (they come after the first forward pass)", st["muted"])]
            if info is not None and number(info.flops.flops_per_step) is not None:
                lines += self.flops_lines(width)
            return lines
        total, trainable, frozen = info.params
        params = self.pairs(self.row("params"), [
            ("", fmt.si(total)), ("trainable", fmt.si(trainable)), ("frozen", fmt.si(frozen)),
            *((dtype, fmt.si(n)) for dtype, n in info.by_dtype),
        ])
        parts = [("", ", ".join(info.roots) or fmt.NA)]
        if info.optimizers:
            parts.append(("optimizer", ", ".join(info.optimizers)))
        modules = self.pairs(self.row("model"), parts)
        p, g, o, s = info.static
        static = self.row("static")
        static.append(fmt.nbytes(s), st["value"]).append(" = params ", st["label"]).append(fmt.nbytes(p), st["value"])
        static.append(" + grads ", st["label"]).append(fmt.nbytes(g), st["value"])
        static.append(" + optimizer ", st["label"]).append(fmt.nbytes(o), st["value"])
        lines = [params, modules, static, *self.budget_lines(width), *self.flops_lines(width)]
        if info.loader:
            lines.append(self.row("loader").append(info.loader, st["value"]))
        return lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.lines(width):
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


class ModelPanel(LinesPanel):
    """Model facts; ``info`` is its state."""

    COMPONENT_CLASSES = {
        "model--label", "model--value", "model--muted", "model--good", "model--bad",
        "model--static", "model--activation", "model--free",
    }

    info: reactive[ModelInfo | None] = reactive(None)
    VIEW = ModelView
