"""``--prometheus``: scraped during a real run and parsed with prometheus_client's own parsers; per-rank label
sets for a job; GPU and allocator readings; findings as labelled gauges; clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from test_e2e import PERFMON, REPO, env, wait_for  # noqa: F401  (env: private runtime dir)
from tui_fixtures import write_job, write_recording

from perfmon.analysis.job import JobState
from perfmon.analysis.report import load_recording
from perfmon.analysis.series import Histogram
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.prometheus import BUCKETS, Endpoint, MetricsError, parse_address


def scrape(url: str, openmetrics: bool = False) -> dict[str, Any]:
    """The endpoint's families by name (parsed by prometheus_client)."""
    req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
                                 if openmetrics else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    parse = parse_openmetrics if openmetrics else text_string_to_metric_families
    return {fam.name: fam for fam in parse(text)}


def value(fam: Any, suffix: str = "", **labels: str) -> float:
    for s in fam.samples:
        if s.name == fam.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {fam.name}{suffix} {labels}")


#: A DataLoader + SGD loop that runs until its stop file appears (batch 64), so the test scrapes it while it runs
#: however slow the machine is.
UNTIL_STOPPED = """
import os, sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
x = torch.randn(64 * 8, 16)
loader = DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=64)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
while not os.path.exists(sys.argv[1]):
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


@pytest.mark.e2e
def test_scraped_during_a_real_run(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    script, stop = tmp_path / "until_stopped.py", tmp_path / "stop"
    script.write_text(UNTIL_STOPPED)
    proc = subprocess.Popen([*PERFMON, "--headless", "--prometheus", "0", "--run-dir", str(tmp_path / "run"),
                             str(script), str(stop)], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        url = wait_for(lambda: next((w for line in lines for w in line.split() if w.startswith("http://")), None),
                       "the metrics URL on stderr")

        def steps_and_a_sample() -> dict[str, Any] | None:
            fams = scrape(url)
            done = [s for s in fams["perfmon_steps"].samples if s.value >= 20]  # none before the first steps
            sampled = fams.get("perfmon_process_resident_memory_bytes")
            return fams if done and sampled is not None and sampled.samples else None

        fams = wait_for(steps_and_a_sample, "20 steps and a telemetry sample in the scraped metrics")
        assert fams["perfmon_step_seconds"].type == "histogram"
        assert fams["perfmon_steps"].type == fams["perfmon_phase_seconds"].type == "counter"
        steps = value(fams["perfmon_steps"], "_total")
        assert value(fams["perfmon_running"]) == 1.0  # the job runs until the test stops it
        assert 0 < value(fams["perfmon_step_seconds"], "_count") <= steps
        buckets = [s.value for s in fams["perfmon_step_seconds"].samples if s.name.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == value(fams["perfmon_step_seconds"], "_count")
        phases = {s.labels["phase"]: s.value for s in fams["perfmon_phase_seconds"].samples}
        assert set(phases) == {"data", "forward", "backward", "optimizer", "other"} and phases["backward"] > 0
        assert value(fams["perfmon_samples"], "_total") == steps * 64  # the script's batch size
        assert value(fams["perfmon_process_resident_memory_bytes"]) > 10 * 2**20
        om = scrape(url, openmetrics=True)  # the same numbers in OpenMetrics, as Prometheus asks for them
        assert om["perfmon_steps"].type == "counter" and value(om["perfmon_steps"], "_total") >= steps
    finally:
        stop.touch()
        proc.wait(timeout=300)
    assert proc.returncode == 0


def test_a_job_has_one_label_set_per_rank_and_its_straggler_as_a_finding(tmp_path: Path) -> None:
    job_dir = write_job(tmp_path / "job", world=4, slow=2, extra_ms=12.0, device="gpu", window_peaks=True)
    job, lock = JobState(), threading.Lock()
    for msg in JobSource(job_dir, follow=False).messages():
        job.apply(msg)
    endpoint = Endpoint("127.0.0.1:0")
    try:
        endpoint.watch(lock, job=job)
        fams = scrape(endpoint.url)
        ranks = {s.labels["rank"] for s in fams["perfmon_steps"].samples}
        assert ranks == {"0", "1", "2", "3"}
        assert value(fams["perfmon_steps"], "_total", rank="2", node="0") == 3000
        assert value(fams["perfmon_running"], rank="0") == 0.0  # the recording holds its exit
        assert value(fams["perfmon_finding"], rank="2", id="straggler", severity="critical") == 1.0
        assert not [s for s in fams["perfmon_finding"].samples if s.labels["id"] == "straggler"
                    and s.labels["rank"] != "2"]
        gpu = fams["perfmon_gpu_utilization_ratio"]
        assert {s.labels["gpu"] for s in gpu.samples} == {"0"} and all(0 <= s.value <= 1 for s in gpu.samples)
        assert value(fams["perfmon_gpu_memory_total_bytes"], rank="1", gpu="0") > 70 * 2**30
        assert value(fams["perfmon_allocator_peak_allocated_bytes"], rank="3") > 0
        assert value(fams["perfmon_mfu_ratio"], rank="0") > 0
    finally:
        endpoint.close()


def test_a_single_run_has_no_rank_labels(tmp_path: Path) -> None:
    state = load_recording(write_recording(tmp_path / "run"))
    endpoint = Endpoint("127.0.0.1:0")
    try:
        endpoint.watch(threading.Lock(), lambda: state)
        fams = scrape(endpoint.url)
        assert [s.labels for s in fams["perfmon_steps"].samples] == [{}]
        assert value(fams["perfmon_steps"], "_total") == 3000
        assert value(fams["perfmon_step_seconds"], "_sum") == pytest.approx(state.totals["step"].total_ms / 1000)
        ids = {s.labels["id"] for s in fams["perfmon_finding"].samples}
        assert "input-bound" in ids  # the fixture's data loading slows in its second half
    finally:
        endpoint.close()


def test_a_fast_jobs_weighted_rows_still_make_whole_monotonic_buckets(tmp_path: Path) -> None:
    """Live rows of a fast job stand for the rows sent in bulk (fractional weights): the exported buckets are
    whole counts that never fall and end at the exact step count, as OpenMetrics requires."""
    state = load_recording(write_recording(tmp_path / "run"))
    hist = state.totals["step"].hist
    hist.add_many([0.3, 0.7, 1.1, 2.9, 0.05] * 7, weight=13.37, extra=420)  # 35 rows standing for 35 + 420
    endpoint = Endpoint("127.0.0.1:0")
    try:
        endpoint.watch(threading.Lock(), lambda: state)
        om = scrape(endpoint.url, openmetrics=True)  # the OpenMetrics parser refuses fractional buckets
        fam = om["perfmon_step_seconds"]
        buckets = [s.value for s in fam.samples if s.name.endswith("_bucket")]
        assert all(b == int(b) for b in buckets) and buckets == sorted(buckets)
        assert buckets[-1] == value(fam, "_count") == hist.n
    finally:
        endpoint.close()


def test_before_the_monitor_watches_anything_the_endpoint_answers_empty() -> None:
    endpoint = Endpoint("127.0.0.1:0")
    try:
        fams = scrape(endpoint.url)
        assert fams["perfmon_steps"].samples == []
    finally:
        endpoint.close()


@pytest.mark.parametrize(("given", "want"), [
    ("9100", ("127.0.0.1", 9100)), ("0.0.0.0:9100", ("0.0.0.0", 9100)), ("[::1]:9", ("::1", 9)),
    (":9100", ("127.0.0.1", 9100)),
])
def test_parse_address(given: str, want: tuple[str, int]) -> None:
    assert parse_address(given) == want


@pytest.mark.parametrize("bad", ["", "host", "host:port", "70000", "1.2.3.4:"])
def test_bad_addresses_are_refused_with_the_form_to_use(bad: str) -> None:
    with pytest.raises(MetricsError, match="PORT or HOST:PORT"):
        Endpoint(bad)


def test_a_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    first = Endpoint("127.0.0.1:0")
    try:
        with pytest.raises(MetricsError, match="cannot listen"):
            Endpoint(f"127.0.0.1:{first.port}")
    finally:
        first.close()


def test_without_prometheus_client_the_option_says_what_to_install(env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from perfmon.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "--headless", "--prometheus", "9100", "--run-dir",
                          str(tmp_path / "run"), str(REPO / "demos" / "train_mlp.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "perfmon[metrics]" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before the job started


@pytest.mark.parametrize(("values", "bounds_s", "want"), [
    ([0.5, 5.0, 50.0], (0.001, 0.01, 0.1), [1, 2, 3]),  # ms values against second bounds
    ([0.9, 0.95, 2.6], (0.001, 0.0025, 0.005), [2, 2, 3]),
    ([0.0, 3.0], (0.001,), [1]),  # a zero counts in every bucket
    ([], BUCKETS[:2], [0, 0]),
])
def test_histogram_cumulative_buckets(values: list[float], bounds_s: tuple[float, ...], want: list[int]) -> None:
    h = Histogram()
    for v in values:
        h.add(v)
    assert h.cumulative([b * 1000 for b in bounds_s]) == want


def test_report_json_is_unchanged_by_the_option(tmp_path: Path) -> None:
    """The endpoint reads; it never changes what the monitor records or reports."""
    run = write_recording(tmp_path / "run")
    before = json.dumps(load_recording(run).steps)
    endpoint = Endpoint("127.0.0.1:0")
    try:
        state = load_recording(run)
        endpoint.watch(threading.Lock(), lambda: state)
        scrape(endpoint.url)
        assert json.dumps(state.steps) == before
    finally:
        endpoint.close()
