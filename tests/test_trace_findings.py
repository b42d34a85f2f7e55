"""Findings of `perfmon trace`, one that fires and one that does not for each, on real GPU traces and on parts
cut from them; then each threshold on both sides, on real facts with one number changed."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from perfmon.analysis.trace import analyse_trace
from perfmon.analysis.trace_breakdown import DeviceFacts, TraceFacts
from perfmon.analysis.trace_findings import RULES, Severity, findings

DATA = Path(__file__).parent / "data" / "gpu-traces"
FULL = {
    "v100": "v100_cnn_rank0.pt.trace.json.gz",
    "ddp": "a100_ddp_2rank_rank0.json.gz",
    "recsys": "a100_8rank_recsys_rank3.json.gz",
}


def cut(doc: dict[str, Any], offset_ms: float, width_ms: float) -> dict[str, Any]:
    """The trace with only the complete events starting in [first kernel + offset, + width): metadata kept."""
    events = doc["traceEvents"]
    t0 = min(e["ts"] for e in events if e.get("cat") == "kernel") + offset_ms * 1000
    t1 = t0 + width_ms * 1000
    return {**doc, "traceEvents": [e for e in events if e.get("ph") != "X" or t0 <= e["ts"] < t1]}


def pageable(doc: dict[str, Any]) -> dict[str, Any]:
    """The same trace as if its pinned host-to-device copies came from pageable memory (Kineto's name)."""
    pinned, unpinned = "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pageable -> Device)"
    renamed = [{**e, "name": unpinned} if e.get("name") == pinned else e for e in doc["traceEvents"]]
    return {**doc, "traceEvents": renamed}


# Parts of the real traces where one condition holds (offsets from the first kernel; see test_variants_hold).
VARIANTS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    # end of a DDP backward: the last gradient buckets all-reduce with little compute left to hide them
    "ddp-allreduce-20ms": ("ddp", lambda d: cut(d, 540, 20)),
    # dense part of a recsys step: hundreds of 5-10 us kernels with the GPU waiting for launches between them
    "recsys-dense-10ms": ("recsys", lambda d: cut(d, 340, 10)),
    "recsys-pageable": ("recsys", pageable),
}


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TraceFacts]:
    out = {key: analyse_trace(DATA / name).facts for key, name in FULL.items()}
    folder = tmp_path_factory.mktemp("variants")
    docs: dict[str, dict[str, Any]] = {}
    for key, (source, make) in VARIANTS.items():
        if source not in docs:
            docs[source] = json.loads(gzip.decompress((DATA / FULL[source]).read_bytes()))
        path = folder / f"{key}.json"
        path.write_text(json.dumps(make(docs[source])))
        out[key] = analyse_trace(path).facts
    return out


CASES = [
    ("device-underused", "ddp", Severity.CRITICAL),  # idle 78%
    ("device-underused", "v100", None),  # idle 2.6%
    ("communication-bound", "ddp-allreduce-20ms", Severity.CRITICAL),  # 65% of the window exposed all-reduce
    ("communication-bound", "ddp", None),  # 25% of busy time, but only ~5% of the window not overlapped
    ("pageable-memcpy", "recsys-pageable", Severity.WARN),  # 13% of busy time
    ("pageable-memcpy", "recsys", None),  # the same copies from pinned memory
    ("host-sync", "recsys", Severity.WARN),  # 10 per step
    ("host-sync", "v100", None),  # none in its steps
    ("launch-bound", "recsys-dense-10ms", Severity.WARN),  # median 7 us, idle 42%, 81% of it in short gaps
    ("launch-bound", "ddp", None),  # idle 78% and short kernels, but the idle is long waits, not launch gaps
    ("launch-bound", "v100", None),  # short kernels too, but the GPU is busy
    ("no-mixed-precision", "v100", Severity.CRITICAL),  # volta_sgemm / scudnn: all FP32 on CUDA cores
    ("no-mixed-precision", "ddp", Severity.INFO),  # TF32 tensor-core kernels (s1688, xmma tf32)
    ("no-mixed-precision", "ddp-allreduce-20ms", None),  # matrix kernels < 10% of busy time
]


@pytest.mark.parametrize(("rule_id", "trace", "severity"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_finding(facts: dict[str, TraceFacts], rule_id: str, trace: str, severity: Severity | None) -> None:
    found = {f.id: f for f in findings(facts[trace])}
    if severity is None:
        assert rule_id not in found
    else:
        assert found[rule_id].severity is severity


FIX_MENTIONS = {
    "device-underused": ("num_workers", "pin_memory=True"),
    "communication-bound": ("bucket_cap_mb", "no_sync"),
    "pageable-memcpy": ("pin_memory=True", "non_blocking=True"),
    "host-sync": (".item()", "set_sync_debug_mode"),
    "launch-bound": ('mode="reduce-overhead"', "CUDA graphs"),
    "no-mixed-precision": ("torch.autocast", "GradScaler", "set_float32_matmul_precision"),
}


def test_evidence_and_fix(facts: dict[str, TraceFacts]) -> None:
    fired = {rule_id: next(f for f in findings(facts[trace]) if f.id == rule_id)
             for rule_id, trace, severity in CASES if severity not in (None, Severity.INFO)}
    assert set(fired) == set(FIX_MENTIONS)
    for rule_id, mentions in FIX_MENTIONS.items():
        assert all(m in fired[rule_id].fix for m in mentions), rule_id
        json.dumps(dict(fired[rule_id].evidence))
    ev = {key: dict(f.evidence) for key, f in fired.items()}
    assert ev["device-underused"]["idle"] == pytest.approx(facts["ddp"].idle, abs=1e-4)
    assert ev["pageable-memcpy"]["pageable_htod_share"] == pytest.approx(0.131, abs=0.002)
    assert ev["pageable-memcpy"]["copies"] == 125  # the 150 copies less the 25 of the last step
    assert ev["no-mixed-precision"]["fp32_gemm_share"] == 1.0
    assert ev["communication-bound"]["exposed_communication"] == pytest.approx(0.65, abs=0.01)
    assert ev["launch-bound"]["median_kernel_us"] < 10 and ev["launch-bound"]["idle_in_short_gaps"] > 0.5


def test_variants_hold(facts: dict[str, TraceFacts]) -> None:
    """The cut windows are what their comments say."""
    allreduce, dense = facts["ddp-allreduce-20ms"], facts["recsys-dense-10ms"]
    assert allreduce.communication is not None and allreduce.communication > 0.9
    assert dense.communication == 0 and dense.gpu is not None and dense.gpu.kernel_count > 300
    assert facts["recsys-pageable"].idle == facts["recsys"].idle


def test_most_severe_first(facts: dict[str, TraceFacts]) -> None:
    severities = [f.severity for f in findings(facts["ddp"])]
    assert severities == [Severity.CRITICAL, Severity.WARN, Severity.INFO]


def _rule(rule_id: str) -> Callable[[TraceFacts], Any]:
    return next(r for r in RULES if r.__name__ == rule_id.replace("-", "_"))


def _with(base: TraceFacts, **changes: Any) -> TraceFacts:
    """`base` with some fields changed, on TraceFacts or on its DeviceFacts."""
    assert base.gpu is not None
    device = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(DeviceFacts)}}
    rest = {k: v for k, v in changes.items() if k not in device}
    return dataclasses.replace(base, gpu=dataclasses.replace(base.gpu, **device), **rest)


# (rule, changes to the ddp facts given the span S and busy time B, expected severity)
BOUNDARIES: list[tuple[str, Callable[[float, float], dict[str, Any]], Severity | None]] = [
    ("device-underused", lambda s, b: {"idle_us": 0.50 * s}, None),
    ("device-underused", lambda s, b: {"idle_us": 0.51 * s}, Severity.WARN),
    ("device-underused", lambda s, b: {"idle_us": 0.76 * s}, Severity.CRITICAL),
    ("communication-bound", lambda s, b: {"comm_us": 0.19 * s, "comm_compute_us": 0.0}, None),
    ("communication-bound", lambda s, b: {"comm_us": 0.21 * s, "comm_compute_us": 0.0}, Severity.WARN),
    ("communication-bound", lambda s, b: {"comm_us": 0.5 * s, "comm_compute_us": 0.05 * s},
     Severity.CRITICAL),
    ("pageable-memcpy", lambda s, b: {"pageable_htod_us": 0.09 * b}, None),
    ("pageable-memcpy", lambda s, b: {"pageable_htod_us": 0.11 * b}, Severity.WARN),
    ("pageable-memcpy", lambda s, b: {"pageable_htod_us": 0.26 * b}, Severity.CRITICAL),
    ("host-sync", lambda s, b: {"syncs_per_step": 2.0}, None),
    ("host-sync", lambda s, b: {"syncs_per_step": None}, None),
    ("host-sync", lambda s, b: {"syncs_per_step": 2.5}, Severity.WARN),
    ("host-sync", lambda s, b: {"syncs_per_step": 21.0}, Severity.CRITICAL),
    ("launch-bound", lambda s, b: {"median_kernel_us": 5.0, "short_gap_idle_us": 0.49 * 0.7778 * s}, None),
    ("launch-bound", lambda s, b: {"median_kernel_us": 10.0, "short_gap_idle_us": 0.9 * 0.7778 * s}, None),
    ("launch-bound", lambda s, b: {"median_kernel_us": 5.0, "short_gap_idle_us": 0.9 * 0.7778 * s},
     Severity.CRITICAL),
    ("launch-bound", lambda s, b: {"median_kernel_us": 5.0, "idle_us": 0.4 * s, "short_gap_idle_us": 0.3 * s},
     Severity.WARN),
    ("no-mixed-precision", lambda s, b: {"gemm_us": 0.09 * b, "gemm_fp32_us": 0.09 * b}, None),
    ("no-mixed-precision", lambda s, b: {"gemm_us": b / 2, "gemm_fp32_us": 0.1 * b, "gemm_tf32_us": 0.1 * b},
     None),
    ("no-mixed-precision", lambda s, b: {"gemm_us": b / 2, "gemm_fp32_us": 0.1 * b, "gemm_tf32_us": 0.2 * b},
     Severity.INFO),
    ("no-mixed-precision", lambda s, b: {"gemm_us": b / 2, "gemm_fp32_us": 0.3 * b}, Severity.WARN),
    ("no-mixed-precision", lambda s, b: {"gemm_us": b / 2, "gemm_fp32_us": 0.45 * b}, Severity.CRITICAL),
]


@pytest.mark.parametrize(("rule_id", "change", "severity"), BOUNDARIES)
def test_threshold(facts: dict[str, TraceFacts], rule_id: str,
                   change: Callable[[float, float], dict[str, Any]], severity: Severity | None) -> None:
    base = facts["ddp"]
    assert base.idle == pytest.approx(0.7778, abs=1e-4)  # the launch-bound rows rely on it
    assert base.busy_us is not None
    f = _with(base, **change(base.span_us, base.busy_us))
    found = _rule(rule_id)(f)
    assert (found.severity if found else None) is severity
    if found:
        assert found.id == rule_id


def test_cpu_only_facts_fire_nothing(facts: dict[str, TraceFacts]) -> None:
    cpu = dataclasses.replace(facts["v100"], gpu=None, syncs_per_step=0.0)
    assert findings(cpu) == ()
