"""Table tests for the multi-GPU rules: the job rules over the ranks' rows (straggler, rank memory imbalance,
communication share), ``evaluate_job``, the per-run ``data-parallel`` rule, and the job helpers they read
(``RankRow``, ``work_ms``, ``slowest``, ``steady_steps``)."""

from __future__ import annotations

import dataclasses

import pytest

from perfmon import protocol
from perfmon.analysis.job import RankRow, slowest, steady_steps, work_ms
from perfmon.analysis.records import Step
from perfmon.analysis.rules import REGISTRY, Config, Facts, evaluate_once
from perfmon.analysis.rules.distributed import (
    JOB_REGISTRY,
    communication_heavy,
    data_parallel,
    evaluate_job,
    rank_memory_imbalance,
    straggler,
)
from perfmon.analysis.state import RunState

GIB = 1 << 30
FIELDS = list(protocol.STEP_FIELDS)
#: One rank's phases (ms per step) when nothing is wrong: they add up to a 100 ms step.
BASE = {"data": 5.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "other": 5.0}


def row(rank: int, *, mean: float | None = None, steady: int = 50, node: int | None = 0, host: str | None = "h0",
        allocated: float | None = None, comm: float | None = None, roots: tuple[str, ...] = (),
        phases: dict[str, float] | None = None, **phase_ms: float) -> RankRow:
    """A rank's row: ``BASE`` phases with some overridden (``data=30``); the mean step is their sum unless given."""
    ph = dict(BASE if phases is None else phases, **phase_ms)
    return RankRow(rank=rank, node=node, host=host, steps=100, step_ms=mean if mean is not None else sum(ph.values()),
                   mean_ms=mean if mean is not None else (sum(ph.values()) if ph else None), steady=steady,
                   phases=ph, allocated_bytes=allocated, comm_share=comm, roots=roots)


def ddp(slow: int, x: float, n: int = 3) -> list[RankRow]:
    """A DDP job of ``n`` ranks, every step 100 ms: rank ``slow`` spends ``x`` ms more loading data, the others
    wait ``x`` ms for it inside backward (the gradient all-reduce), so its own backward is ``x`` ms shorter."""
    return [row(r, data=BASE["data"] + x, backward=BASE["backward"] - x) if r == slow else row(r) for r in range(n)]


def independent(means: list[float], phase: str = "forward") -> list[RankRow]:
    """Ranks that do not wait for each other: rank ``r``'s step is ``means[r]`` ms, the excess in ``phase``."""
    return [row(r, **{phase: BASE[phase] + m - 100.0}) for r, m in enumerate(means)]


# -- straggler --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x, severity", [
    (0.0, None),
    (9.0, None),  # 9/91 = 9.9% more work
    (9.5, "warn"),  # 10.5%
    (12.0, "warn"),  # 13.6%
    (16.5, "warn"),  # 19.8%
    (17.5, "critical"),  # 21.2%
    (30.0, "critical"),  # 42.9%
])
def test_straggler_in_ddp_compares_work_not_steps(x: float, severity: str | None) -> None:
    rows = ddp(slow=1, x=x)
    assert len({r.mean_ms for r in rows}) == 1  # every rank's step takes as long: only the work tells them apart
    f = straggler(rows, Config())
    if severity is None:
        assert f is None
        return
    assert f is not None and f.id == "straggler" and f.severity == severity
    assert f.evidence["rank"] == 1 and f.evidence["phase"] == "data"
    assert f.evidence["gap"] == pytest.approx(x / (100.0 - x), abs=1e-4)
    assert "rank 1" in f.title and "data" in f.title
    assert "num_workers" in f.fix  # the data phase's advice
    assert f.impact == pytest.approx(f.evidence["gap"] / (1 + f.evidence["gap"]), abs=1e-3)


def test_straggler_in_ddp_names_a_slow_forward_over_the_others_wait() -> None:
    # rank 2 computes its forward 15 ms slower; the others wait those 15 ms inside backward
    rows = [row(0, backward=65.0), row(1, backward=65.0), row(2, forward=45.0)]
    f = straggler(rows, Config())
    assert f is not None and f.severity == "warn"
    assert (f.evidence["rank"], f.evidence["phase"]) == (2, "forward")
    assert f.evidence["phase_ms"] == 45.0 and f.evidence["others_phase_ms"] == 30.0


@pytest.mark.parametrize("means, phase, slow, severity", [
    ([100, 115, 100], "forward", 1, "warn"),
    ([100, 100, 111], "forward", 2, "warn"),
    ([100, 100, 109], "forward", None, None),
    ([119, 100, 100], "optimizer", 0, "warn"),
    ([100, 121, 100], "other", 1, "critical"),
    ([100, 100, 140], "data", 2, "critical"),
    ([100, 130, 100], "backward", 1, "critical"),  # no DDP: a slow backward is its own
])
def test_straggler_between_independent_ranks(means: list[float], phase: str, slow: int | None,
                                             severity: str | None) -> None:
    f = straggler(independent(means, phase), Config())
    if severity is None:
        assert f is None
        return
    assert f is not None and f.severity == severity
    assert f.evidence["rank"] == slow and f.evidence["phase"] == phase
    assert f.evidence["step_ms"] == means[slow] and f.evidence["others_step_ms"] == 100.0


@pytest.mark.parametrize("slow_ms, severity", [
    (125.0, None),  # exactly the warn threshold: quiet
    (126.0, "warn"),
    (150.0, "warn"),  # exactly the critical threshold: still warn
    (151.0, "critical"),
])
def test_straggler_thresholds_are_exclusive(slow_ms: float, severity: str | None) -> None:
    cfg = Config(straggler_warn=0.25, straggler_critical=0.5)  # binary-exact gaps at the boundaries
    f = straggler(independent([100.0, slow_ms]), cfg)
    assert (f.severity if f else None) == severity


def test_straggler_reference_is_the_median_of_the_other_ranks() -> None:
    # 18% above the other rank; against the median of both (109 ms) it would be 8% and stay quiet
    f = straggler(independent([100.0, 118.0]), Config())
    assert f is not None and f.evidence["rank"] == 1 and f.evidence["gap"] == pytest.approx(0.18)
    assert f.evidence["others_step_ms"] == 100.0


@pytest.mark.parametrize("means, slow, others_ms", [
    ([100, 100, 121, 100], 2, 100.0),
    ([90, 100, 110, 130], 3, 100.0),  # rank 2 is 10% above its others' median: not it
    ([130, 100, 100, 100], 0, 100.0),
    ([100, 100, 130, 130], 2, 100.0),  # two equally slow: the lower rank
])
def test_straggler_of_four_ranks_names_the_slow_one(means: list[float], slow: int, others_ms: float) -> None:
    f = straggler(independent(means), Config())
    assert f is not None and f.evidence["rank"] == slow and f.evidence["others_step_ms"] == others_ms
    assert f.evidence["step_ms_by_rank"] == {str(r): float(m) for r, m in enumerate(means)}


@pytest.mark.parametrize("waits, every_step, named", [
    ({}, 0.0, False),
    # rank 0 evaluates and saves between steps, rank 1 waits for it at a barrier: its next step's other holds the
    # wait (a helper's DDP run: 36 ms once an epoch) and lifted its mean 27%; its typical step is the others'
    ({41: 60.0, 61: 60.0, 81: 60.0}, 0.0, False),
    ({}, 3.0, True),  # slower in every step: a straggler
    ({41: 60.0, 61: 60.0, 81: 60.0}, 3.0, True),
])
def test_straggler_is_slower_in_most_steps_not_in_a_few_waits(waits: dict[int, float], every_step: float,
                                                               named: bool) -> None:
    from test_rules import make_state

    from perfmon.analysis.job import rank_row

    rows = [rank_row(0, make_state(n=100)), rank_row(1, make_state(n=100, other=0.5 + every_step, spikes=waits))]
    assert (rows[1].mean_ms > 1.1 * rows[0].mean_ms) is bool(waits or every_step)  # the mean alone names rank 1
    f = straggler(rows, Config())
    assert (f is not None and f.evidence["rank"] == 1 and f.evidence["phase"] == "other") is named, f


@pytest.mark.parametrize("rows", [
    [],
    [row(0)],
    [row(0, forward=80.0)],
    [row(0), row(1, forward=80.0, steady=19)],  # the slow rank has too few steady steps to judge
    [row(0, steady=19), row(1, forward=80.0, steady=19)],
    [row(0), RankRow(rank=1, node=0, host="h0", steps=0, step_ms=None)],  # no steps yet
    [row(0), row(1, mean=None, phases={})],
    [row(0, phases={}, mean=100.0), row(1, forward=80.0)],  # no phases for one: nothing to compare
])
def test_straggler_needs_two_timed_steady_ranks(rows: list[RankRow]) -> None:
    assert straggler(rows, Config()) is None


def test_straggler_counts_a_rank_with_exactly_min_steps() -> None:
    f = straggler([row(0, steady=20), row(1, forward=80.0, steady=20)], Config(min_steps=20))
    assert f is not None and f.evidence["rank"] == 1
    assert straggler([row(0, steady=20), row(1, forward=80.0, steady=20)], Config(min_steps=21)) is None


def test_straggler_ignores_unsteady_ranks_when_picking() -> None:
    # rank 2 is far slower but still warming up: the steady ranks are compared, and rank 1 is 15% slower
    rows = [row(0), row(1, forward=45.0), row(2, forward=500.0, steady=3)]
    f = straggler(rows, Config())
    assert f is not None and f.evidence["rank"] == 1
    assert set(f.evidence["step_ms_by_rank"]) == {"0", "1"}


@pytest.mark.parametrize("node, host, where", [(1, "gpu-b", " on node 1"), (None, None, "")])
def test_straggler_evidence(node: int | None, host: str | None, where: str) -> None:
    rows = [row(0), row(1, data=30.0, node=node, host=host), row(2)]
    f = straggler(rows, Config())
    assert f is not None
    assert {"rank", "phase", "node", "host", "gap", "phase_ms", "others_phase_ms", "step_ms", "others_step_ms",
            "step_ms_by_rank"} <= set(f.evidence)
    assert (f.evidence["rank"], f.evidence["phase"], f.evidence["node"], f.evidence["host"]) == (1, "data", node, host)
    assert f.title.startswith(f"rank 1{where} holds the job back: its data phase takes 25.0 ms/step more")
    assert f.to_json()["evidence"]["rank"] == 1


# -- rank memory imbalance ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("allocated, rank", [
    ([10 * GIB, 10 * GIB, 13 * GIB], 2),  # 30%, 3 GiB
    ([12.5 * GIB, 10 * GIB, 10 * GIB], 0),  # 25%, 2.5 GiB
    ([10 * GIB, 12 * GIB, 10 * GIB], None),  # exactly 20%: quiet
    ([4 * GIB, 4 * GIB, 5 * GIB], 2),  # 25%, exactly 1 GiB: fires
    ([4 * GIB, 4 * GIB, 5 * GIB - 1], None),  # 25%, a byte under 1 GiB
    ([1 * GIB, 1 * GIB, 1.5 * GIB], None),  # 50% but only 0.5 GiB
    ([40 * GIB, 40 * GIB, 45 * GIB], None),  # 5 GiB but only 12.5%
    ([10 * GIB, 10 * GIB, 10 * GIB], None),
])
def test_rank_memory_imbalance(allocated: list[float], rank: int | None) -> None:
    f = rank_memory_imbalance([row(r, allocated=a) for r, a in enumerate(allocated)], Config())
    if rank is None:
        assert f is None
        return
    assert f is not None and f.id == "rank-memory-imbalance" and f.severity == "warn"
    assert f.evidence["rank"] == rank and f.evidence["peak_allocated_bytes"] == allocated[rank]
    assert f.evidence["median_peak_allocated_bytes"] == sorted(allocated)[1]
    assert f.evidence["by_rank"] == {str(r): a for r, a in enumerate(allocated)}
    assert f"rank {rank}" in f.title and f"rank {rank}" in f.fix


def test_rank_memory_imbalance_leaves_unsized_ranks_out() -> None:
    # with rank 1 counted as 0 the median would be 10 GiB; among the two sized ranks it is 15 GiB
    rows = [row(0, allocated=10 * GIB), row(1, allocated=None), row(2, allocated=20 * GIB)]
    f = rank_memory_imbalance(rows, Config())
    assert f is not None and f.evidence["rank"] == 2 and f.evidence["median_peak_allocated_bytes"] == 15 * GIB
    assert f.evidence["by_rank"] == {"0": 10 * GIB, "2": 20 * GIB}
    # 18 GiB: exactly 20% above 15 GiB, so quiet (were the 0 counted: 50% above a median of 12 GiB)
    rows = [row(0, allocated=12 * GIB), row(1, allocated=0), row(2, allocated=18 * GIB)]
    assert rank_memory_imbalance(rows, Config()) is None


@pytest.mark.parametrize("allocated", [
    [],
    [20 * GIB],
    [20 * GIB, None],
    [20 * GIB, 0, None],  # 0: not measured (CPU), not "used nothing"
])
def test_rank_memory_imbalance_needs_two_sized_ranks(allocated: list[float | None]) -> None:
    assert rank_memory_imbalance([row(r, allocated=a) for r, a in enumerate(allocated)], Config()) is None


def test_rank_memory_imbalance_thresholds_come_from_config() -> None:
    rows = [row(0, allocated=10 * GIB), row(1, allocated=11.5 * GIB), row(2, allocated=10 * GIB)]  # 15%, 1.5 GiB
    assert rank_memory_imbalance(rows, Config()) is None
    f = rank_memory_imbalance(rows, Config(rank_memory_imbalance=0.10))
    assert f is not None and f.evidence["rank"] == 1
    assert rank_memory_imbalance(rows, Config(rank_memory_imbalance=0.10, rank_memory_min_bytes=2 * GIB)) is None


# -- communication share -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shares, median", [
    ([0.4, 0.5], 0.45),
    ([0.1, 0.5, 0.6], 0.5),
    ([0.31, 0.31], 0.31),
    ([None, 0.5], 0.5),  # ranks without a profiler window are left out
    ([0.3, 0.3], None),  # exactly 30%: quiet
    ([0.29, 0.2], None),
    ([0.1, 0.2, 0.9], None),  # one communication-heavy rank does not make the median
    ([0.0, 0.0, 0.9], None),  # a share of 0 counts
    ([None, None], None),
    ([], None),
])
def test_communication_heavy(shares: list[float | None], median: float | None) -> None:
    f = communication_heavy([row(r, comm=s) for r, s in enumerate(shares)], Config())
    if median is None:
        assert f is None
        return
    assert f is not None and f.id == "communication-heavy" and f.severity == "warn"
    assert f.evidence["median_share"] == pytest.approx(median)
    assert f.evidence["by_rank"] == {str(r): s for r, s in enumerate(shares) if s is not None}
    assert f.impact == pytest.approx(median)


def test_communication_heavy_threshold_comes_from_config() -> None:
    rows = [row(0, comm=0.25), row(1, comm=0.25)]
    assert communication_heavy(rows, Config()) is None
    assert communication_heavy(rows, Config(rank_communication_share=0.2)) is not None


# -- evaluate_job ------------------------------------------------------------------------------------------------

def troubled_job() -> list[RankRow]:
    """Rank 1 is 30% slower (critical straggler), rank 2 peaks 3 GiB higher, communication is half the GPU time."""
    return [row(0, allocated=10 * GIB, comm=0.5), row(1, forward=60.0, allocated=10 * GIB, comm=0.5),
            row(2, allocated=13 * GIB, comm=0.5)]


def test_job_registry_has_the_stable_ids_with_documented_thresholds() -> None:
    assert set(JOB_REGISTRY) == {"straggler", "rank-memory-imbalance", "communication-heavy"}
    assert all(doc for _, doc in JOB_REGISTRY.values())
    assert not set(JOB_REGISTRY) & set(REGISTRY)  # job rules never run on one run's facts


@pytest.mark.parametrize("disabled, expected", [
    ((), ["straggler", "communication-heavy", "rank-memory-imbalance"]),  # critical first, then by impact
    (("straggler",), ["communication-heavy", "rank-memory-imbalance"]),
    (("communication-heavy", "rank-memory-imbalance"), ["straggler"]),
    (("straggler", "communication-heavy", "rank-memory-imbalance"), []),
    (("no-such-rule",), ["straggler", "communication-heavy", "rank-memory-imbalance"]),
])
def test_evaluate_job_sorts_and_honours_disabled(disabled: tuple[str, ...], expected: list[str]) -> None:
    findings = evaluate_job(troubled_job(), Config(disabled=disabled))
    assert [f.id for f in findings] == expected
    assert [f.rank for f in findings] == sorted((f.rank for f in findings), reverse=True)


def test_evaluate_job_defaults() -> None:
    assert [f.id for f in evaluate_job(troubled_job())] == ["straggler", "communication-heavy",
                                                          "rank-memory-imbalance"]
    assert evaluate_job([]) == []
    assert evaluate_job([row(0), row(1), row(2)]) == []  # a healthy job


def test_evaluate_job_survives_a_failing_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(rows: list[RankRow], cfg: Config) -> None:
        raise ZeroDivisionError

    monkeypatch.setitem(JOB_REGISTRY, "broken", (broken, "always fails"))
    assert [f.id for f in evaluate_job(troubled_job())] == ["straggler", "communication-heavy",
                                                          "rank-memory-imbalance"]


# -- data-parallel (one run's facts) -----------------------------------------------------------------------------

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 * GIB, "util_gpu": 98}


def make_state(roots: list[str] | None, n: int = 100, gpus: int = 0) -> RunState:
    """A run of ``n`` 10 ms steps whose model message names ``roots`` (None: no model message)."""
    state = RunState()
    state.apply(protocol.message("hello", seq=1, script="x.py", argv=["x.py"], pid=1, start=1000.0, cuda=bool(gpus)))
    t, rows = 1000.0, []
    for i in range(1, n + 1):
        t += 0.01
        rows.append([i, t, 10.0, 1.0, 3.0, 4.0, 1.5, 0.5, 32])
    state.apply(protocol.message("steps", fields=FIELDS, rows=rows, seq=2))
    if roots is not None:
        state.apply(protocol.message("model", seq=3, roots=roots))
    if gpus:
        state.apply(protocol.message("sample", seq=4, t=1001.0, gpus=[dict(H100, index=k) for k in range(gpus)],
                                     host={"cpu_percent": 100.0, "cpu_count": 8}))
    return state


def make_facts(roots: list[str] | None, gpus: int = 0) -> Facts:
    return Facts.from_state(make_state(roots, gpus=gpus), Config())


@pytest.mark.parametrize("roots, fires", [
    (["DataParallel"], True),
    (["DataParallel", "MSELoss"], True),
    (["DistributedDataParallel"], False),
    (["Sequential"], False),
    (["MyDataParallelWrapper"], False),  # a class name is not matched in part
    ([], False),
    (None, False),  # no model message yet
])
def test_data_parallel(roots: list[str] | None, fires: bool) -> None:
    f = data_parallel(make_facts(roots, gpus=2), Config())
    if not fires:
        assert f is None
        return
    assert f is not None and f.id == "data-parallel" and f.severity == "warn"
    assert f.evidence == {"model": roots, "gpus": 2}
    assert "DistributedDataParallel" in f.fix and "torchrun" in f.fix


def test_data_parallel_is_a_registered_run_rule() -> None:
    assert "data-parallel" in REGISTRY and REGISTRY["data-parallel"][0] is data_parallel
    assert "data-parallel" in [f.id for f in evaluate_once(make_state(["DataParallel"], gpus=4))]
    assert "data-parallel" not in [f.id for f in evaluate_once(make_state(["DataParallel"], gpus=4),
                                                               Config(disabled=("data-parallel",)))]
    assert "data-parallel" not in [f.id for f in evaluate_once(make_state(["DistributedDataParallel"], gpus=1))]


# -- the job helpers ---------------------------------------------------------------------------------------------

def test_rank_row_defaults_and_immutability() -> None:
    r = RankRow(rank=3, node=None, host=None, steps=0, step_ms=None)
    assert (r.mean_ms, r.steady, r.phases, r.allocated_bytes, r.util_gpu, r.cpu_percent, r.rss_bytes, r.roots,
            r.comm_share, r.status) == (None, 0, {}, None, None, None, None, (), None, "running")
    assert r.phases is not RankRow(rank=4, node=None, host=None, steps=0, step_ms=None).phases
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("rows, expected", [
    ([], {}),
    (ddp(slow=1, x=20.0), {0: 80.0, 1: 100.0, 2: 80.0}),  # the others' 20 ms wait in backward is not work
    (independent([100.0, 115.0]), {0: 100.0, 1: 115.0}),
    ([row(0), row(1, mean=None, phases={}), row(2, phases={}, mean=120.0)], {0: 100.0}),
    ([row(0, mean=120.0, backward=70.0), row(1, mean=100.0)], {0: 100.0, 1: 100.0}),
])
def test_work_ms(rows: list[RankRow], expected: dict[int, float]) -> None:
    assert work_ms(rows) == pytest.approx(expected)


@pytest.mark.parametrize("rows, rank", [
    ([], None),
    ([row(0)], None),
    ([row(0), row(1, mean=None, phases={})], None),  # one timed rank
    (ddp(slow=2, x=20.0), 2),  # DDP: every step is as long; the one with the most work
    (independent([100.0, 115.0, 100.0]), 1),
    (independent([100.0, 100.0]), 0),  # a tie: the lower rank
    (independent([100.0, 100.0, 100.0, 90.0]), 0),
])
def test_slowest(rows: list[RankRow], rank: int | None) -> None:
    found = slowest(rows)
    assert (found.rank if found else None) == rank
    if found is not None:
        assert found is next(r for r in rows if r.rank == rank)


def test_slowest_agrees_with_straggler_on_a_slow_backward() -> None:
    rows = independent([100.0, 130.0], phase="backward")
    f = straggler(rows, Config())
    assert f is not None and f.evidence["rank"] == 1
    found = slowest(rows)
    assert found is not None and found.rank == 1


def recorded(n: int, windowed: range = range(0)) -> RunState:
    """A state whose recent window holds steps 1..n, those in ``windowed`` inside a profiler window."""
    state = RunState()
    state.recent.extend(Step(i, 1000.0 + i, 10.0, 1.0, 3.0, 4.0, 1.5, 0.5, 32, i in windowed)
                        for i in range(1, n + 1))
    return state


@pytest.mark.parametrize("n, windowed, kwargs, expected", [
    (100, range(0), {}, list(range(31, 101))),  # past the 30 warm-up steps
    (100, range(50, 60), {}, [*range(31, 50), *range(60, 101)]),  # profiled steps left out
    (50, range(0), {}, list(range(31, 51))),  # exactly 20 past warm-up: enough
    (49, range(0), {}, list(range(3, 50))),  # 19: a short run keeps all but its first two
    (60, range(35, 50), {}, [*range(3, 35), *range(50, 61)]),  # too few once windows are left out
    (10, range(0), {}, list(range(3, 11))),
    (2, range(0), {}, []),
    (0, range(0), {}, []),
    (20, range(0), {"warmup": 5, "min_steps": 10}, list(range(6, 21))),
    (20, range(0), {"warmup": 5, "min_steps": 16}, list(range(3, 21))),
])
def test_steady_steps(n: int, windowed: range, kwargs: dict[str, int], expected: list[int]) -> None:
    steps = steady_steps(recorded(n, windowed), **kwargs)
    assert [s.i for s in steps] == expected
    assert not any(s.windowed for s in steps)


def test_the_report_of_a_job_keeps_its_launchers_exit_status(tmp_path):
    """torchrun stopped by SIGTERM exits 1 while its ranks exit 0 from their own handlers: the live summary said
    exited 1, and `perfmon report RUN` (rebuilt from the ranks' recordings) said exited 0. The launcher records
    torchrun's status in the job dir; the report reads it (a dir without it: the ranks tell)."""
    from tui_fixtures import write_job

    from perfmon import paths
    from perfmon.analysis.job import load_job
    from perfmon.analysis.job_report import build_job_summary, job_status

    job_dir = write_job(tmp_path / "job", world=2, steps=60, telemetry=False, profile=False)
    assert load_job(job_dir).returncode is None
    assert build_job_summary(load_job(job_dir), job_dir)["exit_code"] == 0
    (job_dir / paths.LAUNCHER_EXIT).write_text('{"schema": 1, "returncode": 1}\n')
    job = load_job(job_dir)
    assert build_job_summary(job, job_dir)["exit_code"] == 1 and job_status(job) == "exited 1"
    (job_dir / paths.LAUNCHER_EXIT).write_text("{not json")
    assert load_job(job_dir).returncode is None


def test_a_run_dir_used_again_forgets_an_earlier_launchers_status(tmp_path):
    """A torchrun job that recorded nothing leaves launcher-exit.json but no recording, so its run dir may be used
    again; the new job's report took the old status (a running job read "exited 1")."""
    import subprocess
    import sys

    from perfmon import paths

    run = tmp_path / "run"
    run.mkdir()
    (run / paths.LAUNCHER_EXIT).write_text('{"schema": 1, "returncode": 1}\n')
    (tmp_path / "quick.py").write_text("print('hi')\n")
    res = subprocess.run([sys.executable, "-m", "perfmon.cli", "--headless", "--run-dir", str(run),
                          str(tmp_path / "quick.py")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "hi" in res.stdout, res.stderr
    assert not (run / paths.LAUNCHER_EXIT).exists()


@pytest.mark.parametrize("allocated, rss, shown", [
    (2**30, 3 * 2**30, "1.00G"),  # a GPU: the allocator's peak
    (None, 2**29, "0.50G"),  # CPU ranks: their RSS, as the dashboard's ranks view shows
    (None, None, "n/a"),
])
def test_the_headless_rank_table_shows_rss_where_there_is_no_cuda_memory(allocated, rss, shown):
    from perfmon.analysis.job_report import rank_table

    row = RankRow(rank=0, node=0, host="h", steps=10, step_ms=5.0, allocated_bytes=allocated, rss_bytes=rss)
    line = rank_table([row])[1]
    assert line.split()[-2:] == [shown, "running"]


def test_the_jobs_findings_group_ranks_only_where_a_finding_says_the_same_of_each() -> None:
    """Each rank's own findings are listed once with the ranks they hold on; rank 1's "Biggest phase: other" was
    listed as rank 0's "Biggest phase: backward (ranks 0, 1)". Figures aside, the same words group."""
    from test_rules import make_state

    from perfmon.analysis.job import JobState
    from perfmon.analysis.job_report import job_findings

    job = JobState()
    job.ranks = {0: make_state(n=100, bwd=8.0), 1: make_state(n=100, other=9.0), 2: make_state(n=100, bwd=9.0)}
    priority = {tuple(f["ranks"]): f["title"] for f in job_findings(job) if f["id"] == "priority"}
    assert set(priority) == {(0, 2), (1,)}, priority
    assert "backward" in priority[(0, 2)] and "other" in priority[(1,)]
