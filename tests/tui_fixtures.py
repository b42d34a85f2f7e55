"""Synthetic but realistic recordings for the dashboard tests (deterministic: stable snapshots)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from perfmon import protocol

if TYPE_CHECKING:
    from textual.pilot import Pilot

    from perfmon.analysis.state import RunState
    from perfmon.tui.app import PerfmonApp
    from perfmon.tui.widgets.phases import PhaseInfo

START = 1_760_000_000.0
STARTUP_S = 3.0
PID = 4242
ARGV = ["train.py", "--lr", "3e-4"]
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/ada/proj/train.py", line 61, in <module>\n'
    "    main()\n"
    '  File "/home/ada/proj/train.py", line 37, in main\n'
    '    raise ValueError("boom")\n'
    "ValueError: boom\n"
)


def step_row(i: int) -> list[float | int]:
    """Step ``i``'s phases (ms): a data-loading slowdown in the second half and periodic spikes."""
    wave = 3.0 * (1 + math.sin(i / 120.0))
    data = 2.0 + (i % 7) * 0.25 + wave + (6.0 if i > 1500 else 0.0) + (40.0 if i % 250 == 0 else 0.0)
    forward = 9.0 + (i % 5) * 0.4
    backward = 16.0 + (i % 3) * 0.8
    optimizer = 3.5
    other = 0.7 + (i % 4) * 0.1
    dur = data + forward + backward + optimizer + other
    return [round(x, 3) for x in (dur, data, forward, backward, optimizer, other)]


GIB = 1 << 30
H100 = "NVIDIA H100 80GB HBM3"
H100_TOTAL = 85_520_809_984  # what NVML reports for an H100 80GB HBM3 (79.6 GiB)
NO_GPU_REASON = "no NVIDIA driver (NVML library not found)"
CPU_OPS = [  # a CPU window of demos/train_mlp.py (3 active steps), as the agent measured it
    ("aten::div", 3, 133.43, 133.49, 0, "[[1024, 1024], []]"),
    ("aten::mm", 9, 71.37, 71.38, 1_207_959_552, "[[1024, 64], [64, 1024]]"),
    ("aten::add_", 9, 51.59, 51.71, 0, "[[1024, 1024], [], []]"),
    ("aten::addmm", 9, 38.12, 41.02, 604_372_992, "[[1024], [64, 1024], [1024, 1024]]"),
    ("aten::sqrt", 3, 24.10, 24.10, 0, "[[1024, 1024]]"),
    ("aten::mul_", 6, 19.84, 19.88, 0, "[[1024, 1024], []]"),
    ("aten::threshold_backward", 6, 6.31, 6.31, 0, "[[64, 1024], [64, 1024], []]"),
    ("aten::lerp_", 3, 5.77, 5.80, 0, "[[1024, 1024], [1024, 1024], []]"),
    ("aten::relu", 6, 2.05, 3.12, 0, "[[64, 1024]]"),
    ("aten::copy_", 12, 1.48, 1.48, 0, "[[64, 256], [64, 256], []]"),
    ("aten::mse_loss", 3, 0.41, 0.72, 0, "[[64, 1], [64, 1]]"),
    ("aten::item", 6, 0.02, 0.09, 0, "[[]]"),
]
GPU_OPS = [  # GPT-2 small, fp32 (no autocast), batch 32 x 512 tokens, 3 active steps (device times)
    ("aten::mm", 432, 38.21, 38.24, 9_278_190_944_256, "[[16384, 768], [768, 3072]]"),
    ("aten::_scaled_dot_product_flash_attention", 36, 14.72, 14.90, 0, "[[32, 12, 512, 64], [32, 12, 512, 64]]"),
    ("aten::addmm", 144, 11.30, 11.52, 2_319_282_339_840, "[[3072], [16384, 768], [768, 3072]]"),
    ("aten::_flash_attention_backward", 36, 9.84, 9.91, 0, "[[32, 12, 512, 64], [32, 12, 512, 64]]"),
    ("aten::native_layer_norm", 75, 4.92, 5.01, 0, "[[32, 512, 768], [768], [768]]"),
    ("aten::gelu", 36, 3.81, 3.81, 0, "[[32, 512, 3072]]"),
    ("aten::_fused_adamw_", 3, 3.12, 3.12, 0, "[[768], [768], [768], [768]]"),
    ("aten::add", 150, 2.93, 2.95, 0, "[[32, 512, 768], [32, 512, 768]]"),
    ("aten::copy_", 96, 2.61, 2.64, 0, "[[32, 512], [32, 512], []]"),
    ("aten::native_dropout", 111, 2.24, 2.30, 0, "[[32, 512, 768], [], []]"),
    ("aten::embedding_dense_backward", 3, 1.72, 1.75, 0, "[[32, 512, 768], [32, 512]]"),
    ("aten::nll_loss_forward", 3, 0.38, 0.40, 0, "[[16384, 50257], [16384]]"),
    ("aten::_local_scalar_dense", 3, 0.01, 0.01, 0, "[[]]"),
]


def _gpu_static(i: int) -> dict[str, object]:
    return {"index": i, "name": H100, "uuid": f"GPU-5b1c2d3e-{i:04d}-4f5a-8b9c-0d1e2f3a4b5c",
            "total_bytes": H100_TOTAL, "power_limit_w": 700.0, "sm_clock_max_mhz": 1980}


def gpu_reading(i: int, k: int, throttled: bool = False, na: bool = False, stall: bool = False) -> dict[str, object]:
    """GPU ``i``'s NVML reading at sample ``k``: an H100 running GPT-2, a dip when the input stalls."""
    wave = math.sin(k / 7.0 + i)
    util = round(90 + 5 * wave - (9 if stall else 0) - 2 * i)
    out: dict[str, object] = {
        **_gpu_static(i),
        "util_gpu": util, "util_mem": round(util * 0.48),
        "mem_used_bytes": int((47.6 + 0.4 * i) * GIB), "proc_mem_bytes": int((47.0 + 0.4 * i) * GIB),
        "power_w": round(560 + 60 * wave - 7 * i, 1), "temp_c": 68 + round(3 * wave) + i,
        "sm_clock_mhz": 1980, "throttle": [], "throttled": [],
        "pcie_tx_kbs": 850_000 + 1000 * (k % 7), "pcie_rx_kbs": 3_400_000 + 10_000 * (k % 5),
    }
    if throttled and i == 0:
        out.update(power_w=699.2, sm_clock_mhz=1590, temp_c=83, throttle=["sw_power_cap", "sw_thermal"],
                   throttled=["sw_power_cap", "sw_thermal"])
    if na:
        out.update({k_: None for k_ in ("util_gpu", "util_mem", "proc_mem_bytes", "power_w", "power_limit_w",
                                         "temp_c", "sm_clock_mhz", "sm_clock_max_mhz", "pcie_tx_kbs", "pcie_rx_kbs")})
    return out


def host_reading(k: int, gpu: bool) -> dict[str, object]:
    """The trainer's host at sample ``k``: a 32-core GPU box with 8 workers, or the 2-core CPU VM."""
    wave = math.sin(k / 5.0)
    if gpu:
        return {"cpu_percent": round(104 + 8 * wave, 1), "rss_bytes": int(6.2 * GIB) + k * 1_048_576,
                "threads": 38, "workers": 8, "workers_cpu_percent": round(610 + 40 * wave, 1),
                "workers_rss_bytes": int(9.8 * GIB), "system_cpu_percent": round(42 + 4 * wave, 1),
                "cpu_count": 32, "mem_used_bytes": int(61.3 * GIB), "mem_total_bytes": int(503.5 * GIB),
                "mem_available_bytes": int(432.1 * GIB), "swap_used_bytes": 0, "load1": 9.71,
                "io_read_bps": 210_000_000 + 1_000_000 * (k % 9)}
    return {"cpu_percent": round(98.5 + 3 * wave, 1), "rss_bytes": 412 * 1_048_576 + k * 65_536, "threads": 5,
            "workers": 0, "workers_cpu_percent": 0.0, "workers_rss_bytes": 0,
            "system_cpu_percent": round(56 + 5 * wave, 1), "cpu_count": 2, "mem_used_bytes": 1_402_000_000,
            "mem_total_bytes": 25_275_973_632, "mem_available_bytes": 23_501_000_000, "swap_used_bytes": 0,
            "load1": 2.16, "io_read_bps": None}


def cuda_reading(k: int, window_peaks: bool = False) -> dict[str, object]:
    alloc = int((41.3 + 2.0 * ((k % 10) / 10.0)) * GIB)
    reserved = int(47.0 * GIB)
    out: dict[str, object] = {"allocated_bytes": alloc, "reserved_bytes": reserved,
                              "peak_allocated_bytes": int(52.1 * GIB), "peak_reserved_bytes": int(54.4 * GIB),
                              "alloc_retries": 0, "ooms": 0, "fragmentation_bytes": reserved - alloc}
    if window_peaks:  # the first windows hold a 52.1 GiB start-up spike; steady steps peak at 45-46 GiB
        out["window_peak_allocated_bytes"] = int(52.1 * GIB) if k <= 2 else int((45.0 + 0.1 * (k % 10)) * GIB)
        out["window_peak_reserved_bytes"] = reserved
    return out


def model_facts(gpu: bool) -> dict[str, object]:
    if gpu:
        params = 124_439_808
        return {"roots": ["GPT2LMHeadModel"], "params": params, "trainable": params, "frozen": 0,
                "by_dtype": {"float32": params}, "param_bytes": 4 * params, "grad_bytes": 4 * params,
                "optimizer_bytes": 8 * params, "static_bytes": 16 * params, "optimizers": ["AdamW"],
                "optimizer_flags": [{"name": "AdamW", "fused": True, "foreach": None, "param_tensors": 148}],
                "loaders": [{"num_workers": 8, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2,
                             "batch_size": 32, "dataset": "TokenDataset"}]}
    params = 1_313_793
    return {"roots": ["Sequential"], "params": params, "trainable": params, "frozen": 0,
            "by_dtype": {"float32": params}, "param_bytes": 4 * params, "grad_bytes": 4 * params,
            "optimizer_bytes": 8 * params, "static_bytes": 16 * params, "optimizers": ["AdamW"],
            "optimizer_flags": [{"name": "AdamW", "fused": None, "foreach": None, "param_tensors": 6}],
            "loaders": [{"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None,
                         "batch_size": 64, "dataset": "SyntheticDataset"}]}


GPU_KERNELS = [  # what those ops ran: FP32 SIMT GEMMs (no autocast), flash attention, elementwise
    ("ampere_sgemm_128x64_nn", 576, 49.51), ("flash_fwd_kernel", 36, 14.72), ("flash_bwd_dq_dk_dv_loop_kernel", 36, 9.84),
    ("vectorized_layer_norm_kernel", 75, 4.92), ("vectorized_elementwise_kernel<GeluCUDAKernelImpl>", 36, 3.81),
    ("multi_tensor_apply_kernel<FusedAdamWMathFunctor>", 3, 3.12), ("Memcpy HtoD (Pinned -> Device)", 96, 2.61),
]


def analysed_gpu_window(run_dir: Path, step: int, t: float) -> dict[str, object]:
    """A GPU window as the monitor summarises it from its trace: ops by their kernels' device time, kernels, the
    HTA breakdown and the trace's findings."""
    total = sum(o[2] for o in GPU_OPS)
    kernel_total = sum(k[2] for k in GPU_KERNELS)
    return {
        "step": step, "active_steps": 3, "reason": "on demand", "device": "cuda", "t": round(t, 6),
        "top_ops": [{"name": n, "calls": c, "kind": "op", "self_ms": s_, "share": round(s_ / total, 4)}
                    for n, c, s_, *_ in GPU_OPS],
        "top_kernels": [{"name": n, "calls": c, "kind": "kernel", "self_ms": ms, "share": round(ms / kernel_total, 4)}
                        for n, c, ms in GPU_KERNELS],
        "ops_total": 212, "syncs_per_step": 1.0, "device_busy": 0.74,
        "breakdown": {"idle": 0.26, "compute": 0.71, "non_compute": 0.03, "communication": 0.0, "memory": 0.035,
                      "comm_compute_overlap": None, "span_ms": 121.4},
        "trace_findings": [{"id": "no-mixed-precision", "severity": "warn",
                            "title": "78% of matrix-multiply/convolution time in FP32 kernels (no tensor cores)",
                            "evidence": {"fp32_share": 0.78, "gemm_ms": 49.51, "top_fp32_kernel": "ampere_sgemm_128x64_nn"},
                            "fix": "Run forward and loss under torch.autocast('cuda', dtype=torch.bfloat16); at least "
                                   "allow TF32 with torch.set_float32_matmul_precision('high')."}],
        "trace": str(run_dir / "traces" / f"gpu-box-07_{PID}.1760000104123456789.pt.trace.json"),
    }


def profile_msg(run_dir: Path, gpu: bool, step: int, t: float) -> dict[str, object]:
    """CPU: a window as an older job summarised it (key_averages columns); GPU: as the monitor analyses one now."""
    if gpu:
        return analysed_gpu_window(run_dir, step, t)
    ops = CPU_OPS
    total_self = sum(o[2] for o in ops)
    top = [{"name": n, "calls": c, "self_ms": s_, "total_ms": tot, "self_cpu_ms": round(s_ * (0.11 if gpu else 1.0), 4),
            "flops": f, "shapes": sh, "share": round(s_ / total_self, 4)} for n, c, s_, tot, f, sh in ops]
    return {"step": step, "active_steps": 3, "reason": "on demand", "device": "cuda" if gpu else "cpu",
            "top_ops": top, "ops_total": 212 if gpu else 155, "syncs_per_step": 1.0 if gpu else 2.0,
            "device_busy": 0.74 if gpu else None, "t": round(t, 6),
            "trace": str(run_dir / "traces" / f"gpu-box-07_{PID}.1760000104123456789.pt.trace.json")}


def write_recording(
    run_dir: Path,
    steps: int = 3000,
    batch: int = 100,
    exit: str | None = "ok",
    output: bool = True,
    samples: int = 32,
    device: str = "cpu",
    gpus: int = 1,
    throttled: bool = False,
    na: bool = False,
    telemetry: bool = True,
    model: bool = True,
    flops: bool = True,
    profile: bool = True,
    capturing: bool = False,
    window_peaks: bool = False,
    rank: int = 0,
    world_size: int | None = None,
    adjust: Callable[[list[float]], list[float]] | None = None,
) -> Path:
    """Write ``run_dir/events.jsonl`` (and ``output.log``); ``exit`` is "ok", "failed" or None (running).

    ``device`` "gpu" is an H100 80GB run (``gpus`` of them, optionally ``throttled`` or with ``na``
    readings); "cpu" is a CPU-only run that says why there is no GPU. ``telemetry`` adds a sample a
    second, ``model`` the model facts (and ``flops`` a FLOP count), ``profile`` a profiler window
    near the end, ``capturing`` a window started after it and not finished; ``window_peaks`` adds
    the allocator's per-sample-window peaks.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    gpu = device == "gpu"
    timed: list[tuple[float, str, dict[str, object]]] = []  # (t, type, fields), sorted by t before writing
    hello: dict[str, object] = dict(
        script="train.py", argv=ARGV, pid=PID, start=START, run_dir=str(run_dir), python="3.11.7",
        torch="2.13.0+cu128" if gpu else "2.13.0+cpu", cuda=gpu, host="gpu-box-07", rank=rank,
    )
    if world_size is not None:
        hello.update(world_size=world_size, local_rank=rank % 4, node=rank // 4, pid=PID + rank,
                     host=f"gpu-box-{7 + rank // 4:02d}")  # four GPUs a node
    if telemetry:
        hello.update(gpus=[_gpu_static(i) for i in range(gpus)] if gpu else [],
                     gpu_reason=None if gpu else NO_GPU_REASON)
        if gpu:
            hello["gpu"] = H100
    log = ["perfmon: recording to " + run_dir.name, "\x1b[1mloading dataset\x1b[0m: 96,000 samples"]
    t = START + STARTUP_S
    rows: list[list[float | int]] = []
    step_t: dict[int, float] = {}
    for i in range(1, steps + 1):
        phases = step_row(i)
        if adjust is not None:
            phases = adjust(phases)
        dur, data, forward, backward, optimizer, other = phases
        t += dur / 1000.0
        step_t[i] = t
        rows.append([i, round(t, 6), dur, data, forward, backward, optimizer, other, samples])
        if len(rows) == batch:
            timed.append((t, "steps", {"fields": list(protocol.STEP_FIELDS), "rows": rows}))
            rows = []
        if i % 250 == 0:
            log.append(f"step {i:5d}  loss {2.5 / (1 + i / 500):.4f}  lr 3.0e-04")
    if rows:
        timed.append((t, "steps", {"fields": list(protocol.STEP_FIELDS), "rows": rows}))
    end = t
    if telemetry:
        half = step_t.get(1500, end)
        k = 0
        ts = START + 1.0
        while ts < end:
            k += 1
            fields: dict[str, object] = {"t": round(ts, 6), "host": host_reading(k, gpu), "sampler_cpu_s": 0.0004,
                                         "interval_s": 1.0}
            fields["gpus"] = [gpu_reading(i, k, throttled, na, stall=ts > half) for i in range(gpus)] if gpu else []
            fields["cuda_mem"] = cuda_reading(k, window_peaks) if gpu else None
            timed.append((ts, "sample", fields))
            ts += 1.0
    if model and steps:
        timed.append((step_t[1] + 0.05, "model", model_facts(gpu)))
        if flops:
            per_step = 6 * 124_439_808 * samples * 512 if gpu else 470_188_032
            timed.append((step_t[1] + 0.06, "model", {"flops_per_step": per_step, "flops_counted_at": step_t[1]}))
    if profile and steps >= 20:
        at = max(1, steps - 200)
        timed.append((step_t[at] + 1e-4, "event", {"kind": "profile_started", "reason": "on demand", "steps": 5,
                                                   "t": round(step_t[at], 6)}))
        timed.append((step_t[at] + 2e-4, "event", {"kind": "window_started", "what": "profile", "t": round(step_t[at], 6)}))
        done = step_t[min(steps, at + 5)]
        timed.append((done + 1e-4, "event", {"kind": "window_stopped", "what": "profile", "t": round(done, 6)}))
        timed.append((done + 0.2, "profile", profile_msg(run_dir, gpu, at, done + 0.2)))
    if capturing and steps:
        timed.append((end - 1e-4, "event", {"kind": "profile_started", "reason": "on demand", "steps": 5,
                                            "t": round(end, 6)}))
    timed.sort(key=lambda x: x[0])
    lines = [protocol.encode(protocol.message("hello", seq=1, **hello))]
    for seq, (_, type_, fields) in enumerate(timed, 2):
        lines.append(protocol.encode(protocol.message(type_, seq=seq, **fields)))
    seq = len(lines)
    if exit == "ok":
        lines.append(protocol.encode(protocol.message(
            "event", seq=seq + 1, kind="exit", code=0, t=round(end + 0.4, 6), agent_errors={})))
        log.append("training done")
    elif exit == "failed":
        lines.append(protocol.encode(protocol.message(
            "event", seq=seq + 1, kind="exit", code=1, exception="ValueError: boom", traceback=TRACEBACK,
            t=round(end + 0.4, 6), agent_errors={},
        )))
        log.extend(TRACEBACK.rstrip("\n").splitlines())
    (run_dir / "events.jsonl").write_bytes(b"".join(lines))
    if output:
        (run_dir / "output.log").write_text("\n".join(log) + "\n")
    return run_dir


def write_job(job_dir: Path, world: int = 4, slow: int = 2, extra_ms: float = 8.0, **kw: object) -> Path:
    """A DDP job of ``world`` ranks (``job_dir/rank-K/``) where rank ``slow`` loads data ``extra_ms`` slower
    per step and the others wait as long for it inside backward (the all-reduce), as DDP ranks do."""

    def adjusted(rank: int) -> Callable[[list[float]], list[float]]:
        def adjust(row: list[float]) -> list[float]:
            dur, data, forward, backward, optimizer, other = row
            if rank == slow:
                data += extra_ms
            else:
                backward += extra_ms
            return [round(x, 3) for x in (dur + extra_ms, data, forward, backward, optimizer, other)]

        return adjust

    for rank in range(world):
        write_recording(job_dir / f"rank-{rank}", rank=rank, world_size=world, adjust=adjusted(rank),
                        output=False, **kw)  # type: ignore[arg-type]
    (job_dir / "output.log").write_text("".join(f"rank {r}: training done\n" for r in range(world)))
    return job_dir


def output_lines(run_dir: Path) -> list[str]:
    """The lines of ``output.log`` as written."""
    return (run_dir / "output.log").read_text().splitlines()


# -- driving the app -------------------------------------------------------------------------
def screen_text(app: PerfmonApp) -> str:
    """What the terminal shows now, as plain text."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def panel_steps(info: PhaseInfo, state: RunState) -> int:
    """The steps the phases panel has folded: its whole-run count, the profiled steps, and step 1 where the
    whole-run figures leave it out."""
    return info.total_n + state.windowed_steps + (info.since != "since start")


async def wait_until(pilot: Pilot, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until ``cond()`` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await pilot.pause(0.01)
    await pilot.pause()


async def loaded(pilot: Pilot, steps: int | None = None) -> None:
    """The recording is read (or ``steps`` steps are in, for a stream that goes on) and the output shown."""
    from perfmon.tui.widgets.logpanel import LogPanel
    from perfmon.tui.widgets.phases import PhasesPanel

    app = pilot.app
    log = app.query_one(LogPanel).log_widget
    out = app.run_dir / "output.log"
    want = len(output_lines(app.run_dir)) if out.exists() else 0

    def ready() -> bool:
        if steps is None:
            # the app redraws from the final state on this, and runs the rules once more over the whole run
            summary = app.query_one("#summary")
            data = app.stream_ended and app.findings is not None and summary.info == app.findings
        else:
            info = app.query_one(PhasesPanel).info
            data = info is not None and panel_steps(info, app.state) >= steps
        return data and log.line_count >= want and log.scroll_y == log.max_scroll_y

    await wait_until(pilot, ready)
    # the final findings may change panel heights: let that layout happen
    for _ in range(3):
        await pilot.pause()


def attached_without_socket(run_dir: Path):
    """A live job's recording followed while no socket is connected (an attached monitor whose connection
    dropped): the job may be running, and the monitor cannot command it. A plain recording is a replay."""
    from perfmon.monitor.sources import ReplaySource

    class Followed(ReplaySource):
        mode = "attached"

    return Followed(run_dir, follow=True, poll=0.05)
