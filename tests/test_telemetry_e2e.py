"""End-to-end on CPU: host and model fields of the report filled with real numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "demos" / "train_mlp.py"
pytestmark = pytest.mark.e2e


def test_cpu_run_reports_host_model_and_no_device(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "perfmon.cli", "--headless", "--interval", "100", "--sample-interval", "0.2",
         "--no-window-peaks", "--run-dir", str(run), str(DEMO), "--steps", "120", "--workers", "2"], capture_output=True, text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(subprocess.run([sys.executable, "-m", "perfmon.cli", "report", str(run), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    # 256 -> 1024 -> 1024 -> 1 MLP: weights + biases
    params = 256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 + 1
    model = report["model"]
    assert model["params"] == params == model["trainable"] and model["frozen"] == 0
    assert model["by_dtype"] == {"float32": params} and model["param_bytes"] == 4 * params
    assert model["optimizer_bytes"] == 2 * 4 * params + 6 * 4  # AdamW: exp_avg, exp_avg_sq, a float32 step per tensor
    assert model["static_bytes"] >= 4 * 4 * params
    assert model["max_batch"] is None and "CPU run" in model["memory_note"]
    assert report["device"] is None
    host = report["host"]
    assert host["peak_rss_bytes"] > 100 * 2**20 and host["peak_workers_rss_bytes"] > 10 * 2**20
    assert host["samples"] >= 3 and 0 < host["mean_cpu_percent"] <= 100 * host["cpu_count"]
    assert 0 < host["sampler_cpu_fraction"] < 0.05
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    models = [e for e in events if e["type"] == "model" and "roots" in e]
    assert models and models[-1]["roots"] == ["Sequential"]  # the MLP, not the MSELoss module beside it
    hello = events[0]
    assert hello["type"] == "hello" and hello["window_peaks"] is False  # --no-window-peaks reached the agent
