"""Table tests for every rule on synthetic states: fires, stays quiet, hysteresis, warm-up."""

from __future__ import annotations

import random

import pytest
from fake_nvml import GIB

from perfmon import protocol
from perfmon.analysis.rules import REGISTRY, Config, Engine, evaluate_once
from perfmon.analysis.rules.steps import spike_period
from perfmon.analysis.state import RunState

FIELDS = list(protocol.STEP_FIELDS)


def make_state(n=100, data=1.0, fwd=3.0, bwd=4.0, opt=1.5, other=0.5, spikes=None, samples=32, cuda=False,
               gpus=None, cuda_mem=None, model=None, profile=None, host=None, rss=None, t0=1000.0, closures=None,
               prefetch=None):
    """A run of ``n`` steps with the given phase times (ms); extra telemetry optional."""
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="x.py", argv=["x.py"], pid=1, start=t0, cuda=cuda))
    seq = 2
    t = t0
    rows = []
    for i in range(1, n + 1):
        extra = (spikes or {}).get(i, 0.0)
        dur = data + fwd + bwd + opt + other + extra
        t += dur / 1000
        rows.append([i, t, dur, data, fwd, bwd, opt, other + extra, samples, *([closures] if closures else []),
                     *([prefetch] if prefetch is not None else [])])
    fields = [*FIELDS, *(["closures"] if closures else []), *(["prefetch_ms"] if prefetch is not None else [])]
    state.apply(protocol.message("steps", fields=fields, rows=rows, seq=seq))
    seq += 1
    if model is not None:
        state.apply(protocol.message("model", seq=seq, **model))
        seq += 1
    for k in range(len(rss) if rss else 1):
        if gpus is None and cuda_mem is None and host is None and not rss:
            break
        h = dict(host or {"cpu_percent": 100.0, "cpu_count": 8, "system_cpu_percent": 40.0, "workers": 0})
        if rss:
            h["rss_bytes"] = rss[k]
        state.apply(protocol.message("sample", seq=seq, t=t0 + k * 2.0, host=h, gpus=gpus or [], cuda_mem=cuda_mem))
        seq += 1
    if profile is not None:
        state.apply(protocol.message("profile", seq=seq, **profile))
    return state


def ids(state, cfg=None):
    return [f.id for f in evaluate_once(state, cfg)]


def find(state, rule_id, cfg=None):
    return next((f for f in evaluate_once(state, cfg) if f.id == rule_id), None)


LOADER = {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None, "batch_size": 32}
H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 * GIB, "util_gpu": 98, "power_w": 500.0,
        "power_limit_w": 700.0, "throttled": [], "temp_c": 60}


def test_registry_has_the_stable_ids_with_documented_thresholds():
    expected = {"input-bound", "loader-cpu-bound", "device-underused", "host-sync", "memory-pressure", "fragmentation",
                "no-mixed-precision", "priority", "step-instability", "memory-creep", "throttling", "slow-optimizer",
                "communication-bound", "pageable-memcpy", "launch-bound"}
    assert expected <= set(REGISTRY)
    assert all(doc for _, doc in REGISTRY.values())


def test_healthy_run_has_only_the_priority_info():
    findings = evaluate_once(make_state())
    assert [f.id for f in findings] == ["priority"]
    assert findings[0].severity == "info" and "backward" in findings[0].title


@pytest.mark.parametrize("data, severity", [(0.5, None), (1.4, "warn"), (3.0, "critical")])
def test_input_bound_thresholds(data, severity):
    state = make_state(data=data, fwd=3, bwd=3, opt=1, other=0, model={"loaders": [LOADER]})
    f = find(state, "input-bound")
    if severity is None:
        assert f is None
    else:
        assert f.severity == severity and "num_workers=0" in f.fix and f.impact == pytest.approx(data / (data + 7))


@pytest.mark.parametrize("system_cpu, advice", [
    (40.0, "raise DataLoader(num_workers=0) towards 2 (this host has 2 CPUs)"),  # others use 0.3 CPUs
    (100.0, "free CPUs before raising DataLoader(num_workers=0): other processes use 1.5 of this host's 2 CPUs"),
])
def test_input_bound_asks_for_more_workers_only_where_cpus_are_free(system_cpu, advice):
    """On a host other jobs kept busy, input-bound said to add workers while cpu-contention said no CPU was free."""
    host = {"cpu_percent": 50.0, "cpu_count": 2, "system_cpu_percent": system_cpu, "workers": 0}
    f = find(make_state(data=3.0, fwd=3, bwd=3, opt=1, other=0, model={"loaders": [LOADER]}, host=host), "input-bound")
    assert advice in f.fix, f.fix


def test_a_profile_with_few_steps_gets_only_the_rules_that_read_it():
    """A short run that was profiled almost throughout (--profile-every N with a window of N steps) has a window
    but fewer than min_steps steps outside windows: the step rules stay silent (the priority read "Biggest phase:
    data (0% of step time)" off no steps at all); the window's rules still run."""
    prof = {"step": 5, "device": "cuda", "syncs_per_step": 4.0, "device_busy": 0.9,
            "top_ops": [{"name": "cudaStreamSynchronize", "share": 0.01, "calls": 12}]}
    few = make_state(n=5, data=5, cuda=True, gpus=[{**H100, "util_gpu": 40}], profile=prof,
                     model={"loaders": [LOADER]})
    assert ids(few) == ["host-sync"]  # not device-underused either: whether data is the bottleneck is unknown
    assert {"priority", "input-bound", "host-sync"} <= set(ids(make_state(data=5, cuda=True, gpus=[H100], profile=prof,
                                                                             model={"loaders": [LOADER]})))


def test_loader_cpu_bound_when_workers_saturate():
    loader = {**LOADER, "num_workers": 4}
    host = {"cpu_percent": 50.0, "cpu_count": 4, "system_cpu_percent": 98.0, "workers": 4, "workers_cpu_percent": 390.0}
    assert find(make_state(data=5, model={"loaders": [loader]}, host=host), "loader-cpu-bound") is not None
    idle = {**host, "system_cpu_percent": 30.0, "workers_cpu_percent": 40.0}
    assert find(make_state(data=5, model={"loaders": [loader]}, host=idle), "loader-cpu-bound") is None
    # an idle child process beside the workers (wandb's service, multiprocessing's resource tracker) changes nothing
    beside = {**host, "workers": 5}
    assert find(make_state(data=5, model={"loaders": [loader]}, host=beside), "loader-cpu-bound") is not None


def test_device_underused_from_nvml_or_profile():
    assert find(make_state(cuda=True, gpus=[{**H100, "util_gpu": 40}]), "device-underused") is not None
    assert find(make_state(cuda=True, gpus=[H100]), "device-underused") is None
    prof = {"step": 50, "top_ops": [], "device": "cuda", "device_busy": 0.3, "syncs_per_step": 0}
    assert find(make_state(cuda=True, gpus=[H100], profile=prof), "device-underused") is not None
    # input-bound runs are not "launch bound"
    assert find(make_state(data=5, cuda=True, gpus=[{**H100, "util_gpu": 40}]), "device-underused") is None


def test_host_sync_only_on_cuda_profiles():
    prof = {"step": 50, "device": "cuda", "syncs_per_step": 4.0, "device_busy": 0.9,
            "top_ops": [{"name": "cudaStreamSynchronize", "share": 0.01, "calls": 12}]}
    f = find(make_state(cuda=True, gpus=[H100], profile=prof), "host-sync")
    assert f is not None and f.evidence["syncs_per_step"] == 4.0 and ".item()" in f.fix
    assert find(make_state(profile={**prof, "device": "cpu"}), "host-sync") is None
    assert find(make_state(cuda=True, gpus=[H100], profile={**prof, "syncs_per_step": 0.0}), "host-sync") is None


def test_memory_pressure_and_retries():
    mem = {"peak_reserved_bytes": 76 * GIB, "peak_allocated_bytes": 70 * GIB, "reserved_bytes": 76 * GIB,
           "allocated_bytes": 60 * GIB, "alloc_retries": 0, "ooms": 0}
    model = {"static_bytes": 10 * GIB}
    f = find(make_state(cuda=True, gpus=[H100], cuda_mem=mem, model=model), "memory-pressure")
    assert f is not None and f.severity == "warn" and f.evidence["max_batch"] == int((80 * GIB * 0.95 - 10 * GIB) // (60 * GIB / 32))
    f = find(make_state(cuda=True, gpus=[H100], cuda_mem={**mem, "peak_reserved_bytes": 20 * GIB, "alloc_retries": 3}), "memory-pressure")
    assert f is not None and f.severity == "critical"
    assert find(make_state(cuda=True, gpus=[H100], cuda_mem={**mem, "peak_reserved_bytes": 40 * GIB}), "memory-pressure") is None


@pytest.mark.parametrize("mem, fires", [
    # reserved far above allocated at the peak: the allocator held memory it could not use
    ({"reserved_bytes": 30 * GIB, "allocated_bytes": 10 * GIB, "peak_reserved_bytes": 30 * GIB,
      "peak_allocated_bytes": 20 * GIB, "peak_inactive_split_bytes": 6 * GIB}, True),
    # the normal cache after a step freed its activations: reserved >> allocated now, not at the peak
    ({"reserved_bytes": 30 * GIB, "allocated_bytes": 4 * GIB, "peak_reserved_bytes": 30 * GIB,
      "peak_allocated_bytes": 29 * GIB}, False),
    # a large ratio but a small amount
    ({"reserved_bytes": 2 * GIB, "allocated_bytes": GIB, "peak_reserved_bytes": 1.5 * GIB,
      "peak_allocated_bytes": 0.9 * GIB}, False),
])
def test_fragmentation_is_judged_at_the_allocator_peak(mem, fires):
    f = find(make_state(cuda=True, gpus=[H100], cuda_mem=mem), "fragmentation")
    assert (f is not None) == fires
    if fires:
        assert "expandable_segments:True" in f.fix and f.evidence["slack_bytes"] == 10 * GIB
        assert f.evidence["peak_inactive_split_bytes"] == 6 * GIB


def _window(findings):
    return {"step": 50, "device": "cuda", "syncs_per_step": 0, "device_busy": 0.95, "top_ops": [],
            "trace": "t.pt.trace.json", "trace_findings": findings}


MIXED = {"id": "no-mixed-precision", "title": "92% of matrix time in FP32 kernels", "fix": "use autocast",
         "evidence": {"fp32_share": 0.92}}


@pytest.mark.parametrize("window, model, fires", [
    # decided by the kernels that ran: FP32 SIMT GEMMs fire, whatever the parameters are
    (_window([{**MIXED, "severity": "critical"}]), {"by_dtype": {"bfloat16": 1000}}, True),
    # a correct bf16 autocast setup: parameters stay fp32, the kernels were bf16: no finding
    (_window([]), {"by_dtype": {"float32": 1000}}, False),
    # mostly TF32: said by the trace as info, not raised here
    (_window([{**MIXED, "severity": "info"}]), {"by_dtype": {"float32": 1000}}, False),
    # a window summarised by an older job (no trace analysis): never guessed from op names and dtypes
    ({"step": 50, "device": "cuda", "syncs_per_step": 0, "device_busy": 0.95,
      "top_ops": [{"name": "ampere_sgemm_128x64_nn", "share": 0.5, "calls": 30}]}, {"by_dtype": {"float32": 1000}},
     False),
])
def test_no_mixed_precision_from_the_kernels_that_ran(window, model, fires):
    f = find(make_state(cuda=True, gpus=[H100], profile=window, model=model), "no-mixed-precision")
    assert (f is not None) == fires
    if fires:
        assert f.severity == "critical" and f.evidence["fp32_share"] == 0.92 and f.evidence["window_step"] == 50


@pytest.mark.parametrize("rule_id", ["communication-bound", "pageable-memcpy", "launch-bound"])
def test_trace_findings_of_the_last_window_are_live_findings(rule_id):
    found = {"id": rule_id, "severity": "warn", "title": f"{rule_id} title", "fix": "the fix",
             "evidence": {"share": 0.3}}
    f = find(make_state(cuda=True, gpus=[H100], profile=_window([found])), rule_id)
    assert f is not None and (f.title, f.fix, f.evidence["share"]) == (f"{rule_id} title", "the fix", 0.3)
    assert find(make_state(cuda=True, gpus=[H100], profile=_window([])), rule_id) is None


def test_no_mixed_precision_on_a_real_v100_window(tmp_path):
    """The V100 CNN trace (FP32 sgemm/scudnn kernels), summarised as a live window is: the finding fires."""
    import shutil
    from pathlib import Path

    from perfmon.analysis.profile_window import summarise_window

    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    trace = traces / "v100_cnn_rank0.pt.trace.json.gz"
    shutil.copy(Path(__file__).parent / "data" / "gpu-traces" / trace.name, trace)
    window = summarise_window({"type": "profile", "step": 10, "active_steps": 3, "device": "cuda",
                               "trace": str(trace), "t": 1.0})
    window.pop("type")
    f = find(make_state(cuda=True, gpus=[H100], profile=window, model={"by_dtype": {"float32": 1000}}),
             "no-mixed-precision")
    assert f is not None and f.severity == "critical"


def test_priority_notes_overlapped_data():
    f = find(make_state(data=0.1, fwd=1, bwd=1, opt=1, other=0), "priority")
    assert f.severity == "info" and len(f.evidence["share_by_phase"]) == 5
    assert list(f.evidence["share_by_phase"].values()) == sorted(f.evidence["share_by_phase"].values(), reverse=True)


# step: data 0, fwd 3, bwd 4, opt 1.5, other 11.5 = 20 ms; a prefetching thread fetching `prefetch` ms of it
@pytest.mark.parametrize("prefetch, severity", [(None, None), (10.0, None), (15.9, None), (16.0, "critical"),
                                                (19.5, "critical")])
def test_input_bound_when_the_loop_waits_for_a_prefetching_thread(prefetch, severity):
    state = make_state(data=0.0, other=11.5, prefetch=prefetch, model={"loaders": [LOADER]})
    f = find(state, "input-bound")
    assert (f.severity if f else None) == severity
    if f:
        assert "prefetching thread" in f.title and f.evidence["prefetch_busy"] >= 0.8
        assert "num_workers=0" in f.fix and f.impact == pytest.approx(11.5 / 20)
        assert "prefetching thread" in find(state, "priority").fix  # "other" is its wait
    calm = make_state(data=0.0, other=2.0, prefetch=5.0)  # a 10.5 ms step: the thread keeps up, fetching 48% of it
    assert find(calm, "input-bound") is None
    # a thread busy fetching (an evaluation thread, say) that the loop does not wait for: other is 0.5 of 9 ms
    assert find(make_state(data=0.0, other=0.5, prefetch=9.0), "input-bound") is None


@pytest.mark.parametrize("closures, says", [(None, False), (1, True)])
def test_priority_other_names_the_closure_where_steps_run_one(closures, says):
    """Lightning's loss, logged metrics and hooks run inside optimizer.step(closure): "other" says so there."""
    f = find(make_state(fwd=1, bwd=1, opt=0.5, other=3, closures=closures), "priority")
    assert f.title.startswith("Biggest phase: other")
    assert ("optimizer.step(closure)'s closure" in f.fix) == says


def test_step_instability_periodic_spikes_and_quiet_when_steady():
    spikes = {i: 40.0 for i in range(20, 101, 20)}
    f = find(make_state(spikes=spikes), "step-instability")
    assert f is not None and f.evidence["period"] == 20
    assert find(make_state(), "step-instability") is None


@pytest.mark.parametrize("loader, says", [
    (None, None),
    ({**LOADER, "num_workers": 2, "persistent_workers": True}, None),
    ({**LOADER, "num_workers": 2, "persistent_workers": False}, "set persistent_workers=True."),
    # a helper's loop: a DataLoader with 2 workers built every epoch, spikes "every 16 steps"
    ({**LOADER, "num_workers": 2, "persistent_workers": True, "rebuilt": 4}, "build the loader once"),
])
def test_step_instability_with_a_period_names_workers_started_every_epoch(loader, says):
    model = {"loaders": [loader]} if loader else None
    f = find(make_state(spikes={i: 40.0 for i in range(20, 101, 20)}, model=model), "step-instability")
    assert f is not None and f.evidence["period"] == 20
    if says is None:
        assert "workers to start" not in f.fix
    else:
        assert "If 20 steps are an epoch" in f.fix and "2 workers to start" in f.fix and says in f.fix, f.fix


SCATTERED = {35: 40.0, 52: 40.0, 60: 40.0, 77: 40.0, 91: 40.0}  # no period: 17, 8, 17, 14 steps apart
PERIODIC = {i: 40.0 for i in range(20, 101, 20)}
QUIET = {"cpu_percent": 100.0, "cpu_count": 8, "system_cpu_percent": 13.0, "workers": 0}  # others: 0.04 CPUs
BUSY = {**QUIET, "system_cpu_percent": 40.0}  # others: 2.2 of 8 CPUs
WAITING = {**QUIET, "trainer_wait_percent": 45.0}  # waits 31% of the CPU time it wants


@pytest.mark.parametrize("spikes, host, severity, busy", [
    (SCATTERED, None, "warn", None),
    (SCATTERED, QUIET, "warn", None),
    (SCATTERED, BUSY, "info", "other processes use 2.2 of 8 CPUs"),
    (SCATTERED, WAITING, "info", "the trainer waits for a CPU 31% of the time"),
    (PERIODIC, BUSY, "warn", None),  # a period is the loop's own, however busy the host
], ids=["no host readings", "quiet host", "busy host", "trainer waits for CPUs", "periodic on a busy host"])
def test_step_instability_says_when_a_busy_host_explains_the_spikes(spikes, host, severity, busy):
    f = find(make_state(spikes=spikes, host=host), "step-instability")
    assert f is not None and f.severity == severity
    if busy:
        assert "busy host" in f.title and busy in f.title and f.fix.startswith("Likely the host's")
        assert "other_processes_cpus" in f.evidence and "wait_share" in f.evidence
    else:
        assert f.title.startswith("Unstable step time") and "other_processes_cpus" not in f.evidence


def test_step_instability_ignores_warmup_and_profiled_steps():
    # a huge first step (compilation) is warm-up, not instability
    assert find(make_state(spikes={1: 5000.0, 2: 3000.0}), "step-instability") is None


def test_memory_creep_vs_flat_memory():
    growing = [1 * GIB + k * 20 * 2**20 for k in range(60)]
    f = find(make_state(rss=growing), "memory-creep")
    assert f is not None and f.evidence["series"] == "rss" and f.evidence["grown_bytes"] > 500 * 2**20
    flat = [1 * GIB + (k % 3) * 2**20 for k in range(60)]
    assert find(make_state(rss=flat), "memory-creep") is None


@pytest.mark.parametrize("points, per_point_mib, found", [
    (15, 85, True),  # a helper's leak: RSS 342 -> 1617 MiB in 16 s (15 readings past warm-up) went unsaid
    (15, 20, False),  # +280 MiB over 15 s: too little to judge on so few readings (it would be over 20)
    (25, 20, True),  # +480 MiB over 25 readings: the usual bar
    (9, 200, False),  # under 10 readings: not judged
])
def test_memory_creep_in_a_short_run_needs_a_bigger_rise(points, per_point_mib, found):
    rss = [342 * 2**20 + k * per_point_mib * 2**20 for k in range(points)]
    assert (find(make_state(rss=rss), "memory-creep") is not None) is found


def test_throttling():
    hot = {**H100, "throttled": ["hw_thermal"], "sm_clock_mhz": 1400, "sm_clock_max_mhz": 1980}
    assert find(make_state(cuda=True, gpus=[hot]), "throttling") is not None
    assert find(make_state(cuda=True, gpus=[{**H100, "power_w": 699.0}]), "throttling") is not None
    assert find(make_state(cuda=True, gpus=[H100]), "throttling") is None


@pytest.mark.parametrize("flags, gpus, fires", [
    ({"fused": None, "foreach": None, "devices": ["cpu"]}, None, True),  # CPU default: a per-tensor loop
    ({"fused": None, "foreach": None, "devices": ["cuda"]}, [H100], False),  # CUDA default: foreach
    ({"fused": None, "foreach": False, "devices": ["cuda"]}, [H100], True),  # foreach turned off
    ({"fused": None, "foreach": None, "devices": ["cuda"], "differentiable": True}, [H100], True),
    ({"fused": True, "foreach": None, "devices": ["cpu"]}, None, False),
    ({"fused": None, "foreach": True, "devices": ["cpu"]}, None, False),
    ({"fused": None, "foreach": None}, [H100], False),  # an older recording of a GPU run: torch's default there
    ({"fused": None, "foreach": None}, None, True),
])
def test_slow_optimizer(flags, gpus, fires):
    model = {"optimizer_flags": [{"name": "AdamW", "param_tensors": 200, **flags}]}
    f = find(make_state(opt=6, model=model, gpus=gpus, cuda=gpus is not None), "slow-optimizer")
    assert (f is not None) == fires
    if fires:
        assert "foreach=True" in f.fix
    assert find(make_state(opt=1, model=model, gpus=gpus, cuda=gpus is not None), "slow-optimizer") is None


@pytest.mark.parametrize("loader, says, not_says", [
    ({**LOADER, "num_workers": 2, "dataset": "ImageFolder", "rebuilt": 0}, "persistent_workers=True",
     "build the DataLoader once"),
    # a helper's loop: DataLoader(num_workers=2) built inside the epoch loop, its first fetch 89 ms against 3
    ({**LOADER, "num_workers": 2, "dataset": "ImageFolder", "rebuilt": 5},
     "build the DataLoader once, before the epoch loop: a new one each epoch starts its 2 workers",
     "set persistent_workers=True"),
    # per-sample indexing and collate of tensors: nothing to decode
    ({**LOADER, "dataset": "TensorDataset"}, "sampler=BatchSampler(RandomSampler(dataset), batch_size=32",
     "decoding/augmentation"),
    ({**LOADER, "dataset": "ImageFolder"}, "decoding/augmentation", "BatchSampler"),
])
def test_input_bound_fix_fits_the_loader(loader, says, not_says):
    host = {"cpu_percent": 100.0, "cpu_count": 8, "system_cpu_percent": 20.0, "workers": 0}
    f = find(make_state(data=3.0, fwd=3, bwd=3, opt=1, other=0, model={"loaders": [loader]}, host=host),
             "input-bound")
    assert f is not None and says in f.fix and not_says not in f.fix, f.fix


@pytest.mark.parametrize("tensors, opt_ms, arithmetic", [
    (200, 6.0, False),  # 30 us a tensor: the loop's overhead, which foreach removes
    (10, 255.0, True),  # a helper's recommender: an 800k x 32 embedding under Adam, 25 ms a tensor
])
def test_slow_optimizer_names_the_loop_or_the_arithmetic(tensors, opt_ms, arithmetic):
    model = {"params": 25_700_000, "optimizer_flags": [{"name": "Adam", "param_tensors": tensors, "fused": None,
                                                        "foreach": None, "devices": ["cpu"]}]}
    f = find(make_state(opt=opt_ms, model=model), "slow-optimizer")
    assert f is not None and f.evidence["ms_per_tensor"] == pytest.approx(opt_ms / tensors, rel=1e-3)
    if arithmetic:
        assert "25,700,000 parameters: 25.5 ms a tensor" in f.title and "SparseAdam" in f.fix
        assert "per-tensor loop" not in f.title
    else:
        assert "per-tensor loop" in f.title and "foreach=True" in f.fix and "SparseAdam" not in f.fix


def test_too_few_steps_yield_nothing():
    assert evaluate_once(make_state(n=15, data=5)) == []


def test_hysteresis_appears_after_hold_and_clears_after_clear():
    cfg = Config(hold=3, clear=2)
    engine = Engine(cfg)
    bad = make_state(data=5)
    assert engine.update(bad) == [] and engine.update(bad) == []
    assert [f.id for f in engine.update(bad)][:1] == ["input-bound"]
    assert "input-bound" in [f.id for f in engine.active]
    good = make_state()
    engine.update(good)
    assert "input-bound" in [f.id for f in engine.active]  # one good evaluation is not enough
    engine.update(good)
    assert "input-bound" not in [f.id for f in engine.active]


def test_the_engine_is_settled_once_a_holding_finding_would_have_shown():
    """Until ``hold`` evaluations with enough steps have run, an empty list is no answer yet ("no findings yet"),
    not "nothing is wrong": a finding that holds from the start shows only at the hold-th."""
    engine = Engine(Config(hold=3))
    engine.update(make_state(n=15, data=5))  # too few steps: not an evaluation
    bad = make_state(data=5)
    settled = []
    for _ in range(3):
        settled.append(engine.settled)
        engine.update(bad)
    assert settled == [False, False, False] and engine.settled and engine.active


def test_config_from_toml(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('disabled = ["priority"]\n[thresholds]\ndata-warn = 0.5\ndata_critical = 0.6\n')
    cfg = Config.from_toml(path)
    assert cfg.data_warn == 0.5 and "priority" not in ids(make_state(data=2), cfg)
    assert "input-bound" not in ids(make_state(data=2), cfg)
    path.write_text("[thresholds]\nno_such = 1\n")
    with pytest.raises(ValueError, match="unknown setting"):
        Config.from_toml(path)


@pytest.mark.parametrize(("workers_cpu", "wait", "system", "fires"), [
    # a host shared with other jobs: the workers get little CPU but sit runnable, waiting for it
    (60.0, 150.0, 100.0, True),    # want 210% of 2 CPUs: CPU-bound preprocessing
    (60.0, 110.0, 100.0, False),   # want 170% of 200%: 85%, under the 90% line
    (60.0, 120.0, 100.0, True),    # want 180%: exactly 90%
    (20.0, 5.0, 100.0, False),     # workers that sleep (I/O) on a busy host: not this finding
    (60.0, None, 100.0, False),    # a kernel without schedstat: CPU alone decides (30% of the host < 40%)
])
def test_loader_cpu_bound_counts_time_the_workers_waited_for_a_cpu(workers_cpu, wait, system, fires):
    loader = {**LOADER, "num_workers": 4}
    host = {"cpu_percent": 40.0, "cpu_count": 2, "system_cpu_percent": system, "workers": 4,
            "workers_cpu_percent": workers_cpu, "workers_wait_percent": wait}
    f = find(make_state(data=5, model={"loaders": [loader]}, host=host), "loader-cpu-bound")
    assert (f is not None) == fires
    if fires:
        assert f.evidence["workers_wait_percent"] == wait and "CPU-bound" in f.fix


def test_too_few_workers_when_each_is_busy_and_cpus_are_idle():
    loader = {**LOADER, "num_workers": 2}
    host = {"cpu_percent": 30.0, "cpu_count": 16, "system_cpu_percent": 20.0, "workers": 2, "workers_cpu_percent": 196.0}
    f = find(make_state(data=5, model={"loaders": [loader]}, host=host), "loader-cpu-bound")
    assert f is not None and "num_workers=2) to 4" in f.fix
    assert find(make_state(data=5, model={"loaders": [loader]}, host=host), "input-bound") is None  # superseded


def test_host_cpu_is_judged_over_the_samples_taken_while_stepping():
    """A sample after the loop ended (workers idle) must not hide CPU-bound workers seen while training."""
    loader = {**LOADER, "num_workers": 2}
    state = make_state(data=5, model={"loaders": [loader]})
    busy = {"cpu_percent": 60.0, "cpu_count": 2, "system_cpu_percent": 97.0, "workers": 2, "workers_cpu_percent": 180.0}
    seq, t, i = 10, 2000.0, 100
    for k in range(4):  # steps advance between these samples
        i += 10
        state.apply(protocol.message("steps", fields=FIELDS, seq=seq, rows=[
            [j, t + j * 0.01, 11.0, 5.0, 3.0, 3.0, 0.0, 0.0, 32] for j in range(i - 9, i + 1)]))
        state.apply(protocol.message("sample", seq=seq + 1, t=t + k, host=busy, gpus=[]))
        seq += 2
    idle = {**busy, "system_cpu_percent": 12.0, "workers_cpu_percent": 3.0}
    state.apply(protocol.message("sample", seq=seq, t=t + 9, host=idle, gpus=[]))  # no step since
    assert state.host.system_cpu_percent == 12.0
    assert state.recent_host().system_cpu_percent == 97.0
    assert find(state, "loader-cpu-bound") is not None


@pytest.mark.parametrize("host, fires", [
    # workers fill the CPUs
    ({"cpu_count": 4, "system_cpu_percent": 98.0, "workers_cpu_percent": 390.0}, True),
    # a busy host, most of it the workers
    ({"cpu_count": 2, "system_cpu_percent": 95.0, "workers_cpu_percent": 150.0}, True),
    # the case: workers at 6%, host idle: never "saturate the CPU"
    ({"cpu_count": 2, "system_cpu_percent": 0.0, "workers_cpu_percent": 6.0}, False),
    # a busy host, but not because of the workers (another job)
    ({"cpu_count": 2, "system_cpu_percent": 97.0, "workers_cpu_percent": 12.0}, False),
    # a host shared with one other job: the workers get their session's half of it, and use all of that
    ({"cpu_count": 2, "system_cpu_percent": 100.0, "workers_cpu_percent": 94.0}, True),
    # ... but a third of it is not the workers filling the host
    ({"cpu_count": 2, "system_cpu_percent": 100.0, "workers_cpu_percent": 66.0}, False),
])
def test_loader_cpu_bound_never_contradicts_its_evidence(host, fires):
    loader = {**LOADER, "num_workers": 2}
    f = find(make_state(data=5, model={"loaders": [loader]}, host={"cpu_percent": 40.0, "workers": 2, **host}),
             "loader-cpu-bound")
    assert (f is not None and "saturate" in f.title) == fires
    if f is not None:  # every number in the title is the evidence's own
        ev = f.evidence
        assert f"{ev['workers']} workers use {ev['workers_cpu_share']:.0%} of {ev['cpu_count']} CPUs" in f.title
        assert f"host {ev['system_cpu_percent'] / 100:.0%} busy" in f.title
        assert ev["workers_cpu_share"] >= 0.9 or ev["system_cpu_percent"] >= 90


@pytest.mark.parametrize("text, error", [
    ('data_warn = "0.2"', "data_warn wants a number"),
    ("warmup_steps = 2.5", "warmup_steps wants an integer"),
    ("data_warn = true", "data_warn wants a number"),
    ('disabled = "priority"', "'disabled' wants a list"),
    ('disabled = ["priorty"]', "'disabled' names no rule 'priorty'"),  # misspelt: the rule would stay on
    ("fp32_gemm_share = 0.4", "'fp32_gemm_share' is no longer a setting: no-mixed-precision comes from"),
    ("first_step_ratio = 5.0", "'first_step_ratio' is no longer a setting"),
    ("thresholds = 3", "'thresholds' wants a table"),
    ("data_warn = -1", r"data_warn wants a number >= 0 \(default 0.1\), got -1"),
    ("spike_ratio = nan", "spike_ratio wants a number >= 0"),
    ("[thresholds]\ndata_warn = 0.3\ndata_critical = 0.2", r"data_critical \(0.2\) is below data_warn \(0.3\)"),
    ("straggler_critical = 0.05", r"straggler_critical \(0.05\) is below straggler_warn \(0.1\)"),  # the default
])
def test_config_wrong_types_are_refused_not_silently_disabling(tmp_path, text, error):
    path = tmp_path / "rules.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=error):
        Config.from_toml(path)


@pytest.mark.parametrize("spikes, expected", [
    (list(range(45, 301, 15)), 15),  # a checkpoint every 15 steps
    (sorted(set(range(45, 301, 15)) | {50, 51, 97, 133, 170, 171, 172, 250}), 15),  # and a busy host's slow steps
    (sorted(set(range(45, 301, 15)) - {105}), 15),  # one save that was fast
    ([35, 52, 60, 77, 91], None),  # scattered
    ([40, 41, 42, 43], None),  # one slow stretch is not a period
    ([45, 60], None),  # two are not enough
    ([40, 140, 240], None),  # three chance hits of a gap longer than a third of the window are not a period
], ids=["exact", "with noise between", "one missed", "scattered", "a stretch", "two", "long gap"])
def test_spike_period_survives_a_busy_hosts_slow_steps(spikes, expected):
    assert spike_period(spikes, list(range(31, 301))) == expected


@pytest.mark.parametrize("rate", [0.05, 0.1, 0.15, 0.25])
def test_random_slow_steps_are_not_called_periodic(rate):
    """A busy host's slow steps fall at random: 20-40% of such windows of 200 steps were called periodic ("spikes
    every 42 steps", with a fix about checkpoints every N steps); at most 1% may be now (4 equally spaced slow
    steps do happen by chance). A checkpoint every 25 steps among them is still found (up to 15% of steps slow
    at random: beyond that the rule reports the spread, p99/p50, not a period)."""
    rng = random.Random(int(rate * 1000))
    steps = list(range(101, 301))
    windows = [[i for i in steps if rng.random() < rate] for _ in range(400)]
    assert len([w for w in windows if spike_period(w, steps)]) <= 4
    if rate <= 0.15:
        assert [spike_period(sorted(set(w) | set(range(103, 301, 25))), steps) for w in windows[:50]] == [25] * 50
