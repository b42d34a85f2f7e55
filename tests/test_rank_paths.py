"""Where a rank of a multi-process job sits (its launcher's environment), where the job records (one run dir
all ranks agree on, ``rank-K/`` inside), and the training script in a ``perfmon torchrun`` command line."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from perfmon import paths
from perfmon.monitor.launch import Target, torchrun_script

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "TORCHELASTIC_RUN_ID": "a1b2c3", "MASTER_ADDR": "10.0.0.1"}
NOWHERE = {"rank": None, "local_rank": None, "world_size": None, "local_world_size": None, "node": None,
           "job_id": None}


# -- placement ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    (TORCHRUN, {"rank": 3, "local_rank": 1, "world_size": 8, "local_world_size": 2, "node": 1, "job_id": "a1b2c3"}),
    ({"RANK": "0", "WORLD_SIZE": "1"},
     {"rank": 0, "local_rank": None, "world_size": 1, "local_world_size": None, "node": None,
      "job_id": str(os.getppid())}),
    # torchrun's default run id is "none": Slurm's job id, else the launcher (our parent)
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242"}, {"job_id": "4242"}),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}, {"job_id": str(os.getppid())}),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": "4242"}, {"job_id": "4242"}),
    ({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}, {"job_id": str(os.getppid())}),
    ({**TORCHRUN, "SLURM_JOB_ID": "4242"}, {"job_id": "a1b2c3"}),  # torchrun's own id first
    # the node: torchrun's GROUP_RANK, else Slurm's node id
    ({k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}, {"node": None}),
    ({**{k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}, "SLURM_NODEID": "5"}, {"node": 5}),
    ({**TORCHRUN, "SLURM_NODEID": "5"}, {"node": 1}),
])
def test_placement_in_a_job(env: dict[str, str], expected: dict[str, object]) -> None:
    where = paths.placement(env)
    assert set(where) == set(NOWHERE)
    assert {k: where[k] for k in expected} == expected


@pytest.mark.parametrize("env, local_rank", [
    ({}, None),
    ({"LOCAL_RANK": "2"}, 2),  # a launcher that sets only LOCAL_RANK: not a job of ranks
    ({k: v for k, v in TORCHRUN.items() if k != "RANK"}, 1),
    ({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, 1),
    ({**TORCHRUN, "RANK": "x"}, 1),
    ({**TORCHRUN, "RANK": "-1"}, 1),
    ({**TORCHRUN, "WORLD_SIZE": ""}, 1),
    ({**TORCHRUN, "RANK": "", "LOCAL_RANK": "?"}, None),
])
def test_placement_outside_a_job(env: dict[str, str], local_rank: int | None) -> None:
    assert paths.placement(env) == {**NOWHERE, "local_rank": local_rank}


def test_placement_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NODEID",
                 "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert paths.placement() == NOWHERE
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert paths.placement()["rank"] == 3 and paths.placement()["job_id"] == "a1b2c3"


# -- is_ranked ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where, env, ranked", [
    ({"rank": 0, "world_size": 2}, {}, True),
    ({"rank": 7, "world_size": 8}, {"PERFMON_RANKS": "0"}, True),
    ({"rank": 0, "world_size": 1}, {}, False),  # a plain run started by torchrun with one process
    ({"rank": 0, "world_size": 1}, {"PERFMON_RANKS": "1"}, True),  # perfmon torchrun: rank-0/ even alone
    ({"rank": 0, "world_size": 1}, {"PERFMON_RANKS": "0"}, False),
    ({"rank": 0, "world_size": 1}, {"PERFMON_RANKS": "yes"}, False),
    ({"rank": None, "world_size": None}, {"PERFMON_RANKS": "1"}, False),  # not in a job at all
    (NOWHERE, {}, False),
    ({"rank": None, "world_size": 4}, {}, False),
])
def test_is_ranked(where: dict[str, int | str | None], env: dict[str, str], ranked: bool) -> None:
    assert paths.is_ranked(where, env) is ranked


def test_is_ranked_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = paths.placement({"RANK": "0", "WORLD_SIZE": "1"})
    monkeypatch.delenv(paths.RANKS_ENV, raising=False)
    assert not paths.is_ranked(alone)
    monkeypatch.setenv(paths.RANKS_ENV, "1")
    assert paths.is_ranked(alone)


# -- job_run_dir / rank_dir --------------------------------------------------------------------------------------

def _dated(make: object) -> tuple[Path, set[str]]:
    """``make()`` and the dates it may have used (it may run across midnight)."""
    before = time.strftime("%Y%m%d")
    path = make()  # type: ignore[operator]
    return path, {before, time.strftime("%Y%m%d")}


@pytest.mark.parametrize("target, job_id, name", [
    ("train.py", "a1b2c3", "train-joba1b2c3"),
    ("scripts/train.py", "4242", "train-job4242"),
    ("pkg.train", "4242", "pkg.train-job4242"),  # a module (-m)
    ("my train!.py", "id with/slash:colon", "my_train_-jobid_with_slash_colon"),
    ("train.py", "x" * 60, "train-job" + "x" * 40),  # a long id is cut
    ("", "7", "run-job7"),
])
def test_job_run_dir(tmp_path: Path, target: str, job_id: str, name: str) -> None:
    path, dates = _dated(lambda: paths.job_run_dir(target, job_id, root=tmp_path))
    assert path.parent == tmp_path
    assert path.name in {f"{d}-{name}" for d in dates}


def test_job_run_dir_is_the_same_for_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    first = paths.job_run_dir("train.py", "abc")
    assert first.parent == tmp_path / "perfmon-runs"  # under the cwd by default
    first.mkdir(parents=True)  # the first rank made it: the next one must land in the same dir, not a new one
    assert paths.job_run_dir("train.py", "abc") == first
    assert paths.job_run_dir("train.py", "abd") != first
    assert paths.rank_dir(first, 3) == first / "rank-3"


# -- rank_dirs ---------------------------------------------------------------------------------------------------

def test_rank_dirs_reads_the_latest_attempt_of_each_rank_by_rank(tmp_path: Path) -> None:
    for name in ("rank-0", "rank-1", "rank-1.restart1", "rank-1.restart2", "rank-2.restart1", "rank-10",
                 "rank-3.restart9", "rank-3.restart10", "rank-x", "rank-", "rank-4.restart", "rank-5.old",
                 "Rank-6", "rank-7-copy", "notes", "xrank-8"):
        (tmp_path / name).mkdir()
    (tmp_path / "rank-9").write_text("a file, not a rank")
    (tmp_path / "rank-1.restart3").write_text("a file")
    (tmp_path / "events.jsonl").write_text("")
    assert paths.rank_dirs(tmp_path) == [
        (0, tmp_path / "rank-0"),
        (1, tmp_path / "rank-1.restart2"),
        (2, tmp_path / "rank-2.restart1"),
        (3, tmp_path / "rank-3.restart10"),  # by number, not by name
        (10, tmp_path / "rank-10"),  # by number: after 3
    ]


@pytest.mark.parametrize("files, run_dir", [
    ((), "."),  # empty
    ((), "missing"),
    (("a-file",), "a-file"),  # not a directory
    (("rank-0", "rank-1.restart1"), "."),  # only files named like ranks
])
def test_rank_dirs_of_a_dir_without_ranks(tmp_path: Path, files: tuple[str, ...], run_dir: str) -> None:
    for name in files:
        (tmp_path / name).write_text("")
    assert paths.rank_dirs(tmp_path / run_dir) == []


# -- torchrun_script ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--nproc-per-node", "2", "train.py", "--lr", "3"], ("train.py", False)),
    (["--nproc-per-node=2", "-m", "pkg.train", "x"], ("pkg.train", True)),
    (["--standalone", "--nnodes", "1", "t.py"], ("t.py", False)),
    (["t.py"], ("t.py", False)),
    (["--module", "pkg.train"], ("pkg.train", True)),
    (["--nproc_per_node", "4", "--rdzv-endpoint=host:29500", "--max-restarts", "3", "train.py", "-m", "y"],
     ("train.py", False)),  # the script's own -m is its argument
    (["--no-python", "--nproc-per-node", "2", "echo", "hi"], ("echo", False)),
    (["--run-path", "train.py"], ("train.py", False)),
    (["-r", "3", "train.py"], ("train.py", False)),  # -r/--redirects take a value
    ([], None),
    (["--nnodes", "2"], None),
    (["--nproc-per-node", "2", "--standalone"], None),
    (["-m"], None),
    (["--nnodes"], None),
])
def test_torchrun_script(argv: list[str], expected: tuple[str, bool] | None) -> None:
    assert torchrun_script(argv) == expected


@pytest.mark.parametrize("argv", [["--tee", "3", "train.py"], ["--redirects", "3", "train.py"]])
def test_torchrun_script_skips_the_value_of_tee_and_redirects(argv: list[str]) -> None:
    assert torchrun_script(argv) == ("train.py", False)


def test_torchrun_script_knows_virtual_local_rank_is_a_flag() -> None:
    assert torchrun_script(["--virtual-local-rank", "train.py"]) == ("train.py", False)


@pytest.mark.parametrize("args, name", [
    (["--nproc-per-node", "2", "train.py", "--lr", "3"], "train.py"),
    (["--nproc-per-node=2", "-m", "pkg.train"], "pkg.train"),
    (["--nnodes", "2"], "torchrun"),
])
def test_torchrun_target_is_named_by_its_script(args: list[str], name: str) -> None:
    target = Target(script=None, module=None, args=args, launcher="torchrun")
    assert target.name == name
    assert target.command("py") == ["py", "-m", "perfmon.agent.torchrun", *args]


# -- where a process records (perfmon.agent.bootstrap._run_dir) ---------------------------------------------
_RANK_ENV = ("PERFMON_RUN_DIR", "PERFMON_LAUNCHER_PID", "PERFMON_RANKS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "GROUP_RANK")


@pytest.mark.parametrize(("env", "want"), [
    # `perfmon train.py` in a shell that holds a job's RANK/WORLD_SIZE: where the launcher reads it
    ({"PERFMON_RUN_DIR": "{tmp}/R", "PERFMON_LAUNCHER_PID": "{ppid}", "RANK": "1", "WORLD_SIZE": "2"}, "{tmp}/R"),
    ({"PERFMON_RUN_DIR": "{tmp}/R", "PERFMON_LAUNCHER_PID": "{ppid}"}, "{tmp}/R"),
    # `perfmon torchrun`: one dir per rank under the launcher's, even in a world of one
    ({"PERFMON_RUN_DIR": "{tmp}/R", "PERFMON_LAUNCHER_PID": "1", "PERFMON_RANKS": "1", "RANK": "1",
      "WORLD_SIZE": "2"}, "{tmp}/R/rank-1"),
    ({"PERFMON_RUN_DIR": "{tmp}/R", "PERFMON_LAUNCHER_PID": "1", "PERFMON_RANKS": "1", "RANK": "0",
      "WORLD_SIZE": "1"}, "{tmp}/R/rank-0"),
    # perfmon.instrument(run_dir=...) under a launcher of ranks: the given dir is the job's
    ({"PERFMON_RUN_DIR": "{tmp}/J", "RANK": "3", "WORLD_SIZE": "4"}, "{tmp}/J/rank-3"),
    # a rank torchrun restarted records beside its first attempt
    ({"PERFMON_RUN_DIR": "{tmp}/J", "RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "2"},
     "{tmp}/J/rank-3.restart2"),
    # perfmon.instrument() with no dir: every rank names the job's dir from torchrun's run id and when the
    # process that started the ranks started (the same id run again gets a dir of its own)
    ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"},
     "{cwd}/perfmon-runs/{pdate}-train-jobabc-{ptime}/rank-1"),
])
def test_where_a_process_records(env: dict[str, str], want: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from perfmon.agent.bootstrap import _run_dir

    for name in _RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path, ppid=os.getppid()))
    import psutil

    started = time.localtime(psutil.Process(os.getppid()).create_time())
    fill = {"tmp": tmp_path, "cwd": tmp_path, "pdate": time.strftime("%Y%m%d", started),
            "ptime": time.strftime("%H%M%S", started)}
    assert _run_dir("train.py") == Path(want.format(**fill))


def test_a_plain_process_records_in_a_new_dir_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from perfmon.agent.bootstrap import _run_dir

    for name in _RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    got = _run_dir("train.py")
    assert got.parent == tmp_path / "perfmon-runs" and got.name.endswith("-train")


def test_a_zombie_is_not_alive() -> None:
    """A process that exited but was not reaped (a killed monitor whose parent never waits) counts as gone."""
    import subprocess
    import sys

    from perfmon.paths import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    import time

    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}").exists() and b") Z" not in Path(f"/proc/{child.pid}/stat").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pid_alive(child.pid)  # exited, not yet reaped
    assert pid_alive(os.getpid())
    child.wait()
    assert not pid_alive(child.pid)


def test_a_process_the_job_started_records_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """perfmon.instrument() in a worker the job started (torch.multiprocessing.spawn): the job's environment came
    with it, but the launcher is not its parent, so it gets a recording of its own, never the job's dir."""
    from perfmon.agent.bootstrap import _run_dir

    for name in _RANK_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PERFMON_RUN_DIR", str(tmp_path / "R"))
    monkeypatch.setenv("PERFMON_LAUNCHER_PID", str(os.getppid() + 1))  # not our parent: we are the job's child
    where = _run_dir("train.py")
    assert where.parent == Path("perfmon-runs") or where.parent == tmp_path / "perfmon-runs", where
    assert where.name.endswith("-train")


def test_run_dirs_claimed_at_the_same_second_are_never_shared(tmp_path: Path) -> None:
    """Workers that each call perfmon.instrument() at once name their dirs from the same second: each claims its own
    (created atomically), where a look-then-create would hand two of them one dir and mix their recordings."""
    import threading

    start = threading.Barrier(8)
    got: list[Path] = []

    def claim() -> None:
        start.wait()
        got.append(paths.default_run_dir("train.py", root=tmp_path, now=0.0, claim=True))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and all(p.is_dir() for p in got)
    assert paths.default_run_dir("train.py", root=tmp_path, now=0.0) not in got  # naming alone skips them too
