"""End to end: ``perfmon --headless torchrun ...`` on a gloo DDP script (demos/ddp/train_ddp.py), compared
with the same torchrun command without perfmon: output, exit status, steps per rank, one recording per rank,
the straggler named by rank and phase, a failing rank named with its exception."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_e2e import (  # noqa: F401  (env: the private runtime dir)
    PERFMON,
    PRINTS_EVERY_STEP,
    REPO,
    env,
    into_head,
    perfmon,
    report,
)

pytestmark = pytest.mark.e2e

DDP = REPO / "demos" / "ddp" / "train_ddp.py"
STEPS = 30
DONE = re.compile(r"rank (\d)/2: (\d+) steps")  # ranks share one stdout: lines may interleave


def torchrun(*script_args: str) -> list[str]:
    """A two-rank job on this machine (--standalone: a free port, so concurrent jobs do not collide)."""
    return ["--standalone", "--nproc-per-node", "2", str(DDP), *script_args]


def plain(args: list[str], environ: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=tmp, env=environ,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)


def under_perfmon(run: Path, args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return perfmon(["--headless", "--interval", "1", "--run-dir", str(run), "torchrun", *args], environ, timeout=180)


def done(stdout: str) -> dict[int, int]:
    """What each rank printed at its end: rank -> the steps it counted itself."""
    return {int(rank): int(steps) for rank, steps in DONE.findall(stdout)}


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]  # noqa: F811
            ) -> Iterator[tuple[Path, subprocess.CompletedProcess[str], dict[str, Any]]]:
    run = tmp_path_factory.mktemp("ddp") / "run"
    res = under_perfmon(run, torchrun("--steps", str(STEPS)), env)
    yield run, res, report(run, env)


def test_torchrun_job_runs_as_without_perfmon_and_counts_every_rank(ddp_job, env, tmp_path):  # noqa: F811
    run, res, summary = ddp_job
    without = plain(torchrun("--steps", str(STEPS)), env, tmp_path)
    assert without.returncode == 0, without.stderr[-2000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert done(res.stdout) == done(without.stdout) == {0: STEPS, 1: STEPS}
    assert summary["world_size"] == 2 and summary["nodes"] == 1
    assert summary["exit_code"] == 0 and summary["failed_rank"] is None
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    assert sorted(by_rank) == [0, 1]
    for rank, r in by_rank.items():
        assert r["steps"] == STEPS  # exactly what the script counted on that rank
        assert r["node"] == 0 and r["exit_code"] == 0
        assert Path(r["run_dir"]) == run / f"rank-{rank}"
        assert set(r["phases"]) == {"data", "forward", "backward", "optimizer", "other"}
        assert r["phases"]["backward"]["mean_ms"] > 0 and r["step_ms"]["p50_ms"] > 0
        assert (run / f"rank-{rank}" / "events.jsonl").is_file()
        assert json.loads((run / f"rank-{rank}" / "summary.json").read_text())["steps"] == STEPS
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert "perfmon job summary" in res.stderr and "2 ranks on 1 node" in res.stderr


def test_each_rank_records_its_place_in_the_job(ddp_job):
    run, _, _ = ddp_job
    for rank in (0, 1):
        first = json.loads((run / f"rank-{rank}" / "events.jsonl").read_text().splitlines()[0])
        assert first["type"] == "hello"
        assert (first["rank"], first["local_rank"], first["world_size"], first["node"]) == (rank, rank, 2, 0)


def test_replay_and_report_read_the_whole_job(ddp_job, env):  # noqa: F811
    run, _, _ = ddp_job
    text = perfmon(["report", str(run)], env)
    assert text.returncode == 0, text.stderr
    assert re.search(r"^\s+0\s+0\s+30\s", text.stdout, re.M) and re.search(r"^\s+1\s+0\s+30\s", text.stdout, re.M)


def test_straggler_is_named_by_rank_and_phase(tmp_path, env):  # noqa: F811
    run = tmp_path / "run"
    # rank 1's Dataset sleeps 10 ms a batch: in DDP rank 0 then waits for it inside backward
    res = under_perfmon(run, torchrun("--steps", "60", "--slow-rank", "1", "--delay", "0.01"), env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert done(res.stdout) == {0: 60, 1: 60}
    found = {f["id"]: f for f in report(run, env)["findings"]}
    assert "straggler" in found, found.keys()
    assert found["straggler"]["evidence"]["rank"] == 1
    assert found["straggler"]["evidence"]["phase"] == "data"
    assert found["straggler"]["severity"] == "critical"
    assert "straggler" in res.stderr and "rank 1" in res.stderr


def test_a_failing_rank_takes_the_job_down_and_is_named(tmp_path, env):  # noqa: F811
    args = torchrun("--steps", "40", "--fail-rank", "1", "--fail-at", "5")
    without = plain(args, env, tmp_path)
    res = under_perfmon(tmp_path / "run", args, env)
    assert without.returncode != 0
    assert res.returncode == without.returncode, res.stderr[-3000:]
    # the rank's own traceback, where torchrun shows it (its stderr), and not on stdout
    assert "RuntimeError: rank 1 failed at step 5" in without.stderr and "failed at step" not in without.stdout
    raised = 'raise RuntimeError(f"rank {rank} failed at step {steps}")'
    assert raised in without.stderr and raised in res.stderr and "failed at step" not in res.stdout
    # torchrun's own report, as torchrun raises it: its traceback, then the box named for the script (it read
    # "perfmon.agent FAILED", with no traceback)
    box = [line for line in without.stderr.splitlines() if line.endswith(" FAILED")]
    assert box and box == [line for line in res.stderr.splitlines() if line.endswith(" FAILED")]
    assert "ChildFailedError" in without.stderr and "ChildFailedError" in res.stderr
    summary = report(tmp_path / "run", env)
    assert summary["failed_rank"]["rank"] == 1
    assert "RuntimeError: rank 1 failed at step 5" in summary["failed_rank"]["exception"]
    # the job's exception is the failed rank's (it was rank 0's: none, torchrun's SIGTERM)
    assert (summary["exception"], summary["signal"]) == (summary["failed_rank"]["exception"], None)
    assert summary["exit_code"] == res.returncode
    assert "rank 1 failed: RuntimeError: rank 1 failed at step 5" in res.stderr


def test_a_reader_that_leaves_the_pipe_ends_every_rank_as_under_plain_torchrun(tmp_path, env):  # noqa: F811
    """``torchrun ... | head -2``: the ranks share torchrun's stdout, so their next print raises BrokenPipeError and
    the job fails. Under perfmon the ranks' output goes to files perfmon copies to the pipe: every rank's stdout is
    broken when the copy breaks (they trained on, unseen, for as long as the job ran)."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS_EVERY_STEP)
    args = ["--standalone", "--nproc-per-node", "2", str(script)]
    out, code, err = into_head([sys.executable, "-m", "torch.distributed.run", *args], tmp_path, env)
    assert out.count("\n") == 2 and code != 0 and "BrokenPipeError" in err, err[-2000:]
    run = tmp_path / "run"
    pm_out, pm_code, pm_err = into_head([*PERFMON, "--headless", "--run-dir", str(run), "torchrun", *args],
                                        tmp_path, env)
    assert pm_out.count("\n") == 2 and pm_out.startswith("step "), pm_out
    assert pm_code == code, pm_err[-3000:]
    summary = report(run, env)
    assert len(summary["ranks"]) == 2
    for r in summary["ranks"]:
        assert r["exception"].startswith("BrokenPipeError") and r["steps"] < 400, r


@pytest.mark.parametrize(("args", "message"), [
    ([], "no training script given"),
    (["--nproc-per-node", "2", "missing.py"], "can't open file 'missing.py'"),
    (["--no-python", "--nproc-per-node", "2", "echo"], "--no-python"),
    (["--run-path", "--nproc-per-node", "2", str(DDP)], "--run-path"),
])
def test_bad_torchrun_command_lines_get_one_line_and_exit_2(args, message, tmp_path, env):  # noqa: F811
    res = perfmon(["--headless", "--run-dir", str(tmp_path / "run"), "torchrun", *args], env)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_ranks_that_call_instrument_register_as_one_job_that_attach_reads_whole(tmp_path, env, monkeypatch):  # noqa: F811
    """No perfmon launcher: torchrun starts the script, each rank calls perfmon.instrument(). ``perfmon ls``
    shows the job once with its ranks; attaching by one rank's pid reads every rank live."""
    from test_e2e import wait_for

    from perfmon.analysis.job import JobState
    from perfmon.monitor.discovery import find_run, job_alive
    from perfmon.monitor.job_source import JobSource

    monkeypatch.setenv("PERFMON_RUNTIME_DIR", env["PERFMON_RUNTIME_DIR"])
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun(
        "--steps", "250", "--instrument", "--step-sleep", "0.02")], cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    source = None
    try:
        def listed() -> Any:
            res = perfmon(["ls", "--json"], env)
            jobs = [r for r in json.loads(res.stdout or "[]") if len(r.get("ranks") or []) == 2]
            return jobs[0] if jobs else None

        entry = wait_for(listed, "the job in perfmon ls, with both ranks")
        assert Path(entry["job_dir"]).parent == tmp_path / "perfmon-runs"
        assert [r["rank"] for r in entry["ranks"]] == [0, 1]
        text = perfmon(["ls"], env).stdout
        assert text.count(entry["job_dir"]) == 1 and "job of 2/2 ranks" in text
        run = find_run(str(entry["ranks"][1]["pid"]))  # what perfmon attach PID looks up: the whole job
        assert run["job_dir"] == entry["job_dir"]
        state = JobState()
        source = JobSource(Path(run["job_dir"]), alive=lambda: job_alive(Path(run["job_dir"])))
        for msg in source.messages():
            state.apply(msg)
            if len(state.ranks) == 2 and all(s.steps >= 5 for s in state.ranks.values()) \
                    and source.ranks_connected() == [0, 1]:
                break
        assert source.ranks_connected() == [0, 1]  # live, through each rank's own socket
    finally:
        if source is not None:
            source.close()
        out = job.communicate(timeout=180)[0]
    assert job.returncode == 0, out[-3000:]
    assert done(out) == {0: 250, 1: 250}
    job_dir = Path(entry["job_dir"])
    # nobody launched it: each rank's exit starts a detached report that writes the summaries
    summary = wait_for(lambda: (job_dir / "summary.json").exists() and json.loads(
        (job_dir / "summary.json").read_text()), "the job's summary.json")
    wait_for(lambda: all(r["steps"] == 250 and r["exit_code"] == 0 for r in json.loads(
        (job_dir / "summary.json").read_text())["ranks"]), "a summary with both ranks' exits")
    assert summary["world_size"] == 2


def test_a_run_dir_that_holds_a_job_is_not_reused(ddp_job, env):  # noqa: F811
    run, _, _ = ddp_job
    res = perfmon(["--headless", "--run-dir", str(run), "torchrun", *torchrun("--steps", "3")], env)
    assert res.returncode == 2 and "already holds a recording" in res.stderr


SPAWN_DDP = REPO / "demos" / "ddp" / "spawn_ddp.py"


def test_ranks_the_script_spawns_are_followed_as_a_job(tmp_path, env):  # noqa: F811
    """The DDP tutorial's own launcher, ``mp.spawn`` from the script: each spawned process records as a rank in
    RUN/ranks/ (a job's run dir), the launcher follows them as a torchrun job and prints the job's summary, and
    ``perfmon report RUN`` reads the ranks' job; the script runs as under plain python."""
    without = subprocess.run([sys.executable, str(SPAWN_DDP), "--steps", str(STEPS)], cwd=tmp_path, env=env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    run = tmp_path / "run"
    res = perfmon(["--headless", "--interval", "1", "--run-dir", str(run), str(SPAWN_DDP), "--steps", str(STEPS)],
                  env, timeout=180)
    assert without.returncode == 0, without.stderr[-2000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert done(res.stdout) == done(without.stdout) == {0: STEPS, 1: STEPS}
    assert "perfmon job summary" in res.stderr and "2 ranks on 1 node" in res.stderr, res.stderr[-2000:]
    assert "perfmon follows this process only" not in res.stderr  # the old warning: not followed
    summary = report(run, env)  # the script's run dir: its ranks' job
    assert summary["world_size"] == 2 and summary["exit_code"] == 0
    for r in summary["ranks"]:
        assert r["steps"] == STEPS and Path(r["run_dir"]) == run / "ranks" / f"rank-{r['rank']}"
        assert json.loads((run / "ranks" / f"rank-{r['rank']}" / "summary.json").read_text())["steps"] == STEPS
    assert json.loads((run / "ranks" / "summary.json").read_text())["world_size"] == 2
    assert (run / "events.jsonl").is_file()  # the script's own recording stays


SPAWN_FAIL_SCRIPT = """
import torch
import torch.multiprocessing as mp
def train(rank):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(6):
        if rank == 1 and i == 3:
            raise RuntimeError(f"rank {rank} broke at step {i}")
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
if __name__ == "__main__":
    mp.start_processes(train, nprocs=2, start_method="fork")
"""


def test_a_spawned_rank_that_fails_is_named_and_its_traceback_is_the_scripts(tmp_path, env):  # noqa: F811
    """A rank the script spawned raises: the script fails as under python, with the rank's traceback as python
    prints it (no frame of perfmon's: the rank's function is called from C), and the job summary names it."""
    script = tmp_path / "fails.py"
    script.write_text(SPAWN_FAIL_SCRIPT)
    # no status line: on a loaded host the job outlasts the default 10 s, and the line is perfmon's, not the traceback's
    res = perfmon(["--headless", "--interval", "3600", "--run-dir", str(tmp_path / "run"), str(script)], env,
                  timeout=180)
    assert res.returncode == 1, res.stderr[-3000:]
    traceback_text = res.stderr[:res.stderr.index("perfmon job summary")]
    assert "RuntimeError: rank 1 broke at step 3" in traceback_text and "in train" in traceback_text
    if hot_path_built():
        assert "perfmon" not in traceback_text, traceback_text
    assert "rank 1 failed: RuntimeError: rank 1 broke at step 3" in res.stderr
    summary = report(tmp_path / "run", env)
    # rank 0 is terminated by torch when rank 1 fails, at whatever step it reached
    assert {r["rank"]: r["steps"] for r in summary["ranks"]}[1] == 3 and summary["failed_rank"]["rank"] == 1


SPAWN_TWICE_SCRIPT = """
import torch
import torch.multiprocessing as mp
def loop(steps):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
def rank(i, steps):
    loop(steps)
if __name__ == "__main__":
    mp.start_processes(rank, args=(5,), nprocs=2, start_method="fork")  # train
    mp.start_processes(rank, args=(3,), nprocs=1, start_method="fork")  # then evaluate, say
    loop(7)  # and the script's own process trains too
    print("done")
"""


def test_each_spawn_is_a_job_of_its_own_and_the_scripts_own_steps_stay_its(tmp_path, env):  # noqa: F811
    """Two mp.spawn calls in one script record two jobs (RUN/ranks, RUN/ranks-2: the second wrote into the first's
    recordings), and steps the script's own process trains are reported as its (they were hidden by the ranks)."""
    script = tmp_path / "twice.py"
    script.write_text(SPAWN_TWICE_SCRIPT)
    run = tmp_path / "run"
    res = perfmon(["--headless", "--run-dir", str(run), str(script)], env, timeout=180)
    assert res.returncode == 0 and res.stdout == "done\n", res.stderr[-3000:]
    assert "perfmon job summary" in res.stderr and "perfmon summary" in res.stderr, res.stderr
    assert f"other ranks too: perfmon report {run / 'ranks-2'}" in res.stderr
    assert report(run, env)["steps"] == 7  # the script trained: RUN is its own run
    assert [r["steps"] for r in report(run / "ranks", env)["ranks"]] == [5, 5]
    assert [r["steps"] for r in report(run / "ranks-2", env)["ranks"]] == [3]


PREPROCESS_SCRIPT = """
import torch
import torch.multiprocessing as mp
def shard(i):
    torch.save(torch.randn(64, 4) * i, f"shard{i}.pt")  # preprocessing in spawned processes: no training
if __name__ == "__main__":
    mp.start_processes(shard, nprocs=2, start_method="fork")
    x = torch.cat([torch.load(f"shard{i}.pt") for i in range(2)])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(6):
        model(x[i::6]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("trained")
"""


def test_processes_spawned_to_preprocess_leave_the_scripts_own_run_on_show(tmp_path, env):  # noqa: F811
    """mp.spawn for work that does not train (no rank steps): the monitor stays on the script, which trains after."""
    script = tmp_path / "prep.py"
    script.write_text(PREPROCESS_SCRIPT)
    run = tmp_path / "run"
    res = perfmon(["--headless", "--run-dir", str(run), str(script)], env, cwd=tmp_path, timeout=180)
    assert res.returncode == 0 and res.stdout == "trained\n", res.stderr[-3000:]
    assert "perfmon job summary" not in res.stderr and "perfmon summary" in res.stderr, res.stderr
    assert report(run, env)["steps"] == 6


def hot_path_built() -> bool:
    from perfmon.agent.native import HOT

    return HOT is not None


WARNING_SCRIPT = """
import os
import time

import torch.multiprocessing as mp
said = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-warned")
if os.environ["RANK"] == "1":  # 5.5 s after rank 0: past the monitor's next look at the warnings (one each 5 s)
    deadline = time.monotonic() + 120
    while not os.path.exists(said) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(5.5)
try:  # each rank warns as the processes start; the start fails at once, and the rank ends
    mp.start_processes(print, nprocs=1, start_method="no-such-method")
except ValueError as exc:
    print("could not start:", type(exc).__name__)
if os.environ["RANK"] == "0":
    open(said, "w").close()
"""


def test_the_ranks_warnings_are_printed_once_with_the_ranks_that_said_them(tmp_path, env):  # noqa: F811
    """``perfmon --headless torchrun``: what the ranks' agents warn about reaches the terminal (it was only in the
    recordings), one line for the ranks that said the same thing, seconds apart or in the job's last second."""
    script = tmp_path / "warns.py"
    script.write_text(WARNING_SCRIPT)
    res = under_perfmon(tmp_path / "run", ["--standalone", "--nproc-per-node", "2", str(script)], env)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if line.startswith("[perfmon] warning")]
    assert len(said) == 1, res.stderr
    assert said[0].startswith("[perfmon] warning (ranks 0, 1): torch.multiprocessing started 1 process"), said


def test_the_warning_feed_groups_ranks_and_follows_a_restart():
    from perfmon import protocol
    from perfmon.analysis.job import JobState, WarningFeed, warning_line

    def new_warnings(job: JobState, feed: WarningFeed) -> list[str]:
        return [warning_line(who, text).removeprefix("[perfmon] ") for who, text in feed.new(job=job)]

    clock = [0.0]
    job, said = JobState(), WarningFeed(hold_s=10.0, clock=lambda: clock[0])
    for rank, text in ((0, "disk full"), (0, "slow"), (1, "disk full")):
        job.rank(rank).apply(protocol.message("event", kind="warning", message=text, t=0.5))
    assert new_warnings(job, said) == ["warning (ranks 0, 1): disk full"]  # "slow" waits for rank 1
    clock[0] = 9.0
    job.rank(1).apply(protocol.message("event", kind="warning", message="late", t=9.0))
    assert new_warnings(job, said) == []  # rank 1 may yet say "slow"; rank 0 "late"
    clock[0] = 10.0
    assert new_warnings(job, said) == ["warning (rank 0): slow"]  # the others' time is up
    job.rank(0).apply(protocol.message("event", kind="warning", message="late", t=10.0))
    assert new_warnings(job, said) == ["warning (ranks 0, 1): late"]  # said late, by both: one line still
    assert new_warnings(job, said) == []  # nothing new
    for rank in (0, 1):  # the ranks' recordings read again at the job's end: the same runs, nothing new
        hello = protocol.message("hello", pid=100 + rank, start=1.0)
        job.rank(rank).apply(hello)
        new_warnings(job, said)
        again = type(job.rank(rank))()
        for msg in (hello, *(protocol.message("event", kind="warning", message=text, t=0.5)
                             for text in job.rank(rank).warnings_since(0))):
            again.apply(msg)
        job.ranks[rank] = again
    assert new_warnings(job, said) == []
    job.ranks[1] = type(job.rank(0))()  # rank 1 restarted: its state begins again
    job.rank(1).apply(protocol.message("event", kind="warning", message="again", t=1.0))
    assert new_warnings(job, said) == []  # held (the other rank may say it too) ...
    clock[0] = 20.0  # ... until its time is up
    assert new_warnings(job, said) == ["warning (rank 1): again"]
    for k in range(60):  # more than the 50 a state keeps: every new one is still said
        job.rank(0).apply(protocol.message("event", kind="warning", message=f"w{k}", t=2.0))
    assert new_warnings(job, said) == []  # held (the other rank may say it too) ...
    clock[0] = 30.0  # ... until its time is up
    assert new_warnings(job, said) == [f"warning (rank 0): w{k}" for k in range(10, 60)]
    job.rank(0).apply(protocol.message("event", kind="warning", message="w60", t=3.0))
    assert new_warnings(job, said) == []  # held (the other rank may say it too) ...
    clock[0] = 40.0  # ... until its time is up
    assert new_warnings(job, said) == ["warning (rank 0): w60"]
    job.rank(0).reset()  # a replay that starts over: what it says again is said again
    job.rank(0).apply(protocol.message("event", kind="warning", message="w0", t=0.1))
    assert new_warnings(job, said) == []
    assert [line for who, text in said.new(job=job, final=True) for line in [warning_line(who, text)]] == [
        "[perfmon] warning (rank 0): w0"]  # the job over: whatever waits is said
    job.rank(1).apply(protocol.message("event", kind="warning", message="w1", t=0.2))
    job.process_exited(0)  # every rank ended (a replay of a finished job too): no rank is left to wait for
    assert new_warnings(job, said) == ["warning (rank 1): w1"]


@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="needs tmux to run the dashboard in a terminal")
def test_a_torchrun_job_under_the_dashboard_is_summarised_as_it_ends(env, tmp_path):  # noqa: F811
    """Every rank's summary.json and the job's come with the job's end, while the dashboard still shows it: a
    terminal that hangs up then (an SSH drop) kills perfmon before its own ending would write them."""
    run = tmp_path / "run"
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    cmd = " ".join([*PERFMON, "--run-dir", str(run), "torchrun", "--nproc_per_node", "2", str(DDP), "--steps", "20"])
    subprocess.run([*tmux, "new-session", "-d", "-s", "pm", "-x", "120", "-y", "40", f"cd {REPO} && {cmd}; sleep 60"],
                   env=env, check=True)
    try:
        from test_e2e import wait_for

        summary = wait_for(lambda: (run / "summary.json").exists() and json.loads((run / "summary.json").read_text()),
                           "the job's summary.json while its dashboard is open", timeout=120)
        assert summary["world_size"] == 2 and {r["steps"] for r in summary["ranks"]} == {20}
        assert all((run / f"rank-{k}" / "summary.json").exists() for k in (0, 1))
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "pm"], capture_output=True, text=True).stdout
        assert "steps/s" in screen  # the dashboard is still the one on screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
