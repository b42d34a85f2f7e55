"""Device panel: GPU utilization, memory, power, temperature, clocks, throttling; or why there is no GPU."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive

from perfmon import messages
from perfmon.analysis.state import RunState
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import LABEL_W, SPANS, span_words, spark, stacked_bar
from perfmon.tui.widgets.fmt import Num, number
from perfmon.tui.widgets.styled import LinesPanel


@dataclass(frozen=True)
class GpuRow:
    """One GPU's reading."""

    index: int | None
    name: str
    util: Num
    util_mem: Num
    used: Num
    total: Num
    proc: Num
    power: Num
    power_limit: Num
    temp: Num
    clock: Num
    clock_max: Num
    throttled: tuple[str, ...]
    pcie_tx: Num
    pcie_rx: Num
    proc_reason: str | None = None  # why ``proc`` (this process's memory on the GPU) is n/a

    @classmethod
    def from_sample(cls, g: messages.GpuSample) -> GpuRow:
        proc = number(g.proc_mem_bytes)
        return cls(
            index=g.index,
            name=g.name or "GPU",
            util=number(g.util_gpu), util_mem=number(g.util_mem),
            used=number(g.mem_used_bytes), total=number(g.total_bytes),
            proc=proc,
            power=number(g.power_w), power_limit=number(g.power_limit_w),
            temp=number(g.temp_c),
            clock=number(g.sm_clock_mhz), clock_max=number(g.sm_clock_max_mhz),
            throttled=g.throttled,
            pcie_tx=number(g.pcie_tx_kbs), pcie_rx=number(g.pcie_rx_kbs),
            proc_reason=g.proc_mem_reason if g.proc_mem_reason and proc is None else None,
        )

    @property
    def label(self) -> str:
        return f"GPU{self.index}" if self.index is not None else "GPU"

    @property
    def short_name(self) -> str:
        return self.name.removeprefix("NVIDIA ").strip()


@dataclass(frozen=True)
class CudaMem:
    """The caching allocator's numbers (this process)."""

    allocated: Num
    reserved: Num
    peak_allocated: Num
    peak_reserved: Num
    retries: Num
    ooms: Num
    fragmentation: Num
    window_peak: Num = None  # peak allocated in the last sample window (None with --no-window-peaks)

    @classmethod
    def from_sample(cls, m: messages.CudaMem) -> CudaMem:
        return cls(
            allocated=number(m.allocated_bytes), reserved=number(m.reserved_bytes),
            peak_allocated=number(m.peak_allocated_bytes), peak_reserved=number(m.peak_reserved_bytes),
            retries=number(m.alloc_retries), ooms=number(m.ooms), fragmentation=number(m.fragmentation_bytes),
            window_peak=number(m.window_peak_allocated_bytes),
        )


@dataclass(frozen=True)
class DeviceInfo:
    """What the panel shows; equal values mean nothing to redraw."""

    gpus: tuple[GpuRow, ...]
    cuda: CudaMem | None
    series: tuple[float, ...]
    span: str
    no_gpu: str | None  # the reason in words when there is no GPU; None when there are GPUs or no word yet

    @classmethod
    def from_state(cls, state: RunState, span_index: int = 0) -> DeviceInfo:
        """Derive the panel from ``state`` (call with the state lock held)."""
        label, seconds = SPANS[span_index % len(SPANS)]
        gpus = tuple(GpuRow.from_sample(g) for g in state.gpus)
        no_gpu = None
        if not gpus and (state.samples_seen or state.meta.gpus_probed or state.meta.cuda is False):
            no_gpu = state.meta.gpu_reason or "none reported"
        return cls(
            gpus=gpus,
            cuda=CudaMem.from_sample(state.cuda_mem) if state.cuda_mem else None,
            series=tuple(state.series["gpu_util"].values(seconds)) if gpus else (),
            span=label,
            no_gpu=no_gpu,
        )


def no_gpu_text(reason: str) -> str:
    return f"No GPU: {reason} — showing CPU data"


class DeviceView:
    """Rich renderable for :class:`DeviceInfo`."""

    def __init__(self, info: DeviceInfo | None, styles: dict[str, Style]) -> None:
        self.info = info
        self.styles = styles

    # -- pieces ---------------------------------------------------------------------------------
    def mem_bar(self, used: Num, total: Num, cuda: CudaMem | None, width: int) -> Text:
        """allocated █ | reserved, not allocated ▓ | other use of the device ▒ | free ░, of the total."""
        st = self.styles
        line = Text(no_wrap=True)
        if not total or width <= 0:
            return line.append("·" * max(0, width), st["free"])
        parts: list[tuple[str, float]] = []
        if cuda is not None and cuda.allocated is not None and cuda.reserved is not None:
            parts += [("alloc", cuda.allocated), ("reserved", max(0.0, cuda.reserved - cuda.allocated))]
            other = max(0.0, (used or 0.0) - cuda.reserved)
        else:
            other = used or 0.0
        parts.append(("other", other))
        parts.append(("free", max(0.0, total - sum(v for _, v in parts))))
        glyph = {"alloc": "█", "reserved": "▓", "other": "▒", "free": "░"}
        for key, n in stacked_bar(parts, width):
            line.append(glyph[key] * n, st[key])
        return line

    def util_line(self, gpu: GpuRow, width: int, prefix: str = "") -> Text:
        st, info = self.styles, self.info
        assert info is not None
        line = Text(prefix, st["label"], no_wrap=True).append("util".ljust(LABEL_W), st["label"])
        line.append(fmt.pct(gpu.util).rjust(4), st["value"]).append("  ")
        suffix = f"  {span_words(info.span)}"
        room = width - line.cell_len - len(suffix)
        if room >= 8:
            if info.series:
                line.append(spark(info.series, room, 0.0, 100.0), st["chart"])
            else:
                line.append("·" * room, st["free"])
            line.append(suffix, st["span"])
        return line

    def throttle_text(self, gpu: GpuRow, short: bool = False) -> Text:
        if not gpu.throttled:
            return Text("")
        reasons = ", ".join(gpu.throttled)
        return Text(f"⚠ {reasons}" if short else f"⚠ throttled: {reasons}", self.styles["warn"])

    def cuda_lines(self, cuda: CudaMem, width: int, line: Text | None = None) -> list[Text]:
        """Peaks, retries and OOMs, wrapped at `` · `` so a narrow terminal never cuts off the OOM count."""
        st = self.styles
        line = line if line is not None else Text(" " * LABEL_W, no_wrap=True, overflow="ellipsis")
        pieces = [Text("peak alloc ", st["label"]).append(fmt.nbytes(cuda.peak_allocated), st["value"])]
        if cuda.window_peak is not None:
            pieces[0].append(" (last window ", st["label"]).append(fmt.nbytes(cuda.window_peak), st["value"])
            pieces[0].append(")", st["label"])
        pieces.append(Text("reserved ", st["label"]).append(fmt.nbytes(cuda.peak_reserved), st["value"]))
        for label, value in (("retries ", cuda.retries), ("OOMs ", cuda.ooms)):
            pieces.append(Text(label, st["label"]).append(fmt.num(value), st["bad"] if value else st["value"]))
        lines, start = [line], line.cell_len
        for i, piece in enumerate(pieces):
            sep = Text(" · ", st["label"]) if i and lines[-1].cell_len > start else Text("")
            if i and lines[-1].cell_len + sep.cell_len + piece.cell_len > width:
                lines.append(Text(" " * LABEL_W, no_wrap=True, overflow="ellipsis"))
                start, sep = LABEL_W, Text("")
            lines[-1].append_text(sep).append_text(piece)
        return lines

    def single(self, gpu: GpuRow, cuda: CudaMem | None, width: int) -> list[Text]:
        st = self.styles
        head = Text(no_wrap=True, overflow="ellipsis")
        for name, short in ((gpu.name, False), (gpu.name, True), (gpu.short_name, True)):
            head = Text(no_wrap=True, overflow="ellipsis")
            head.append(f"{gpu.label} ", st["label"]).append(name, st["name"])
            throttle = self.throttle_text(gpu, short)
            if head.cell_len + 2 + throttle.cell_len <= width:
                break
        if throttle.cell_len:
            head.append(" " * max(2, width - head.cell_len - throttle.cell_len)).append_text(throttle)
        lines = [head, self.util_line(gpu, width)]
        total = f" {fmt.gib(gpu.used)}/{fmt.gib(gpu.total)} GiB"
        mem = Text("mem".ljust(LABEL_W), st["label"], no_wrap=True)
        mem.append_text(self.mem_bar(gpu.used, gpu.total, cuda, max(0, width - LABEL_W - len(total))))
        lines.append(mem.append(total, st["value"]))
        legend = Text(" " * LABEL_W, no_wrap=True, overflow="ellipsis")
        if cuda is not None:
            other = (gpu.used - cuda.reserved) if gpu.used is not None and cuda.reserved is not None else None
            legend.append("█ ", st["alloc"]).append("alloc ", st["label"]).append(fmt.nbytes(cuda.allocated), st["value"])
            legend.append("  ▓ ", st["reserved"]).append("reserved ", st["label"]).append(fmt.nbytes(cuda.reserved), st["value"])
            legend.append("  ▒ ", st["other"]).append("other ", st["label"]).append(fmt.nbytes(max(0.0, other or 0.0)), st["value"])
            lines += [legend, *self.cuda_lines(cuda, width)]
        else:
            legend.append("▒ ", st["other"]).append("used ", st["label"]).append(fmt.nbytes(gpu.used), st["value"])
            legend.append("  ░ ", st["free"]).append("free ", st["label"])
            free = gpu.total - gpu.used if gpu.total is not None and gpu.used is not None else None
            lines.append(legend.append(fmt.nbytes(free), st["value"]))
        power = Text("power".ljust(LABEL_W), st["label"], no_wrap=True, overflow="ellipsis")
        power.append(of(gpu.power, gpu.power_limit, " W"), st["value"])
        power.append(" · temp ", st["label"]).append(fmt.num(gpu.temp, "°C"), st["value"])
        power.append(" · SM ", st["label"]).append(of(gpu.clock, gpu.clock_max, " MHz"), st["value"])
        io = Text("PCIe".ljust(LABEL_W), st["label"], no_wrap=True, overflow="ellipsis")
        io.append(f"↓{pcie(gpu.pcie_rx)} ↑{pcie(gpu.pcie_tx)}", st["value"])
        io.append(" · mem io ", st["label"]).append(fmt.pct(gpu.util_mem), st["value"])
        return [*lines, power, *self.proc_lines(io, gpu, width)]

    def proc_lines(self, line: Text, gpu: GpuRow, width: int) -> list[Text]:
        """`` · this process 47.0 GiB`` at the end of ``line``; when it is n/a with a reason, the reason
        too, on lines of its own (wrapped) if it does not fit."""
        st = self.styles
        if gpu.proc_reason is None:
            line.append(" · this process ", st["label"]).append(fmt.nbytes(gpu.proc), st["value"])
            return [line]
        text = f"{fmt.NA}: {gpu.proc_reason}"
        if line.cell_len + len(" · this process ") + len(text) <= width:
            line.append(" · this process ", st["label"]).append(text, st["value"])
            return [line]
        indent = " " * LABEL_W
        parts = textwrap.wrap(f"this process {text}", max(20, width - LABEL_W))
        lines = [line]
        for k, part in enumerate(parts):
            row = Text(indent, no_wrap=True, overflow="ellipsis")
            if k == 0 and part.startswith("this process "):
                row.append("this process ", st["label"]).append(part.removeprefix("this process "), st["value"])
            else:
                row.append(part, st["value"])
            lines.append(row)
        return lines

    def several(self, gpus: tuple[GpuRow, ...], cuda: CudaMem | None, width: int) -> list[Text]:
        st = self.styles
        name_w = max(4, min(18, max(len(g.short_name) for g in gpus)))
        lines = [self.util_line(gpus[0], width, prefix=f"{gpus[0].label} ")]
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"{'#':<2} {'name':<{name_w}} {'util':>4}  {'memory GiB':<24}  {'power W':>9} {'temp':>5} {'SM MHz':>6}",
                    st["heading"])
        lines.append(head)
        for g in gpus:
            row = Text(no_wrap=True, overflow="ellipsis")
            row.append(f"{g.index if g.index is not None else '?':<2} ", st["label"])
            row.append(f"{g.short_name[:name_w]:<{name_w}} ", st["name"])
            row.append(fmt.pct(g.util).rjust(4), st["value"]).append("  ")
            row.append_text(self.mem_bar(g.used, g.total, cuda if g is gpus[0] else None, 10))
            row.append(f" {fmt.gib(g.used)}/{fmt.gib(g.total)}".ljust(14), st["value"])
            row.append(of(g.power, g.power_limit).rjust(9), st["value"])
            row.append(fmt.num(g.temp, "°C").rjust(6), st["value"])
            row.append(fmt.num(g.clock).rjust(7), st["value"])
            throttle = self.throttle_text(g, short=True)
            if throttle.cell_len:
                row.append("  ").append_text(throttle)
            lines.append(row)
        if cuda is not None:
            line = Text("allocator ", st["label"], no_wrap=True, overflow="ellipsis")
            line.append(fmt.nbytes(cuda.allocated), st["value"]).append(" allocated · ", st["label"])
            line.append(fmt.nbytes(cuda.reserved), st["value"]).append(" reserved · ", st["label"])
            lines += self.cuda_lines(cuda, width, line)
        return lines

    def lines(self, width: int) -> list[Text]:
        st, info = self.styles, self.info
        if info is None or (not info.gpus and info.no_gpu is None):
            return [Text("waiting for device telemetry…", st["label"])]
        if not info.gpus:
            assert info.no_gpu is not None
            return [Text(part, st["warn"], no_wrap=True, overflow="ellipsis")
                    for part in textwrap.wrap(no_gpu_text(info.no_gpu), max(20, width)) or [""]]
        if len(info.gpus) == 1:
            return self.single(info.gpus[0], info.cuda, width)
        return self.several(info.gpus, info.cuda, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for line in self.lines(width):
            line.truncate(width, overflow="ellipsis")
            yield from line.render(console)
            yield Segment.line()


def of(value: Num, limit: Num, unit: str = "") -> str:
    """``412/700 W``; ``412 W`` without a limit; "n/a" when the value is unknown."""
    if value is None:
        return fmt.NA
    return f"{fmt.num(value)}/{fmt.num(limit)}{unit}" if limit is not None else f"{fmt.num(value)}{unit}"


def pcie(kbs: Num) -> str:
    """NVML PCIe throughput (KB/s) as MB/s or GB/s."""
    if kbs is None:
        return fmt.NA
    mbs = kbs / 1000.0
    return f"{mbs / 1000.0:.1f} GB/s" if mbs >= 1000 else f"{mbs:.0f} MB/s"


class DevicePanel(LinesPanel):
    """GPU telemetry; ``info`` is its state."""

    COMPONENT_CLASSES = {
        "device--label", "device--value", "device--name", "device--heading", "device--chart", "device--span",
        "device--alloc", "device--reserved", "device--other", "device--free", "device--warn", "device--bad",
    }

    info: reactive[DeviceInfo | None] = reactive(None)
    VIEW = DeviceView
