"""``perfmon accelerate launch ...``: Hugging Face accelerate's own launch command with the agent around each
process it starts, compared with the same ``accelerate launch`` without perfmon (output, exit status, the weights
the script saves, the steps it counts), on its simple launcher (one process, rank 0 of a world of one) and on
torchrun (``--multi_gpu --num_processes 2`` runs two workers on a CPU machine too); and the command lines it refuses,
each with one line."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e import PERFMON, REPO, env, perfmon, report  # noqa: F401  (env: the private runtime dir)

from perfmon import paths
from perfmon.agent.accelerate_launch import refusal
from perfmon.monitor.launch import Target, accelerate_script

SCRIPT = REPO / "demos" / "accelerate" / "train_accelerate.py"
#: accelerate's launch options stated, so that neither run prints its "defaults used" notice differently
OPTIONS = ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]
DONE = re.compile(r"process (\d)/(\d): (\d+) steps")
STEPS_PER_EPOCH = 1024 // 32


@pytest.mark.parametrize(("argv", "found"), [
    (["launch", "train.py", "--lr", "3e-4"], ("train.py", False)),
    (["launch", "--cpu", "--num_processes", "2", "sub/train.py", "x.py"], ("sub/train.py", False)),
    (["launch", "--config_file", "cfg.py", "train.py"], ("train.py", False)),
    (["launch", "-m", "pkg.train", "--epochs", "3"], ("pkg.train", True)),
    (["launch", "--num_processes", "2", "--module", "pkg.train"], ("pkg.train", True)),
    (["launch", "--cpu"], None),
    (["launch", "--cpu", "./train"], None),  # not named .py: the job's accelerate parses it (no early check)
])
def test_the_script_of_an_accelerate_command_line(argv, found):
    assert accelerate_script(argv) == found


def test_a_launcher_named_as_a_module_or_a_console_script_is_followed(tmp_path):
    """``perfmon -m torch.distributed.run ...`` or ``perfmon $(which accelerate) launch ...`` ran the launcher under
    the agent: its own process trains nothing, and its workers were not followed."""
    from perfmon.cli import _launcher

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "accelerate"):
        (bin_dir / name).write_text("#!/usr/bin/env python\n")
    assert _launcher("torch.distributed.run", ["--nproc-per-node", "2", "t.py"]) == [
        "torchrun", "--nproc-per-node", "2", "t.py"]
    assert _launcher("accelerate.commands.launch", ["--cpu", "t.py"]) == ["accelerate", "launch", "--cpu", "t.py"]
    assert _launcher(None, [str(bin_dir / "torchrun"), "t.py"]) == ["torchrun", "t.py"]
    assert _launcher(None, [str(bin_dir / "accelerate"), "launch", "t.py"]) == ["accelerate", "launch", "t.py"]
    assert _launcher(None, [str(bin_dir / "accelerate"), "env"]) is None  # not a launch
    assert _launcher("mypkg.train", ["--lr", "1"]) is None
    assert _launcher(None, ["torchrun.py"]) is None and _launcher(None, ["train.py"]) is None


def test_the_run_dir_and_the_command_of_an_accelerate_job():
    target = Target(script=None, module=None, args=["launch", "--cpu", "dir/train.py", "--lr", "1"],
                    launcher="accelerate")
    assert target.ranked and not target.torchrun and target.name == "dir/train.py"
    assert target.command("py") == ["py", "-m", "perfmon.agent.accelerate_launch", *target.args]


def test_a_process_without_rank_records_as_the_sole_rank_only_where_perfmon_accelerate_says_so():
    assert paths.placement({})["rank"] is None
    sole = paths.placement({paths.SOLE_RANK_ENV: "1"})
    assert (sole["rank"], sole["world_size"], sole["local_rank"], sole["node"]) == (0, 1, 0, 0)
    assert paths.is_ranked(sole, {paths.RANKS_ENV: "1"})
    ranked = paths.placement({paths.SOLE_RANK_ENV: "1", "RANK": "1", "WORLD_SIZE": "2"})  # torchrun's ranks
    assert (ranked["rank"], ranked["world_size"]) == (1, 2)


@pytest.mark.parametrize(("given", "words"), [
    ({"no_python": True}, "--no_python"),
    ({"mpirun_hostfile": "hosts"}, "MPI"),
    ({"num_machines": 2}, "perfmon torchrun --nnodes"),
])
def test_launches_perfmon_cannot_follow_are_refused_with_a_reason(given, words):
    fields = {"no_python": False, "mpirun_hostfile": None, "num_machines": None}
    assert refusal(argparse.Namespace(**fields)) is None
    why = refusal(argparse.Namespace(**{**fields, **given}))
    assert why is not None and words in why


@pytest.mark.parametrize(("args", "words"), [
    (["accelerate", "config"], "accelerate's other commands need no perfmon"),
    (["accelerate", "launch", "missing.py"], "can't open file 'missing.py'"),
    (["accelerate", "launch", "--cpu"], "no training script given"),
    (["accelerate", "launch", "--no_python", "train.py"], "--no_python"),
])
def test_a_command_line_perfmon_cannot_run_is_one_line_and_exit_2(args, words, env, tmp_path):  # noqa: F811
    res = perfmon(["--headless", "--run-dir", str(tmp_path / "run"), *args], env, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith("perfmon: error:") and words in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_help_is_perfmons_own(env):  # noqa: F811
    res = perfmon(["accelerate", "launch", "--help"], env)
    assert res.returncode == 0 and "perfmon [OPTIONS] accelerate launch" in res.stdout


pytest.importorskip("accelerate")


def plain(args: list[str], environ: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``accelerate launch ARGS`` as the accelerate command runs it."""
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args], cwd=cwd, env=environ,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)


def under_perfmon(run: Path, args: list[str], environ: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return perfmon(["--headless", "--interval", "3600", "--run-dir", str(run), "accelerate", "launch", *args],
                   environ, cwd=cwd, timeout=240)


def both(args: list[str], environ: dict[str, str], tmp: Path
         ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], Path, Path]:
    """``accelerate launch ARGS`` run twice, each in a dir of its own (the files it writes): without perfmon, then
    under it. Returns both results, and the dirs: plain's, perfmon's (its run dir is ``run`` in it)."""
    a, b = tmp / "plain", tmp / "perfmon"
    a.mkdir(), b.mkdir()
    return plain(args, environ, a), under_perfmon(b / "run", args, environ, b), a, b


@pytest.mark.e2e
def test_one_process_runs_as_under_plain_accelerate_and_counts_as_rank_0(env, tmp_path):  # noqa: F811
    without, res, a, b = both([*OPTIONS, str(SCRIPT), "--epochs", "2", "--save", "weights.pt"], env, tmp_path)
    assert without.returncode == 0, without.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == without.stdout
    assert DONE.findall(res.stdout) == [("0", "1", str(2 * STEPS_PER_EPOCH))]
    import torch

    mine, theirs = torch.load(b / "weights.pt"), torch.load(a / "weights.pt")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    summary = report(b / "run", env)
    assert summary["world_size"] == 1 and summary["exit_code"] == 0
    (rank,) = summary["ranks"]
    assert rank["rank"] == 0 and rank["steps"] == 2 * STEPS_PER_EPOCH  # what the script counted
    assert rank["phases"]["forward"]["mean_ms"] > 0 and rank["phases"]["backward"]["mean_ms"] > 0
    assert json.loads((b / "run" / "rank-0" / "summary.json").read_text())["steps"] == 2 * STEPS_PER_EPOCH
    assert "perfmon job summary: " in res.stderr and "(1 rank on 1 node)" in res.stderr


@pytest.mark.e2e
def test_a_crashing_script_fails_as_under_plain_accelerate_and_is_named(env, tmp_path):  # noqa: F811
    without, res, _, b = both([*OPTIONS, str(SCRIPT), "--epochs", "1", "--fail-at", "5"], env, tmp_path)
    assert without.returncode == res.returncode == 1
    assert res.stdout == without.stdout
    last = without.stderr.strip().splitlines()[-1]
    assert last.startswith("subprocess.CalledProcessError: Command '[") and str(SCRIPT) in last
    assert last in res.stderr.splitlines()  # the command accelerate names is the script, not perfmon's agent
    summary = report(b / "run", env)
    assert summary["failed_rank"]["rank"] == 0 and summary["ranks"][0]["steps"] == 5
    assert "RuntimeError: failing at step 5 as asked" in res.stderr


@pytest.mark.e2e
def test_torchrun_workers_are_ranks_of_one_process_group(env, tmp_path):  # noqa: F811
    """``--multi_gpu`` is accelerate's torchrun; with ``ACCELERATE_USE_CPU=true`` its workers are two gloo ranks of
    one process group on a machine without GPUs (without it, each is a process of its own to accelerate), each
    training on half of every epoch, each recorded as its rank."""
    args = ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), "--epochs", "1"]
    res = under_perfmon(tmp_path / "run", args, dict(env, ACCELERATE_USE_CPU="true"), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    half = STEPS_PER_EPOCH // 2
    assert sorted(DONE.findall(res.stdout)) == [("0", "2", str(half)), ("1", "2", str(half))]
    summary = report(tmp_path / "run", env)
    assert summary["world_size"] == 2 and summary["exit_code"] == 0
    assert {r["rank"]: r["steps"] for r in summary["ranks"]} == {0: half, 1: half}
    assert "(2 ranks on 1 node)" in res.stderr
