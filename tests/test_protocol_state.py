"""Protocol round trip, decoder robustness, state aggregation and the summary schema."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfmon import protocol
from perfmon.analysis.report import build_summary, format_summary, status_line
from perfmon.analysis.state import Histogram, RunState, TimeSeries
from perfmon.tui.widgets.phases import notes_line


def steps_msg(rows, seq):
    return protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=rows, seq=seq)


def row(i, t, dur=10.0, data=1.0, fwd=2.0, bwd=3.0, opt=2.0, samples=32):
    return [i, t, dur, data, fwd, bwd, opt, dur - data - fwd - bwd - opt, samples]


@pytest.mark.parametrize(("msg", "exit", "pid"), [
    (protocol.message("event", kind="exit", code=0), True, None),
    (protocol.message("event", kind="warning", message="x"), False, None),
    (protocol.message("steps", kind="exit"), False, None),  # only an event is an exit
    (protocol.message("hello", pid=4242), False, 4242),
    (protocol.message("hello", pid="4242"), False, None),  # a pid of the wrong type is no pid
    (protocol.message("hello", pid=True), False, None),
    (protocol.message("sample", pid=4242), False, None),  # only a hello names the job's pid
])
def test_exit_and_pid_read_from_a_stream(msg, exit, pid):
    assert protocol.is_exit(msg) is exit
    assert protocol.hello_pid(msg) == pid


def test_round_trip_preserves_message():
    msg = steps_msg([row(1, 100.0), row(2, 100.01)], seq=3)
    back = protocol.decode(protocol.encode(msg))
    assert back == msg
    assert protocol.encode(msg).endswith(b"\n") and protocol.encode(msg).count(b"\n") == 1


def test_non_finite_floats_become_null():
    line = protocol.encode(protocol.message("event", kind="x", value=math.nan, more=[math.inf]))
    assert json.loads(line)["value"] is None and json.loads(line)["more"] == [None]


@pytest.mark.parametrize(
    "line, why",
    [
        (b"not json", "not JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'{"type":"steps"}', "version"),
        (b'{"v":99,"type":"steps"}', "newer"),
        (b'{"v":1,"type":"rm -rf"}', "unknown message type"),
        (b'{"v":true,"type":"steps"}', "version"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 200_000, "nested too deeply"),  # a RecursionError traceback in report and replay
        (b'{"v":-1,"type":"steps"}', "version"),
    ],
)
def test_decode_rejects_bad_lines_with_a_reason(line, why):
    with pytest.raises(protocol.DecodeError, match=why):
        protocol.decode(line)


def test_decode_rejects_oversized_line():
    with pytest.raises(protocol.DecodeError, match="limit"):
        protocol.decode(b'{"v":1,"type":"log","x":"' + b"a" * protocol.MAX_LINE + b'"}')


def test_only_whitelisted_commands_pass():
    from perfmon.messages.commands import Command, CommandError, parse_command

    line = protocol.encode(protocol.message("command", name="profile"))
    assert parse_command(protocol.decode(line, allowed=("command",))) == Command("profile")
    refused = parse_command(protocol.decode(protocol.encode(protocol.message("command", name="exec")),
                                            allowed=("command",)))
    assert isinstance(refused, CommandError) and "not allowed" in refused.message
    with pytest.raises(protocol.DecodeError):
        protocol.decode(protocol.encode(protocol.message("steps")), allowed=("command",))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_never_raises_anything_but_decode_error(data):
    try:
        protocol.decode(data)
    except protocol.DecodeError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "v", "seq", "rows", "fields", "kind", "code", "start"]), json_values))
def test_state_survives_any_decodable_message(fields):
    state = RunState()
    try:
        msg = protocol.decode(json.dumps(fields))
    except protocol.DecodeError:
        return
    state.apply(msg)
    build_summary(state)
    status_line(state)


def hello(seq=1, start=1000.0):
    return protocol.message("hello", seq=seq, script="train.py", argv=["train.py", "--lr", "3e-4"], pid=42, start=start)


def test_state_aggregates_recent_and_total():
    state = RunState(recent=10)
    state.apply(hello())
    rows = [row(i, 1000.0 + i * 0.01, dur=10.0 if i % 2 else 20.0) for i in range(1, 101)]
    state.apply(steps_msg(rows[:50], seq=2))
    state.apply(steps_msg(rows[50:], seq=3))
    assert state.steps == 100
    assert len(state.recent) == 10
    total = state.phase_stats(recent=False)  # steps 2-100: step 1 (10 ms) is left out
    assert state.first_step_left_out() == (1, 1000.01, 10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 32, False, 0.0)
    assert total["step"].mean_ms == pytest.approx(1490 / 99)
    assert total["step"].p50_ms == pytest.approx(15.0, rel=0.4)  # between the two modes
    assert total["step"].p95_ms == pytest.approx(20.0, rel=0.02)
    assert total["data"].share == pytest.approx(99 / 1490)
    assert sum(total[p].share for p in protocol.ALL_PHASES) == pytest.approx(1.0)
    recent = state.phase_stats(recent=True)
    assert recent["step"].mean_ms == pytest.approx(15.0)
    assert state.steps_per_s(recent=True) == pytest.approx(10 / (0.1 - 0.010 + 0.020), rel=0.2)
    assert state.samples_per_s(recent=False) == pytest.approx(32 * state.steps_per_s(recent=False))
    line = status_line(state, now=1001.0)  # the headless status line reads the same stats
    assert "step 100 |" in line and "step 15.0 ms | data 7% fwd" in line, line


def test_the_summary_names_time_outside_steps_that_reads_as_more_than_zero():
    """A step cut short by a signal leaves a tenth of a millisecond "outside" it: "evaluation 0.0%" said nothing
    but that the script evaluates, which it may not. The JSON keeps it."""
    state = RunState()
    state.apply(hello())
    state.apply(steps_msg([row(i, 1001.0 + i * 0.01) for i in range(1, 11)], seq=2))
    summary = build_summary(state)
    summary["outside_steps"] = {"evaluation": {"ms": 0.094, "share": 0.00004},
                                "checkpoint": {"ms": 30.0, "share": 0.25}}
    lines = [line.split() for line in format_summary(state, summary).splitlines() if line.startswith("  outside")]
    assert lines == [["outside", "checkpoint", "25.0%", "of", "wall", "time", "(not", "in", "any", "step)"]]


def test_time_outside_steps_is_a_share_of_the_recordings_time_not_of_the_clock_now():
    """A job killed without an exit record: its report's share shrank each time it was read (the wall clock went
    on); a replay paused mid-way read its share against today. Up to the last word, or the dashboard's clock."""
    state = RunState()
    state.apply(hello())  # start 1000.0
    msg = steps_msg([row(i, 1000.0 + i) for i in range(1, 11)], seq=2)
    msg["outside"] = {"evaluation_ms": 500.0}
    state.apply(msg)
    assert build_summary(state)["outside_steps"]["evaluation"]["share"] == pytest.approx(0.05)  # 0.5 s of 10 s
    assert state.outside_shares(now=1005.0)["evaluation"] == pytest.approx(0.1)
    assert notes_line(state, now=1005.0).startswith("outside steps: evaluation 10% of wall time")


@pytest.mark.parametrize(("steps", "words"), [
    (0, "findings  none: the run ended before its first step"),
    (40, "findings  none: too few steps past warm-up for the rules that judge steps (10 of the 20 they need)"),
    (80, "findings  none: nothing the rules can name held this run back"),
])
def test_a_summary_without_findings_says_why(steps, words):
    """A summary with no finding says whether the rules judged the run (a 40-step run said nothing at all)."""
    state = RunState()
    state.apply(hello())
    if steps:
        state.apply(steps_msg([row(i, 1001.0 + i * 0.01) for i in range(1, steps + 1)], seq=2))
    summary = build_summary(state)
    summary["findings"] = []
    assert ("  " + words) in format_summary(state, summary).splitlines()


def test_whole_run_figures_leave_the_first_step_out_and_say_so():
    """Step 1 holds what ran before the loop was learned (here 2 s of setup after a first forward): the phase
    table, steps/s and samples/s describe the steps after it, and the summary names it. A run of two steps (too
    short to leave one out), and a step 1 summarised in bulk or profiled (never seen as a row), keep it."""
    state = RunState()
    state.apply(hello())
    rows = [row(1, 1002.0, dur=2000.0, data=0.0, fwd=1.0, bwd=1.0, opt=1.0, samples=32)]
    rows += [row(i, 1002.0 + (i - 1) * 0.01, dur=10.0) for i in range(2, 11)]
    state.apply(steps_msg(rows, seq=2))
    total = state.phase_stats(recent=False)
    assert total["step"].mean_ms == pytest.approx(10.0) and total["step"].p95_ms == pytest.approx(10.0, rel=0.02)
    assert total["other"].share == pytest.approx(0.2) and total["data"].share == pytest.approx(0.1)
    assert state.steps_per_s(recent=False) == pytest.approx(9 / 0.09)
    assert state.samples_per_s(recent=False) == pytest.approx(32 * 9 / 0.09)
    summary = build_summary(state)
    assert summary["steps"] == 10 and summary["first_step_ms"] == 2000.0
    first = [line.split() for line in format_summary(state, summary).splitlines() if line.startswith("  first ")]
    assert [words[:8] for words in first] == [["first", "2000.0", "ms,", "left", "out", "of", "the", "table"]]
    # 10 steps in 2.09 s at 100 steps/s reads as a contradiction unless the rate says where it starts
    assert "(100.00 steps/s, 3,200.0 samples/s from step 2)" in format_summary(state, summary)

    short = RunState()
    short.apply(hello())
    short.apply(steps_msg(rows[:2], seq=2))
    assert short.first_step_left_out() is None and build_summary(short)["first_step_ms"] is None
    assert short.phase_stats(recent=False)["step"].mean_ms == pytest.approx(1005.0)

    unseen = RunState()  # the live stream of a fast job: step 1 in a bulk summary, only later rows
    unseen.apply(hello())
    unseen.apply(steps_msg(rows[4:], seq=2))
    assert unseen.first_step_left_out() is None


@pytest.mark.parametrize("with_samples, expected", [
    (range(1, 21), 32 * 19 / 0.19),  # every step fetched its batch
    (range(1, 9), None),  # itertools.cycle(loader): the first pass fetched, the replayed batches count none
    ([1], None),  # only step 1 (left out): was 0.0 samples/s
])
def test_whole_run_samples_per_s_only_where_most_steps_counted_theirs(with_samples, expected):
    state = RunState()
    state.apply(hello())
    state.apply(steps_msg([row(i, 1000.0 + i * 0.01, samples=32 if i in with_samples else 0)
                           for i in range(1, 21)], seq=2))
    got = state.samples_per_s(recent=False)
    assert got == (pytest.approx(expected) if expected is not None else None)
    assert state.samples_per_s(recent=True) == (pytest.approx(got) if got is not None else None)  # as live


def test_a_bad_value_stops_its_message_but_the_rows_before_it_count():
    state = RunState(recent=5)
    state.apply(hello())
    rows = [row(i, 1000.0 + i * 0.01) for i in range(1, 11)]
    rows[3] = [1, 2]  # wrong length: dropped alone
    rows[6][2] = "slow"  # not a number: the message stops here
    state.apply(steps_msg(rows, seq=2))
    assert state.skipped == 1
    assert state.steps == 6 and state.totals["step"].hist.n == 5 == state.totals["data"].hist.n
    assert state.totals["step"].total_ms == pytest.approx(50.0)
    assert [s.i for s in state.recent] == [1, 2, 3, 5, 6]


def test_only_the_last_rows_of_a_big_message_are_kept_as_recent_steps():
    state = RunState(recent=200)
    state.apply(hello())
    state.apply(protocol.message("event", kind="window_started", what="profile", t=1000.0 + 1995 * 0.01, seq=2))
    state.apply(protocol.message("event", kind="window_stopped", what="profile", t=1000.0 + 1998 * 0.01, seq=3))
    state.apply(steps_msg([row(i, 1000.0 + i * 0.01) for i in range(1, 2001)], seq=4))
    assert [s.i for s in state.recent] == list(range(1801, 2001))
    assert [s.i for s in state.recent if s.windowed] == [1996, 1997, 1998]
    # the profiled steps are left out of the phase statistics, and counted apart
    assert state.totals["forward"].hist.n == 1997 and state.windowed_steps == 3
    assert state.steps == 2000 and state.steps_folded == 2000 and state.samples_total == 32 * 2000


@given(st.lists(st.floats(0, 1e4, allow_nan=False), max_size=200))
def test_histogram_add_many_is_add_one_by_one(values):
    one, many = Histogram(), Histogram()
    for v in values:
        one.add(v)
    many.add_many(values)
    assert (one.n, one.zeros, one.counts) == (many.n, many.zeros, many.counts)


def test_duplicate_seq_is_ignored():
    state = RunState()
    state.apply(hello())
    msg = steps_msg([row(1, 1000.0)], seq=2)
    state.apply(msg)
    state.apply(msg)
    assert state.totals["step"].hist.n == 1


def test_device_times_replace_host_phase_times_when_present():
    state = RunState()
    fields = [*protocol.STEP_FIELDS, "dev_forward_ms", "dev_backward_ms", "dev_optimizer_ms"]
    state.apply(protocol.message("steps", fields=fields, rows=[[*row(1, 1000.0), 5.0, None, 1.0]], seq=1))
    step = state.recent[-1]
    assert step.forward == 5.0 and step.backward == 3.0 and step.optimizer == 1.0
    assert state.device_timed


def test_exit_states():
    state = RunState()
    state.apply(hello())
    assert state.status == "running"
    state.apply(protocol.message("event", kind="exit", code=1, exception="ValueError: boom", t=1010.0, seq=2))
    assert state.status == "failed: ValueError" and state.exit_status == 1
    assert state.elapsed() == pytest.approx(10.0)
    killed = RunState()
    killed.apply(hello())
    killed.process_exited(-9)
    assert killed.status == "killed by SIGKILL" and killed.exit_status == 137


def test_summary_schema_shape():
    state = RunState()
    state.apply(hello())
    state.apply(steps_msg([row(i, 1000.0 + i * 0.01) for i in range(1, 21)], seq=2))
    state.apply(protocol.message("event", kind="exit", code=0, t=1001.0, seq=3))
    s = build_summary(state)
    assert s["schema"] == 1 and s["steps"] == 20 and s["exit_code"] == 0 and s["signal"] is None
    assert s["argv"] == ["train.py", "--lr", "3e-4"]
    assert set(s["phases"]) == set(protocol.ALL_PHASES)
    assert sum(p["share"] for p in s["phases"].values()) == pytest.approx(1.0, abs=1e-5)
    assert s["findings"] == []
    assert "exited 0" in format_summary(state)


def test_histogram_quantiles_are_close():
    h = Histogram()
    for x in range(1, 10001):
        h.add(float(x))
    assert h.quantile(0.5) == pytest.approx(5000, rel=0.02)
    assert h.quantile(0.95) == pytest.approx(9500, rel=0.02)
    assert Histogram().quantile(0.5) is None


def test_time_series_memory_is_bounded_over_a_week():
    ts = TimeSeries()
    for s in range(0, 7 * 24 * 3600, 5):
        ts.add(float(s), 1.0)
    assert sum(len(level) for level in ts.levels) <= sum(n for _, n in TimeSeries.LEVELS)
    assert len(ts.values(60.0)) <= 61
    whole = ts.values(None)
    assert 0 < len(whole) <= 1008


@pytest.mark.parametrize(("text", "line", "status"), [
    ("ValueError: boom", "ValueError: boom", "failed: ValueError"),
    ('  File "/x/syn.py", line 2\n    x = (\n        ^\nSyntaxError: \'(\' was never closed\n',
     "SyntaxError: '(' was never closed (syn.py line 2)", "failed: SyntaxError (syn.py line 2)"),
    ('  File "/x/syn.py", line 2\n    x = (\n        ^\nSyntaxError: \'(\' was never closed\nwhile loading plugin foo\n',
     "SyntaxError: '(' was never closed (syn.py line 2)", "failed: SyntaxError (syn.py line 2)"),  # with a note
    ("KeyError: 'a:b'", "KeyError: 'a:b'", "failed: KeyError"),
    # messages of several lines: the first (and the next where the first ends in a colon), never the last
    ("RuntimeError: Serialization of parametrized modules is only supported through state_dict(). See:\n"
     "https://pytorch.org/tutorials/beginner/saving_loading_models.html\n",
     "RuntimeError: Serialization of parametrized modules is only supported through state_dict(). See: "
     "https://pytorch.org/tutorials/beginner/saving_loading_models.html", "failed: RuntimeError"),
    ("ValueError: \nbad shape (4, 7)\n", "ValueError: bad shape (4, 7)", "failed: ValueError"),
    ("torch._dynamo.exc.Unsupported: generator\n\nfrom user code:\n   File \"t.py\", line 3, in f\n",
     "torch._dynamo.exc.Unsupported: generator", "failed: torch._dynamo.exc.Unsupported"),
    ("AssertionError: loss went nan\nstep 4120 of epoch 3\n", "AssertionError: loss went nan", "failed: AssertionError"),
    # re-raised from a DataLoader worker: the original error, on the last line of the traceback it carries
    ("ValueError: Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
     '  File "/x/ds.py", line 9, in __getitem__\n    raise ValueError(f"bad sample {i}")\nValueError: bad sample 17\n',
     "ValueError: bad sample 17", "failed: ValueError"),
    # ...whose own message goes on (a hint, a note): its first line
    ("RuntimeError: Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):"
     '\n  File "/x/w.py", line 3, in f\n    raise e\nRuntimeError: stack expects each tensor to be equal size\n'
     "Hint: set collate_fn\n", "RuntimeError: stack expects each tensor to be equal size", "failed: RuntimeError"),
    ("torch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError: CUDA out of memory",
     "failed: torch.OutOfMemoryError"),
])
def test_exceptions_are_one_line_in_state_and_status(text, line, status):
    from perfmon.protocol import exception_line

    assert exception_line(text) == line
    state = RunState()
    state.apply(protocol.message("event", kind="exit", code=1, exception=text, seq=1))  # old recordings too
    assert state.exit.exception == line and state.status == status and "\n" not in state.status


def test_a_window_being_captured_ends_with_the_job():
    """A recording that ends during a profiler window does not show "capturing" forever."""
    state = RunState()
    state.apply(protocol.message("event", kind="profile_started", reason="on demand", t=5.0, seq=1))
    assert state.profiling is not None
    state.apply(protocol.message("event", kind="exit", code=0, t=6.0, seq=2))
    assert state.profiling is None


@pytest.mark.parametrize(("exception", "hinted"), [
    ("EOFError: EOF when reading a line", True),  # input()
    ("bdb.BdbQuit", True),  # breakpoint(), then pdb met the end of /dev/null
    ("EOFError: Ran out of input", False),  # pickle.load / torch.load of a truncated file
    ("EOFError", False),  # a closed multiprocessing pipe
    ("ValueError: boom", False),
    (None, False),
])
def test_only_a_script_that_read_its_stdin_is_told_about_it(exception, hinted):
    from perfmon.monitor.launch import stdin_hint

    assert (stdin_hint(exception) is not None) is hinted


@pytest.mark.parametrize("model, said", [
    ({}, None),  # not counted: no line
    # steps of 10 ms: 100 steps/s
    ({"flops_per_step": 1.0731e6}, "1.073 MFLOP a step · 107.3 MFLOP/s achieved · MFU n/a: CPU run"),
    ({"flops_per_step": 2.5e12, "peak_tflops": 1000.0},
     "2.5 TFLOP a step · 250 TFLOP/s achieved · MFU 25.0% of 1 PFLOP/s (--peak-tflops)"),
])
def test_the_text_summary_shows_flops_and_mfu_where_counted(model, said):
    """``--count-flops`` (and ``--peak-tflops``) were in the report JSON only: the headless summary and ``perfmon
    report`` said nothing of them."""
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="x", start=1000.0, cuda=False,
                                 peak_tflops=model.pop("peak_tflops", None)))
    state.apply(steps_msg([row(i, 1000.0 + i * 0.001) for i in range(1, 41)], seq=2))
    if model:
        state.apply(protocol.message("model", seq=3, **model))
    lines = [line for line in format_summary(state).splitlines() if line.startswith("  flops ")]
    assert lines == ([] if said is None else [lines[0]]) and (said is None or said in lines[0]), lines


def test_time_series_extent_is_the_single_values_range_that_means_hide():
    """A 60 ms spike every 15 steps of 8 ms: the bars (1 s means) stay near 11 ms; the chart's label gives the
    fastest and slowest single step, at every level of the series."""
    ts = TimeSeries()
    t, values = 0.0, []
    for i in range(3000):
        value = 60.0 if i % 15 == 0 else 8.0
        values.append(value)
        t += value / 1000
        ts.add(t, value)
    assert max(ts.values(60.0)) < 20.0
    assert ts.extent(60.0) == (8.0, 60.0)
    assert ts.extent(None) == (8.0, 60.0)
    assert TimeSeries().extent(60.0) is None
    for s in range(0, 3 * 3600, 5):  # hours later: coarser levels keep the range too
        ts.add(t + s, 9.0)
    assert ts.extent(None) == (8.0, 60.0) and ts.extent(60.0) == (9.0, 9.0)


def test_a_report_without_exit_says_whether_its_process_still_runs_here():
    """``perfmon report`` on a live run said "still running, or killed"; it can tell which."""
    import os
    import socket
    import time

    import psutil

    def status(pid: int, start: float) -> str:
        state = RunState()
        state.apply(protocol.message("hello", seq=1, script="x", pid=pid, start=start, host=socket.gethostname()))
        line = next(x for x in format_summary(state).splitlines() if x.startswith("  status"))
        return line.split(None, 1)[1]

    me = os.getpid()
    assert status(me, time.time()) == f"running (pid {me}): no exit yet; perfmon attach {me} follows it live"
    # a pid that a later process was given: it began after the recording did
    assert status(me, psutil.Process(me).create_time() - 60).startswith("no exit recorded")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert status(dead.pid, time.time()).startswith("no exit recorded (killed")


def test_a_recording_without_exit_lasts_to_its_last_word_not_to_now():
    """A killed job's ``elapsed_s`` grew with the wall clock at every ``perfmon report`` (826 s for a 41 s job)."""
    state = RunState()
    state.apply(hello(start=1000.0))
    state.apply(steps_msg([row(i, 1000.0 + i) for i in range(1, 31)], seq=2))
    state.apply(protocol.message("sample", seq=3, t=1041.0))
    assert build_summary(state)["elapsed_s"] == 41.0


def test_an_uncounted_flop_figure_points_at_f_only_while_the_job_runs() -> None:
    """After the job ended, "press f" named a key that does nothing any more."""
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="x", start=1000.0))
    assert state.flops().reason == "no FLOP count yet (press f)"
    state.apply(protocol.message("event", kind="exit", code=0, t=1010.0, seq=2))
    assert state.flops().reason == "not counted (--count-flops, or f while the job runs)"


@pytest.mark.parametrize(("events", "status"), [
    ([], "running"),
    ([protocol.message("event", kind="exec", program="bash", t=1.0)], "replaced itself with bash (os.exec*)"),
    ([protocol.message("event", kind="exec", program=None, t=1.0)], "replaced itself with another program (os.exec*)"),
    ([protocol.message("event", kind="exec", program=7, t=1.0)], "replaced itself with another program (os.exec*)"),
    # the exec failed: the script goes on
    ([protocol.message("event", kind="exec", program="bad.sh", t=1.0),
      protocol.message("event", kind="exec", failed=True, t=1.1)], "running"),
    # a launcher recorded the new program's exit: that is how the job ended
    ([protocol.message("event", kind="exec", program="bash", t=1.0),
      protocol.message("event", kind="exit", code=3, t=2.0)], "exited 3"),
])
def test_a_script_that_replaced_itself_says_so_until_an_exit_is_recorded(events, status):
    state = RunState()
    state.apply(protocol.message("hello", pid=4242, script="x.py", start=0.5))
    for msg in events:
        state.apply(msg)
    assert state.status == status


@pytest.mark.parametrize("split", [False, True], ids=["one-message", "step-1-alone"])
def test_the_step_time_chart_leaves_the_warm_up_step_out_as_the_tables_do(split):
    """Step 1 (compilation, first calls) drew the chart's range "52.0-1128 ms" over 52 ms steps."""
    state = RunState()
    rows = [row(1, 1001.128, dur=1128.0)] + [row(i, 1001.128 + 0.052 * (i - 1), dur=52.0) for i in range(2, 40)]
    if split:
        state.apply(steps_msg(rows[:1], 1))
        assert state.step_series.extent(None) is None  # nothing to chart yet
        state.apply(steps_msg(rows[1:], 2))
    else:
        state.apply(steps_msg(rows, 1))
    assert state.step_series.extent(None) == (52.0, 52.0)
    assert state.steps == 39


@pytest.mark.parametrize("loaders, data_ms, said", [
    ([], 0.0, True),  # a loop that slices its tensors: data reads 0 while its batches cost something
    ([{"num_workers": 0, "batch_size": 32}], 1.0, False),
    ([], 1.0, False),  # fetches timed otherwise (perfmon.phase("data"))
    (None, 0.0, False),  # no model message yet: not known
])
def test_a_loop_without_a_dataloader_is_told_its_data_is_in_other(loaders, data_ms, said):
    from perfmon.analysis.report import NO_LOADER
    from perfmon.tui.widgets.phases import notes_line

    state = RunState()
    state.apply(steps_msg([row(i, 1000.0 + 0.01 * i, data=data_ms) for i in range(1, 40)], 1))
    if loaders is not None:
        state.apply(protocol.message("model", seq=2, params=10, loaders=loaders))
    assert (NO_LOADER in notes_line(state)) is said
    assert (f"data       {NO_LOADER}" in format_summary(state)) is said
