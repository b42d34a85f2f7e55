"""`perfmon trace`: the breakdown of real GPU traces against HolisticTraceAnalysis (HTA), op attribution, the
CPU-only path against torch's own key_averages(), the JSON schema and the CLI."""

from __future__ import annotations

import gzip
import json
import logging
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from perfmon.analysis.trace import (
    TraceAnalysis,
    TraceError,
    analyse_path,
    analyse_trace,
    format_text,
    main,
    trace_report,
)

DATA = Path(__file__).parent / "data" / "gpu-traces"
V100 = "v100_cnn_rank0.pt.trace.json.gz"
DDP = "a100_ddp_2rank_rank0.json.gz"
RECSYS = "a100_8rank_recsys_rank3.json.gz"
TRACES = (V100, DDP, RECSYS)

# HTA 0.5.0 on these traces (printed by benchmarks/trace_vs_hta.py): temporal breakdown (idle, compute,
# non-compute), kernel-type breakdown (communication, memory: share of typed busy time), comm/compute overlap.
# Checked here on every run; test_matches_hta_live recomputes them with HTA when it is installed.
HTA_0_5 = {
    V100: (0.0263, 0.9675, 0.0062, 0.0, 0.0063, None),
    DDP: (0.7778, 0.1726, 0.0497, 0.2508, 0.0105, 0.1431),
    RECSYS: (0.1620, 0.6123, 0.2257, 0.4124, 0.1411, 0.4703),
}
# HTA's top-5 kernels by device time (kernel breakdown, "others" left out), by a unique part of each name.
HTA_TOP5 = {
    V100: ("CUDAFunctor_add<float>", "bn_bw_1C11_kernel_new<float, float, float2, 128,",
           "bn_bw_1C11_kernel_new<float, float, float2, 32,", "dgrad_engine<float, 512, 6, 5,",
           "threshold_kernel_impl"),
    DDP: ("ncclKernel_AllReduce", "nchwToNhwcKernel", "bn_bw_1C11_kernel_new<float, float, float2, 128,",
          "CUDAFunctor_add<float>", "threshold_kernel_impl"),
    RECSYS: ("ncclKernel_SendRecv", "Memcpy HtoD (Pinned -> Device)", "split_embedding_backward_codegen",
             "ncclKernel_AllReduce", "split_embedding_codegen_forward"),
}
KEYS = ("idle", "compute", "non_compute", "communication", "memory", "comm_compute_overlap")


@pytest.fixture(scope="module")
def analysed() -> dict[str, TraceAnalysis]:
    return {name: analyse_trace(DATA / name) for name in TRACES}


def _close(ours: float | None, theirs: float | None, tol: float) -> bool:
    if theirs is None:
        return ours is None
    return ours is not None and abs(ours - theirs) <= tol


@pytest.mark.parametrize("name", TRACES)
def test_breakdown_matches_recorded_hta(analysed: dict[str, TraceAnalysis], name: str) -> None:
    j = analysed[name].to_json()
    tolerances = (0.01, 0.01, 0.01, 0.02, 0.02, 0.02)
    for key, theirs, tol in zip(KEYS, HTA_0_5[name], tolerances, strict=True):
        assert _close(j[key], theirs, tol), (key, j[key], theirs)
    assert j["busy"] == pytest.approx(1 - j["idle"], abs=1e-4)
    assert j["idle"] + j["compute"] + j["non_compute"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("name", TRACES)
def test_top_kernels_match_recorded_hta(analysed: dict[str, TraceAnalysis], name: str) -> None:
    top = [k["name"] for k in analysed[name].to_json()["top_kernels"][:5]]
    for fragment in HTA_TOP5[name]:
        assert sum(fragment in kernel for kernel in top) == 1, (fragment, top)


@pytest.fixture(scope="module")
def hta(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """HTA's own numbers for each trace (skipped when HolisticTraceAnalysis is not installed)."""
    pytest.importorskip("hta")
    from hta.trace_analysis import TraceAnalysis as HTA

    logging.getLogger("hta").setLevel(logging.ERROR)
    out = {}
    for name in TRACES:
        folder = tmp_path_factory.mktemp(name.split(".")[0])
        shutil.copy(DATA / name, folder / name)  # HTA reads a folder; the trace alone in it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = HTA(trace_dir=str(folder))
            temporal = t.get_temporal_breakdown(visualize=False).iloc[0]
            types, kernels = t.get_gpu_kernel_breakdown(visualize=False)
            overlap = float(t.get_comm_comp_overlap(visualize=False).iloc[0]["comp_comm_overlap_pctg"])
        span = float(temporal["kernel_time(us)"])
        total = float(types["sum"].sum())

        def typed(word: str, types: Any = types, total: float = total) -> float:
            return float(types[types["kernel_type"].str.contains(word)]["sum"].sum()) / total

        named = kernels[kernels["name"] != "others"].sort_values("sum (us)", ascending=False)
        out[name] = {
            "idle": float(temporal["idle_time(us)"]) / span,
            "compute": float(temporal["compute_time(us)"]) / span,
            "non_compute": float(temporal["non_compute_time(us)"]) / span,
            "communication": typed("COMMUNICATION"),
            "memory": typed("MEMORY"),
            "comm_compute_overlap": None if math.isnan(overlap) else overlap / 100,
            "span_ms": span / 1000,
            "top5": set(named["name"].head(5)),
        }
    return out


@pytest.mark.parametrize("name", TRACES)
def test_matches_hta_live(analysed: dict[str, TraceAnalysis], hta: dict[str, dict[str, Any]],
                          name: str) -> None:
    ours, theirs = analysed[name].to_json(), hta[name]
    for key, tol in zip(KEYS, (0.01, 0.01, 0.01, 0.02, 0.02, 0.02), strict=True):
        assert _close(ours[key], theirs[key], tol), (key, ours[key], theirs[key])
    assert ours["span_ms"] == pytest.approx(theirs["span_ms"], rel=1e-3)
    assert {k["name"] for k in ours["top_kernels"][:5]} == theirs["top5"]
    # and the recorded table above is still what HTA says
    for key, recorded in zip(KEYS, HTA_0_5[name], strict=True):
        assert _close(theirs[key], recorded, 0.0005), (key, theirs[key], recorded)


@pytest.mark.parametrize(
    ("name", "rank", "world", "device", "steps"),
    [
        (V100, 0, 1, "Tesla V100-SXM2-32GB", 5),
        (DDP, 0, 2, "NVIDIA A100-PG509-200", 3),
        (RECSYS, 3, 8, "NVIDIA A100-PG509-200", 6),
    ],
)
def test_metadata(analysed: dict[str, TraceAnalysis], name: str, rank: int, world: int, device: str,
                  steps: int) -> None:
    j = analysed[name].to_json()
    got = (j["file"], j["rank"], j["world_size"], j["device"], j["steps"])
    assert got == (name, rank, world, device, steps)


def test_json_schema(analysed: dict[str, TraceAnalysis]) -> None:
    report = trace_report([DATA / DDP])
    assert report["schema"] == 1 and len(report["traces"]) == 1
    j = report["traces"][0]
    assert set(j) == {"file", "rank", "world_size", "device", "steps", "span_ms", "busy", "idle", "compute",
                      "non_compute", "communication", "memory", "comm_compute_overlap", "syncs_per_step",
                      "top_kernels", "top_ops", "findings"}
    assert j == analysed[DDP].to_json()
    assert all(set(k) == {"name", "device_ms", "count", "share"} for k in j["top_kernels"])
    assert all(set(o) == {"name", "device_ms", "count", "share"} for o in j["top_ops"])
    assert all(set(f) == {"id", "severity", "title", "evidence", "fix"} for f in j["findings"])
    assert [k["device_ms"] for k in j["top_kernels"]] == sorted((k["device_ms"] for k in j["top_kernels"]),
                                                                reverse=True)
    assert 0 < sum(k["share"] for k in j["top_kernels"]) <= 1
    json.dumps(report)  # serialisable as is


def test_kernels_go_to_the_innermost_op_once(analysed: dict[str, TraceAnalysis]) -> None:
    j = analysed[DDP].to_json()
    ops = {o["name"]: o for o in j["top_ops"]}
    nccl = sum(k["device_ms"] for k in j["top_kernels"] if k["name"].startswith("ncclKernel"))
    # c10d launches its NCCL kernels inside record_param_comms, the innermost op around the launch
    assert ops["record_param_comms"]["device_ms"] == pytest.approx(nccl, abs=0.1)
    # the wrappers around cuDNN calls get none of their kernels' time: it is not counted twice
    assert "aten::convolution" not in ops and "aten::conv2d" not in ops and "aten::_convolution" not in ops
    assert ops["aten::cudnn_convolution"]["device_ms"] > 5
    # every kernel is attributed once: the shares of all ops add up to the kernels' total
    f = analysed[DDP].facts
    assert f.gpu is not None and f.op_total_us == pytest.approx(f.gpu.kernel_total_us)
    # (each row rounded to 1 us: allow that much per row)
    assert sum(o["device_ms"] for o in j["top_ops"]) <= f.gpu.kernel_total_us / 1000 + 0.0005 * len(j["top_ops"])


def test_syncs_per_step(analysed: dict[str, TraceAnalysis]) -> None:
    # recsys: 60 cudaStreamSynchronize in its 6 steps, 30 of them inside .item() (counted once each)
    assert analysed[RECSYS].to_json()["syncs_per_step"] == 10.0
    # ddp: 24 cudaEventSynchronize in 3 steps; v100: its one cudaDeviceSynchronize is outside the steps
    assert analysed[DDP].to_json()["syncs_per_step"] == 8.0
    assert analysed[V100].to_json()["syncs_per_step"] == 0.0


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """A CPU-only profiler trace of a tiny MLP, and key_averages()' self CPU time (us) of its cpu ops."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    path = tmp_path_factory.mktemp("cpu") / "cpu.pt.trace.json"
    averages: dict[str, float] = {}

    def ready(prof: Any) -> None:
        prof.export_chrome_trace(str(path))
        averages.update({e.key: e.self_cpu_time_total for e in prof.key_averages()})

    sched = schedule(wait=0, warmup=1, active=3, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=ready) as prof:
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    events = json.loads(path.read_text())["traceEvents"]
    cpu_ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    return path, {k: v for k, v in averages.items() if k in cpu_ops}


def test_cpu_only_trace_ranks_ops_by_self_cpu_time(cpu_trace: tuple[Path, dict[str, float]]) -> None:
    path, averages = cpu_trace
    j = analyse_trace(path).to_json()
    assert j["device"] == "cpu" and j["steps"] == 3
    assert all(j[k] is None for k in ("busy", "idle", "compute", "communication", "comm_compute_overlap"))
    assert j["top_kernels"] == [] and j["findings"] == []
    assert all(set(o) == {"name", "self_cpu_ms", "count", "share"} for o in j["top_ops"])
    expected = sorted(averages, key=lambda k: -averages[k])[:3]
    assert [o["name"] for o in j["top_ops"][:3]] == expected
    for o in j["top_ops"][:3]:
        assert o["self_cpu_ms"] * 1000 == pytest.approx(averages[o["name"]], rel=0.05)
    assert "self CPU time" in format_text([analyse_trace(path)])


def test_folder_sorted_by_rank(tmp_path: Path) -> None:
    shutil.copy(DATA / RECSYS, tmp_path / "a.json.gz")  # rank 3 first by name
    shutil.copy(DATA / DDP, tmp_path / "b.json.gz")  # rank 0
    (tmp_path / "notes.txt").write_text("not a trace")
    ranks = [(a.facts.rank, a.facts.file) for a in analyse_path(tmp_path)]
    assert ranks == [(0, "b.json.gz"), (3, "a.json.gz")]


def test_plain_json_and_errors(tmp_path: Path) -> None:
    plain = tmp_path / "trace.json"
    plain.write_bytes(gzip.decompress((DATA / DDP).read_bytes()))
    assert analyse_trace(plain).to_json()["idle"] == pytest.approx(HTA_0_5[DDP][0], abs=0.01)
    with pytest.raises(TraceError, match="no such file"):
        analyse_path(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no \\*.json"):
        analyse_path(tmp_path / "empty")


def test_cli_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DATA / DDP)]) == 0
    out = capsys.readouterr().out
    assert "rank 0/2" in out and "idle 77.8%" in out and "communication 25.1%" in out
    assert "ncclKernel_AllReduce_RING_LL_Sum_float" in out and "record_param_comms" in out
    assert "CRITICAL device-underused" in out and "fix:" in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(DATA / V100), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1 and doc["traces"][0]["file"] == V100


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b'{"hello": "world"}', "not a PyTorch profiler trace"),
        (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "not a PyTorch profiler trace"),
        (b"{not json", "cannot read a JSON trace"),
    ],
)
def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None,
                    message: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_bytes(content)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_corrupt_gzip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes((DATA / DDP).read_bytes()[:5000])  # truncated download
    assert main([str(path)]) == 2
    assert "cannot read a JSON trace" in capsys.readouterr().err


def test_perfmon_trace_command(tmp_path: Path) -> None:
    """`perfmon trace` as a user types it: the folder of per-rank traces, --json, and a clear error."""
    import subprocess
    import sys

    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(DATA / "a100_ddp_2rank_rank0.json.gz", folder)
    out = subprocess.run([sys.executable, "-m", "perfmon.cli", "trace", str(folder), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == 1 and [t["rank"] for t in doc["traces"]] == [0]
    assert any(f["id"] == "device-underused" for f in doc["traces"][0]["findings"])
    bad = subprocess.run([sys.executable, "-m", "perfmon.cli", "trace", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "perfmon: error:" in bad.stderr


def test_a_window_whose_trace_was_dropped_reads_its_numbers_from_the_analysis(tmp_path):
    """--profile-keep drops a periodic window's trace once a monitor analysed it: later readers (replay, report) get
    the window from RUN/analysis/; an analysis from another perfmon's schema says so instead of failing to parse."""
    import json
    import shutil

    from perfmon import paths
    from perfmon.analysis.profile_window import summarise_window

    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    trace = traces / "v100_cnn_rank0.pt.trace.json.gz"
    shutil.copy(DATA / trace.name, trace)
    msg = {"type": "profile", "step": 10, "active_steps": 3, "device": "cuda", "trace": str(trace), "t": 1.0}
    first = summarise_window(msg)
    assert first["top_ops"] and paths.trace_analysis(trace).exists()
    trace.unlink()
    assert summarise_window(msg)["top_ops"] == first["top_ops"]
    cache = paths.trace_analysis(trace)
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "schema": -1}))
    old = summarise_window(msg)
    assert old["top_ops"] == [] and "removed (--profile-keep)" in old["analysis_error"]
    assert not list(cache.parent.glob("*.tmp"))  # no temp file left behind


def test_a_window_keeps_the_most_called_ops_beside_the_costliest(tmp_path):
    """The ops view sorts by calls too: it re-sorted the 30 ops kept by self time, leaving out ops called more
    often than any of them. An older analysis (schema 1) of a trace since dropped is still read."""
    import shutil

    from perfmon import paths
    from perfmon.analysis.profile_window import TOP_N, summarise_window

    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    trace = traces / "a100_8rank_recsys_rank3.json.gz"
    shutil.copy(Path(__file__).parent / "data" / "gpu-traces" / trace.name, trace)
    window = summarise_window({"type": "profile", "step": 10, "active_steps": 3, "device": "cuda",
                               "trace": str(trace), "t": 1.0})
    ops = window["top_ops"]
    by_time = sorted(ops, key=lambda o: o["self_ms"], reverse=True)
    assert ops == by_time and TOP_N < len(ops) <= 2 * TOP_N  # costliest first, as before, and more of them
    extra = ops[TOP_N:]  # kept for their calls: each called more than the least called of the costliest 30
    assert min(o["calls"] for o in extra) >= min(o["calls"] for o in ops[:TOP_N])
    cache = paths.trace_analysis(trace)
    old = json.loads(cache.read_text())
    cache.write_text(json.dumps({**old, "schema": 1, "top_ops": old["top_ops"][:3]}))
    trace.unlink()  # dropped by --profile-keep: the older analysis is all there is
    again = summarise_window({"type": "profile", "step": 10, "active_steps": 3, "device": "cuda",
                              "trace": str(trace), "t": 1.0})
    assert [op["name"] for op in again["top_ops"]] == [op["name"] for op in ops[:3]]
    assert "analysis_error" not in again
