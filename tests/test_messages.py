"""The typed messages: what parse makes of good, odd and bad messages."""

from __future__ import annotations

from perfmon import messages, protocol
from perfmon.analysis.state import RunState


def test_fields_of_the_wrong_type_become_none_and_ints_stay_ints():
    host = {"cpu_percent": "high", "rss_bytes": 2**30, "workers": True}
    gpus = [{"index": 0, "util_gpu": 87, "throttled": ["hw_thermal"]}, "junk"]
    msg = protocol.message("sample", seq=4, t=10, host=host, gpus=gpus)
    s = messages.parse(msg)
    assert isinstance(s, messages.Sample) and s.seq == 4 and s.t == 10.0
    assert s.host == messages.HostSample(rss_bytes=2**30) and isinstance(s.host.rss_bytes, int)
    (g,) = s.gpus
    assert g.util_gpu == 87 and g.throttled == ("hw_thermal",) and g.power_w is None
    assert s.cuda_mem is None  # not sent: the last reading stands


def test_a_sample_without_a_time_is_invalid_and_counted_as_skipped():
    assert isinstance(messages.parse(protocol.message("sample", host={})), messages.Invalid)
    state = RunState()
    state.apply(protocol.message("sample", seq=1, t="soon"))
    assert state.skipped == 1 and state.samples_seen == 0 and state.last_seq == 1


def test_an_older_agents_zero_process_memory_is_unknown():
    (g,) = messages.parse(protocol.message("sample", t=1.0, gpus=[{"proc_mem_bytes": 0}])).gpus
    assert g.proc_mem_bytes is None and g.proc_mem_reason == messages.LEGACY_PROC_MEM_REASON
    new = {"proc_mem_bytes": 0, "proc_mem_reason": None}
    (g,) = messages.parse(protocol.message("sample", t=1.0, gpus=[new])).gpus
    assert g.proc_mem_bytes == 0  # a new agent's 0 is 0 bytes


def test_facts_sent_in_pieces_are_merged_field_by_field():
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="a.py", pid=3, cuda=None))
    state.apply(protocol.message("hello", seq=2, cuda=True, gpu_reason=None))
    assert (state.meta.script, state.meta.pid, state.meta.cuda) == ("a.py", 3, True)
    assert state.meta.received and state.meta.gpus_probed
    state.apply(protocol.message("model", seq=3, params=10, loaders=[{"num_workers": 2, "pin_memory": True}]))
    state.apply(protocol.message("model", seq=4, flops_per_step=1e9))
    assert state.model.params == 10 and state.model.flops_per_step == 1e9
    assert state.model.loaders == (messages.LoaderSettings(num_workers=2, pin_memory=True),)


def test_step_rows_are_columns_and_a_bad_value_cuts_the_message():
    fields = [*protocol.STEP_FIELDS, "closures", "dev_forward_ms"]
    rows = [[1, 100.0, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 32, 3, 1.5],
            [2, 100.01, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 0, None, None],
            [3, 100.02],  # the wrong length: dropped alone
            [4, 100.03, "x", 1.0, 2.0, 3.0, 2.0, 2.0, 32, 1, None]]
    s = messages.parse(protocol.message("steps", fields=fields, rows=rows, outside={"checkpoint_ms": 5}))
    assert isinstance(s, messages.StepRows) and len(s) == 2 and s.cut
    assert s.i == [1, 2] and s.phases[1] == [1.5, 2.0]  # the device time where measured
    assert s.samples == [32, 0] and s.closures == [3, None] and s.device_timed
    assert s.outside == {"checkpoint": 5.0}
    fetched = messages.parse(protocol.message("steps", fields=[*protocol.STEP_FIELDS, "prefetch_ms"],
                                              rows=[[1, 100.0, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 32, 7.5]],
                                              bulk={"n": 3, "sum_ms": {"dur": 30.0}, "prefetch_ms": 21.0}))
    assert fetched.prefetch == [7.5] and fetched.bulk.prefetch_ms == 21.0 and s.prefetch is None
    missing = protocol.message("steps", fields=["i", "t"], rows=[[1, 2.0]])
    assert messages.parse(missing).cut  # a required column is missing


def test_events_profiles_and_the_rest():
    exit_ = messages.parse(protocol.message("event", kind="exit", code=1, exception="ValueError: boom", t=5))
    assert exit_ == messages.Exit(code=1, exception="ValueError: boom", t=5)
    edge = messages.parse(protocol.message("event", kind="window_started", t=2, what="profile"))
    assert edge == messages.WindowEdge(started=True, t=2.0, what="profile")
    answer = protocol.message("event", kind="command_result", name="stop", id=1, ok=True, extra=1)
    result = messages.parse(answer)
    assert result == messages.CommandResult(name="stop", id=1, ok=True)
    profile = messages.parse(protocol.message("profile", step=3, top_ops=[], seq=4))
    assert profile == messages.ProfileWindow(seq=4, step=3, given=frozenset({"step", "top_ops"}))
    assert isinstance(messages.parse(protocol.message("log", text="x", seq=9)), messages.Other)
    assert isinstance(messages.parse({"type": "reset"}), messages.Reset)


def test_a_profile_window_is_read_once_into_typed_parts():
    """Top ops and kernels, the breakdown and the trace's findings become records; a value of the wrong type
    becomes None (or is dropped, for a list item that is not an object), never a crash downstream; what the
    window carried is written back as it came."""
    sent = {
        "type": "profile", "v": 1, "seq": 7, "step": 40, "active_steps": 3, "reason": "on demand", "device": "cuda",
        "trace": "/r/traces/x.pt.trace.json", "t": 5.5, "ops_total": 212, "syncs_per_step": 2, "device_busy": 0.8,
        "top_ops": [{"name": "aten::mm", "calls": 30, "kind": "op", "self_ms": 1.5, "share": 0.5},
                    {"name": "aten::add", "calls": "many", "self_ms": None, "share": 0.1}, "junk"],
        "top_kernels": [{"name": "sgemm", "calls": 30, "kind": "kernel", "self_ms": 1.2, "share": 0.9}],
        "breakdown": {"idle": 0.2, "compute": 0.7, "communication": "n/a", "span_ms": 12.5},
        "trace_findings": [{"id": "launch-bound", "severity": "warn", "title": "t", "evidence": {"idle": 0.4},
                            "fix": "f"}],
    }
    w = messages.parse(sent)
    assert isinstance(w, messages.ProfileWindow)
    assert (w.seq, w.step, w.device, w.syncs_per_step, w.ops_total) == (7, 40, "cuda", 2, 212)
    assert [op.name for op in w.top_ops] == ["aten::mm", "aten::add"]  # "junk" is not an op
    assert w.top_ops[1].calls is None and w.top_ops[1].self_ms is None  # wrong types: None
    assert w.top_kernels[0].self_ms == 1.2
    assert w.breakdown is not None and (w.breakdown.compute, w.breakdown.communication) == (0.7, None)
    found = w.finding("launch-bound")
    assert found is not None and found.evidence == {"idle": 0.4} and w.finding("host-sync") is None
    back = messages.as_sent(w)
    assert back["top_kernels"] == sent["top_kernels"] and back["trace_findings"] == sent["trace_findings"]
    assert "analysis_error" not in back  # not carried, not written
    odd = messages.parse({"type": "profile", "step": "3", "top_ops": "none", "breakdown": [1]})
    assert isinstance(odd, messages.ProfileWindow) and (odd.step, odd.top_ops, odd.breakdown) == (None, (), None)


def test_reset_forgets_everything_but_the_recent_window_size():
    state = RunState(recent=7)
    state.apply(protocol.message("hello", seq=1, script="a.py"))
    state.apply(protocol.message("steps", seq=2, fields=list(protocol.STEP_FIELDS),
                                 rows=[[i, 100.0 + i, 10.0, 1, 2, 3, 2, 2, 32] for i in range(1, 20)]))
    state.apply({"type": "reset"})
    assert not state.meta.received and state.steps == 0 and state.last_seq == 0 and not state.recent
    assert state.recent.maxlen == 7


def test_a_fed_readings_job_fields_are_read_into_the_sample():
    """A fed reading is the launcher's line with the job's fields appended: torch's threads at the top level,
    and ``cuda_context`` where the job had CUDA initialised (NVML's "no context yet", read from outside, then
    means the pid is not visible to NVML)."""
    gpus = [{"index": 0, "proc_mem_bytes": None, "proc_mem_reason": messages.PROC_NO_CONTEXT},
            {"index": 1, "proc_mem_bytes": None, "proc_mem_reason": "NVML process list unavailable"}]
    msg = protocol.message("sample", t=1.0, host={"cpu_percent": 50.0}, gpus=gpus, torch_threads=8)
    s = messages.parse(msg)
    assert s.host.torch_threads == 8 and s.host.cpu_percent == 50.0
    assert [g.proc_mem_reason for g in s.gpus] == [messages.PROC_NO_CONTEXT, "NVML process list unavailable"]
    (g0, g1) = messages.parse(dict(msg, cuda_context=True)).gpus
    assert g0.proc_mem_reason == messages.PROC_NOT_VISIBLE and g1.proc_mem_reason == "NVML process list unavailable"
    own = messages.parse(protocol.message("sample", t=1.0, host={"torch_threads": 4}, torch_threads=8))
    assert own.host.torch_threads == 4  # a job's own reading says it in host


def test_the_ranks_a_script_spawned_are_read_with_their_dir_and_world():
    from perfmon.messages import Other, RanksSpawned, parse

    ok = parse({"v": 1, "type": "event", "kind": "ranks", "seq": 3, "job_dir": "/r/ranks", "world_size": 4, "t": 1.0})
    assert ok == RanksSpawned(seq=3, job_dir="/r/ranks", world_size=4)
    for bad in ({"job_dir": 7, "world_size": 4}, {"job_dir": "/r/ranks"}, {"job_dir": "/r/ranks", "world_size": 0}):
        assert isinstance(parse({"v": 1, "type": "event", "kind": "ranks", "seq": 4, **bad}), Other)
