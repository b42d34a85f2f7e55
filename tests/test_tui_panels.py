"""Pilot tests of the device, host, model, ops and findings panels, the views and the command keys."""

from __future__ import annotations

import dataclasses
import io
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tui_fixtures import (
    ARGV,
    GIB,
    H100,
    NO_GPU_REASON,
    START,
    loaded,
    panel_steps,
    profile_msg,
    screen_text,
    wait_until,
    write_recording,
)

from perfmon import protocol
from perfmon.analysis.rules import Config, evaluate_once
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command
from perfmon.monitor.sources import ReplaySource, Source
from perfmon.recording import RecordingReader
from perfmon.tui.app import NOT_CONNECTED, PerfmonApp
from perfmon.tui.widgets import fmt
from perfmon.tui.widgets.charts import SPANS
from perfmon.tui.widgets.device import DevicePanel
from perfmon.tui.widgets.findings import FindingsPanel, FindingsSummary
from perfmon.tui.widgets.host import HostPanel
from perfmon.tui.widgets.logpanel import LogPanel
from perfmon.tui.widgets.model import ModelPanel
from perfmon.tui.widgets.ops import EMPTY, SORTS, OpsPanel
from perfmon.tui.widgets.phases import PhasesPanel
from perfmon.tui.widgets.views import VIEWS

ROOT = Path(__file__).resolve().parent.parent
CLOCK = START + 150.0


def make_app(tmp_path: Path, rules: Config | None = None, **kw: Any) -> PerfmonApp:
    run_dir = write_recording(tmp_path / "run", **kw)
    app = PerfmonApp(RunState(), ReplaySource(run_dir), run_dir, rules=rules)
    app.clock = lambda: CLOCK
    return app


class RecordingSource(Source):
    """Test double for a live source: a recording's messages, then whatever the test injects.

    ``send`` records the commands (False once ``connected`` is cleared); ``reply`` pushes the agent's
    ``command_result`` event for a command.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.sent: list[Command] = []
        self.connected = True
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._closed = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        yield from RecordingReader(self.run_dir / "events.jsonl").read_new()
        while not self._closed.is_set():
            try:
                yield self._queue.get(timeout=0.02)
            except queue.Empty:
                continue

    def push(self, msg: dict[str, Any]) -> None:
        self._queue.put(msg)

    def reply(self, name: str, id: int, **fields: Any) -> None:
        self.push(protocol.message("event", kind="command_result", name=name, id=id, **fields))

    def send(self, command: Command) -> bool:
        if not self.connected:
            return False
        self.sent.append(command)
        return True

    def close(self) -> None:
        self._closed.set()


def live_app(tmp_path: Path, **kw: Any) -> tuple[PerfmonApp, RecordingSource]:
    run_dir = write_recording(tmp_path / "run", exit=None, **kw)
    source = RecordingSource(run_dir)
    app = PerfmonApp(RunState(), source, run_dir)
    app.clock = lambda: CLOCK
    return app, source


async def live_loaded(pilot: Any, steps: int = 3000) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.state.steps >= steps
                     and panel_steps(app.query_one(PhasesPanel).info, app.state) >= steps)


def toasts(app: PerfmonApp) -> list[tuple[str, str]]:
    """(message, severity) of the notifications on show."""
    return [(n.message, n.severity) for n in app._notifications]


def shown(app: PerfmonApp, widget_id: str) -> bool:
    """The widget is laid out on screen (its view shows it)."""
    widget = app.query_one(f"#{widget_id}")
    return widget.display and widget.region.area > 0 and all(a.display for a in widget.ancestors_with_self
                                                              if hasattr(a, "display"))


# -- device ------------------------------------------------------------------------------------
async def test_device_one_gpu(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        g, cm = app.state.gpus[0], app.state.cuda_mem
        text = screen_text(app)
        assert f"GPU0 {H100}" in text
        assert f"util  {fmt.pct(g.util_gpu):>4}" in text
        assert f"{fmt.gib(g.mem_used_bytes)}/79.6 GiB" in text
        assert f"alloc {fmt.nbytes(cm.allocated_bytes)}" in text
        assert f"reserved {fmt.nbytes(cm.reserved_bytes)}" in text
        assert "peak alloc 52.1 GiB · reserved 54.4 GiB · retries 0 · OOMs 0" in text
        assert f"power {g.power_w:.0f}/700 W · temp {g.temp_c}°C · SM 1980/1980 MHz" in text
        assert "PCIe  ↓3.4 GB/s" in text
        assert "throttled" not in text
        info = app.query_one(DevicePanel).info
        assert info.series == tuple(app.state.series["gpu_util"].values(60.0)) and len(info.series) > 30
        header = text.splitlines()[:4]
        assert f"pid 4242 · {H100}" in header[2]
        assert header[3].startswith(f" GPU {fmt.pct(g.util_gpu)} mem 47.6/79.6G")


async def test_device_several_gpus(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu", gpus=4)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        text = screen_text(app)
        assert f"4× {H100}" in text and " 4 GPUs " in text
        assert re.search(r"#\s+name\s+util\s+memory GiB\s+power W\s+temp\s+SM MHz", text)
        for g in app.state.gpus:
            row = re.search(rf"│ {g.index}\s+H100 80GB HBM3\s+(\d+)%\s+\S+ ([\d.]+)/79.6\s+"
                            rf"(\d+)/700\s+(\d+)°C\s+1980", text)
            assert row, g.index
            assert int(row[1]) == g.util_gpu and row[2] == fmt.gib(g.mem_used_bytes)
            assert int(row[3]) == round(g.power_w) and int(row[4]) == g.temp_c
        assert "allocator 4" in text and "allocated" in text


async def test_device_throttled(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu", throttled=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        text = screen_text(app)
        assert "⚠ throttled: sw_power_cap, sw_thermal" in text
        assert "power 699/700 W · temp 83°C · SM 1590/1980 MHz" in text
        assert "⚠ throttled" in text.splitlines()[3]  # the vital signs, on every view
        assert "throttling" in [r.id for r in app.findings.rows]


async def test_device_na_values(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu", na=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        text = screen_text(app)
        assert "util   n/a" in text
        assert "power n/a · temp n/a · SM n/a" in text
        assert "PCIe  ↓n/a ↑n/a · mem io n/a · this process n/a" in text
        assert "47.6/79.6 GiB" in text  # what is known is still shown
        assert text.splitlines()[3].startswith(" GPU n/a mem 47.6/79.6G")


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_no_gpu_says_why(tmp_path: Path, size: tuple[int, int]) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        text = screen_text(app)
        assert f"No GPU: {NO_GPU_REASON} — showing CPU data" in text
        assert "CPU only — no GPU" in text and "no GPU │" in text
        assert "trainer" in text  # the CPU data is there


# -- host --------------------------------------------------------------------------------------
async def test_host_panel_cpu_run(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        h = app.state.host
        text = screen_text(app)
        assert f"CPU   trainer {fmt.pct(h.cpu_percent):>4}" in text
        assert f"system {fmt.pct(h.system_cpu_percent)} of 2 CPUs · load 2.16" in text
        peak = fmt.nbytes(app.state.peaks.rss_bytes)
        assert f"RSS   trainer {fmt.nbytes(h.rss_bytes)} · peak {peak} · threads 5" in text
        assert "no DataLoader workers · read n/a" in text
        assert "1.31/23.5 GiB · avail 21.9 GiB · swap 0 B" in text
        assert app.query_one(HostPanel).info.series == tuple(app.state.series["cpu"].values(60.0))


async def test_host_panel_workers(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        h = app.state.host
        text = screen_text(app)
        assert f"8 workers 9.80 GiB · CPU {fmt.pct(h.workers_cpu_percent)} · read" in text
        assert "of 32 CPUs" in text and "61.3/504 GiB" in text


# -- model -------------------------------------------------------------------------------------
async def test_model_with_budget(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("3")
        budget, flops = app.state.memory_budget(), app.state.flops()
        text = screen_text(app)
        assert "params   124M · trainable 124M · frozen 0 · float32 124M" in text
        assert "GPT2LMHeadModel · optimizer AdamW (fused, 148 tensors)" in text
        assert "static   1.85 GiB = params 475 MiB + grads 475 MiB + optimizer 949 MiB" in text
        assert f"budget   peak 52.1 GiB · activations {fmt.nbytes(budget.activation_bytes)}" in text
        assert f"{fmt.nbytes(budget.per_sample_bytes)}/sample" in text
        assert f"batch 32 → the largest that fits ≈{budget.max_batch} · margin {fmt.share(budget.margin)}" \
            in text
        achieved = fmt.flops_rate(flops.achieved_flops)
        assert f"FLOPs    12.2T/step · achieved {achieved} · MFU {fmt.share(flops.mfu)}" in text
        assert "of peak 989 TFLOP/s (NVIDIA H100 80GB HBM3 dense bf16)" in text
        assert f"MFU {fmt.share(flops.mfu)}" in text.splitlines()[3]  # the vital signs


async def test_the_budget_margin_is_bad_below_what_the_memory_pressure_rule_leaves(tmp_path: Path) -> None:
    """The margin turns bad where ``--rules``' memory_pressure would warn, not at a number of its own."""
    from rich.style import Style

    from perfmon.tui.widgets.model import ModelInfo, ModelView

    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        margin = app.state.memory_budget().margin
        assert margin is not None and 0.02 < margin < 0.98
        names = ("label", "value", "muted", "good", "bad", "static", "activation", "free")
        styles = {name: Style(color=f"color({i})") for i, name in enumerate(names)}

        def margin_style(memory_pressure: float) -> str:
            info = ModelInfo.from_state(app.state, memory_pressure)
            for line in ModelView(info, styles).budget_lines(80):
                text = line.plain
                at = text.find(fmt.share(margin), text.find("margin "))
                if "margin " in text and at >= 0:
                    return next(name for name, style in styles.items()
                                if any(sp.start <= at < sp.end and sp.style == style for sp in line.spans))
            raise AssertionError("no margin shown")

        assert margin_style(1.0 - margin + 0.01) == "value"  # the rule would not warn yet
        assert margin_style(1.0 - margin - 0.01) == "bad"


async def test_window_peaks_in_device_and_budget(tmp_path: Path) -> None:
    """With window peaks the budget uses the steady per-step peak, not the start-up spike."""
    app = make_app(tmp_path, device="gpu", window_peaks=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("2")
        last = app.state.cuda_mem.window_peak_allocated_bytes
        assert f"peak alloc 52.1 GiB (last window {fmt.nbytes(last)}) · reserved 54.4 GiB" in screen_text(app)
        await pilot.press("3")
        budget = app.state.memory_budget()
        assert budget.peak_source == "steady state" and budget.peak_bytes == int(45.9 * GIB)
        assert budget.activation_bytes == int(45.9 * GIB) - 16 * 124_439_808
        assert f"budget   step peak {fmt.nbytes(budget.peak_bytes)} · activations" in screen_text(app)


async def test_model_without_budget(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("3")
        text = screen_text(app)
        assert "params   1.31M · trainable 1.31M · frozen 0 · float32 1.31M" in text
        assert "budget   n/a: CPU run: no allocator statistics" in text
        assert "FLOPs    470M/step" in text and "MFU n/a" in text
        assert "CPU run: MFU needs --peak-tflops" in text
        assert "loader   batch 64, 0 workers, no pin_memory, SyntheticDataset" in text


async def test_model_waiting(tmp_path: Path) -> None:
    app = make_app(tmp_path, model=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("3")
        assert "waiting for model facts" in screen_text(app)
        assert app.query_one(ModelPanel).info.has_model is False


# -- ops ---------------------------------------------------------------------------------------
async def test_ops_empty(tmp_path: Path) -> None:
    app = make_app(tmp_path, profile=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("4")
        assert EMPTY in screen_text(app) and EMPTY == "no profiler window yet — p captures one (a live job)"


async def test_ops_filled_and_sort_cycles(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("4")
        panel = app.query_one(OpsPanel)
        prof = app.state.profiles[-1]
        age = fmt.ago(CLOCK - prof.t)
        text = screen_text(app)
        assert f"window: step {fmt.count(prof.step)} · 3 steps · on demand · cpu · {age} · sort: self time (s)" in text
        assert f"syncs/step n/a (CPU run) · device busy n/a · 155 ops, top {len(prof.top_ops)} kept · trace gpu-box-07" in text
        for label, key in [*SORTS, SORTS[0]]:
            assert panel.info.sort == label
            want = sorted(prof.top_ops, key=lambda op: (getattr(op, key), op.self_ms), reverse=True)
            assert [r.name for r in panel.info.rows] == [op.name for op in want]
            text = screen_text(app)
            assert f"sort: {label} (s)" in text
            names = [line.split()[1] for line in text.splitlines() if line.startswith("│ aten::")]
            assert names == [op.name for op in want]
            await pilot.press("s")
        assert "aten::mm" in text and "1.21G" in text  # FLOPs of the mm rows


async def test_s_only_sorts_in_ops_view(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("s")
        assert app.query_one(OpsPanel).sort_index == 0
        assert " s Sort" not in screen_text(app)
        await pilot.press("4")
        assert " s Sort" in screen_text(app)


async def test_ops_capturing_marker(tmp_path: Path) -> None:
    app, source = live_app(tmp_path, capturing=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await live_loaded(pilot)
        await wait_until(pilot, lambda: app.state.profiling is not None)
        assert app.query_one(OpsPanel).info is None  # a hidden view's panel is not derived
        await pilot.press("4")
        await wait_until(pilot, lambda: app.query_one(OpsPanel).info.capturing is not None)
        text = screen_text(app)
        assert f"● capturing a profiler window (from step {fmt.count(app.state.profiling.step)})…" in text
        assert "last window: step 2,800" in text
        assert "4 ops ●" in text  # the view bar, on every view
        source.push(protocol.message("profile", **profile_msg(app.run_dir, False, 3000, CLOCK - 2)))
        await wait_until(pilot, lambda: app.query_one(OpsPanel).info.capturing is None)
        text = screen_text(app)
        assert "capturing" not in text and "window: step 3,000" in text and "2s ago" in text


# -- findings ----------------------------------------------------------------------------------
async def test_findings_expand_with_enter(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        expected = evaluate_once(app.state)
        assert [r.id for r in app.findings.rows] == [f.id for f in expected]
        await pilot.press("5")
        panel = app.query_one(FindingsPanel)
        assert app.focused is panel.list
        text = screen_text(app)
        first, second = expected[0], expected[1]
        assert "▸ ▲ critical Input-bound: " in text and first.id == "input-bound"
        assert "fix" not in text and "data_share" not in text
        await pilot.press("enter")
        text = screen_text(app)
        assert f"▾ ▲ critical {first.title}" in text
        assert re.search(r"data_share\s+\d+%", text)
        assert "raise DataLoader(num_workers=8) towards 16" in text
        assert f"rule         {first.id}" in text or re.search(rf"rule\s+{first.id}", text)
        await pilot.press("down", "enter")
        text = screen_text(app)
        assert f"▾ ▲ {second.severity:<9}{second.title}" in text
        assert panel.expanded == {first.id, second.id}
        await pilot.press("up", "enter")
        assert panel.expanded == {second.id}
        assert f"▸ ▲ critical {first.title}" in screen_text(app)


async def test_findings_open_on_the_worst_unless_the_cursor_is_in_use(tmp_path: Path) -> None:
    """A critical finding that came above the one first listed, while another view showed: the findings view
    opened with the cursor on the row below it (Enter opened the info one). It opens on the worst; while the list
    is read, the cursor stays on its finding."""
    from perfmon.tui.widgets.findings import FindingRow, FindingsInfo

    def row(id_: str, severity: str) -> FindingRow:
        return FindingRow(id_, severity, id_, (), "fix", 0.0)

    low, crit, warn = row("priority", "info"), row("cpu-contention", "critical"), row("step-instability", "warn")
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        panel = app.query_one(FindingsPanel)
        app.update_findings = lambda: None  # type: ignore[method-assign]  # the engine's rows stay out of the way
        panel.info = FindingsInfo(rows=(low,), evaluated=True)
        panel.info = FindingsInfo(rows=(crit, low), evaluated=True)  # while the overview shows
        await pilot.pause()
        assert panel.list.highlighted == 0
        panel.list.focus()
        await pilot.pause()
        panel.list.highlighted = 1  # the reader moved to the info one
        panel.info = FindingsInfo(rows=(crit, warn, low), evaluated=True)
        await pilot.pause()
        assert panel.list.highlighted_option.id == "priority"


async def test_header_badge_and_summary(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu", throttled=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        n = len(app.findings.rows)
        assert n >= 3
        line2 = screen_text(app).splitlines()[1]
        assert line2.rstrip().endswith(f"▲ critical: input-bound +{n - 1}")
        summary = app.query_one(FindingsSummary)
        assert shown(app, "summary") and summary.info is app.findings
        text = screen_text(app)
        assert f"… {n - 2} more: press 5" in text
        assert f"5 findings {n}" in text
    app = make_app(tmp_path / "small", device="gpu", throttled=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        line2 = screen_text(app).splitlines()[1]
        assert "elapsed 0:02:02" in line2 and line2.rstrip().endswith(f"▲ input-bound +{n - 1}")


async def test_no_findings_no_badge(tmp_path: Path) -> None:
    app = make_app(tmp_path, steps=15)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        assert app.findings.rows == () and "▲" not in screen_text(app)
        await pilot.press("5")
        # the recording is over: no more steps will come for the rules to judge
        assert "no findings: the run had too few steps past warm-up for the rules" in screen_text(app)


async def test_rules_config(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu", rules=Config(disabled=("input-bound", "host-sync")))
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        ids = [r.id for r in app.findings.rows]
        assert "input-bound" not in ids and "host-sync" not in ids and ids
        assert "input-bound" not in screen_text(app)


async def test_live_findings_come_from_the_engine(tmp_path: Path) -> None:
    app, _ = live_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await live_loaded(pilot)
        assert not app.stream_ended
        await wait_until(pilot, lambda: app.findings is not None and app.findings.rows, timeout=15)  # hysteresis
        assert [r.id for r in app.findings.rows] == [f.id for f in app.engine.active]
        assert "▲ critical: input-bound" in screen_text(app)


# -- commands ----------------------------------------------------------------------------------
async def test_p_sends_profile_and_results_are_toasts(tmp_path: Path) -> None:
    app, source = live_app(tmp_path, profile=False)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await live_loaded(pilot)
        await pilot.press("p")
        assert source.sent == [Command("profile", id=1)]
        assert app.view == "ops" and EMPTY in screen_text(app)
        source.reply("profile", 1, ok=True, done=False, message="profile: starts at the next step boundary")
        source.push(protocol.message("event", kind="profile_started", reason="on demand", steps=5, t=CLOCK - 3))
        await wait_until(pilot, lambda: "● capturing a profiler window" in screen_text(app))
        # the ops view shows the capture itself: no toast over its table for the acknowledgement
        assert toasts(app) == []
        source.push(protocol.message("profile", **profile_msg(app.run_dir, False, 3000, CLOCK - 1)))
        source.reply("profile", 1, ok=True, done=True, message="profile ready: 12 top ops", trace="x.json")
        await wait_until(pilot, lambda: ("profile ready: 12 top ops", "information") in toasts(app))
        text = screen_text(app)
        assert "aten::addmm" in text and "capturing" not in text
        await wait_until(pilot, lambda: "profile ready: 12 top ops" in screen_text(app))  # the toast is on screen
        await wait_until(pilot, lambda: toasts(app) == [])  # and gone again after a short while


async def test_the_agents_warnings_are_toasted_and_stay_in_the_output_panel(tmp_path: Path) -> None:
    """What the agent warns about (a buffer that overflowed, ranks it does not follow, a recording it cannot write)
    reaches the dashboard: a toast, and a line of the output panel that stays; each once."""
    app, source = live_app(tmp_path)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await live_loaded(pilot)
        text = "torch.distributed: this process is rank 0 of 2, and perfmon follows this process only"
        source.push(protocol.message("event", kind="warning", message=text, t=CLOCK))
        await wait_until(pilot, lambda: (text, "warning") in toasts(app))
        lines = app.query_one(LogPanel).log_widget.lines
        assert [line for line in lines if "[perfmon]" in line] == [f"[perfmon] warning: {text}"]
        second = "cannot write the recording: [Errno 28] No space left on device; use `perfmon torchrun SCRIPT [ARGS]`"
        source.push(protocol.message("event", kind="warning", message=second, t=CLOCK))
        await wait_until(pilot, lambda: (second, "warning") in toasts(app))
        await wait_until(pilot, lambda: "[Errno 28] No space left" in screen_text(app))  # text, not markup
        assert "SCRIPT [ARGS]" in screen_text(app)
        assert [line for line in lines if "[perfmon]" in line] == [f"[perfmon] warning: {text}",
                                                                    f"[perfmon] warning: {second}"]


async def test_e_exports_a_replayed_window_but_no_command_reaches_a_job(tmp_path: Path) -> None:
    """A replay has no job to command (p, c, f, m do nothing), but e is the monitor's own: it writes the window."""
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await loaded(pilot)
        await pilot.press("4", "p", "c", "e")
        assert app.commands_sent == []
        await wait_until(pilot, lambda: any(t.startswith("exported ") for t, _ in toasts(app)))
        exported = next(t for t, _ in toasts(app) if t.startswith("exported "))
        assert "window at step" in Path(exported.removeprefix("exported ")).read_text()


async def test_c_on_cpu_run_shows_the_agents_answer(tmp_path: Path) -> None:
    app, source = live_app(tmp_path)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await live_loaded(pilot)
        await pilot.press("c")
        assert source.sent == [Command("empty_cache", id=1)]
        source.reply("empty_cache", 1, ok=True, done=True, message="no CUDA device: nothing to free")
        await wait_until(pilot, lambda: ("no CUDA device: nothing to free", "information") in toasts(app))
        await wait_until(pilot, lambda: "no CUDA device: nothing to free" in screen_text(app))
        assert [n.title for n in app._notifications] == ["free CUDA cache"]  # the key's words, not the wire id


@pytest.mark.parametrize("device", ["cpu", "gpu"])
async def test_footer_offers_the_command_keys_that_act_on_this_job(tmp_path: Path, device: str) -> None:
    """p and f on every running job; c and m where it has a CUDA device (the footer showed only p). On a CPU job
    c and m are off the footer, not off the keyboard: the job answers them."""
    app, source = live_app(tmp_path, device=device)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await live_loaded(pilot)
        await wait_until(pilot, lambda: "f FLOPs" in screen_text(app).splitlines()[-1])
        footer = screen_text(app).splitlines()[-1]
        assert "p Profile" in footer and "d Detach" in footer and "? Help" in footer, footer
        assert ("c Free cache" in footer and "m Snapshot" in footer) == (device == "gpu"), footer
        await pilot.press("c", "m")
        assert source.sent == [Command("empty_cache", id=1), Command("memory_snapshot", id=2)]
        await pilot.press("question_mark")
        assert "not in a replay" not in screen_text(app)  # nothing listed as needing a running job: it runs


async def test_command_keys_names_ids_and_failures(tmp_path: Path) -> None:
    app, source = live_app(tmp_path)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await live_loaded(pilot)
        await pilot.press("p", "c", "f", "m", "e")
        assert source.sent == [
            Command("profile", id=1), Command("empty_cache", id=2), Command("count_flops", id=3),
            Command("memory_snapshot", id=4),
        ]  # e is the monitor's own: it writes the analysed window it holds, the job is not asked
        assert app.view == "model"  # f shows where the FLOPs will appear
        exported = [t for t, _ in toasts(app) if t.startswith("exported ")]
        assert len(exported) == 1
        table = Path(exported[0].removeprefix("exported ")).read_text()
        assert table.count("aten::") >= 3 and "window at step" in table
        source.reply("memory_snapshot", 4, ok=False, done=True, message="memory snapshot: n/a (no CUDA device)")
        await wait_until(pilot, lambda: ("memory snapshot: n/a (no CUDA device)", "error") in toasts(app))
        source.push(protocol.message("event", kind="command_result", ok=False, error="command 'x' is not allowed"))
        await wait_until(pilot, lambda: ("command 'x' is not allowed", "error") in toasts(app))
        source.connected = False
        await pilot.press("p")
        assert len(source.sent) == 4
        assert (NOT_CONNECTED, "warning") in toasts(app)


async def test_commands_and_detach_are_not_offered_on_a_recording(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await loaded(pilot)
        footer = screen_text(app).splitlines()[-1]
        assert "Profile" not in footer and "Detach" not in footer and "Quit" in footer
        await pilot.press("p", "d", "c")
        assert app.commands_sent == [] and app.view == "overview" and app.is_running
        # the keys that act on a running job say there is none; d (no job to leave running) stays quiet
        assert [(text.split(";")[0], severity) for text, severity in toasts(app)] == [
            ("p: no running job here (it ended)", "warning"), ("c: no running job here (it ended)", "warning")]


# -- views, keys, layout -----------------------------------------------------------------------
async def test_span_key_applies_to_every_sparkline(tmp_path: Path) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("t")
        label, seconds = SPANS[1]
        device, host = app.query_one(DevicePanel).info, app.query_one(HostPanel).info
        assert device.span == host.span == label == "10 min"
        assert device.series == tuple(app.state.series["gpu_util"].values(seconds))
        assert host.series == tuple(app.state.series["cpu"].values(seconds))
        assert len(device.series) > 60  # the fixture runs for two minutes
        text = screen_text(app)
        assert text.count("last 10 min") >= 3 and "span 10 min" in text


PANELS = {"overview": {"phases", "log"}, "device": {"device", "host"}, "model": {"model"}, "ops": {"ops"},
          "findings": {"findings"}, "output": {"log"}}
ALL = {"phases", "device", "host", "model", "ops", "summary", "findings", "log"}


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_every_view_by_number_key(tmp_path: Path, size: tuple[int, int]) -> None:
    app = make_app(tmp_path, device="gpu")
    async with app.run_test(size=size) as pilot:
        await loaded(pilot)
        for key, (view, _) in enumerate(VIEWS, 1):
            await pilot.press(str(key))
            await pilot.pause()
            assert app.view == view
            visible = {p for p in ALL if shown(app, p)}
            assert PANELS[view] <= visible, view
            text = screen_text(app)
            lines = text.splitlines()
            assert len(lines) == size[1]
            assert " ".join(ARGV) in lines[0] and "step 3,000" in lines[1] and "MFU" in lines[3]  # header
            assert re.search(rf"\b{key} {view}\b", lines[4])  # the view bar
            assert "q Quit" in lines[-1] and "? Help" in lines[-1] and "1-6 View" in lines[-1]  # the footer
        if size == (120, 40):
            await pilot.press("1")
            await pilot.pause()
            assert {p for p in ALL if shown(app, p)} == {"phases", "device", "host", "summary", "log"}
            await pilot.press("2")
            await pilot.pause()
            assert shown(app, "model")  # tall enough: the device view has the model too
        else:
            await pilot.press("1")
            await pilot.pause()
            assert {p for p in ALL if shown(app, p)} == {"phases", "log"}


@pytest.mark.parametrize("captured", [True, False])
async def test_an_output_panel_without_output_files_says_why(tmp_path: Path, captured: bool) -> None:
    """Attached to a perfmon.instrument() run, whose output goes to its own terminal, the panel was silently
    empty, as if the script printed nothing."""
    from perfmon.tui.workers import NOT_CAPTURED

    app = make_app(tmp_path, output=captured)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        await pilot.press("6")
        log = app.query_one(LogPanel).log_widget
        if captured:
            await wait_until(pilot, lambda: "training done" in log.lines)
            assert NOT_CAPTURED not in log.lines
        else:
            await wait_until(pilot, lambda: NOT_CAPTURED in log.lines)
            assert "is not captured in this run" in screen_text(app)


async def test_view_focus_and_log_tail(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot)
        log = app.query_one(LogPanel).log_widget
        assert app.focused is log and log.scroll_y == log.max_scroll_y  # the tail, below the new panels
        await pilot.press("5")
        assert app.focused is app.query_one(FindingsPanel).list
        await pilot.press("6")
        await pilot.pause()
        assert app.focused is log
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y)
        assert "training done" in screen_text(app)


async def test_help_lists_every_key(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("question_mark")
        text = screen_text(app)
        for key, words in (("1 … 6", "overview, device, model, ops, findings, output"), ("p", "profiler window"),
                           ("c", "CUDA caching allocator"), ("f", "FLOPs"), ("m", "memory snapshot"),
                           ("e", "export"), ("s", "sort"), ("t", "chart span"), ("Enter", "evidence and fix"),
                           ("d", "detach"), ("?", "this help")):
            assert re.search(rf"(^|\s){re.escape(key)}\s{{2,}}[^│█]*{words}", text, re.M), key
        assert "esc, ? or q closes this help" in text  # it fits in 80x24
        await pilot.press("4")  # the dashboard's keys wait under the dialog
        assert app.view == "overview"


# -- the real thing ----------------------------------------------------------------------------
@pytest.mark.e2e
async def test_end_to_end_profile_and_empty_cache(tmp_path: Path) -> None:
    from perfmon.monitor.headless import connect
    from perfmon.monitor.launch import Target, TrainingProcess

    proc = TrainingProcess(Target(script=str(ROOT / "demos" / "train_mlp.py"), module=None,
                                  args=["--steps", "100000"]), tmp_path / "run").start()
    try:
        source = connect(proc)
        app = PerfmonApp(RunState(), source, proc.run_dir, proc)
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            await wait_until(pilot, lambda: app.state.steps >= 3, timeout=60)
            await pilot.press("p")
            assert app.commands_sent == [Command("profile", id=1)] and app.view == "ops"

            def has_mm() -> bool:
                text = screen_text(app)
                return "aten::addmm" in text or "aten::mm" in text

            await wait_until(pilot, has_mm, timeout=60)
            # awaited here, not asserted later: a toast times out, and on a loaded machine the next one may come
            # seconds after it
            await wait_until(pilot, lambda: any("profile ready" in m for m, _ in toasts(app)), timeout=30)
            await pilot.press("c")
            await wait_until(pilot, lambda: any(m == "no CUDA device: nothing to free" for m, _ in toasts(app)),
                             timeout=30)
            await wait_until(pilot, lambda: "no CUDA device: nothing to free" in screen_text(app))
    finally:
        proc.stop()
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.stop()
        proc.wait()


def test_a_ranking_in_evidence_reads_as_a_ranked_list():
    from perfmon.tui.widgets.findings import evidence_value

    text = evidence_value("share_by_phase", {"optimizer": 0.5081, "backward": 0.203, "other": 0.1})
    assert text == "1. optimizer 51% · 2. backward 20% · 3. other 10%"


def test_cpu_percents_in_evidence_say_they_are_of_one_cpu():
    """cpu-contention's evidence showed "wait_share 53%" beside "trainer_wait_percent 100" (of one CPU: the
    trainer waited as long as a whole CPU would run), which read as a contradiction."""
    from perfmon.tui.widgets.findings import evidence_value

    assert [evidence_value(k, v) for k, v in (("wait_share", 0.53), ("trainer_wait_percent", 100.0),
                                              ("trainer_cpu_percent", 145.8), ("system_cpu_percent", 95.0))] == [
        "53%", "100% of a CPU", "146% of a CPU", "95% of the host"]


def test_ops_view_of_a_gpu_window_analysed_from_its_trace(tmp_path: Path) -> None:
    """A real A100 DDP trace, summarised as the monitor summarises a live window: ops by the device time of
    their kernels (no inclusive-time or FLOPs columns it cannot fill), the kernels apart, HTA's breakdown."""
    import shutil

    from rich.style import Style

    from perfmon.analysis.profile_window import summarise_window
    from perfmon.analysis.state import RunState
    from perfmon.tui.widgets.ops import OpsInfo, OpsView

    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    trace = traces / "a100_ddp_2rank_rank0.json.gz"
    shutil.copy(Path(__file__).parent / "data" / "gpu-traces" / trace.name, trace)
    state = RunState()
    state.apply(summarise_window({"v": 1, "type": "profile", "step": 40, "active_steps": 3, "reason": "on demand",
                                  "device": "cuda", "trace": str(trace), "t": 100.0}))
    info = OpsInfo.from_state(state, 0, now=103.0)
    assert info.columns == () and info.kernels and info.breakdown is not None
    assert OpsInfo.from_state(state, 1).sort == "calls" and OpsInfo.from_state(state, 2).sort == "self time"
    styles = dict.fromkeys(("label", "value", "name", "heading", "sort", "sorted", "capturing"), Style())
    text = "\n".join(line.plain for line in OpsView(info, styles, 40).lines(120))
    assert "op (device time of its kernels)" in text and "total ms" not in text and "FLOPs" not in text
    assert "aten::convolution_backward" in text.split("kernel ")[0]  # the op table comes first
    kernels = text.split("\nkernel")[1]
    assert "ncclKernel_AllReduce" in kernels and "device ms" in kernels
    assert "syncs/step 8.0 · device busy 22% · compute 17% · comm 25% · overlap 14%" in text


def test_host_view_shows_a_cpu_limit_and_torch_threads_only_when_known() -> None:
    from rich.style import Style

    from perfmon.messages import HostSample
    from perfmon.tui.widgets.host import HostInfo, HostView

    styles = {k: Style() for k in ("label", "value", "chart", "span", "trainer", "used", "free")}

    def text(**host: Any) -> str:
        info = HostInfo(host=HostSample(cpu_count=32, threads=40, **host), series=(), span="60s", peak_rss=None)
        return "\n".join(line.plain for line in HostView(info, styles).lines(120))

    limited = text(usable_cpus=8.0, torch_threads=32)
    assert "of 32 CPUs (8 usable) · load" in limited and "threads 40 · torch 32" in limited
    plain = text(usable_cpus=32.0)  # the whole host, torch not imported yet
    assert "of 32 CPUs · load" in plain and "torch" not in plain


@pytest.mark.parametrize("children, loaders, said", [
    (4, [{"num_workers": 4}], "4 workers"),
    (1, [{"num_workers": 0}], "1 child process"),  # Lightning's second rank, started by the script
    (2, [], "2 child processes"),
    (3, [{"num_workers": 2}], "3 workers and others"),
])
def test_the_host_panel_calls_children_workers_only_where_the_loaders_account_for_them(children, loaders, said):
    from rich.style import Style

    from perfmon.tui.widgets.host import HostInfo, HostView

    st = RunState()
    st.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    st.apply(protocol.message("model", seq=2, loaders=loaders))
    st.apply(protocol.message("sample", seq=3, t=1001.0, host={"cpu_percent": 50.0, "cpu_count": 2,
                                                             "workers": children, "workers_cpu_percent": 80.0}))
    info = HostInfo.from_state(st)
    assert info is not None
    styles = {k: Style() for k in ("label", "value", "chart", "span", "trainer", "used", "free")}
    text = "\n".join(line.plain for line in HostView(info, styles).lines(120))
    assert f" {said} " in text, text


@pytest.mark.parametrize("gap, shown", [
    (0.8, "10.0"),  # the agent's tick: rows come a second late, the job is not quiet
    (4.0, "10.0"),
    (12.0, f"{fmt.DASH} (no step for 0:00:12)"),  # steps/s would have stayed at the last second's 10.0
])
def test_the_header_says_when_the_job_has_gone_quiet_instead_of_its_last_rate(gap, shown):
    from perfmon.tui.widgets.header import HeaderInfo

    st = RunState()
    st.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    rows = [[i, 1000.0 + i / 10, 100.0, 0, 50.0, 40.0, 10.0, 0, 32] for i in range(1, 51)]
    st.apply(protocol.message("steps", fields=list(protocol.STEP_FIELDS), seq=2, rows=rows))
    header = HeaderInfo.from_state(st, now=1005.0 + gap)
    assert header.steps_s == shown and header.samples_s == (fmt.DASH if "no step" in shown else "320")
    st.apply(protocol.message("event", seq=3, kind="exit", code=0, t=1005.0))
    assert HeaderInfo.from_state(st, now=1005.0 + gap).steps_s == "10.0"  # over: its rate stands


def test_one_long_step_does_not_hide_the_job_going_quiet_later():
    """A 12 s step (a pause at an epoch's end) made "quiet" wait for 24 s of no step, however fast the others."""
    st = RunState()
    st.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    rows = [[i, 1000.0 + i / 10 + (12.0 if i > 20 else 0.0), 12000.0 if i == 21 else 100.0, 0, 50.0, 40.0, 10.0, 0,
             32] for i in range(1, 101)]
    st.apply(protocol.message("steps", fields=list(protocol.STEP_FIELDS), seq=2, rows=rows))
    last = rows[-1][1]
    assert st.quiet_for(last + 8.0) == pytest.approx(8.0) and st.quiet_for(last + 3.0) is None


def test_a_quiet_jobs_header_at_80_columns_keeps_its_elapsed_time_over_an_unknown_sample_rate():
    """"steps/s — (no step for 0:00:11)" is long: at 80 columns "samples/s —" (nothing known) gives way, not the
    elapsed time ("elap…")."""
    from collections import defaultdict

    from rich.console import Console
    from rich.style import Style

    from perfmon.tui.widgets.header import HeaderInfo, HeaderView

    st = RunState()
    st.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    rows = [[i, 1000.0 + i / 10, 100.0, 0, 50.0, 40.0, 10.0, 0, 0] for i in range(1, 102)]
    st.apply(protocol.message("steps", fields=list(protocol.STEP_FIELDS), seq=2, rows=rows))

    def second_line(width: int, badge: str) -> str:
        info = dataclasses.replace(HeaderInfo.from_state(st, now=1021.5), badge=badge, badge_kind="warn")
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(HeaderView(info, defaultdict(Style)))
        return console.export_text().splitlines()[1]

    narrow = second_line(80, "▲ cpu-contention")
    assert "(no step for 0:00:11)" in narrow and "elapsed 0:00:21" in narrow and "samples/s" not in narrow
    assert "samples/s —" in second_line(120, "▲ cpu-contention")  # room enough: said as before


def test_an_ended_jobs_header_gives_the_whole_runs_rates_as_its_summary_does():
    """The recent rate stayed in the header after the end: 18.5 steps/s beside the report's 20.51."""
    from perfmon.analysis.report import build_summary
    from perfmon.tui.widgets.header import HeaderInfo

    st = RunState()
    st.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    rows = [[i, 1000.0 + i * (0.1 if i <= 250 else 0.2), 100.0, 0, 50.0, 40.0, 10.0, 0, 32] for i in range(1, 301)]
    st.apply(protocol.message("steps", fields=list(protocol.STEP_FIELDS), seq=2, rows=rows))
    recent = fmt.rate(st.steps_per_s())
    assert HeaderInfo.from_state(st, now=1060.5).steps_s == recent  # live: the recent rate
    st.apply(protocol.message("event", seq=3, kind="exit", code=0, t=1060.5))
    summary = build_summary(st)
    header = HeaderInfo.from_state(st, now=1060.5)
    assert header.steps_s == fmt.rate(summary["steps_per_s"]) != recent
    assert header.samples_s == fmt.rate(summary["samples_per_s"])


@pytest.mark.parametrize("evaluated, ended, stepped, words", [
    (False, False, True, "no findings yet: the rules need a few steps past warm-up"),
    (False, False, False, "no findings yet: the rules need a few steps past warm-up"),
    (True, False, True, "no findings: nothing the rules can name is holding this run back"),
    (True, True, True, "no findings: nothing the rules can name is holding this run back"),
    (False, True, True, "no findings: the run had too few steps past warm-up for the rules that judge steps"),
    (False, True, False, "no findings: the run ended before its first step"),
])
def test_an_empty_findings_list_says_why(evaluated, ended, stepped, words):
    from perfmon.tui.widgets.findings import FindingsInfo

    assert FindingsInfo.from_findings([], evaluated, ended=ended, stepped=stepped).empty_words == words


@pytest.mark.parametrize("low, high, text", [
    (37.3, 84.0, "37.3–84.0 ms"),
    (0.41, 9999.0, "0.41–9999 ms"),
    (8.49, 15_000.0, "8.49 ms–15.0 s"),  # a step of seconds: each end with its unit ("8.49–15.0s ms" before)
    (12_000.0, 150_000.0, "12.0 s–150 s"),
])
def test_the_step_time_range_gives_each_end_its_unit_past_ten_seconds(low, high, text):
    assert fmt.ms_range(low, high) == text


async def test_a_run_that_ended_before_its_first_step_says_so_while_its_stream_stays_open(tmp_path: Path) -> None:
    """A job that failed at once (input() under the dashboard) whose stream is still followed: its exit is known,
    so the findings say the run ended before a step (they said "no findings yet" for good)."""
    run_dir = write_recording(tmp_path / "run", steps=0, exit="failed", profile=False, flops=False)
    app = PerfmonApp(RunState(), ReplaySource(run_dir, follow=True, poll=0.05), run_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.exit is not None)
        await wait_until(pilot, lambda: "the run ended before its first step" in screen_text(app))
        assert not app.stream_ended
