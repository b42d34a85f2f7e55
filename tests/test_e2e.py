"""End to end: ``perfmon --headless`` on real (tiny) training scripts, checked with ``perfmon report --json``.

Each test launches perfmon as a user would (the ``perfmon`` console script next to the
interpreter, else ``python -m perfmon.cli``) on a script of ``demos/loops`` and reads back
the recording. Nothing waits on a fixed sleep: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
LOOPS = REPO / "demos" / "loops"
CONSOLE = Path(sys.executable).with_name("perfmon")
PERFMON = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "perfmon.cli"]
PERFMON_MODULE = [sys.executable, "-m", "perfmon.cli"]
DEADLINE = 90.0  # seconds; generous, the machine may be shared
# Five shares each rounded to 6 places can miss 1 by up to 2.5e-6: live runs allow that much, and the
# documented "add up to 1" (within 1e-6) is held by a recording crafted to hit the worst case
# (test_report_phase_shares_sum_to_one_despite_rounding), which fails deterministically instead of now and then.
SHARE_TOL = 3e-6

# Known perfmon bugs these tests found (strict: a fix makes the test pass, then drop the mark).


# -- helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def env() -> Iterator[dict[str, str]]:
    """A private runtime dir (sockets, discovery files), so concurrent runs elsewhere do not interfere."""
    rt = tempfile.mkdtemp(prefix="pm-e2e-")  # short path: Unix socket paths are limited to ~107 bytes
    yield dict(os.environ, PERFMON_RUNTIME_DIR=rt)
    shutil.rmtree(rt, ignore_errors=True)


def wait_for(cond: Callable[[], Any], what: str, timeout: float = DEADLINE, every: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts TCP connections on ``host:port``."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def perfmon(args: list[str], env: dict[str, str], cwd: Path = REPO, launcher: list[str] | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(launcher or PERFMON), *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def headless(run: Path, script: str, *args: str, env: dict[str, str], cwd: Path = REPO,
             interval: float | None = None, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    opts = ["--headless", "--run-dir", str(run)] + (["--interval", str(interval)] if interval else [])
    target = ["-m", script] if not script.endswith(".py") else [script]
    return perfmon([*opts, *target, *args], env, cwd=cwd, launcher=launcher)


def plain_and_headless(source: str, name: str, env: dict[str, str], tmp_path: Path
                       ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], Path]:
    """``source`` saved as ``tmp_path/name`` and run twice, both in ``tmp_path``: by plain python, then under
    ``perfmon --headless`` (its run dir is the third item), with no status line (on a loaded host a run of a few
    steps lasts long enough for one, and these tests compare the script's own output)."""
    script = tmp_path / name
    script.write_text(source)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env,
                           cwd=tmp_path)
    run = tmp_path / "run"
    return plain, headless(run, str(script), env=env, cwd=tmp_path, interval=3600), run


def report(run: Path, env: dict[str, str]) -> dict[str, Any]:
    res = perfmon(["report", str(run), "--json"], env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def events(run: Path) -> list[dict[str, Any]]:
    """Complete lines of RUN/events.jsonl (a trailing partial line is left for later)."""
    try:
        data = (run / "events.jsonl").read_bytes()
    except OSError:
        return []
    return [json.loads(line) for line in data.split(b"\n")[:-1] if line.strip()]


def hello_pid(run: Path) -> int:
    msgs = wait_for(lambda: [m for m in events(run) if m.get("type") == "hello"], "the hello message")
    return int(msgs[0]["pid"])


def has_steps(run: Path, at_least: int = 1) -> bool:
    rows = sum(len(m.get("rows", [])) for m in events(run) if m.get("type") == "steps")
    return rows >= at_least


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def leftovers(env: dict[str, str], pid: int) -> list[str]:
    """The agent's socket and discovery file left in the runtime dir after its process ended."""
    return sorted(p.name for p in Path(env["PERFMON_RUNTIME_DIR"]).glob(f"{pid}.*"))


def kill_quietly(pid: int | None) -> None:
    if pid is not None and not gone(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Background:
    """perfmon started with Popen, its stdout/stderr going to files that a test can poll."""

    def __init__(self, args: list[str], env: dict[str, str], tmp: Path, cwd: Path = REPO) -> None:
        self.out_path, self.err_path = tmp / "perfmon.out", tmp / "perfmon.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen([*PERFMON, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=err)
        self.train_pid: int | None = None

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # what perfmon and the job were doing: the failure says it
            raise AssertionError(f"perfmon did not end in {timeout:.0f} s; {self.processes()}; its stderr:\n"
                                 f"{self.stderr}") from exc

    def processes(self) -> str:
        import psutil

        def state(pid: int) -> str:
            try:
                proc = psutil.Process(pid)
                return f"{pid} {proc.status()} {' '.join(proc.cmdline()[:3])}"
            except psutil.Error:
                return f"{pid} gone"

        pids = [self.popen.pid, *([self.train_pid] if self.train_pid else [])]
        try:
            pids += [c.pid for c in psutil.Process(self.popen.pid).children(recursive=True) if c.pid not in pids]
        except psutil.Error:
            pass
        return "processes: " + "; ".join(state(pid) for pid in pids)

    def cleanup(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        kill_quietly(self.train_pid)


@pytest.fixture
def background(env, tmp_path) -> Iterator[Callable[..., Background]]:
    started: list[Background] = []

    def start(args: list[str], cwd: Path = REPO) -> Background:
        bg = Background(args, env, tmp_path, cwd)
        started.append(bg)
        return bg

    yield start
    for bg in started:
        bg.cleanup()


# -- the plain DataLoader + optimizer loop, one run shared by several checks ------------------------------
DL_STEPS, DL_BATCH = 20, 16


@pytest.fixture(scope="module")
def dl_run(env, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str], dict[str, Any]]:
    run = tmp_path_factory.mktemp("dl") / "run"
    res = headless(run, "demos/loops/dataloader_optimizer.py", "--steps", str(DL_STEPS),
                   "--batch-size", str(DL_BATCH), env=env, interval=0.5)
    return run, res, report(run, env)


def test_dataloader_loop_exact_steps_and_clean_exit(dl_run):
    run, res, rep = dl_run
    assert res.returncode == 0, res.stderr
    assert rep["steps"] == DL_STEPS
    assert rep["exit_code"] == 0 and rep["complete"] is True and rep["exception"] is None


def test_dataloader_loop_all_phases_timed_and_shares_sum_to_one(dl_run):
    rep = dl_run[2]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert rep["phases"][phase]["mean_ms"] > 0, phase
    assert abs(sum(p["share"] for p in rep["phases"].values()) - 1.0) <= SHARE_TOL


def test_samples_per_s_is_steps_per_s_times_batch_size(dl_run):
    rep = dl_run[2]
    assert rep["steps_per_s"] > 0
    assert rep["samples_per_s"] == pytest.approx(rep["steps_per_s"] * DL_BATCH, rel=0.03)


def test_script_stdout_passes_through_and_is_logged(dl_run):
    run, res, _ = dl_run
    assert f"done steps={DL_STEPS}" in res.stdout
    assert f"done steps={DL_STEPS}" in (run / "output.log").read_text()
    assert "[perfmon]" not in res.stdout  # status lines go to stderr only


STREAMS_SCRIPT = """
import sys, warnings
for i in range(3):
    print(f"out {i}")
    print(f"err {i}", file=sys.stderr)
warnings.warn("a warning")
sys.stdout.write("no newline at the end")
"""


def test_script_stdout_and_stderr_stay_apart(env, tmp_path):
    """As under plain python: ``perfmon --headless train.py > log`` has only the script's stdout in log; its
    stderr (warnings, tracebacks, progress bars) comes on perfmon's stderr, beside perfmon's own lines."""
    plain, res, run = plain_and_headless(STREAMS_SCRIPT, "streams.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == (run / "output.log").read_text()
    assert plain.stderr and (run / "stderr.log").read_text() == plain.stderr
    theirs = [line for line in res.stderr.splitlines() if line in plain.stderr.splitlines()]
    assert theirs == plain.stderr.splitlines(), res.stderr  # every line, in order


STACK_SCRIPT = """
import inspect, logging, os, runpy, sys, traceback, warnings
import torch
logging.basicConfig(format="%(levelname)s %(message)s")


def report_stack():
    traceback.print_stack(file=sys.stdout)
    print([(f.function, f.lineno) for f in inspect.stack()])
    logging.warning("from here", stack_info=True)


report_stack()
runpy.run_path(os.path.join(os.path.dirname(__file__), "inner.py"))  # the script's own runpy frames stay
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    with torch.autograd.detect_anomaly():  # a NaN in the backward names the forward line that made it
        loss = model(torch.randn(4, 2)).sum() * (float("nan") if i == 2 else 1.0)
        try:
            loss.backward()
        except RuntimeError as exc:
            print("caught:", exc)
    opt.step()
    opt.zero_grad()


def deprecated(what):
    warnings.warn(what, FutureWarning, stacklevel=3)  # for a wrapper: called directly, past the script's stack


deprecated("named sys:1 by python")
for _ in range(2):
    warnings.warn(UserWarning("once, in sys's registry"), stacklevel=4)
warnings.warn("a level below 1 is the caller's", stacklevel=0)
"""


def test_the_script_sees_its_own_stack_as_under_plain_python(env, tmp_path):
    """Stacks printed while the script runs (traceback.print_stack, inspect.stack, logging's stack_info, autograd's
    anomaly mode) end at the script's module frame, as under plain python: no frame of perfmon's launcher below;
    a warning whose stacklevel reaches past it is sys:1's."""
    (tmp_path / "inner.py").write_text("import inspect\nprint('inner', [f.function for f in inspect.stack()])\n")
    plain, res, run = plain_and_headless(STACK_SCRIPT, "stack.py", env, tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr
    assert "'run_path', '<module>']" in plain.stdout
    assert "Traceback of forward call" in plain.stderr and "caught:" in plain.stdout
    assert "sys:1: FutureWarning: named sys:1 by python" in plain.stderr
    assert res.stdout == plain.stdout
    assert (run / "stderr.log").read_text() == plain.stderr


WRAPPED_CALLS_SCRIPT = """
import inspect, io, traceback, warnings
import torch
from torch import nn

warnings.simplefilter("default")  # once per place: a warning named at a wrapper's line would hide the next one


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, step):
        if step in (0, 6):  # 0: in discovery's wrapper; 6: in the root's
            for level in (2, 3, 4, 5):
                warnings.warn(f"level {level}", UserWarning, stacklevel=level)
            print("stack", step, [f.function for f in inspect.stack()][:6])
            print("".join(traceback.format_stack(limit=4)).count("File "))
        if step in (3, 8):
            raise RuntimeError("out of memory (simulated)")
        return self.lin(x)


def train_step(model, opt, x, step):
    try:
        loss = model(x, step).pow(2).mean()
    except RuntimeError:
        buf = io.StringIO()
        traceback.print_exc(file=buf)
        print("skipped", step, buf.getvalue().count("File "), [f.name for f in traceback.extract_tb(
            __import__("sys").exc_info()[2])])
        return
    opt.zero_grad()
    loss.backward()
    opt.step()


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    train_step(model, opt, torch.randn(8, 4), step)
model(torch.randn(3, 4), 6)  # the same warnings from two lines: python names (and prints) both
model(torch.randn(5, 4), 6)
"""


def test_warnings_and_caught_tracebacks_through_perfmons_wrappers_are_plain_pythons(env, tmp_path):
    """The root module's __call__ wrapper (and discovery's, during step 1) is a Python frame of perfmon's between
    the script's: a warning with stacklevel=4 in forward named hooks.py instead of the caller's line (and so
    printed once for two call sites), and a caught exception's traceback (fairseq's out-of-memory skip) had an
    extra frame. Warnings, caught tracebacks and printed stacks are now exactly python's."""
    plain, res, run = plain_and_headless(WRAPPED_CALLS_SCRIPT, "wrapped.py", env, tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr
    assert "UserWarning: level 4\n  loss = model(x, step).pow(2).mean()" in plain.stderr
    assert plain.stderr.count("UserWarning: level 4\n  model(torch.randn(") == 2 and "skipped 3 " in plain.stdout
    assert res.stdout == plain.stdout
    assert (run / "stderr.log").read_text() == plain.stderr
    assert "hooks.py" not in res.stdout + (run / "stderr.log").read_text()
    assert report(run, env)["steps"] == 8


def test_an_instrumented_script_prints_what_it_prints_without_perfmon(env, tmp_path):
    """perfmon.instrument() in a plain python run: the same warnings (stacklevel from forward), logging's
    stacklevel, caught tracebacks, and no "subprocess still running" ResourceWarning from the summary writer
    perfmon leaves behind at exit (a script that shows every warning printed one)."""
    script = ("import sys\nif sys.argv[1:]:\n    import perfmon\n    perfmon.instrument()\n"
              "import logging\nlogging.basicConfig(format='%(filename)s:%(lineno)d %(funcName)s %(message)s', "
              "stream=sys.stdout, level=logging.INFO)\n"
              + WRAPPED_CALLS_SCRIPT.replace('warnings.simplefilter("default")', 'warnings.simplefilter("always")')
              .replace('print("stack", step,', 'logging.info("from forward", stacklevel=4); print("stack", step,'))
    (tmp_path / "instr.py").write_text(script)
    runs = [subprocess.run([sys.executable, "instr.py", *extra], capture_output=True, text=True, timeout=120,
                           env=env, cwd=tmp_path) for extra in ([], ["instrument"])]
    plain, instrumented = runs
    assert plain.returncode == instrumented.returncode == 0, instrumented.stderr
    assert "instr.py:" in plain.stdout and "from forward" in plain.stdout
    assert instrumented.stdout == plain.stdout
    assert instrumented.stderr == plain.stderr
    assert len(list((tmp_path / "perfmon-runs").iterdir())) == 1  # it did record


COMPILED_MODEL_NO_RECOMPILE_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


model = Net()
compiled = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(12):
    loss = nn.functional.cross_entropy(compiled(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i == 0:
        torch.compiler.set_stance("fail_on_recompile")  # warmed up: a recompile from here on is an error
print("steps", i + 1, "loss", round(loss.item(), 4))
"""


@pytest.mark.parametrize("compiled", ["module", "function"])
def test_a_compiled_model_compiles_once_as_under_plain_python(env, tmp_path, compiled):
    """During step 1 dynamo traced the compiled model's forward (or a compiled function calling the model) through
    perfmon's discovery wrapper on nn.Module.__call__ and guarded on it; discovery's end put the plain __call__
    back, and the next step recompiled: an error under set_stance("fail_on_recompile"), an extra graph elsewhere."""
    script = COMPILED_MODEL_NO_RECOMPILE_SCRIPT
    if compiled == "function":
        script = script.replace('compiled = torch.compile(model, backend="eager")',
                                '@torch.compile(backend="eager")\ndef compiled(x):\n    return model(x)')
    plain, res, run = plain_and_headless(script, "compiled_model.py", env, tmp_path)
    assert plain.returncode == 0 and "steps 12" in plain.stdout, plain.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == plain.stdout
    rep = report(run, env)
    assert rep["steps"] == 12
    if compiled == "module":  # a compiled function's model is inlined in its graph: other (README)
        assert rep["phases"]["forward"]["mean_ms"] > 0


def test_count_flops_leaves_a_compiled_model_alone_and_says_why(env, tmp_path):
    """FlopCounterMode (a dispatch mode with global module hooks) made dynamo run the counted step eagerly: torch
    warned into the script's stderr, and a model with dropout drew other masks and trained differently from then
    on. perfmon leaves compiled code uncounted and says so instead."""
    script = tmp_path / "compiled_model.py"
    script.write_text(COMPILED_MODEL_NO_RECOMPILE_SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                           cwd=tmp_path)
    run = tmp_path / "run"
    res = perfmon(["--headless", "--count-flops", "--run-dir", str(run), str(script)], env, cwd=tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == plain.stdout
    assert "global hooks" not in res.stderr and "FLOPs not counted: the script runs torch.compile'd code" in res.stderr
    rep = report(run, env)
    assert rep["steps"] == 12 and rep["flops_per_step"] is None


COMPILED_OPTIMIZER_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=5)


@torch.compile(backend="eager")  # PyTorch's recipe "Compiling the optimizer with torch.compile"
def opt_step():
    opt.step()
    sched.step()


for i in range(8):
    loss = model(torch.randn(32, 16)).pow(2).mean()
    loss.backward()
    opt_step()
    opt.zero_grad(set_to_none=True)
print("steps", i + 1, "loss", round(loss.item(), 5))
"""

_LOG_PREFIX = re.compile(r"^[WIE]\d{4} [\d:.]+ \d+ ", re.M)  # torch's log lines: time and pid


def test_a_compiled_optimizer_step_runs_and_counts_as_under_plain_python(env, tmp_path):
    """The recipe's compiled optimizer step: its hooks run from compiled code, and perfmon's discovery, which ends
    at the first optimizer step, was compiled by dynamo frame by frame; with the script's stack hidden, torch's
    FakeTensorMode then failed on dynamo's own code objects (an agent error, and no forward timed)."""
    plain, res, run = plain_and_headless(COMPILED_OPTIMIZER_SCRIPT, "compiled_opt.py", env, tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr
    assert res.stdout == plain.stdout
    assert _LOG_PREFIX.sub("", (run / "stderr.log").read_text()) == _LOG_PREFIX.sub("", plain.stderr)
    rep = report(run, env)
    assert rep["steps"] == 8 and not rep.get("agent_errors"), rep.get("agent_errors")
    assert rep["phases"]["forward"]["p50_ms"] > 0  # the model was found and timed


def test_the_summary_starts_below_a_progress_line_the_script_left_open(env, tmp_path):
    """A script whose stderr ends mid-line (a progress bar redrawn after a carriage return): its bytes come through
    as they are, and perfmon's summary starts on the next line rather than on the end of the bar."""
    script = ("import sys, torch\nm = torch.nn.Linear(2, 1)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for i in range(5):\n    m(torch.randn(2, 2)).sum().backward(); o.step(); o.zero_grad()\n"
              "    sys.stderr.write(f'\\rtrain {i + 1}/5')\n")
    plain, res, _ = plain_and_headless(script, "bar.py", env, tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr
    assert plain.stderr.endswith("train 5/5")  # (read as text: the carriage returns read as newlines)
    assert res.stderr.startswith(plain.stderr + "\nperfmon summary: "), res.stderr[:300]


PDB_SCRIPT = """
import torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    opt.zero_grad()
    if i == 1:
        breakpoint()
print("done", i)
"""


def test_a_breakpoint_debugs_the_script_as_under_plain_python(env, tmp_path):
    """pdb under --headless: where lists the script's frames only, up stops at its oldest, and stepping on runs the
    script's lines (the launcher's frames below the script's are the debugger's to skip, as python has none)."""
    script = tmp_path / "debugged.py"
    script.write_text(PDB_SCRIPT)
    given = "w\nup\nn\nn\np i\nc\n"
    plain = subprocess.run([sys.executable, str(script)], input=given, capture_output=True, text=True, timeout=60,
                           env=env, cwd=tmp_path)
    res = subprocess.run([*PERFMON, "--headless", "--run-dir", str(tmp_path / "run"), str(script)], input=given,
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr
    assert "*** Oldest frame" in plain.stdout and "done 2" in plain.stdout
    assert res.stdout == plain.stdout


STDIN_SCRIPT = """
import sys
import torch
lr = float(input("lr? "))
rest = sys.stdin.read()
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(2, 2)).sum().backward()
    opt.step()
print(f"lr={lr} rest={rest!r}")
"""


def test_headless_script_reads_perfmons_stdin_as_under_plain_python(env, tmp_path):
    """``echo 3e-4 | perfmon --headless train.py``: what is piped in reaches the script (the dashboard, which owns the
    terminal, gives it /dev/null)."""
    script = tmp_path / "reads_stdin.py"
    script.write_text(STDIN_SCRIPT)
    given = "0.5\nmore input\n"
    plain = subprocess.run([sys.executable, str(script)], input=given, capture_output=True, text=True, timeout=60,
                           env=env)
    run = tmp_path / "run"
    res = subprocess.run([*PERFMON, "--headless", "--run-dir", str(run), str(script)], input=given, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "lr? lr=0.5 rest='more input\\n'\n"
    assert report(run, env)["steps"] == 3


def test_headless_status_line_on_stderr(dl_run):
    res = dl_run[1]
    status = [line for line in res.stderr.splitlines() if line.startswith("[perfmon] ")]
    assert status, res.stderr
    assert all(" step " in line for line in status)
    assert "perfmon summary" in res.stderr


def test_summary_json_agrees_with_report(dl_run):
    run, _, rep = dl_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == rep["steps"] == DL_STEPS
    assert summary["exit_code"] == rep["exit_code"] == 0


def test_events_jsonl_lines_are_versioned_typed_and_sequenced(dl_run):
    run = dl_run[0]
    lines = (run / "events.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"", "the recording must end with a complete line"
    msgs = [json.loads(line) for line in lines[:-1]]
    assert msgs and all("v" in m and "type" in m and isinstance(m.get("seq"), int) for m in msgs)
    seqs = [m["seq"] for m in msgs]
    assert seqs == sorted(set(seqs)), "seq must strictly increase"
    assert msgs[0]["type"] == "hello"
    assert msgs[-1]["type"] == "event" and msgs[-1]["kind"] == "exit"


# -- every loop shape counts exactly its steps ---------------------------------------------------------
LOOP_SHAPES = [
    # id, script, args, steps, phases that must be timed (> 0), samples per step (None: not checked)
    ("manual_update", "demos/loops/manual_update.py", ["--steps", "12"], 12, ("forward", "backward"), None),
    ("grad_accum", "demos/loops/grad_accum.py", ["--steps", "6", "--batch-size", "8"], 6,
     ("data", "forward", "backward", "optimizer"), 32),
    ("lbfgs", "demos/loops/lbfgs.py", ["--steps", "6"], 6, ("optimizer",), None),
    ("amp_scaler", "demos/loops/amp_scaler.py", ["--steps", "8"], 8, ("forward", "backward", "optimizer"), None),
    ("eval_loop", "demos/loops/eval_loop.py", ["--steps", "30"], 30, ("data", "forward", "backward", "optimizer"), 16),
    ("eval_loop_manual", "demos/loops/eval_loop.py", ["--steps", "30", "--manual"], 30,
     ("data", "forward", "backward"), 16),
    ("custom_loop_explicit_api", "demos/custom_loop.py", ["--steps", "20", "--batch-size", "8"], 20,
     ("data", "forward", "backward", "optimizer"), None),
    ("sibling_import", "demos/loops/sibling_import.py", ["--steps", "6"], 6, ("forward", "backward", "optimizer"), None),
    ("workers_fork", "demos/loops/workers.py", ["--steps", "6", "--context", "fork", "--epochs", "2"], 6,
     ("data", "forward", "optimizer"), 16),
    ("workers_spawn", "demos/loops/workers.py", ["--steps", "6", "--context", "spawn"], 6, ("data", "forward", "optimizer"), 16),
]


def _shape_param(case: tuple) -> Any:
    bug = case[6] if len(case) > 6 else None
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(*case[1:6], id=case[0], marks=marks)


@pytest.mark.parametrize(("script", "args", "steps", "phases", "per_step"), [_shape_param(c) for c in LOOP_SHAPES])
def test_loop_shape_counts_exact_steps(env, tmp_path, script, args, steps, phases, per_step):
    run = tmp_path / "run"
    res = headless(run, script, *args, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "done steps=" in res.stdout
    rep = report(run, env)
    assert rep["steps"] == steps, f"{script}: {rep['steps']} steps recorded, the script ran {steps}"
    for phase in phases:
        assert rep["phases"][phase]["mean_ms"] > 0, phase
    assert abs(sum(p["share"] for p in rep["phases"].values()) - 1.0) <= SHARE_TOL
    if per_step is not None:
        assert rep["samples_per_s"] == pytest.approx(rep["steps_per_s"] * per_step, rel=0.03)
    if "eval_loop" not in script:  # the workers' start and shutdown at each epoch are the steps' data, never evaluation
        assert rep["outside_steps"]["evaluation"]["ms"] == 0, rep["outside_steps"]
    if script.endswith("sibling_import.py"):
        assert "helper_mod imported" in res.stdout


@pytest.mark.parametrize("name", ["grad_accum", "workers_fork"])
def test_the_pure_python_hooks_count_the_same_steps(env, tmp_path, name):
    """``PERFMON_NO_ACCEL=1`` (or no C compiler at install): the Python hooks, state and event buffer, end to end."""
    _, script, args, steps, phases, per_step = next(c for c in LOOP_SHAPES if c[0] == name)[:6]
    run = tmp_path / "run"
    probe = "import perfmon.agent.native as n\nprint('native', n.HOT)\n"
    target = tmp_path / "train.py"
    target.write_text(probe + (REPO / script).read_text())
    res = headless(run, str(target), *args, env={**env, "PERFMON_NO_ACCEL": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "native None" in res.stdout  # the fallback really ran
    rep = report(run, env)
    assert rep["steps"] == steps
    for phase in phases:
        assert rep["phases"][phase]["mean_ms"] > 0, phase
    assert rep["samples_per_s"] == pytest.approx(rep["steps_per_s"] * per_step, rel=0.03)


@pytest.mark.parametrize("accel", ["c", "python"])
def test_an_evaluation_without_no_grad_is_outside_time_with_either_hooks(env, tmp_path, accel):
    """``model.eval()`` with autograd still on: the C and the Python forward hooks both say the module is in eval
    mode, so its validation batches are outside time, not the next step's samples (they were: 32 and 288)."""
    run = tmp_path / "run"
    res = headless(run, "demos/corpus/eval_without_no_grad.py", "--epochs", "2",
                   env={**env, "PERFMON_NO_ACCEL": "1"} if accel == "python" else env)
    assert res.returncode == 0, res.stderr
    rows = [dict(zip(m["fields"], row, strict=True))
            for m in events(run) if m.get("type") == "steps" for row in m["rows"]]
    assert len(rows) == 20 and {r["samples"] for r in rows} == {32}
    assert report(run, env)["outside_steps"]["evaluation"]["ms"] > 0


def test_lbfgs_closure_forward_backward_are_forward_backward(env, tmp_path):
    run = tmp_path / "run"
    res = headless(run, "demos/loops/lbfgs.py", "--steps", "4", env=env)
    assert res.returncode == 0, res.stderr
    closure_calls = int(re.search(r"closure_calls=(\d+)", res.stdout)[1])
    rep = report(run, env)
    phases = rep["phases"]
    assert rep["steps"] == 4
    assert phases["forward"]["mean_ms"] > 0 and phases["backward"]["mean_ms"] > 0
    assert phases["optimizer"]["share"] < 0.9  # its own work, not the closure's forward and backward
    assert abs(sum(p["share"] for p in phases.values()) - 1.0) <= SHARE_TOL
    assert rep["closures_per_step"] == pytest.approx(closure_calls / 4)


@pytest.mark.parametrize("manual", [False, True], ids=["optimizer", "manual"])
def test_evaluation_time_stays_out_of_training_steps(env, tmp_path, manual):
    run = tmp_path / "run"
    res = headless(run, "demos/loops/eval_loop.py", "--steps", "30", "--eval-batches", "40",
                   *(["--manual"] if manual else []), env=env)
    assert res.returncode == 0, res.stderr
    m = re.search(r"loop_s=([\d.]+) eval_s=([\d.]+)", res.stdout)
    assert m, res.stdout
    loop_s, eval_s = float(m[1]), float(m[2])
    rep = report(run, env)
    assert rep["steps"] == 30
    stepped_s = rep["step_ms"]["mean_ms"] * rep["steps"] / 1000.0
    # Without eval filtering the steps would add up to ~loop_s; with it, to ~loop_s - eval_s.
    assert stepped_s < loop_s - 0.5 * eval_s, (stepped_s, loop_s, eval_s)
    # ...and the evaluation is reported as its own line, about as long as the script measured it
    outside_eval_s = rep["outside_steps"]["evaluation"]["ms"] / 1000.0
    assert 0.5 * eval_s < outside_eval_s < 1.5 * eval_s + 0.05, (outside_eval_s, eval_s)


def test_custom_loop_runs_without_perfmon(env):
    res = subprocess.run([sys.executable, "demos/custom_loop.py", "--steps", "5"], cwd=REPO, env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "done steps=5" in res.stdout


# -- the script sees what plain python would show it ------------------------------------------------------
def _echo_plain_and_perfmon(env: dict[str, str], tmp: Path, target: list[str], cwd: Path) -> tuple[dict, dict]:
    out = tmp / "echo.json"
    args = [*target, "x", "--out", str(out), "--flag=1", "-v"]
    res = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    plain = json.loads(out.read_text())
    out.unlink()
    res = perfmon(["--headless", "--run-dir", str(tmp / "run"), *args], env, cwd=cwd, launcher=PERFMON_MODULE)
    assert res.returncode == 0, res.stderr
    return plain, json.loads(out.read_text())


SCRIPT_VIEW = ("argv", "argv_repr", "path0", "cwd", "name")
MAIN_GLOBALS = ("file", "package", "spec_is_none", "main_is_this", "path", "torch_imported", "stdin_isatty")


def test_script_argv_path_cwd_name_match_plain_python(env, tmp_path):
    plain, under = _echo_plain_and_perfmon(env, tmp_path, ["demos/loops/argv_echo.py"], REPO)
    assert {k: under[k] for k in SCRIPT_VIEW} == {k: plain[k] for k in SCRIPT_VIEW}


def test_module_argv_path_cwd_name_match_plain_python(env, tmp_path):
    plain, under = _echo_plain_and_perfmon(env, tmp_path, ["-m", "argv_echo"], LOOPS)
    assert {k: under[k] for k in SCRIPT_VIEW} == {k: plain[k] for k in SCRIPT_VIEW}


@pytest.mark.parametrize(("target", "cwd"), [
    pytest.param(["demos/loops/argv_echo.py"], REPO, id="script"),
    pytest.param(["-m", "argv_echo"], LOOPS, id="module"),
])
def test_main_globals_match_plain_python(env, tmp_path, target, cwd):
    plain, under = _echo_plain_and_perfmon(env, tmp_path, target, cwd)
    assert {k: under[k] for k in MAIN_GLOBALS} == {k: plain[k] for k in MAIN_GLOBALS}


def test_symlinked_script_sys_path0_matches_plain_python(env, tmp_path):
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "echo_link.py").symlink_to(LOOPS / "argv_echo.py")
    plain, under = _echo_plain_and_perfmon(env, tmp_path, ["links/echo_link.py"], tmp_path)
    assert plain["path0"] == str(LOOPS)  # python resolves the link: sibling imports keep working
    assert {k: under[k] for k in SCRIPT_VIEW} == {k: plain[k] for k in SCRIPT_VIEW}


@pytest.mark.parametrize("launcher", [
    pytest.param(PERFMON, id="console_script"),
    pytest.param(PERFMON_MODULE, id="python_m_perfmon_cli"),
])
def test_module_run_with_dash_m(env, tmp_path, launcher):
    run = tmp_path / "run"
    res = headless(run, "dataloader_optimizer", "--steps", "5", env=env, cwd=LOOPS, launcher=launcher)
    assert res.returncode == 0, res.stderr
    assert "done steps=5" in res.stdout
    rep = report(run, env)
    assert rep["steps"] == 5 and rep["exit_code"] == 0


# -- exits --------------------------------------------------------------------------------------------------
def test_crash_exit_1_with_exception_and_traceback(env, tmp_path):
    run = tmp_path / "run"
    res = headless(run, "demos/loops/crash.py", env=env)
    assert res.returncode == 1
    rep = report(run, env)
    assert rep["exit_code"] == 1 and rep["complete"] is True
    assert "ValueError: boom" in rep["exception"]
    assert rep["steps"] == 5
    log = (run / "stderr.log").read_text()
    for text in (log, res.stderr):  # stderr, as without perfmon: a log of stdout alone holds no traceback
        assert "Traceback (most recent call last)" in text and "ValueError: boom" in text
        assert 'raise ValueError("boom")' in text
    assert "Traceback" not in res.stdout and "Traceback" not in (run / "output.log").read_text()


def _traceback(text: str) -> str:
    start = text.index("Traceback (most recent call last)")
    end = text.index("ValueError: boom", start) + len("ValueError: boom")
    return text[start:end]


def test_crash_traceback_is_the_one_plain_python_prints(env, tmp_path):
    plain = subprocess.run([sys.executable, "demos/loops/crash.py"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1
    run = tmp_path / "run"
    headless(run, "demos/loops/crash.py", env=env)
    tb = _traceback((run / "stderr.log").read_text())
    # Only the script's own frames: no agent or runpy frame. Checked by file name, not by looking for the
    # word "perfmon", which is in every path when the checkout itself is named perfmon (git clone's default).
    frames = re.findall(r'^  File "([^"]+)"', tb, re.M)
    assert frames and all(Path(f).name == "crash.py" for f in frames), tb
    assert tb == _traceback(plain.stderr)
    exit_event = [m for m in events(run) if m.get("kind") == "exit"][-1]
    assert _traceback(exit_event["traceback"]) == _traceback(plain.stderr)


def test_sys_exit_code_is_perfmon_exit_code(env, tmp_path):
    run = tmp_path / "run"
    res = headless(run, "demos/loops/exit_code.py", "--steps", "4", env=env)
    assert res.returncode == 3, res.stderr
    rep = report(run, env)
    assert rep["exit_code"] == 3 and rep["steps"] == 4 and rep["exception"] is None


OS_EXIT_SCRIPT = """
import os
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(96, 8), torch.randn(96, 1)), batch_size=16, num_workers=2)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = 0
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    steps += 1
print(f"steps {steps}", flush=True)
os._exit(7)  # skip the teardown, as many distributed scripts end
"""


def test_os_exit_records_every_step_and_the_exit_from_inside_the_job(env, tmp_path):
    """``os._exit`` runs no finally: the job records its steps and exit before it goes (its forked DataLoader
    workers, which also leave with os._exit, stay silent), so nothing is lost to a missed publisher tick."""
    plain, res, run = plain_and_headless(OS_EXIT_SCRIPT, "os_exit.py", env, tmp_path)
    assert res.returncode == plain.returncode == 7, res.stderr
    assert res.stdout == plain.stdout == "steps 6\n"
    rep = report(run, env)
    assert rep["steps"] == 6 and rep["exit_code"] == 7
    exits = [e for e in events(run) if e.get("type") == "event" and e.get("kind") == "exit"]
    assert len(exits) == 1 and "agent_errors" in exits[0]  # recorded by the job's agent, not made up after it


EXEC_SCRIPT = """
import os
import sys
import torch
generation = int(os.environ.get("GENERATION", "0"))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(9):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
print(f"generation {generation}: 9 steps", flush=True)
if generation == 0:  # restart in a fresh interpreter, as auto-resume code does
    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, GENERATION="1"))
sys.exit(3)
"""


def test_a_script_that_execs_itself_keeps_its_steps_and_the_new_programs_exit(env, tmp_path):
    """``os.exec*`` runs no atexit: the steps before it are recorded as it happens (they were lost), with a warning
    that perfmon stops there; the exit recorded is the new program's, as the launcher saw it."""
    plain, res, run = plain_and_headless(EXEC_SCRIPT, "reexec.py", env, tmp_path)
    assert res.returncode == plain.returncode == 3, res.stderr
    assert res.stdout == plain.stdout == "generation 0: 9 steps\ngeneration 1: 9 steps\n"
    assert "replaces itself with another program" in res.stderr
    rep = report(run, env)
    assert rep["steps"] == 9 and rep["exit_code"] == 3
    exits = [e for e in events(run) if e.get("type") == "event" and e.get("kind") == "exit"]
    assert len(exits) == 1 and exits[0]["recorded_by"] == "monitor"


INSTRUMENTED_EXEC = """
import os, sys
import torch
import perfmon
perfmon.instrument(run_dir="run")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(7):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
sys.stdout.flush()
os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(0.5); print('the new program')"])
"""


def test_an_instrumented_script_that_execs_is_reported_as_replaced_not_killed(env, tmp_path):
    """With ``perfmon.instrument()`` no launcher records the new program's exit: the recording ended in an exec,
    which the report says (it said "no exit recorded (killed...)", or "running" while the new program ran on in the
    same pid), with the steps before it."""
    script = tmp_path / "instrumented_exec.py"
    script.write_text(INSTRUMENTED_EXEC)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout == "the new program\n", res.stderr
    text = perfmon(["report", str(tmp_path / "run")], env)
    assert text.returncode == 0, text.stderr
    status = next(line for line in text.stdout.splitlines() if line.strip().startswith("status"))
    assert "replaced itself with python" in status and "not recorded" in status, text.stdout
    assert report(tmp_path / "run", env)["steps"] == 7


EXEC_FAILS = """
import os
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train(n):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
train(12)
with open("bad.sh", "w") as f:
    f.write("#!/no/such/interpreter\\n")
os.chmod("bad.sh", 0o755)
try:  # executable, but the exec fails (its interpreter does not exist)
    os.execv(os.path.abspath("bad.sh"), ["bad.sh"])
except OSError as exc:
    print("exec failed:", exc.errno, flush=True)
train(8)
print("trained 20", flush=True)
"""


def test_an_exec_that_fails_leaves_the_script_and_perfmon_going_on(env, tmp_path):
    plain, res, run = plain_and_headless(EXEC_FAILS, "exec_fails.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "exec failed: 2\ntrained 20\n"
    assert "os.exec* failed" in res.stderr
    assert report(run, env)["steps"] == 20


PRINTS_EVERY_STEP = """
import time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(400):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    print("step", step, flush=True)
    time.sleep(0.05)
"""


def into_head(command: list[str], cwd: Path, env: dict[str, str], streams: str = "") -> tuple[str, int, str]:
    """``command {streams} | head -2``: what head printed, the command's exit status, its stderr."""
    line = " ".join(map(shlex.quote, command)) + f" {streams} | head -2; exit ${{PIPESTATUS[0]}}"
    res = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=180)
    return res.stdout, res.returncode, res.stderr


@pytest.mark.parametrize("streams", ["", "2>&1"], ids=["stdout", "stdout-and-stderr"])
def test_a_reader_that_leaves_the_pipe_ends_the_job_as_under_plain_python(env, tmp_path, streams):
    """``python train.py | head -2``: the script's third print raises BrokenPipeError and it ends, exit 1. Under
    perfmon the script's output goes to files perfmon copies to the pipe: when the copy breaks, the job's streams
    are broken too, so it ends the same way (it trained on, unseen, for as long as it ran)."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS_EVERY_STEP)
    assert into_head([sys.executable, str(script)], tmp_path, env, streams)[:2] == ("step 0\nstep 1\n", 1)
    run = tmp_path / "run"
    # no status line (with 2>&1 it is in the pipe too: a loaded host took over 10 s to the first step)
    pm = into_head([*PERFMON, "--headless", "--interval", "3600", "--run-dir", str(run), str(script)], tmp_path, env,
                   streams)
    assert pm[:2] == ("step 0\nstep 1\n", 1)
    rep = report(run, env)
    assert rep["exit_code"] == 1 and rep["exception"].startswith("BrokenPipeError"), rep
    assert rep["steps"] < 400


def train_loop(steps: int) -> str:
    """A function body (4-space indent) for the scripts below: ``steps`` SGD updates of a small model."""
    return f"""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range({steps}):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
"""


THREAD_SCRIPT = """
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import torch
pool = ThreadPoolExecutor(2)  # never shut down (torch.compile's workers are such a pool): python stops it at exit
pool.submit(sum, [1, 2]).result()
def train():
    time.sleep(0.2)  # the main thread has returned by now
""" + train_loop(12) + """
    print("trained 12 steps", flush=True)
threading.Thread(target=train).start()
print("main returns", flush=True)
"""


def test_training_in_a_thread_the_main_thread_left_is_waited_for_and_counted(env, tmp_path):
    """Python waits for non-daemon threads before it exits; so does the job, before it records its exit. An
    executor the script left open is stopped first, as python stops it, instead of waited for forever."""
    plain, res, run = plain_and_headless(THREAD_SCRIPT, "thread_train.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "main returns\ntrained 12 steps\n"
    rep = report(run, env)
    assert rep["steps"] == 12 and rep["exit_code"] == 0


JOIN_ALL_SCRIPT = """
import threading
import torch
def save():
    torch.save({"w": torch.zeros(4)}, "ckpt.pt")
""" + "def train():" + train_loop(8) + """
train()
saver = threading.Thread(target=save, name="saver")
saver.start()
saver.join()
print("threads", [t.name for t in threading.enumerate()], threading.active_count(), flush=True)
for t in threading.enumerate():  # wait for whatever else is running before exiting
    if t is not threading.current_thread():
        t.join()
print("all joined", flush=True)
"""


def test_a_script_that_lists_or_joins_every_thread_sees_only_its_own(env, tmp_path):
    """Under plain python the script's threads are all there is: one that joined every thread but its own waited
    forever on perfmon's (which live as long as the job), and its listing showed them."""
    plain, res, run = plain_and_headless(JOIN_ALL_SCRIPT, "join_all.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "threads ['MainThread'] 1\nall joined\n"
    assert report(run, env)["steps"] == 8


SAVES_SCRIPT = """
import hashlib
import sys
import time
from safetensors.torch import save_file  # before torch: safetensors.torch imports torch itself
import torch
from accelerate import Accelerator
torch.manual_seed(0)
accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = accelerator.prepare(model, opt)
class Sampler:  # a resumable sampler's position, gathered (slowly) by save_state itself
    def state_dict(self):
        time.sleep(0.08)
        return {"position": 0}
    def load_state_dict(self, state):
        pass
accelerator.register_for_checkpointing(Sampler())
saved = 0.0
for step in range(8):
    opt.zero_grad()
    accelerator.backward(model(torch.randn(16, 512)).pow(2).mean())
    opt.step()
    if step % 2 == 1:
        t0 = time.perf_counter()
        for copy in range(2):
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"ckpt{copy}.safetensors")
        accelerator.save_state(f"state{step}")  # model.safetensors, optimizer.bin, RNG states, the sampler's
        saved += time.perf_counter() - t0
print(f"saved_s={saved:.4f}", file=sys.stderr)
digest = hashlib.md5(open("ckpt1.safetensors", "rb").read() + open("state7/optimizer.bin", "rb").read())
print("trained 8 steps, 4 checkpoints", digest.hexdigest(), flush=True)
"""


def test_safetensors_and_accelerate_saves_between_steps_are_checkpoint_time(env, tmp_path):
    """safetensors' save_file (HF's default format), bound by name before ``import torch`` as transformers and
    accelerate bind it, and accelerate's save_state (whose own work around its torch.save and save_file calls
    outlasts them): time outside the steps as *checkpoint*, as torch.save is (it was the next step's *other*, or
    an evaluation's where one came before), and the files hold the same bytes as under plain python."""
    plain, res, run = plain_and_headless(SAVES_SCRIPT, "saves.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout and res.stdout.startswith("trained 8 steps, 4 checkpoints "), res.stdout
    saved_s = float(re.search(r"saved_s=([\d.]+)", res.stderr)[1])
    rep = report(run, env)
    assert rep["steps"] == 8
    checkpoint_s = rep["outside_steps"]["checkpoint"]["ms"] / 1000.0
    assert 0.8 * saved_s <= checkpoint_s <= saved_s + 0.05, (checkpoint_s, saved_s, rep["outside_steps"])


SPAWN_SCRIPT = """
import torch
import torch.multiprocessing as mp
def train(rank):
    import perfmon
    perfmon.instrument()  # as the warning suggests: a recording per process
""" + train_loop(4) + """
if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
    print("spawned ranks done")
"""


def test_torch_multiprocessing_spawn_workers_are_followed_as_ranks_even_where_they_call_instrument(env, tmp_path):
    """The DDP tutorial's launcher: each spawned process records as a rank of the job (RUN/ranks/rank-K), and its
    own perfmon.instrument() (what an older perfmon's warning advised) adds no second recording; the job's own
    recording has the job's process only."""
    plain, res, run = plain_and_headless(SPAWN_SCRIPT, "spawned.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "spawned ranks done\n"
    assert "[perfmon] warning" not in res.stderr and "perfmon job summary" in res.stderr, res.stderr
    assert {e["pid"] for e in events(run) if e.get("type") == "hello"} == {hello_pid(run)}
    assert [r["steps"] for r in report(run, env)["ranks"]] == [4, 4]  # the script's run dir: its ranks' job
    # the plain run's instrument() made a recording per process here; the ranks under perfmon made none
    workers = [d for d in (tmp_path / "perfmon-runs").iterdir() if (d / "events.jsonl").exists()]
    assert len(workers) == 2, workers


PROCESS_SCRIPT = """
import multiprocessing as mp
import sys
import torch
def train(instrument):
    if instrument:
        import perfmon
        perfmon.instrument()  # as the warning suggests: a recording of its own
""" + train_loop(6) + """
if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    for instrument in (False, True):
        p = ctx.Process(target=train, args=(instrument,))
        p.start()
        p.join()
        print("child exit", p.exitcode)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_training_in_a_multiprocessing_process_is_said_and_instrument_there_records_it(env, tmp_path, method):
    """A script that trains in a ``multiprocessing.Process`` of its own showed no steps and a hint about custom
    loops: a warning names the process's function and what to do; ``perfmon.instrument()`` there records it, in a
    forked child too (the parent's silenced agent came along with the fork, and instrument() did nothing)."""
    script = tmp_path / "in_a_process.py"
    script.write_text(PROCESS_SCRIPT)
    plain = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=120,
                           env=env, cwd=tmp_path)
    run = tmp_path / "run"
    res = perfmon(["--headless", "--run-dir", str(run), str(script), method], env, cwd=tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "child exit 0\nchild exit 0\n"
    said = re.findall(r"^\[perfmon\] warning: the script started a process running train\(\) before any training "
                      r"step", res.stderr, re.M)
    assert len(said) == 1, res.stderr
    assert report(run, env)["steps"] == 0  # the job itself trained nothing
    # the plain run's instrumented child made a recording of its own; the one under perfmon another
    children = [d for d in (tmp_path / "perfmon-runs").iterdir() if (d / "events.jsonl").exists()]
    assert len(children) == 2, children
    assert [report(d, env)["steps"] for d in children] == [6, 6]


LAST_SECOND_WARNING_SCRIPT = """
import multiprocessing as mp
import torch
def work():
    pass
if __name__ == "__main__":  # perfmon warns as the process starts, and the script ends at once
    p = mp.get_context("fork").Process(target=work)
    p.start()
    p.join()
    print("child exit", p.exitcode)
"""


def test_a_warning_in_the_jobs_last_second_is_still_printed(env, tmp_path):
    """headless prints the job's warnings once a second; one that comes after the last of those is printed before
    the summary, not lost."""
    plain, res, run = plain_and_headless(LAST_SECOND_WARNING_SCRIPT, "last_second.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "child exit 0\n"
    said = re.findall(r"^\[perfmon\] warning: the script started a process running work\(\)", res.stderr, re.M)
    assert len(said) == 1, res.stderr
    assert res.stderr.index("[perfmon] warning") < res.stderr.index("perfmon summary")


RANKS_BY_SUBPROCESS_SCRIPT = """
import os, subprocess, sys, tempfile
import torch
import torch.distributed as dist
rank = int(os.environ.get("LOCAL_RANK", "0"))
if rank == 0:  # PyTorch Lightning's DDP launcher: the script again, one subprocess per further rank
    os.environ["INIT_FILE"] = tempfile.mktemp()
    child = subprocess.Popen([sys.executable, *sys.argv], env=dict(os.environ, LOCAL_RANK="1"))
dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
dist.barrier()  # neither rank closes its connections while the other still talks (gloo aborts then)
dist.destroy_process_group()
if rank == 0:
    child.wait()  # not its status: gloo's teardown aborts the second rank now and then on a loaded host, with or
    print("rank 0 done")  # without perfmon (1 run in ~50 here), which is not what this test is about
"""


def test_ranks_the_job_starts_itself_are_said_with_what_follows_them(env, tmp_path):
    """A job that starts its other ranks itself (Lightning's DDP): perfmon follows the process it started, says
    once that the others run without it, and how to follow them all; the job runs as under plain python."""
    plain, res, run = plain_and_headless(RANKS_BY_SUBPROCESS_SCRIPT, "lightning_ddp.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "rank 0 done\n"
    said = re.findall(r"^\[perfmon\] warning: torch.distributed: this process is rank 0 of 2.*$", res.stderr, re.M)
    assert len(said) == 1 and "perfmon torchrun --nproc_per_node 2 SCRIPT" in said[0], res.stderr
    assert report(run, env)["steps"] == 4


INTERLEAVED_SCRIPT = """
import sys
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(12):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
"""


def test_stdout_and_stderr_into_one_log_keep_the_order_the_script_wrote_them(env, tmp_path):
    """`perfmon --headless train.py > train.log 2>&1`: the script's two streams come out in the order written, as
    from plain python (copied from two files by polls, they came out a poll's worth of one, then of the other)."""
    script = tmp_path / "interleaved.py"
    script.write_text(INTERLEAVED_SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=60, env=env, cwd=tmp_path)
    run = tmp_path / "run"
    res = subprocess.run([*PERFMON, "--headless", "--run-dir", str(run), str(script)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert plain.returncode == res.returncode == 0, res.stdout
    script_lines = [line for line in res.stdout.splitlines() if line.startswith(("out ", "err "))]
    assert script_lines == plain.stdout.splitlines()
    assert not (run / "stderr.log").exists() and "err 11" in (run / "output.log").read_text()
    assert report(run, env)["steps"] == 12


ENDING_SCRIPT = """\
import atexit, sys
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
print("steps", i + 1)
atexit.register(lambda: print("atexit says bye", file=sys.stderr))
print("checking config... ", end="")
ending = sys.argv[1]
if ending == "exit-message":
    sys.exit("error: config invalid")
if ending == "raise":
    raise RuntimeError("config invalid")
if ending == "ctrl-c":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("ending", ["end", "exit-message", "raise", "ctrl-c"])
def test_a_partial_line_the_script_leaves_comes_before_what_ends_it_as_under_plain_python(env, tmp_path, ending):
    """``print("checking config... ", end="")`` and then an error: python writes the pending stdout before the
    traceback, the exit message or the atexit handlers' output. It came after them (and after a Ctrl-C it was
    lost: the process died of SIGINT before python's last flush)."""
    env = {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}  # as most users run: stdout buffered
    script = tmp_path / "ending.py"
    script.write_text(ENDING_SCRIPT)
    plain = subprocess.run([sys.executable, str(script), ending], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=60, env=env, cwd=tmp_path)
    run = tmp_path / "run"
    res = subprocess.run([*PERFMON, "--headless", "--interval", "3600", "--run-dir", str(run), str(script), ending],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert "checking config... " in plain.stdout and "atexit says bye" in plain.stdout
    assert (run / "output.log").read_text() == plain.stdout
    assert res.stdout.startswith(plain.stdout.rstrip("\n")), res.stdout
    assert report(run, env)["steps"] == 3


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to run the dashboard in a terminal")
def test_the_dashboards_output_panel_shows_stdout_and_stderr_in_the_order_written_and_the_end_is_summarised(
        env, tmp_path):
    """In a terminal perfmon's stdout and stderr are one: the script's two streams share ``RUN/output.log`` and
    the panel shows them as the script wrote them (from two files, a poll's worth of one came before the other's)."""
    script, gate, run = tmp_path / "interleaved.py", tmp_path / "gate", tmp_path / "run"
    script.write_text(INTERLEAVED_SCRIPT + f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n"
                      "    time.sleep(0.05)\n")
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]  # a tmux server of its own
    subprocess.run([*tmux, "new-session", "-d", "-s", "pm", "-x", "120", "-y", "40",
                    f"cd {tmp_path} && {' '.join(PERFMON)} --run-dir {run} {script}; sleep 60"], env=env, check=True)

    def panel() -> list[str]:
        text = subprocess.run([*tmux, "capture-pane", "-p", "-t", "pm"], capture_output=True, text=True).stdout
        return re.findall(r"\b((?:out|err) \d+)\b", text)

    try:
        shown = wait_for(lambda: (lines := panel()) and lines[-1] == "err 11" and lines, "the script's last line")
        written = [f"{stream} {i}" for i in range(12) for stream in ("out", "err")]
        assert len(shown) >= 4 and shown == written[-len(shown):], shown
        assert not (run / "stderr.log").exists()
        assert (run / "output.log").read_text().splitlines() == written
        gate.touch()
        # summary.json comes with the job's end, while the dashboard still shows it: a terminal that hangs up now
        # (an SSH drop) kills perfmon before its own ending, and the agent left the summary to perfmon
        summary = wait_for(lambda: (run / "summary.json").exists() and json.loads((run / "summary.json").read_text()),
                           "summary.json while the dashboard is open")
        assert summary["steps"] == 12 and summary["exit_code"] == 0
    finally:
        gate.touch()
        subprocess.run([*tmux, "kill-server"], capture_output=True)


CRASHING_SCRIPT = """\
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    opt.zero_grad()
    model(torch.randn(2, 4 if i < 3 else 5)).sum().backward()
    opt.step()
    for k in range(10):
        print(f"step {i} line {k}", flush=True)
"""


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to run the dashboard in a terminal")
def test_a_crash_leaves_its_output_traceback_and_summary_in_the_terminal_once_the_dashboard_closes(env, tmp_path):
    """The dashboard shows the failure; quitting it left only "perfmon: failed: RuntimeError" where plain python
    leaves the script's output and traceback (the dashboard's screen is the terminal's alternate one, gone when it
    closes). Now: the output's last 20 lines under a line naming its file, the traceback once, the summary."""
    script, run = tmp_path / "crash.py", tmp_path / "run"
    script.write_text(CRASHING_SCRIPT)
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]  # a tmux server of its own
    subprocess.run([*tmux, "new-session", "-d", "-s", "pm", "-x", "120", "-y", "40",
                    f"cd {tmp_path} && {' '.join(PERFMON)} --run-dir {run} {script}; echo rc=$?; sleep 60"],
                   env=env, check=True)

    def screen() -> str:
        # with the lines scrolled off the top (after the dashboard, the terminal's main screen)
        return subprocess.run([*tmux, "capture-pane", "-p", "-S", "-200", "-t", "pm"], capture_output=True,
                              text=True).stdout

    try:
        wait_for(lambda: [m for m in events(run) if m.get("type") == "event" and m.get("kind") == "exit"],
                 "the job's exit in the recording")
        wait_for(lambda: "failed" in screen(), "the dashboard showing the failure")
        subprocess.run([*tmux, "send-keys", "-t", "pm", "q"], check=True)
        text = wait_for(lambda: "rc=1" in (t := screen()) and t, "perfmon's exit")
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)"))
        assert "crash.py\", line 6, in <module>" in text and "RuntimeError: mat1 and mat2" in text, text
        assert "perfmon" not in "\n".join(lines[at:at + 3]), text  # the script's frames, as python prints them
        assert text.count("Traceback (most recent call last)") == 1, text
        assert any(line.startswith("perfmon: failed: RuntimeError") for line in lines[at:]), text
        # 30 lines printed, then the traceback (one file: tmux's terminal is both streams): the last 20 stay, above
        # the whole traceback and below a line that names the file with all of them
        more = next(i for i, line in enumerate(lines) if line.startswith("perfmon: the script's output, its last"))
        assert lines[at - 20:at] == [f"step {i} line {k}" for i in (1, 2) for k in range(10)], text
        assert "step 0 line 9" not in text and more < at - 20, text
        assert str(run / "output.log") in "".join(lines[more:at - 20]), text  # (wrapped at 120 columns)
        summary = next(i for i, line in enumerate(lines) if line.startswith("perfmon summary:"))
        assert at < summary and any(line.split()[:2] == ["steps", "3"] for line in lines[summary:]), text
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to run the dashboard in a terminal")
def test_a_script_that_fails_before_its_first_step_leaves_the_dashboard_at_once(env, tmp_path):
    """A typo, a missing config file: the dashboard opened on a job with nothing to show and waited for q; plain
    python prints the traceback and returns. perfmon closes it and leaves the terminal as python would."""
    script, run = tmp_path / "typo.py", tmp_path / "run"
    script.write_text('print("loading config", flush=True)\nopen("config.yaml")\n')
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    subprocess.run([*tmux, "new-session", "-d", "-s", "pm", "-x", "120", "-y", "40",
                    f"cd {tmp_path} && {' '.join(PERFMON)} --run-dir {run} {script}; echo rc=$?; sleep 60"],
                   env=env, check=True)
    try:
        text = wait_for(lambda: "rc=" in (t := subprocess.run([*tmux, "capture-pane", "-p", "-t", "pm"],
                                                             capture_output=True, text=True).stdout) and t,
                        "perfmon's exit, with no key pressed")
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines[0] == "loading config" and lines[1] == "Traceback (most recent call last):", text
        assert "FileNotFoundError: [Errno 2] No such file or directory: 'config.yaml'" in lines, text
        flat = "".join(text.splitlines())  # the last line may wrap, with a long temporary path
        assert flat.endswith(f"FileNotFoundError: [Errno 2] No such file or directory: 'config.yaml'perfmon: failed: "
                             f"FileNotFoundError; run dir {run}rc=1"), text  # no summary: there is no step
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


#: Exceptions that pass through perfmon's wrappers on their way up: a forward raising in a thread (python's own
#: ``threading.excepthook`` prints it, in C), signals a script sends itself (through the ``os.kill`` stand-in), and an
#: uncaught Ctrl-C, which python hands to ``sys.excepthook`` like any other exception.
THROUGH_WRAPPERS = """
import os, signal, sys, threading, traceback
import torch
torch.manual_seed(0)
class Bad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 1)
    def forward(self, x):
        if x.shape[0] == 3:
            raise ValueError("bad batch size 3")
        return self.l(x)
m = Bad()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
def work(sizes):
    for n in sizes:
        loss = m(torch.randn(n, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
work((8, 8, 8))
t = threading.Thread(target=work, args=((8, 3),), name="w")
t.start()
t.join()
def preempted(sig, frame):
    raise RuntimeError("preempted")
signal.signal(signal.SIGUSR1, preempted)
try:
    os.kill(os.getpid(), signal.SIGUSR1)
except RuntimeError:
    traceback.print_exc()
def hook(kind, exc, tb):
    names = []
    while tb is not None:  # walked by hand, as a C printer walks it
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    print("[hook]", kind.__name__, names, file=sys.stderr)
    open("crash.txt", "w").write(kind.__name__)
sys.excepthook = hook
print("steps 4", flush=True)
os.kill(os.getpid(), signal.SIGINT)
"""


def test_exceptions_through_perfmons_wrappers_print_as_under_plain_python(env, tmp_path):
    """A thread's uncaught error named hooks.py's ``__call__``; a handler raising in a script that signals itself
    named exits.py's ``kill``; and an uncaught Ctrl-C skipped the script's ``sys.excepthook``."""
    plain_dir, pm_dir = tmp_path / "plain", tmp_path / "pm"
    plain_dir.mkdir()
    pm_dir.mkdir()
    (tmp_path / "through.py").write_text(THROUGH_WRAPPERS)
    plain = subprocess.run([sys.executable, str(tmp_path / "through.py")], capture_output=True, text=True,
                           timeout=60, env=env, cwd=plain_dir)
    run = tmp_path / "run"
    res = headless(run, str(tmp_path / "through.py"), env=env, cwd=pm_dir)
    assert plain.returncode == -signal.SIGINT and res.returncode == -signal.SIGINT, res.stderr
    assert "bad batch size 3" in plain.stderr and "[hook] KeyboardInterrupt ['<module>']" in plain.stderr
    assert (run / "stderr.log").read_text() == plain.stderr
    assert (pm_dir / "crash.txt").read_text() == (plain_dir / "crash.txt").read_text() == "KeyboardInterrupt"
    assert report(run, env)["steps"] == 4


#: Whether a process forked by the script catches SIGTERM at the C level (``SigCgt``): a Python handler there turned
#: Pool.terminate()'s SIGTERM into a flag, which a worker about to block in sem_wait never looked at again.
FORKED_SIGTERM = """
import multiprocessing as mp
import torch

def show(where):
    caught = int(next(line for line in open("/proc/self/status") if line.startswith("SigCgt:")).split()[1], 16)
    print(where, "child catches SIGTERM:", bool(caught >> 14 & 1), flush=True)

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        pool.apply(show, ("pool",))
    p = ctx.Process(target=show, args=("process",))
    p.start()
    p.join()
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_forked_children_start_with_sigterm_at_its_default_as_under_plain_python(env, tmp_path):
    """A fork Pool closed 300 times hung under perfmon: its workers inherited perfmon's SIGTERM handler."""
    plain, res, run = plain_and_headless(FORKED_SIGTERM, "forked.py", env, tmp_path)
    assert plain.stdout == "pool child catches SIGTERM: False\nprocess child catches SIGTERM: False\n"
    assert res.returncode == plain.returncode == 0 and res.stdout == plain.stdout, res.stderr


#: Two loops training side by side in threads (a sweep in a ThreadPoolExecutor): one loop to perfmon.
SIDE_BY_SIDE = """
import sys, threading, time
import torch
losses = {}
pause, n0 = (0.6, 4) if sys.argv[1:] == ["slow"] else (0.0, 200)  # slow: a step every 0.6 s, the loops in turn
torch.manual_seed(0)
models = [torch.nn.Linear(8, 1) for _ in range(2)]  # made here: two threads drawing from one RNG draw in any order
def run(k, n):
    g = torch.Generator().manual_seed(k)
    m = models[k]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    for _ in range(n):
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        time.sleep(pause)
    losses[k] = round(loss.item(), 4)
threads = [threading.Thread(target=run, args=(k, n0 + n0 // 2 * k)) for k in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(losses.items()))
"""


@pytest.mark.parametrize("accel, pace", [("c", "fast"), ("python", "fast"), ("c", "slow")])
def test_loops_training_side_by_side_in_threads_are_said_to_be_miscounted(env, tmp_path, accel, pace):
    """Their steps were counted at random (239, 260, 210 of 500 updates) and nothing said so; slow loops (a step a
    second) too, however few times a second they take turns."""
    env = dict(env, **({"PERFMON_NO_ACCEL": "1"} if accel == "python" else {}))
    script = tmp_path / "side_by_side.py"
    script.write_text(SIDE_BY_SIDE)
    plain = subprocess.run([sys.executable, str(script), pace], capture_output=True, text=True, timeout=60, env=env)
    res = headless(tmp_path / "run", str(script), pace, env=env, cwd=tmp_path)
    assert res.returncode == plain.returncode == 0 and res.stdout == plain.stdout, res.stderr
    assert res.stderr.count("backward runs on several threads in turn") == 1, res.stderr


#: A tracer of the script's own wrapping every module call, put in place after ``import torch`` (perfmon's discovery
#: wrapper is then what it wraps).
OWN_MODULE_CALL = """
import torch
calls = 0
theirs = torch.nn.Module.__call__
def counted(self, *args, **kwargs):
    global calls
    calls += 1
    return theirs(self, *args, **kwargs)
torch.nn.Module.__call__ = counted
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for _ in range(30):
    opt.zero_grad()
    ((m(x) - y) ** 2).mean().backward()
    opt.step()
print("calls", calls, "still ours:", torch.nn.Module.__call__ is counted)
"""


def test_the_scripts_own_module_call_wrapper_stays_in_place(env, tmp_path):
    """perfmon put torch's ``__call__`` back when discovery ended, over the script's: 8 calls counted of 120."""
    plain, res, run = plain_and_headless(OWN_MODULE_CALL, "own_call.py", env, tmp_path)
    assert plain.stdout == "calls 120 still ours: True\n"
    assert res.returncode == 0 and res.stdout == plain.stdout, res.stderr
    assert report(run, env)["steps"] == 30


#: A script that leads a process group of its own, to ``killpg`` what it starts at its end.
OWN_PROCESS_GROUP = """
import os, signal, subprocess, sys
import torch
os.setpgrp()
os.setpgid(0, 0)
print("leads its group:", os.getpgrp() == os.getpid(), flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)
print("child ended by", -child.wait())
"""


def test_a_script_that_leads_its_own_process_group_runs_as_under_plain_python(env, tmp_path):
    """``os.setpgrp()`` raised EPERM: perfmon's job leads a session of its own, where python leads a group."""
    plain, res, run = plain_and_headless(OWN_PROCESS_GROUP, "own_group.py", env, tmp_path)
    assert plain.stdout == f"leads its group: True\nchild ended by {int(signal.SIGTERM)}\n", plain.stderr
    assert res.returncode == plain.returncode == 0 and res.stdout == plain.stdout, res.stderr
    assert report(run, env)["steps"] == 5


@pytest.mark.parametrize("source, status", [
    ("import sys\nsys.exit(256)\n", 0),  # the parent sees the low byte of the code
    ("import sys\nsys.exit(-1)\n", 255),
    ("import sys\nsys.exit(True)\n", 1),
    ("import sys\nsys.exit(2**100)\n", 255),
    ("import sys\nsys.stderr = None\nsys.exit('bye')\n", 1),  # the message on fd 2 all the same
], ids=["256", "-1", "True", "2**100", "message-without-stderr"])
def test_sys_exit_ends_and_is_recorded_as_under_plain_python(env, tmp_path, source, status):
    plain, res, run = plain_and_headless(source, "leaves.py", env, tmp_path)
    assert plain.returncode == res.returncode == status
    assert res.stdout == plain.stdout and (run / "stderr.log").read_text() == plain.stderr
    assert report(run, env)["exit_code"] == status


def test_python_dev_mode_shows_no_warning_of_perfmons_own(env, tmp_path):
    """``PYTHONDEVMODE=1`` (or ``-W always``): perfmon's launcher left its socket, the recording's reader and the
    output files to the interpreter's end, and printed a ResourceWarning for each."""
    env = dict(env, PYTHONDEVMODE="1")
    plain, res, run = plain_and_headless(TORCH_LOOKED_UP_FIRST, "dev_mode.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0 and res.stdout == plain.stdout
    assert "Warning" not in plain.stderr and "Warning" not in res.stderr, res.stderr


@pytest.mark.parametrize("module, said", [
    ("pkg.missing", "No module named pkg.missing"),
    ("pkg", "No module named pkg.__main__; 'pkg' is a package and cannot be directly executed"),
])
def test_a_module_runpy_cannot_run_is_one_line_not_a_traceback(env, tmp_path, module, said):
    """``-m pkg.missing`` (its package exists) and ``-m pkg`` without ``__main__``: python says one line and exits 1;
    perfmon printed runpy's traceback (then its own line and exit status 2, which a launcher above the worker
    reported as the script's: accelerate's "returned non-zero exit status 2")."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    plain = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert plain.returncode == 1 and plain.stderr.strip().endswith(said)
    res = headless(tmp_path / "run", module, env=env, cwd=tmp_path)
    assert res.returncode == 1 and f"{sys.executable}: {said}\n" in res.stderr and "Traceback" not in res.stderr


#: Daemon-style code: every inherited descriptor closed, then files of its own opened (on the same numbers).
CLOSES_ITS_DESCRIPTORS = """
import os, time
import torch
m = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(4, 8)
def step():
    opt.zero_grad()
    m(x).sum().backward()
    opt.step()
for _ in range(5):
    step()
os.closerange(3, 4096)
files = [open(f"mine-{i}.txt", "w") for i in range(12)]
for _ in range(200):
    step()
    time.sleep(0.005)
for f in files:
    f.write("mine\\n")
    f.close()
print("sizes", [os.path.getsize(f"mine-{i}.txt") for i in range(12)])
"""


def test_a_script_that_closes_every_inherited_descriptor_keeps_its_files_and_its_steps(env, tmp_path):
    """perfmon wrote its recording into the script's new files (their descriptors had the agent's numbers), closed
    one of them under it (EBADF in the script) and recorded 0 steps."""
    plain, res, run = plain_and_headless(CLOSES_ITS_DESCRIPTORS, "closer.py", env, tmp_path)
    assert plain.stdout == f"sizes {[5] * 12}\n", plain.stderr
    assert res.returncode == plain.returncode == 0 and res.stdout == plain.stdout, res.stderr
    assert "steps     205" in res.stderr  # the summary reads the recording the cut stream could not bring
    assert report(run, env)["steps"] == 205
    assert all(line.startswith(b"{") for line in (run / "events.jsonl").read_bytes().splitlines())


def test_pythonsafepath_keeps_the_scripts_folder_off_sys_path_as_python_does(env, tmp_path):
    """PYTHONSAFEPATH=1 (what perfmon itself says to use for ``python -P``): perfmon put the script's folder back
    in front, over the standard library's first entry, so a file there shadowed a stdlib module."""
    (tmp_path / "colorsys.py").write_text("raise SystemExit('the shadow colorsys was imported')\n")
    env = dict(env, PYTHONSAFEPATH="1")
    plain, res, run = plain_and_headless("import colorsys, sys\nprint(colorsys.__name__, sys.path[0] != '')\n",
                                         "safe.py", env, tmp_path)
    assert plain.returncode == 0 and plain.stdout == "colorsys True\n", plain.stderr
    assert res.returncode == 0 and res.stdout == plain.stdout, res.stderr


#: Hugging Face's examples import datasets (or transformers) before torch; both ask importlib whether torch is
#: there (``is_torch_available``: ``find_spec("torch")``) without importing it.
TORCH_LOOKED_UP_FIRST = """
import importlib.util
assert importlib.util.find_spec("torch") is not None
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
print("steps", step + 1)
"""


def test_a_script_that_looks_torch_up_before_importing_it_is_counted(env, tmp_path):
    """The import hook waits for torch's real import: a lookup first left it gone, and the run had 0 steps."""
    plain, res, run = plain_and_headless(TORCH_LOOKED_UP_FIRST, "looked_up.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "steps 8\n"
    assert report(run, env)["steps"] == 8


def test_sigterm_to_training_process_gives_143_and_live_status(background, env, tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--interval", "0.5", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "1000", "--hold-at", "10", "--gate", str(gate)])
    bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 10), "10 steps in events.jsonl")
    # The live status line catches up with the held job (the monitor is not stuck on step 0).
    wait_for(lambda: re.search(r"^\[perfmon\] .* step 10 \|", bg.stderr, re.M), "a status line at step 10")
    os.kill(bg.train_pid, signal.SIGTERM)
    assert bg.wait() == -signal.SIGTERM, bg.stderr  # perfmon dies of the signal its job died of
    rep = report(run, env)
    assert rep["exit_code"] == 143 and rep["signal"] == "SIGTERM" and rep["steps"] == 10
    assert "holding at step 10" in bg.stdout
    assert leftovers(env, bg.train_pid) == []


#: A rank whose main thread waits in C code that retries on EINTR (a store waiting for peers that never come, as
#: ``init_process_group`` does when another rank failed): python's SIGTERM handler never gets to run there.
HELD_IN_C = """
import datetime
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("waiting for peers", flush=True)
torch.distributed.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=True,
                           timeout=datetime.timedelta(seconds=120))
"""


def test_sigterm_ends_a_job_held_in_c_code_at_once_as_under_plain_python(background, env, tmp_path):
    """Plain python dies of SIGTERM at once wherever its main thread is; perfmon's handler (python-level, to record
    the exit) waited for a bytecode the held thread never ran: torchrun waited 30 s and sent SIGKILL, and here the
    job waited for the store's 120 s. perfmon's watcher thread finishes the job instead, half a second on."""
    (tmp_path / "held.py").write_text(HELD_IN_C)
    run = tmp_path / "run"
    bg = background(["--headless", "--interval", "3600", "--run-dir", str(run), "held.py"], cwd=tmp_path)
    bg.train_pid = hello_pid(run)
    wait_for(lambda: "waiting for peers" in bg.stdout, "the job to wait in the store")
    os.kill(bg.train_pid, signal.SIGTERM)
    assert bg.wait(timeout=60) == -signal.SIGTERM, bg.stderr  # the store's timeout is 120 s
    rep = report(run, env)
    assert rep["exit_code"] == 143 and rep["signal"] == "SIGTERM" and rep["steps"] == 3  # recorded by the job
    assert leftovers(env, bg.train_pid) == []


#: A forked child with a SIGTERM handler of its own, sent SIGTERM by its parent, which trains on for a second after.
CHILD_HANDLES_SIGTERM = """
import os, signal, time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, lambda sig, frame: os._exit(7))
    os.write(w, b"x")
    time.sleep(60)
    os._exit(1)
os.read(r, 1)
os.kill(pid, signal.SIGTERM)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
end = time.monotonic() + 1.5
while time.monotonic() < end:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.01)
print("parent done", flush=True)
print("wakeup fd", signal.set_wakeup_fd(-1))  # none of the script's: -1, as under plain python
"""


def test_a_forked_childs_own_sigterm_is_not_the_parents(env, tmp_path):
    """Python's wakeup fd, which tells perfmon's watcher that a SIGTERM came, survives a fork: a child's own handler
    would write to the parent's pipe, and the watcher would end the parent. A forked child sets it back."""
    plain, res, run = plain_and_headless(CHILD_HANDLES_SIGTERM, "child_sigterm.py", env, tmp_path)
    assert plain.returncode == res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == plain.stdout == "child 7\nparent done\nwakeup fd -1\n"
    assert report(run, env)["signal"] is None


#: A script that handles preemption as training scripts do: SIGUSR1 is a notice (noted, training goes on), SIGTERM
#: ends the loop, a checkpoint is saved, exit 0.
PREEMPTIBLE = """
import signal, sys, time
import torch
from torch import nn
stop = False
def on_term(sig, frame):
    global stop
    stop = True
def on_usr1(sig, frame):
    print("preemption notice", flush=True)
    open("usr1", "w").close()
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
while not stop:
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    steps += 1
    if steps == 3:
        open("ready", "w").close()
    time.sleep(0.01)
torch.save(model.state_dict(), "ckpt.pt")
print(f"checkpoint saved after {steps} steps", flush=True)
sys.exit(0)
"""


#: The same, with a SIGTERM handler that calls the one it found, as PyTorch Lightning's signal connector does: under
#: plain python it finds SIG_DFL and calls nothing; perfmon's own handler, found instead, killed the job (143, no
#: checkpoint) until it learned to do nothing when another handler calls it.
PREEMPTIBLE_CHAINING = PREEMPTIBLE.replace("""def on_term(sig, frame):
    global stop
    stop = True
""", """previous = signal.getsignal(signal.SIGTERM)
def on_term(sig, frame):
    global stop
    stop = True
    if callable(previous):
        previous(sig, frame)
""")


#: The same, fetching from a DataLoader's worker processes: a SIGTERM that reached them too (a signal to the job's
#: process group) killed them, and the script died of "DataLoader worker (pid N) is killed by signal: Terminated".
PREEMPTIBLE_WORKERS = PREEMPTIBLE.replace("""model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
while not stop:
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
""", """from torch.utils.data import DataLoader, TensorDataset
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
for x, y in DataLoader(TensorDataset(torch.randn(100000, 8), torch.randn(100000, 1)), batch_size=4, num_workers=2):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
""").replace("""    time.sleep(0.01)
""", """    time.sleep(0.05)
    if stop:
        break
""")


@pytest.mark.parametrize("script", [PREEMPTIBLE, PREEMPTIBLE_CHAINING, PREEMPTIBLE_WORKERS],
                         ids=["own", "chaining", "loader_workers"])
def test_sigterm_and_sigusr1_to_perfmon_reach_the_scripts_own_handlers(background, env, tmp_path, script):
    """`kill PID`, `timeout`, `docker stop` or a scheduler signal perfmon, not the job: SIGTERM and SIGUSR1 go on to
    the job's process as they are (not to its children), so its handlers run as under plain python (a checkpoint,
    exit 0), never a KeyboardInterrupt."""
    assert "previous(sig, frame)" in PREEMPTIBLE_CHAINING and "num_workers=2" in PREEMPTIBLE_WORKERS
    assert "if stop:" in PREEMPTIBLE_WORKERS
    (tmp_path / "preempt.py").write_text(script)
    run = tmp_path / "run"
    bg = background(["--headless", "--interval", "0.3", "--run-dir", str(run), "preempt.py"], cwd=tmp_path)
    bg.train_pid = hello_pid(run)
    wait_for(lambda: (tmp_path / "ready").exists() and "[perfmon] " in bg.stderr, "training and a status line")
    bg.popen.send_signal(signal.SIGUSR1)
    wait_for(lambda: (tmp_path / "usr1").exists(), "the script's SIGUSR1 handler")
    assert bg.popen.poll() is None  # a notice: perfmon and the job go on
    bg.popen.send_signal(signal.SIGTERM)
    assert bg.wait() == 0, bg.stderr
    assert (tmp_path / "ckpt.pt").exists()
    saved = re.search(r"^checkpoint saved after (\d+) steps$", bg.stdout, re.M)
    assert saved and "preemption notice" in bg.stdout, bg.stdout
    rep = report(run, env)
    assert rep["exit_code"] == 0 and rep["signal"] is None and rep["exception"] is None
    assert rep["steps"] == int(saved.group(1))


#: A preemption handler that saves, then chains the handler it found or, finding none (SIG_DFL, as under plain
#: python), dies of the signal itself. perfmon's handler, had the script seen it, would have been called and done
#: nothing: the job trained on.
PREEMPTIBLE_REKILL = """
import os, signal, time
import torch
from torch import nn
previous = signal.getsignal(signal.SIGTERM)
steps = 0
def on_term(sig, frame):
    torch.save(model.state_dict(), "ckpt.pt")
    print(f"checkpoint saved after {steps} steps", flush=True)
    if callable(previous):
        previous(sig, frame)
    else:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
signal.signal(signal.SIGTERM, on_term)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
while True:
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    steps += 1
    if steps == 3:
        open("ready", "w").close()
    time.sleep(0.01)
"""


def test_a_handler_that_finds_no_previous_handler_dies_of_sigterm_with_every_step_recorded(background, env,
                                                                                          tmp_path):
    """perfmon's own SIGTERM handler is out of the script's sight (getsignal reads SIG_DFL), so a handler that
    re-kills itself when it finds none dies as under plain python (of SIGTERM), and the steps up to its own kill are
    recorded (os.kill of itself with a fatal signal at SIG_DFL records first, as os._exit does)."""
    (tmp_path / "rekill.py").write_text(PREEMPTIBLE_REKILL)
    run = tmp_path / "run"
    bg = background(["--headless", "--interval", "0.3", "--run-dir", str(run), "rekill.py"], cwd=tmp_path)
    bg.train_pid = hello_pid(run)
    wait_for(lambda: (tmp_path / "ready").exists(), "training")
    bg.popen.send_signal(signal.SIGTERM)
    assert bg.wait() == -signal.SIGTERM, bg.stderr  # perfmon dies of the signal its job died of
    saved = re.search(r"^checkpoint saved after (\d+) steps$", bg.stdout, re.M)
    assert saved and (tmp_path / "ckpt.pt").exists(), bg.stdout
    rep = report(run, env)
    assert rep["signal"] == "SIGTERM" and rep["steps"] == int(saved.group(1))


FORK_TERMINATED_SCRIPT = """
import multiprocessing as mp, time
import torch
def helper():
    time.sleep(60)
""" + "def train():" + train_loop(5) + """
if __name__ == "__main__":
    train()
    p = mp.get_context("fork").Process(target=helper)
    p.start()
    time.sleep(0.5)
    p.terminate()  # SIGTERM: the child inherited perfmon's handler with the fork
    p.join()
    train()
    print("helper exit", p.exitcode, flush=True)
"""


def test_a_forked_child_terminated_leaves_the_jobs_recording_alone(env, tmp_path):
    """The handler a forked child inherits does what SIG_DFL does there: before, it finished the parent's agent from
    the child (a second, false exit record in the job's recording; its discovery file and socket removed)."""
    plain, res, run = plain_and_headless(FORK_TERMINATED_SCRIPT, "fork_terminated.py", env, tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    assert res.stdout == plain.stdout == "helper exit -15\n"
    exits = [e for e in events(run) if e.get("kind") == "exit"]
    assert len(exits) == 1 and exits[0]["code"] == 0, exits
    assert report(run, env)["steps"] == 10


def test_ctrl_z_on_perfmon_suspends_the_job_too_and_fg_resumes_both(background, env, tmp_path):
    """Ctrl-Z (SIGTSTP) on plain python stops training; on perfmon it stops the job with it (the job's own session
    would not see the terminal's), and continuing perfmon continues the job."""
    import psutil

    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--interval", "0.3", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "12", "--hold-at", "4", "--gate", str(gate)])
    bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 4) and "[perfmon] " in bg.stderr, "4 steps and a status line")
    ours, job = psutil.Process(bg.popen.pid), psutil.Process(bg.train_pid)
    bg.popen.send_signal(signal.SIGTSTP)
    wait_for(lambda: ours.status() == job.status() == psutil.STATUS_STOPPED, "perfmon and the job stopped")
    bg.popen.send_signal(signal.SIGCONT)
    wait_for(lambda: psutil.STATUS_STOPPED not in (ours.status(), job.status()), "both running again")
    gate.touch()
    assert bg.wait() == 0, bg.stderr
    assert report(run, env)["steps"] == 12


def test_sigterm_to_perfmon_ends_a_script_without_a_handler_and_perfmon_dies_of_it(background, env, tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--interval", "0.3", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "1000", "--hold-at", "5", "--gate", str(gate)])
    bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 5) and "[perfmon] " in bg.stderr, "5 steps and a status line")
    bg.popen.send_signal(signal.SIGTERM)
    assert bg.wait() == -signal.SIGTERM, bg.stderr  # perfmon dies of the signal its job died of
    rep = report(run, env)
    assert rep["exit_code"] == 143 and rep["signal"] == "SIGTERM" and rep["steps"] == 5
    assert "KeyboardInterrupt" not in (run / "stderr.log").read_text()


def test_sigkill_to_training_process_is_recorded_by_the_monitor(background, env, tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "1000", "--hold-at", "4", "--gate", str(gate)])
    bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 4), "4 steps in events.jsonl")
    os.kill(bg.train_pid, signal.SIGKILL)
    assert bg.wait() == -signal.SIGKILL, bg.stderr
    rep = report(run, env)
    assert rep["exit_code"] == 137 and rep["signal"] == "SIGKILL" and rep["complete"] is True
    assert rep["steps"] == 4
    assert json.loads((run / "summary.json").read_text())["signal"] == "SIGKILL"


IGNORES_SIGINT = """
import signal, time
import torch
signal.signal(signal.SIGINT, signal.SIG_IGN)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(100000):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if i == 3:
        open("ready", "w").close()
    time.sleep(0.01)
"""


def test_a_second_ctrl_c_says_it_went_past_what_python_does(background, env, tmp_path):
    """A script that ignores SIGINT runs on after a Ctrl-C, as under plain python; the second one (SIGTERM) is
    perfmon's own, and it says so instead of ending the job without a word."""
    (tmp_path / "stubborn.py").write_text(IGNORES_SIGINT)
    run = tmp_path / "run"
    bg = background(["--headless", "--run-dir", str(run), "stubborn.py"], cwd=tmp_path)
    bg.train_pid = hello_pid(run)
    wait_for(lambda: (tmp_path / "ready").exists(), "training")
    bg.popen.send_signal(signal.SIGINT)
    first = len(events(run))
    wait_for(lambda: len(events(run)) > first, "training on after the first Ctrl-C")
    assert bg.popen.poll() is None
    bg.popen.send_signal(signal.SIGINT)
    assert bg.wait() == 143, bg.stderr  # perfmon's own SIGTERM: an exit status, not re-raised on perfmon
    assert "[perfmon] Ctrl-C again: SIGTERM sent to the job" in bg.stderr


def test_ctrl_c_on_perfmon_stops_the_job_like_python(background, env, tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "1000", "--hold-at", "3", "--gate", str(gate)])
    bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 3), "3 steps in events.jsonl")
    bg.popen.send_signal(signal.SIGINT)
    assert bg.wait() == -signal.SIGINT, bg.stderr
    rep = report(run, env)
    assert rep["signal"] == "SIGINT" and rep["exit_code"] == 130 and rep["steps"] == 3
    assert "KeyboardInterrupt" in (run / "stderr.log").read_text()


def test_ctrl_backslash_on_perfmon_quits_the_job_too(background, env, tmp_path):
    """SIGQUIT (Ctrl-\\) ended perfmon alone: the job, in its own session, trained on unseen."""
    import resource

    import psutil

    core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, core[1]))  # the job dumps no core into the checkout
    try:
        run, gate = tmp_path / "run", tmp_path / "gate"
        bg = background(["--headless", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                         "--steps", "1000", "--hold-at", "3", "--gate", str(gate)])
        bg.train_pid = hello_pid(run)
        wait_for(lambda: has_steps(run, 3), "3 steps in events.jsonl")
        bg.popen.send_signal(signal.SIGQUIT)
        assert bg.wait() == -signal.SIGQUIT, bg.stderr
        wait_for(lambda: not psutil.pid_exists(bg.train_pid) or psutil.Process(bg.train_pid).status() == "zombie",
                 "the job's end")
        assert report(run, env)["signal"] == "SIGQUIT"
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, core)


def test_monitor_killed_training_goes_on_and_recording_completes(background, env, tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    bg = background(["--headless", "--interval", "0.5", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                     "--steps", "40", "--hold-at", "5", "--gate", str(gate)])
    pid = bg.train_pid = hello_pid(run)
    wait_for(lambda: has_steps(run, 5), "5 steps in events.jsonl")
    bg.popen.kill()  # SIGKILL to the headless monitor
    assert bg.wait() == -signal.SIGKILL
    assert not gone(pid), "the training process died with its monitor"
    gate.touch()
    wait_for(lambda: gone(pid), "the training process to finish")
    exits = [m for m in events(run) if m.get("type") == "event" and m.get("kind") == "exit"]
    assert len(exits) == 1 and exits[0]["code"] == 0
    rep = report(run, env)
    assert rep["steps"] == 40 and rep["exit_code"] == 0 and rep["complete"] is True
    assert "done steps=40" in (run / "output.log").read_text()
    # its launcher is gone: a detached writer outside the job writes summary.json
    summary = wait_for(lambda: (run / "summary.json").exists() and (run / "summary.json").read_text(), "summary.json")
    assert json.loads(summary)["steps"] == 40
    assert leftovers(env, pid) == []


# -- usage errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, form", [("-P", "PYTHONSAFEPATH=1"), ("-u", "PYTHONUNBUFFERED=1"),
                                          ("-OO", "PYTHONOPTIMIZE=2"), ("-Wignore", "PYTHONWARNINGS")])
def test_a_python_option_is_refused_naming_its_environment_form(env, option, form):
    res = perfmon(["--headless", "python", option, "demos/loops/crash.py"], env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].endswith(f"use {form} instead (see perfmon --help)"), res.stderr


@pytest.mark.parametrize("args", [
    pytest.param(["--headless", "no_such_script.py"], id="missing_script"),
    pytest.param(["--headless", "-m", "no_such_module_xyz"], id="missing_module"),
    pytest.param(["--headless", "--bogus-option", "demos/loops/crash.py"], id="bad_option"),
    pytest.param(["--headless", "--interval", "abc", "demos/loops/crash.py"], id="bad_value"),
    # argparse's float took these: a NaN --log-interval spun a core, a tiny --sample-interval took half of one
    pytest.param(["--headless", "--interval", "nan", "demos/loops/crash.py"], id="nan_interval"),
    pytest.param(["--headless", "--tensorboard", "--log-interval", "nan", "demos/loops/crash.py"], id="nan_log"),
    pytest.param(["--headless", "--sample-interval", "1e-9", "demos/loops/crash.py"], id="tiny_sampling"),
    pytest.param(["--headless", "--profile-interval", "-3", "demos/loops/crash.py"], id="negative_profile"),
    pytest.param(["--headless", "--peak-tflops", "-1", "demos/loops/crash.py"], id="negative_peak"),
    pytest.param(["--headless", "--python", "/bin/false", "demos/loops/crash.py"], id="not_a_python"),
    pytest.param(["--headless", "demos"], id="directory"),
    pytest.param(["--headless", "python", "-u", "demos/loops/crash.py"], id="python_option"),
])
def test_usage_errors_exit_2_with_one_line(env, tmp_path, args):
    run = tmp_path / "run"
    res = perfmon(["--run-dir", str(run), *args], env)
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("perfmon: error: ") and "Traceback" not in res.stderr
    assert res.stdout == ""
    assert not run.exists(), "a usage error must not leave a run dir behind"


def test_a_script_given_as_the_run_dir_is_named(env):
    """``perfmon --run-dir train.py --epochs 1`` (the folder left out): "unrecognized arguments: --epochs"."""
    res = perfmon(["--headless", "--run-dir", "demos/loops/crash.py", "--epochs", "1"], env)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("perfmon: error: --run-dir takes a folder, and demos/loops/crash.py is a script: "
                                 "perfmon --run-dir DIR demos/loops/crash.py ..."), res.stderr


def test_a_folder_with_a_main_runs_as_under_plain_python(env, tmp_path):
    """``python pkgdir`` runs pkgdir/__main__.py with the folder first on sys.path; perfmon refused the folder."""
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "helper.py").write_text("X = 5\n")
    (tmp_path / "pkgdir" / "__main__.py").write_text(
        "import os, sys\nimport helper\nprint(__name__, sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0], "
        "helper.X)\nsys.exit(3)\n")
    plain = subprocess.run([sys.executable, "pkgdir", "a", "b"], cwd=tmp_path, env=env, capture_output=True, text=True)
    res = perfmon(["--headless", "--run-dir", str(tmp_path / "run"), "pkgdir", "a", "b"], env, cwd=tmp_path)
    assert plain.stdout == f"__main__ ['a', 'b'] pkgdir {tmp_path / 'pkgdir'} 5\n" and plain.returncode == 3
    assert res.stdout == plain.stdout and res.returncode == 3, res.stderr


def test_torchrun_help_says_how_torchrun_mode_is_used(env, tmp_path):
    """``perfmon torchrun --help`` was a usage error ("no training script given")."""
    res = perfmon(["torchrun", "--help"], env, cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.startswith("usage: perfmon [OPTIONS] torchrun [TORCHRUN OPTIONS] SCRIPT") and "torchrun --help" in res.stdout
    assert list(tmp_path.iterdir()) == []  # nothing was run


@pytest.mark.parametrize("how", ["script", "module"])
def test_python_typed_before_the_script_is_the_interpreter(env, tmp_path, how):
    """``perfmon python train.py`` (as one types ``nsys profile python train.py``) runs train.py with that python,
    as ``perfmon train.py`` would; ``perfmon python -m pkg.mod`` runs the module."""
    target = ["dataloader_optimizer.py"] if how == "script" else ["-m", "dataloader_optimizer"]
    run = tmp_path / "run"
    res = perfmon(["--headless", "--run-dir", str(run), sys.executable, *target, "--steps", "5"], env, cwd=LOOPS)
    assert res.returncode == 0, res.stderr
    assert "done steps=5" in res.stdout
    assert report(run, env)["steps"] == 5


def test_report_phase_shares_sum_to_one_despite_rounding(env, tmp_path):
    """A recording whose five shares, each rounded to 6 places, would add up to 1.000002."""
    run = tmp_path / "run"
    run.mkdir()
    fields = ["i", "t", "dur_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "other_ms", "samples"]
    lines = [
        {"v": 1, "type": "hello", "script": "x.py", "argv": ["x.py"], "pid": 1, "start": 1000.0, "seq": 1},
        {"v": 1, "type": "steps", "fields": fields, "rows": [[1, 1001.0, 8.893, 2.9124, 0.423, 0.7241, 1.8916, 2.9419, 8]],
         "seq": 2},
        {"v": 1, "type": "event", "kind": "exit", "t": 1001.5, "code": 0, "signal": None, "exception": None, "seq": 3},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    rep = report(run, env)
    assert rep["steps"] == 1
    assert abs(sum(p["share"] for p in rep["phases"].values()) - 1.0) <= 1e-6, rep["phases"]


def test_reused_run_dir_does_not_mix_two_runs(env, tmp_path):
    run = tmp_path / "run"
    first = headless(run, "demos/custom_loop.py", "--steps", "5", "--batch-size", "8", env=env)
    assert first.returncode == 0, first.stderr
    second = headless(run, "demos/custom_loop.py", "--steps", "7", "--batch-size", "8", env=env)
    if second.returncode == 2:  # refusing to overwrite a recording is fine too, in one line
        assert len(second.stderr.splitlines()) == 1 and report(run, env)["steps"] == 5
        return
    assert second.returncode == 0, second.stderr
    assert "done steps=5" not in second.stdout, "the previous run's output was replayed"
    rep = report(run, env)
    assert rep["steps"] == 7 and rep["argv"][-3:] == ["7", "--batch-size", "8"]


def test_without_a_terminal_perfmon_runs_headless_and_ends_with_the_job(env, tmp_path):
    """cron / nohup / CI: no TTY, no --headless: no dashboard waiting forever, the job's exit status."""
    res = perfmon(["--run-dir", str(tmp_path / "run"), "demos/loops/exit_code.py"], env)
    assert res.returncode == 3, res.stderr
    assert "no terminal" in res.stderr and "running headless" in res.stderr
    assert "perfmon summary" in res.stderr
    again = perfmon(["--run-dir", str(tmp_path / "run"), "demos/loops/exit_code.py"], env)
    assert again.returncode == 2  # refused: one line, no word about how it would have run
    assert again.stderr.splitlines() == [f"perfmon: error: run dir {tmp_path / 'run'} already holds a recording; "
                                         "choose another --run-dir"]


def test_syntax_error_is_one_status_line_and_no_step_table(env, tmp_path):
    script = tmp_path / "syn.py"
    script.write_text("import torch\nx = (\n")
    run = tmp_path / "run"
    res = headless(run, str(script), env=env)
    assert res.returncode == 1
    status = [line for line in res.stderr.splitlines() if line.strip().startswith("status")]
    assert status == ["  status    failed: SyntaxError (syn.py line 2)"], res.stderr
    # it ended before a step could be: no hint about custom loops
    assert "no training steps: the script ended (failed: SyntaxError (syn.py line 2)) before its first step" in \
        res.stderr and "custom loop" not in res.stderr and "mean ms" not in res.stderr
    assert "SyntaxError: '(' was never closed" in (run / "stderr.log").read_text()  # the full text stays


@pytest.mark.parametrize("source, said", [
    # accelerate launch, a subprocess: the training runs in processes perfmon did not start
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(1)'], check=True)\n",
     "this process never imported torch"),
    ("import torch\nprint(torch.ones(2).sum().item())\n", "a custom loop? mark steps with perfmon.step()"),
])
def test_a_run_without_steps_says_what_may_be_why(env, tmp_path, source, said):
    script = tmp_path / "nosteps.py"
    script.write_text(source)
    run = tmp_path / "run"
    res = headless(run, str(script), env=env)
    assert res.returncode == 0, res.stderr
    assert "no training steps seen" in res.stderr and said in res.stderr
    assert said in perfmon(["report", str(run)], env).stdout


def test_report_accepts_the_recording_file_itself(dl_run, env):
    run, _, rep = dl_run
    assert report(run / "events.jsonl", env) == rep


def test_python_without_perfmon_is_one_line_exit_2(env, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    res = perfmon(["--python", str(bare / "bin" / "python"), str(REPO / "demos/loops/exit_code.py")], env,
                  cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no perfmon installed" in lines[0] and "pip install" in lines[0]


def test_rules_file_reaches_summary_json_report_and_headless_summary(env, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('disabled = ["priority"]\n')
    run = tmp_path / "run"
    res = perfmon(["--headless", "--rules", str(rules), "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                   "--steps", "60"], env)
    assert res.returncode == 0, res.stderr
    assert "priority" not in res.stderr.split("perfmon summary", 1)[1]  # the final summary used the file
    summary = json.loads((run / "summary.json").read_text())
    assert "priority" not in [f["id"] for f in summary["findings"]]
    assert "priority" in [f["id"] for f in report(run, env)["findings"]]  # without --rules: the defaults
    with_rules = json.loads(perfmon(["report", str(run), "--json", "--rules", str(rules)], env).stdout)
    assert "priority" not in [f["id"] for f in with_rules["findings"]]
    rules.write_text('data_warn = "0.2"\n')
    bad = perfmon(["--headless", "--rules", str(rules), "demos/loops/dataloader_optimizer.py"], env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "data_warn wants a number" in bad.stderr
