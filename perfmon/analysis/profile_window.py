"""A profiler window's summary, computed outside the job from the trace the job exported.

The job only captures a window and writes its Kineto trace (``RUN/traces/*.pt.trace.json``); its
``profile`` message names the file. Here, in the monitor, ``perfmon report`` or a replay, the trace is
analysed as ``perfmon trace`` analyses any trace (:mod:`perfmon.analysis.trace`), and the message gains
the fields the ops view, the rules and the report read. The analysis is cached in ``RUN/analysis/`` (not
beside the trace: HolisticTraceAnalysis and ``perfmon trace`` read every ``.json`` in a traces folder) so a
replay or report does not parse it again.

Recordings made when the job summarised its own windows (``top_ops`` already in the message) are passed
through unchanged.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from perfmon import paths
from perfmon.analysis.trace import TraceError, analyse_trace
from perfmon.messages import ProfileWindow

#: Rows kept per window (ops, and kernels on a GPU), per sort the ops view offers (self time, calls).
TOP_N = 30
#: 2: the top ops by calls kept beside those by self time (1 kept the self-time ones alone: the view's "calls"
#: sort re-sorted them, without the most called ops)
CACHE_SCHEMA = 2


def summarised(messages: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``messages`` with every ``profile`` message that names a trace summarised from it."""
    for msg in messages:
        yield summarise_window(msg) if msg.get("type") == "profile" else msg


def summarise_window(msg: dict[str, Any]) -> dict[str, Any]:
    """The ``profile`` message with its window's analysis: ``top_ops`` (name, calls, kind, self_ms, share),
    ``top_kernels`` on a GPU, ``ops_total``, ``syncs_per_step``, ``device_busy`` and the HTA breakdown
    (``breakdown``), and the trace's own findings (``trace_findings``)."""
    if msg.get("top_ops") is not None or not isinstance(msg.get("trace"), str):
        return msg  # summarised by the job (older recordings), or the export failed
    analysis = _analysis(Path(msg["trace"]))
    if "error" in analysis:
        return {**msg, "top_ops": [], "analysis_error": analysis["error"]}
    gpu = msg.get("device") == "cuda" or bool(analysis.get("top_kernels"))
    basis = "device_ms" if gpu else "self_cpu_ms"
    ops = [{"name": o["name"], "calls": o["count"], "kind": "op", "self_ms": o.get(basis) or 0.0,
            "share": o["share"]} for o in analysis["top_ops"]]
    kernels = [{"name": k["name"], "calls": k["count"], "kind": "kernel", "self_ms": k["device_ms"],
                "share": k["share"]} for k in analysis["top_kernels"]]
    steps = msg.get("active_steps")
    return {
        **msg, "top_ops": ops, "top_kernels": kernels, "ops_total": analysis.get("ops_total"),
        # a CPU run has no device to wait for: an .item() there is a plain read, not a sync
        "syncs_per_step": analysis["syncs_per_step"] if gpu else None,
        "device_busy": analysis["busy"] if gpu else None,
        "breakdown": {k: analysis[k] for k in ("idle", "compute", "non_compute", "communication", "memory",
                                               "comm_compute_overlap", "span_ms")} if gpu else None,
        "trace_findings": analysis["findings"], "trace_steps": analysis.get("steps") or steps,
    }


def _analysis(trace: Path) -> dict[str, Any]:
    """The trace's ``perfmon trace`` JSON (top lists cut to TOP_N), from the cache when it is there."""
    cache = paths.trace_analysis(trace)
    try:
        cached = json.loads(cache.read_text())
        if cached.get("schema") == CACHE_SCHEMA or (cached.get("schema") == 1 and not trace.exists()):
            return cached  # an older one where the trace is gone: what was kept is all there is
        if not trace.exists():  # dropped by --profile-keep: what was cached is all there is
            return {"error": f"the trace was removed (--profile-keep) and its analysis is from another perfmon "
                             f"(schema {cached.get('schema')})"}
    except (OSError, ValueError, AttributeError):
        pass
    try:
        full = analyse_trace(trace)
    except TraceError as exc:
        return {"error": str(exc)}
    out = full.to_json()
    out["ops_total"] = full.facts.ops_total
    out["top_kernels"] = out["top_kernels"][:TOP_N]
    out["schema"] = CACHE_SCHEMA
    try:  # a read-only run dir (someone else's recording) just means no cache
        cache.parent.mkdir(exist_ok=True)
        # its own temp file: the dashboard and a report may analyse one trace at once (and the job drops a trace
        # once its analysis exists: never a half-written one)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(out))
            os.replace(tmp, cache)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        pass
    return out


def export_text(prof: ProfileWindow, run_dir: Path) -> Path:
    """Write a summarised window's top ops (and kernels) as a text table under ``RUN/exports/``."""
    out = run_dir / "exports" / f"top-ops-step{prof.step}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"perfmon top ops, window at step {prof.step} ({prof.active_steps} active steps, "
             f"{prof.device})", f"trace: {prof.trace}"]
    for title, rows in (("op", prof.top_ops), ("kernel", prof.top_kernels)):
        if not rows:
            continue
        lines += ["", f"{title:<60} {'calls':>7} {'self ms':>10} {'share':>7}"]
        lines += [f"{str(r.name)[:60]:<60} {r.calls or 0:>7} {r.self_ms or 0.0:>10.3f} "
                  f"{(r.share or 0.0) * 100:>6.1f}%" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    return out
