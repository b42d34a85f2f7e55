"""`perfmon trace PATH [--json]`: analyse PyTorch profiler (Kineto) traces, one per rank.

Device time breakdown as HolisticTraceAnalysis defines it (see trace_breakdown), top kernels, top ops, host
synchronisations, and findings with their evidence and fix (trace_findings). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from perfmon.analysis.trace_breakdown import OpBasis, Stat, TraceFacts, facts
from perfmon.analysis.trace_findings import Finding, findings
from perfmon.analysis.trace_load import TraceError, load_trace, trace_files

__all__ = [
    "TraceAnalysis", "TraceError", "analyse_path", "analyse_trace", "format_text", "main", "trace_report",
]

SCHEMA = 1
TEXT_TOP = 5


@dataclass(frozen=True)
class TraceAnalysis:
    """What `perfmon trace` reports for one trace file."""

    facts: TraceFacts
    findings: tuple[Finding, ...]

    def to_json(self) -> dict[str, Any]:
        f, g = self.facts, self.facts.gpu
        kernel_total = g.kernel_total_us if g is not None else 0.0
        return {
            "file": f.file,
            "rank": f.rank,
            "world_size": f.world_size,
            "device": f.device,
            "steps": f.steps,
            "span_ms": _ms(f.span_us),
            "busy": _frac(f.busy),
            "idle": _frac(f.idle),
            "compute": _frac(f.compute),
            "non_compute": _frac(f.non_compute),
            "communication": _frac(f.communication),
            "memory": _frac(f.memory),
            "comm_compute_overlap": _frac(f.comm_compute_overlap),
            "syncs_per_step": None if f.syncs_per_step is None else round(f.syncs_per_step, 3),
            "top_kernels": [_stat(s, "device_ms", kernel_total) for s in (g.top_kernels if g else ())],
            "top_ops": [_stat(s, f.op_basis.value, f.op_total_us) for s in f.top_ops],
            "findings": [
                {"id": x.id, "severity": x.severity.value, "title": x.title, "evidence": dict(x.evidence),
                 "fix": x.fix}
                for x in self.findings
            ],
        }


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _frac(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _stat(s: Stat, key: str, total: float) -> dict[str, Any]:
    share = round(s.us / total, 4) if total else 0.0
    return {"name": s.name, key: _ms(s.us), "count": s.count, "share": share}


def analyse_trace(path: str | Path) -> TraceAnalysis:
    """Analyse one trace file (`.json` or `.json.gz`); raises TraceError."""
    f = facts(load_trace(Path(path)))
    return TraceAnalysis(f, findings(f))


def analyse_path(path: str | Path) -> list[TraceAnalysis]:
    """A trace file, or every trace in a folder (one per rank), sorted by rank; raises TraceError."""
    out = [analyse_trace(p) for p in trace_files(Path(path))]
    return sorted(out, key=lambda a: (a.facts.rank is None, a.facts.rank or 0, a.facts.file))


def trace_report(paths: str | Path | Iterable[str | Path]) -> dict[str, Any]:
    """The `--json` document for one or more trace files or folders."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return {"schema": SCHEMA, "traces": [a.to_json() for p in items for a in analyse_path(p)]}


_NAMESPACE_RE = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


def short_kernel_name(name: str, width: int = 60) -> str:
    """A C++ kernel name without `void`, namespaces and its parameter list, cut to `width`."""
    if not name.startswith(("Memcpy", "Memset")):
        name = _NAMESPACE_RE.sub("", name.removeprefix("void "))
        depth = 0
        for i, c in enumerate(name):
            depth += (c == "<") - (c == ">")
            if c == "(" and depth == 0 and i > 0:
                name = name[:i]
                break
    return name if len(name) <= width else name[: width - 3] + "..."


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_text(analyses: Iterable[TraceAnalysis]) -> str:
    """Compact human-readable tables, one block per trace."""
    blocks = []
    for a in analyses:
        f = a.facts
        rank = "" if f.rank is None else f"  rank {f.rank}/{f.world_size or '?'}"
        sync = "-" if f.syncs_per_step is None else f"{f.syncs_per_step:.1f}"
        lines = [f"{f.file}{rank}  {f.device}  {f.steps} steps  span {f.span_us / 1000:.1f} ms"]
        if f.gpu is not None:
            lines += [
                f"  device   busy {_pct(f.busy)}  idle {_pct(f.idle)}  compute {_pct(f.compute)}  "
                f"non-compute {_pct(f.non_compute)}",
                f"  of busy  communication {_pct(f.communication)}  memory {_pct(f.memory)}  "
                f"comm/compute overlap {_pct(f.comm_compute_overlap)}  syncs/step {sync}",
                f"  {'top kernels':<62} {'ms':>9} {'count':>6} {'share':>6}",
            ]
            lines += _rows(f.gpu.top_kernels, f.gpu.kernel_total_us, short=True)
        else:
            lines.append(f"  CPU-only trace (no GPU kernels)  syncs/step {sync}")
        basis = "device time of their kernels" if f.op_basis is OpBasis.DEVICE else "self CPU time"
        lines.append(f"  {'top ops (' + basis + ')':<62} {'ms':>9} {'count':>6} {'share':>6}")
        lines += _rows(f.top_ops, f.op_total_us, short=False)
        if a.findings:
            lines.append("  findings")
        for x in a.findings:
            lines.append(f"    {x.severity.value.upper():<8} {x.id}: {x.title}")
            lines += textwrap.wrap(f"fix: {x.fix}", width=106, initial_indent=" " * 13,
                                   subsequent_indent=" " * 18)
        if not a.findings:
            lines.append("  findings: none")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _rows(stats: Iterable[Stat], total: float, short: bool) -> list[str]:
    total = total if total > 0 else 1.0
    out = []
    for s in list(stats)[:TEXT_TOP]:
        name = short_kernel_name(s.name) if short else (s.name if len(s.name) <= 60 else s.name[:57] + "...")
        out.append(f"    {name:<60} {s.us / 1000:>9.2f} {s.count:>6} {100 * s.us / total:>5.1f}%")
    return out


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (exit 2), like the rest of perfmon's CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"perfmon: error: {message} (see perfmon trace --help)\n")


def main(argv: list[str]) -> int:
    """`perfmon trace PATH [--json]`; 2 on a missing, unreadable or non-trace PATH."""
    p = _Parser(prog="perfmon trace", description="Analyse PyTorch profiler (Kineto) traces, one per rank.")
    p.add_argument("path", type=Path, metavar="PATH", help="a trace (.json or .json.gz) or a folder of them")
    p.add_argument("--json", action="store_true", help="machine-readable JSON (schema 1)")
    args = p.parse_args(argv)
    try:
        analyses = analyse_path(args.path)
    except TraceError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"schema": SCHEMA, "traces": [a.to_json() for a in analyses]}, indent=2))
    else:
        print(format_text(analyses))
    return 0
