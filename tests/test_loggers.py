"""``--tensorboard`` and ``--wandb``: phase timings and findings where people already look, written by the
monitor (TensorBoard event files read back with TensorBoard's own reader) or added to the script's own wandb
run (a stand-in ``wandb`` module: no account, no network) without changing the script's steps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_e2e import REPO, env, perfmon  # noqa: F401  (env: private runtime dir)
from tui_fixtures import write_job, write_recording

from perfmon.analysis.job import JobState
from perfmon.analysis.report import load_recording
from perfmon.messages.commands import Command
from perfmon.monitor.job_source import JobSource
from perfmon.monitor.loggers import LoggerError, ScalarLoggers, scalars

FAKE_WANDB = REPO / "demos" / "loggers" / "fake_wandb_run.py"


def tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "perfmon"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.e2e
def test_wandb_and_tensorboard_during_a_real_run(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    out = tmp_path / "wandb.jsonl"
    res = perfmon(["--headless", "--wandb", "--tensorboard", "--log-interval", "1", "--run-dir",
                   str(tmp_path / "run"), str(FAKE_WANDB), "--out", str(out), "--seconds", "5"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    steps = int(res.stdout.split()[0])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # the script's own steps, exactly: perfmon's numbers joined them (commit=False), never made steps of their own
    assert [r["_step"] for r in records] == list(range(steps))
    assert all("loss" in r for r in records)
    ours = [r for r in records if "perfmon/step_ms" in r]
    assert len(ours) >= 2, "logged about once a second while the job ran"
    assert all(r["perfmon/step_ms"] > 0 and 0 <= r["perfmon/backward_share"] <= 1 for r in ours)
    tb = tb_scalars(tmp_path / "run")
    assert {"perfmon/step_ms", "perfmon/data_ms", "perfmon/backward_ms", "perfmon/steps_per_s"} <= set(tb)
    logged_steps = [step for step, _ in tb["perfmon/step_ms"]]
    assert logged_steps == sorted(logged_steps) and logged_steps[-1] == steps  # the last one at the end
    assert any(tag.startswith("perfmon/finding/") for tag in tb)


def test_scalars_of_a_run(tmp_path: Path) -> None:
    state = load_recording(write_recording(tmp_path / "run", device="gpu"))
    from perfmon.analysis.rules import evaluate_once

    values = scalars(state, evaluate_once(state))
    assert values["perfmon/step_ms"] == pytest.approx(state.phase_stats()["step"].mean_ms)
    assert sum(values[f"perfmon/{p}_share"] for p in ("data", "forward", "backward", "optimizer", "other")) \
        == pytest.approx(1.0, abs=1e-6)
    assert 0 < values["perfmon/gpu_util_percent"] <= 100 and values["perfmon/mfu"] > 0
    assert values["perfmon/finding/input-bound"] == 3.0  # critical


def test_a_job_logs_one_series_per_rank_and_cleared_findings_log_zero(tmp_path: Path) -> None:
    job_dir = write_job(tmp_path / "job", world=2, slow=1, extra_ms=20.0, telemetry=False, profile=False)
    job, lock = JobState(), threading.Lock()
    for msg in JobSource(job_dir, follow=False).messages():
        job.apply(msg)
    loggers = ScalarLoggers(job_dir, tensorboard=True, interval=3600)
    sent: list[Command] = []
    loggers.wandb = True
    loggers.watch(lock, job=job, send=lambda c: sent.append(c) or True)
    loggers.flush()
    assert [(c.name, c.ranks) for c in sent] == [("log_metrics", (0,)), ("log_metrics", (1,))]  # each its own run
    assert sent[1].metrics["perfmon/finding/straggler"] == 3.0  # critical, on the slow rank
    job.ranks[1].recent.clear()  # nothing to judge any more: the straggler clears
    loggers.flush()
    assert sent[-1].metrics["perfmon/finding/straggler"] == 0.0
    assert len(sent) == 3  # rank 0's numbers are as they were: no second point at the same step
    loggers.flush()
    loggers.close()  # nothing new either
    assert len(sent) == 3
    tb = tb_scalars(job_dir)
    assert "rank0/perfmon/step_ms" in tb and "rank1/perfmon/finding/straggler" in tb


def test_without_tensorboard_the_option_says_what_to_install(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "from perfmon.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "--headless", "--tensorboard", "--run-dir",
                          str(tmp_path / "run"), str(REPO / "demos" / "train_mlp.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "pip install tensorboard" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()


@pytest.mark.e2e
def test_wandb_without_an_active_run_is_said_once(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    res = perfmon(["--headless", "--wandb", "--log-interval", "0.5", "--run-dir", str(tmp_path / "run"),
                   str(REPO / "demos" / "loops" / "fast_steps.py"), "--seconds", "3"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("no active wandb run") == 1


def test_loggers_error_type_is_for_the_user() -> None:
    assert issubclass(LoggerError, Exception)


@pytest.mark.e2e
def test_tensorboard_follows_the_ranks_a_script_spawns(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    """``--tensorboard`` on a script that spawns its ranks (mp.spawn): once the monitor turns to them, it logs a
    series per rank (it stopped at the hand-over, its file holding no scalar)."""
    run = tmp_path / "run"
    res = perfmon(["--headless", "--tensorboard", "--log-interval", "1", "--run-dir", str(run),
                   str(REPO / "demos" / "ddp" / "spawn_ddp.py"), "--steps", "1500"], env, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    tb = tb_scalars(run)
    assert {"rank0/perfmon/step_ms", "rank1/perfmon/step_ms"} <= set(tb), sorted(tb)
    assert tb["rank0/perfmon/step_ms"][-1][0] == 1500  # the last one at the end, at the rank's last step
