"""The corpus (``demos/corpus``): training scripts written after the loops of widely used codebases, each run
once under plain python and once under ``perfmon --headless``.

perfmon must not change what a script does (exit code, stdout byte for byte, files written, warnings), and
its report must agree with what the script counted itself: every script ends by printing one line
``GROUND_TRUTH {json}`` (steps, and evals, closure calls, skipped steps, files... where relevant).
Both runs of a script go at once (one thread each) and each script runs once per mode (module fixtures).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:  # tests/ has no __init__.py: pytest puts it on sys.path (rootdir "prepend" import mode)
    from test_e2e import env, events, perfmon, report  # noqa: F401 - env is a fixture
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_e2e import env, events, perfmon, report  # noqa: F401

pytestmark = pytest.mark.e2e

CORPUS = Path(__file__).resolve().parents[1] / "demos" / "corpus"
PLAIN_TIMEOUT = 120.0

# id: (script, args, writes files into --out)
CASES: dict[str, tuple[str, list[str], bool]] = {
    "timm_style": ("timm_style.py", ["--steps", "8", "--steps-per-epoch", "4", "--val-batches", "2"], True),
    "distill": ("distill.py", ["--steps", "10"], False),
    "dcgan": ("dcgan.py", ["--steps", "6"], True),
    "dcgan_no_loader": ("dcgan.py", ["--steps", "6", "--no-loader"], True),
    "wgan": ("wgan.py", [], False),
    "wgan_first_batch": ("wgan.py", ["--first-generator", "0"], False),
    "nanogpt": ("nanogpt.py", ["--steps", "5", "--eval-interval", "3", "--eval-iters", "40"], True),
    "lbfgs": ("lbfgs.py", ["--steps", "3"], True),
    "eval_between": ("eval_between.py", ["--steps", "16", "--val-batches", "80"], True),
    "module_transforms": ("module_transforms.py", ["--steps", "8"], False),
    "instrument_late": ("instrument_late.py", ["--steps", "12"], False),
    "scaler_skip": ("scaler_skip.py", ["--steps", "8", "--inf-every", "4"], False),
    "spawn_pickle": ("spawn_pickle.py", ["--steps", "4"], False),
    "lightning_style": ("lightning_style.py", ["--steps", "48", "--steps-per-epoch", "24", "--val-every", "16"], True),
    "self_profiling": ("self_profiling.py", ["--steps", "40"], False),
    "mfu_logging": ("mfu_logging.py", ["--steps", "24"], False),
    "pretrain_finetune": ("pretrain_finetune.py", ["--pretrain-steps", "20", "--probe-steps", "20"], False),
    "cleanrl_ppo": ("cleanrl_ppo.py", ["--iterations", "3"], False),
    "cleanrl_dqn": ("cleanrl_dqn.py", [], False),
    "accumulate_validate": ("accumulate_validate.py", ["--batches", "24"], False),
    "eval_without_no_grad": ("eval_without_no_grad.py", [], False),
    "eval_without_no_grad_criterion": ("eval_without_no_grad.py", ["--criterion"], False),
    "eval_without_no_grad_center_loss": ("eval_without_no_grad.py", ["--center-loss"], False),
    "ssl_knn": ("ssl_knn.py", [], True),
}


@dataclass
class Pair:
    """One script run twice: ``plain`` (python) and ``pm`` (perfmon --headless)."""

    name: str
    cwd_plain: Path
    cwd_pm: Path
    plain: subprocess.CompletedProcess[str]
    pm: subprocess.CompletedProcess[str]
    out_plain: Path
    out_pm: Path
    run: Path
    truth: dict[str, Any]
    rep: dict[str, Any] | None


def ground_truth(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("GROUND_TRUTH ")]
    assert len(lines) == 1, f"expected one GROUND_TRUTH line, got {len(lines)}:\n{stdout}"
    return json.loads(lines[0][len("GROUND_TRUTH "):])


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


_WARNING = re.compile(r"\b\w*Warning: ")
# glog-style lines of TORCH_LOGS (level, date, time, pid): they differ run to run
_TORCH_LOG = re.compile(r"^[VIWEDF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")


def warning_lines(*texts: str) -> list[str]:
    """``...Warning: ...`` lines the script's stack printed, in order."""
    return [line.strip() for text in texts for line in text.splitlines() if _WARNING.search(line)]


def script_stdout(pm_stdout: str, plain_stderr: str) -> list[str]:
    """perfmon --headless passes the script's stderr through on its own stdout (README): take those lines out."""
    err = set(plain_stderr.splitlines())
    return [line for line in pm_stdout.splitlines() if line not in err and not _TORCH_LOG.match(line)]


def run_pair(name: str, script: str, args: list[str], writes: bool, env: dict[str, str], tmp: Path,
             extra_env: dict[str, str] | None = None, pm_timeout: float = 120.0,
             pm_options: tuple[str, ...] = ()) -> Pair:
    path = str(CORPUS / script)
    env = dict(env, **(extra_env or {}))
    cwd_plain, cwd_pm = tmp / "plain", tmp / "pm"
    cwd_plain.mkdir()
    cwd_pm.mkdir()
    out_plain, out_pm, run = tmp / "out-plain", tmp / "out-pm", tmp / "run"
    argv = list(args)
    plain_out, plain_err = tmp / "plain.stdout", tmp / "plain.stderr"
    with open(plain_out, "wb") as fo, open(plain_err, "wb") as fe:  # files, not pipes: nothing can block on a full pipe
        plain_proc = subprocess.Popen([sys.executable, path, *argv, *(["--out", str(out_plain)] if writes else [])],
                                      cwd=cwd_plain, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe)
    try:
        pm_args = ["--headless", "--run-dir", str(run), *pm_options, path, *argv, *(["--out", str(out_pm)] if writes else [])]
        pm = perfmon(pm_args, env, cwd=cwd_pm, timeout=pm_timeout)
        plain_proc.wait(timeout=PLAIN_TIMEOUT)
    finally:
        if plain_proc.poll() is None:
            plain_proc.kill()
            plain_proc.wait()
    plain = subprocess.CompletedProcess(plain_proc.args, plain_proc.returncode, plain_out.read_text(), plain_err.read_text())
    assert plain.returncode == 0, f"{name} fails under plain python:\n{plain.stdout}\n{plain.stderr}"
    rep = report(run, env) if (run / "events.jsonl").exists() else None
    return Pair(name, cwd_plain, cwd_pm, plain, pm, out_plain, out_pm, run, ground_truth(plain.stdout), rep)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, env, tmp_path_factory) -> Pair:
    script, args, writes = CASES[request.param]
    return run_pair(request.param, script, args, writes, env, tmp_path_factory.mktemp(request.param))


def _rep(p: Pair) -> dict[str, Any]:
    assert p.rep is not None, f"no recording in {p.run}:\n{p.pm.stderr}"
    return p.rep


# -- perfmon changes nothing the script does -----------------------------------------------------------------
def test_same_exit_code(pair):
    assert pair.pm.returncode == pair.plain.returncode, pair.pm.stderr[-3000:]


def test_same_stdout(pair):
    assert script_stdout(pair.pm.stdout, pair.plain.stderr) == pair.plain.stdout.splitlines(), pair.pm.stderr[-3000:]


def test_same_files_written(pair):
    plain, pm = files_under(pair.out_plain), files_under(pair.out_pm)
    assert pm == plain
    if "files" in pair.truth:
        assert plain == sorted(pair.truth["files"])


def test_same_warnings(pair):
    assert warning_lines(pair.pm.stdout, pair.pm.stderr) == warning_lines(pair.plain.stdout, pair.plain.stderr)


# -- the report agrees with the script's own count -------------------------------------------------------------
def test_report_steps_match_ground_truth(pair):
    rep = _rep(pair)
    assert rep["steps"] == pair.truth["steps"], f"{pair.name}: recorded {rep['steps']}, script counted {pair.truth}"


def test_report_exit_status_matches(pair):
    rep = _rep(pair)
    assert rep["complete"] is True
    assert (rep["exit_code"], rep["exception"]) == (pair.plain.returncode, None)


def test_case_expectations(pair):
    rep = _rep(pair)
    phases, truth = rep["phases"], pair.truth
    if pair.name == "distill":  # the frozen teacher's no_grad forward is forward time, not "other"
        assert phases["forward"]["mean_ms"] > 0
        assert phases["other"]["share"] < 0.5, phases
    elif pair.name == "lbfgs":  # forward/backward inside optimizer.step(closure) are timed as such
        assert phases["forward"]["mean_ms"] > 0 and phases["backward"]["mean_ms"] > 0, phases
        assert phases["optimizer"]["share"] < 0.9, phases
        if "closures_per_step" in rep:
            assert rep["closures_per_step"] == pytest.approx(truth["closure_calls"] / truth["steps"])
    elif pair.name == "lightning_style":  # every step is step(closure=...): the closure's own work is "other"
        assert rep["closures_per_step"] == pytest.approx(truth["closure_calls"] / truth["steps"]) == 1.0
        assert phases["forward"]["mean_ms"] > 0 and phases["backward"]["mean_ms"] > 0, phases
        # its loss and logged metrics cost ~2x Adam's own step here (~10x less when charged to the optimizer)
        assert phases["other"]["p50_ms"] > phases["optimizer"]["p50_ms"], phases
    elif pair.name.startswith("dcgan"):  # two optimizers, one training step per batch
        assert rep["steps"] == truth["optimizer_steps"]["D"] == truth["optimizer_steps"]["G"]
    elif pair.name.startswith("wgan"):  # the generator every n batches: still one step a batch, each its own batch
        rows = [dict(zip(m["fields"], row, strict=True))
                for m in events(pair.run) if m.get("type") == "steps" for row in m["rows"]]
        assert [r["samples"] for r in rows] == [truth["samples"] // truth["steps"]] * truth["steps"], rows
    elif pair.name in ("eval_between", "nanogpt"):  # more than 64 no_grad forwards before the first backward
        assert phases["forward"]["mean_ms"] > 0 and phases["backward"]["mean_ms"] > 0, phases
    elif pair.name == "pretrain_finetune":  # the probe, a model built after the first, is timed as forward too
        rows = [dict(zip(m["fields"], row, strict=True))
                for m in events(pair.run) if m.get("type") == "steps" for row in m["rows"]]
        probe = [r for r in rows if r["i"] > truth["pretrain_steps"] + 1]  # its first forward ran before it was seen
        assert len(probe) == truth["steps"] - truth["pretrain_steps"] - 1
        assert all(r["forward_ms"] > 0 for r in probe), [r["forward_ms"] for r in probe]
    elif pair.name.startswith(("accumulate_validate", "eval_without_no_grad")):  # validation: outside, not the step's
        rows = [dict(zip(m["fields"], row, strict=True))
                for m in events(pair.run) if m.get("type") == "steps" for row in m["rows"]]
        assert [r["samples"] for r in rows] == [truth["samples_per_step"]] * truth["steps"], rows
        assert rep["outside_steps"]["evaluation"]["ms"] > 0, rep["outside_steps"]
    elif pair.name == "ssl_knn":  # a kNN monitor over the backbone only: its fetches are outside, not step data
        rows = [dict(zip(m["fields"], row, strict=True))
                for m in events(pair.run) if m.get("type") == "steps" for row in m["rows"]]
        assert [r["samples"] for r in rows] == [truth["samples_per_step"]] * truth["steps"], rows
        # perfmon's stretches outside the steps hold every monitor pass the script timed (more: the epoch's end)
        monitor_ms = 1000 * json.loads((pair.out_pm / "timing.json").read_text())["monitor_s"]
        assert rep["outside_steps"]["evaluation"]["ms"] >= 0.95 * monitor_ms, (rep["outside_steps"], monitor_ms)
    elif pair.name == "cleanrl_ppo":  # the rollouts between updates (the agent under no_grad) are outside steps
        per_rollout = rep["outside_steps"]["evaluation"]["ms"] / 2  # 3 iterations: 2 rollouts between updates
        assert per_rollout > 0 and phases["forward"]["mean_ms"] > 0, rep["outside_steps"]
        durations = [dict(zip(m["fields"], row, strict=True))["dur_ms"]
                     for m in events(pair.run) if m.get("type") == "steps" for row in m["rows"]]
        assert max(durations) < per_rollout, (durations, per_rollout)  # 32 acting steps of 4 envs: in no step
    elif pair.name == "cleanrl_dqn":  # acting with grad between updates: the next update's forward, not outside
        assert phases["forward"]["mean_ms"] > 0 and rep["outside_steps"]["evaluation"]["ms"] == 0, rep
    elif pair.name == "instrument_late":  # plain python: instrument() after model and optimizer exist records
        runs = sorted((pair.cwd_plain / "perfmon-runs").glob("*"))
        assert len(runs) == 1, runs
        late = report(runs[0], dict(os.environ))
        assert (late["steps"], late["exit_code"]) == (truth["steps"], 0)
    if "samples" in truth:
        per_step = truth["samples"] / truth["steps"]
        assert rep["samples_per_s"] == pytest.approx(rep["steps_per_s"] * per_step, rel=0.03)


# -- the script's own torch.profiler beside perfmon's windows ---------------------------------------------------
@pytest.mark.parametrize("every", [3, 4])
def test_scripts_own_profiler_comes_first(env, tmp_path, every):
    """Kineto records one session a process. Before perfmon's windows gave way, a window open when the script's
    session began emptied the script's results (exit 3 here) or crashed the job (SIGSEGV, with a window every 3
    steps); now the script's profiles are whole, perfmon says why its windows wait, and they resume after."""
    p = run_pair("self_profiling", "self_profiling.py", ["--steps", "40"], False, env, tmp_path,
                 pm_options=("--profile-every", str(every)))
    assert p.pm.returncode == p.plain.returncode == 0, p.pm.stderr[-3000:]
    assert script_stdout(p.pm.stdout, p.plain.stderr) == p.plain.stdout.splitlines()
    assert _rep(p)["steps"] == p.truth["steps"] == 40
    recorded = events(p.run)
    warnings = [m["message"] for m in recorded if m.get("kind") == "warning"]
    assert any("runs its own torch.profiler" in w for w in warnings), warnings
    # a window started inside the script's emit_itt ranges raised in the agent and ended the script's session
    assert [m["agent_errors"] for m in recorded if m.get("kind") == "exit"] == [{}]
    # windows ran where the script's profiler was closed: after its scheduled session, and after its block
    windows = sorted(m["step"] for m in recorded if m.get("type") == "profile" and m.get("trace"))
    assert any(12 <= s < 20 for s in windows) and any(s >= 24 for s in windows), windows


@pytest.mark.parametrize("count_every", [4, 1])
def test_count_flops_beside_the_scripts_own_flop_counter(env, tmp_path, count_every):
    """``--count-flops`` on a loop without a DataLoader counted 0 FLOPs: its first step's end is confirmed only at
    the next ``optimizer.step()``, with nothing but the update left to count. And a count that began inside the
    script's own FlopCounterMode was popped by the script's exit (torch pops dispatch modes by position). Now the
    count is the script's own figure; where the script counts every step, perfmon says it does not count."""
    p = run_pair("mfu_logging", "mfu_logging.py", ["--steps", "24", "--count-every", str(count_every)], False, env,
                 tmp_path, pm_options=("--count-flops",))
    assert p.pm.returncode == p.plain.returncode == 0, p.pm.stderr[-3000:]
    assert script_stdout(p.pm.stdout, p.plain.stderr) == p.plain.stdout.splitlines()
    assert _rep(p)["steps"] == p.truth["steps"] == 24
    recorded = events(p.run)
    counted = [m["flops_per_step"] for m in recorded if m.get("type") == "model" and "flops_per_step" in m]
    warnings = [m["message"] for m in recorded if m.get("kind") == "warning"]
    if count_every == 1:
        assert counted == [] and any("dispatch mode of its own" in w for w in warnings), (counted, warnings)
    else:
        assert counted == [p.truth["flops_per_step"]] and p.truth["flops_per_step"] > 0, warnings


# -- torch.compile: tens of seconds on 2 cores the first time (inductor's cache is cold) ----------------------
_DYNAMO_LOG = re.compile(r"\[__(recompiles|recompiles_verbose|graph_breaks)\]\s*(.*)$")


def recompile_lines(text: str) -> list[str]:
    """TORCH_LOGS=recompiles,graph_breaks lines without their time/pid prefix."""
    return [f"{m[1]}: {m[2].strip()}" for line in text.splitlines() if (m := _DYNAMO_LOG.search(line))]


def test_nanogpt_compile_same_recompiles_graph_breaks_and_warnings(env, tmp_path):
    args = ["--steps", "4", "--eval-interval", "2", "--eval-iters", "4", "--compile"]
    p = run_pair("nanogpt_compile", "nanogpt.py", args, True, env, tmp_path,
                 extra_env={"TORCH_LOGS": "recompiles,graph_breaks"}, pm_timeout=400.0)
    assert p.pm.returncode == p.plain.returncode, p.pm.stderr[-3000:]
    assert script_stdout(p.pm.stdout, p.plain.stderr) == p.plain.stdout.splitlines()
    plain_log = recompile_lines(p.plain.stdout + p.plain.stderr)
    assert any("Recompiling" in line for line in plain_log), "the script should recompile once (grad mode)"
    assert recompile_lines(p.pm.stdout + p.pm.stderr) == plain_log
    assert warning_lines(p.pm.stdout, p.pm.stderr) == warning_lines(p.plain.stdout, p.plain.stderr)
    assert files_under(p.out_pm) == files_under(p.out_plain)
    rep = _rep(p)
    assert rep["steps"] == p.truth["steps"]
    assert rep["phases"]["forward"]["mean_ms"] > 0  # the compiled model is still timed
