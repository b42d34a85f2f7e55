"""perfmon's trace numbers next to HolisticTraceAnalysis' (HTA) for each trace, and how long each takes.

    python benchmarks/trace_vs_hta.py [PATH ...]      # default: tests/data/gpu-traces/*.json.gz

Needs `pip install HolisticTraceAnalysis` (in perfmon's dev extras; pulls pandas and jupyterlab, not torch).
HTA reads a folder, so each trace is linked alone into a temporary folder. Fractions are printed in percent.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from perfmon.analysis.trace import analyse_trace

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gpu-traces"
KEYS = ("idle", "compute", "non_compute", "communication", "memory", "comm_compute_overlap")


def hta_numbers(trace: Path) -> dict[str, Any]:
    """HTA's temporal and kernel-type breakdowns, comm/compute overlap and top-5 kernels of one trace."""
    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)  # it logs every parse step at WARNING
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # its overlap divides 0 by 0 without communication
        (Path(tmp) / trace.name).symlink_to(trace.resolve())
        t = TraceAnalysis(trace_dir=tmp)
        temporal = t.get_temporal_breakdown(visualize=False).iloc[0]
        types, kernels = t.get_gpu_kernel_breakdown(visualize=False)
        overlap = float(t.get_comm_comp_overlap(visualize=False).iloc[0]["comp_comm_overlap_pctg"])
    span = float(temporal["kernel_time(us)"])
    total = float(types["sum"].sum())

    def typed(word: str) -> float:
        return float(types[types["kernel_type"].str.contains(word)]["sum"].sum()) / total

    named = kernels[kernels["name"] != "others"].sort_values("sum (us)", ascending=False)
    return {
        "idle": float(temporal["idle_time(us)"]) / span,
        "compute": float(temporal["compute_time(us)"]) / span,
        "non_compute": float(temporal["non_compute_time(us)"]) / span,
        "communication": typed("COMMUNICATION"),
        "memory": typed("MEMORY"),
        "comm_compute_overlap": None if overlap != overlap else overlap / 100.0,  # NaN: no communication
        "span_ms": span / 1000.0,
        "top5": list(named["name"].head(5)),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:6.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path, help="trace files (default: the test traces)")
    args = p.parse_args()
    paths = args.paths or sorted(DATA.glob("*.json.gz"))
    print(f"{'trace':<34} {'metric':<22} {'perfmon':>8} {'HTA':>8}")
    for path in paths:
        t0 = time.perf_counter()
        ours = analyse_trace(path).to_json()
        t1 = time.perf_counter()
        theirs = hta_numbers(path)
        t2 = time.perf_counter()
        for key in KEYS:
            print(f"{path.name:<34} {key:<22} {_pct(ours[key]):>8} {_pct(theirs[key]):>8}")
        print(f"{path.name:<34} {'span_ms':<22} {ours['span_ms']:8.1f} {theirs['span_ms']:8.1f}")
        same = {k["name"] for k in ours["top_kernels"][:5]} == set(theirs["top5"])
        print(f"{path.name:<34} {'same top-5 kernels':<22} {str(same):>8}")
        print(f"{path.name:<34} {'seconds':<22} {t1 - t0:8.2f} {t2 - t1:8.2f}")


if __name__ == "__main__":
    main()
