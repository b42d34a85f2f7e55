"""A runtime dir that is not safely ours (a symlink, another user's, writable by others) is never used.

The launcher says so in one line on stderr and goes on: the job runs under a private runtime dir of
its own (so this monitor still talks to it live) and records to its run dir as always.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfmon import paths
from perfmon.monitor import discovery
from perfmon.monitor.launch import Target, TrainingProcess

ROOT = Path(__file__).resolve().parent.parent
CONSOLE = Path(sys.executable).with_name("perfmon")
PERFMON = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "perfmon.cli"]
OTHER_UID = 54321  # no such user needed: chown takes any number
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir to another user needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A short private dir to build runtime dirs in (Unix socket paths are limited to ~107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="pm-rt-"))
    yield d
    subprocess.run(["chmod", "-R", "u+rwx", str(d)], check=False)
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _symlink(base: Path) -> Path:
    target = base / "target"
    target.mkdir(mode=0o700)
    (base / "rt").symlink_to(target)
    return base / "rt"


def _too_long(base: Path) -> Path:
    """A dir (not made yet) whose sockets' paths would not fit a Unix socket address."""
    return base / ("x" * 100)


def _wide(base: Path) -> Path:
    rt = base / "rt"
    rt.mkdir()
    rt.chmod(0o777)
    return rt


def _foreign(base: Path) -> Path:
    rt = base / "rt"
    rt.mkdir(mode=0o700)
    os.chown(rt, OTHER_UID, OTHER_UID)
    return rt


# -- paths.runtime_dir ---------------------------------------------------------------------------
def test_missing_dir_is_created_private(base, monkeypatch):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(base / "a" / "rt"))
    rt = paths.runtime_dir()
    st = rt.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def test_default_is_per_user_under_tmp(monkeypatch):
    monkeypatch.delenv("PERFMON_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert paths.configured_runtime_dir() == Path(f"/tmp/perfmon-{os.getuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert paths.configured_runtime_dir() == Path("/run/user/1000/perfmon")


def test_symlink_is_refused_and_never_followed(base, monkeypatch):
    rt = _symlink(base)
    (base / "target").chmod(0o755)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    for create in (True, False):
        with pytest.raises(paths.RuntimeDirError, match="is a symlink"):
            paths.runtime_dir(create=create)
    with pytest.raises(paths.RuntimeDirError):
        paths.socket_path(123)
    assert stat.S_IMODE((base / "target").stat().st_mode) == 0o755  # not chmod'ed through the link
    assert list((base / "target").iterdir()) == []


def test_dangling_symlink_is_refused_and_nothing_is_created_at_its_target(base, monkeypatch):
    (base / "rt").symlink_to(base / "nowhere")
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(base / "rt"))
    with pytest.raises(paths.RuntimeDirError, match="is a symlink"):
        paths.runtime_dir()
    assert not (base / "nowhere").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o702])
def test_dir_others_can_write_is_refused_and_left_as_it_is(base, monkeypatch, mode):
    rt = base / "rt"
    rt.mkdir()
    rt.chmod(mode)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    with pytest.raises(paths.RuntimeDirError, match=f"has mode {mode:04o}"):
        paths.runtime_dir()
    assert stat.S_IMODE(rt.stat().st_mode) == mode


def test_own_dir_others_can_only_read_is_made_private(base, monkeypatch):
    rt = base / "rt"
    rt.mkdir()
    rt.chmod(0o755)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    assert paths.runtime_dir() == rt
    assert stat.S_IMODE(rt.stat().st_mode) == 0o700


def test_a_file_in_the_way_is_refused(base, monkeypatch):
    (base / "rt").write_text("")
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(base / "rt"))
    with pytest.raises(paths.RuntimeDirError, match="is not a directory"):
        paths.runtime_dir()


def test_dir_that_cannot_be_created_is_an_error_not_a_traceback(base, monkeypatch):
    (base / "file").write_text("")
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(base / "file" / "rt"))
    with pytest.raises(paths.RuntimeDirError, match="cannot be created"):
        paths.runtime_dir()


@as_root
def test_dir_of_another_user_is_refused(base, monkeypatch):
    rt = _foreign(base)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    with pytest.raises(paths.RuntimeDirError, match=f"is owned by uid {OTHER_UID}"):
        paths.runtime_dir()
    assert rt.stat().st_uid == OTHER_UID


def test_the_line_says_what_is_wrong_and_the_fix(base, monkeypatch):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(_wide(base)))
    with pytest.raises(paths.RuntimeDirError) as info:
        paths.runtime_dir()
    line = paths.unusable_line(info.value, "live attach disabled")
    assert line == (f"perfmon: runtime dir {base / 'rt'} has mode 0777 (others can write to it): not using it; "
                    "live attach disabled (set PERFMON_RUNTIME_DIR to a private dir)")


def test_a_dir_too_long_for_a_socket_says_so_and_is_not_made(base, monkeypatch):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(_too_long(base)))
    with pytest.raises(paths.RuntimeDirError) as info:
        paths.runtime_dir()
    assert "is too long for a socket's path" in str(info.value)
    assert "shorter path" in paths.unusable_line(info.value, "live attach disabled")
    assert not _too_long(base).exists()


# -- discovery ----------------------------------------------------------------------------------
def test_ls_and_attach_do_not_read_an_unsafe_dir(base, monkeypatch, capsys):
    rt = _wide(base)
    (rt / "1.json").write_text(json.dumps({"pid": os.getpid(), "socket": str(rt / "1.sock"), "run_dir": "/x"}))
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    assert discovery.live_runs() == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"perfmon: runtime dir {rt} has mode 0777")
    with pytest.raises(discovery.AttachError):
        discovery.find_run(None)
    assert (rt / "1.json").exists()  # not ours to clean up either


@pytest.mark.parametrize("record", [
    {"start": "now"},  # perfmon ls: time.localtime(str)
    {"run_dir": 7},  # perfmon attach: Path(7)
    {"argv": "train.py"},
    [1, 2],
])
def test_a_discovery_file_with_wrong_types_is_left_out_not_a_traceback(tmp_path, monkeypatch, record):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    good = {"pid": os.getpid(), "socket": str(rt / "2.sock"), "run_dir": str(tmp_path / "run"), "start": 1.0,
            "argv": ["train.py"]}
    bad = {**good, **record} if isinstance(record, dict) else record
    (rt / "1.json").write_text(json.dumps(bad))
    (rt / "2.json").write_text(json.dumps(good))
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    assert discovery.live_runs() == [good]


# -- the launcher --------------------------------------------------------------------------------
def test_launcher_gives_the_job_a_private_dir_and_removes_it(base, tmp_path, monkeypatch, capsys):
    rt = _symlink(base)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(rt))
    script = tmp_path / "job.py"
    script.write_text("import os\nprint(os.environ['PERFMON_RUNTIME_DIR'])\n")
    monkeypatch.chdir(ROOT)  # the job imports perfmon from here
    proc = TrainingProcess(Target(str(script), None), tmp_path / "run").start()
    private = proc.runtime_dir
    assert private is not None and private != rt and not private.is_symlink()
    st = private.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert proc.socket_path.parent == private
    assert proc.wait() == 0
    assert not private.exists()
    assert (tmp_path / "run" / "output.log").read_text().strip().splitlines()[-1] == str(private)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a symlink" in err and "not using it" in err
    assert list((base / "target").iterdir()) == []


def test_a_tmpdir_too_long_for_a_socket_gives_a_private_dir_under_tmp(base, tmp_path, monkeypatch):
    """The private dir was made under $TMPDIR whatever its length: with a long one the job's socket could not be
    made, and the monitor lost the live view."""
    long_tmp = _too_long(base)
    long_tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))  # as $TMPDIR would (tempfile reads it once)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(_symlink(base)))
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    monkeypatch.chdir(ROOT)
    proc = TrainingProcess(Target(str(script), None), tmp_path / "run").start()
    private = proc.runtime_dir
    assert private is not None and private.parent == Path("/tmp") and paths.socket_overflow(private) is None
    assert proc.wait() == 0
    assert not private.exists() and list(long_tmp.iterdir()) == []  # the one too long was removed at once


# -- end to end -------------------------------------------------------------------------------
def _steps_recorded(run: Path) -> int:
    n = 0
    for line in (run / "events.jsonl").read_text().splitlines():
        msg = json.loads(line)
        if msg.get("type") == "steps":
            n += len(msg["rows"])
    return n


@pytest.mark.e2e
@pytest.mark.parametrize("make, problem", [
    pytest.param(_symlink, "is a symlink", id="symlink"),
    pytest.param(_wide, "has mode 0777", id="mode-0777"),
    pytest.param(_too_long, "is too long for a socket's path", id="too-long"),
    pytest.param(_foreign, f"is owned by uid {OTHER_UID}", id="foreign-owner", marks=as_root),
])
def test_headless_run_under_an_unsafe_runtime_dir(base, tmp_path, make, problem):
    rt = make(base)
    before = sorted(p.name for p in base.rglob("*"))
    run = tmp_path / "run"
    env = dict(os.environ, PERFMON_RUNTIME_DIR=str(rt))
    res = subprocess.run([*PERFMON, "--headless", "--run-dir", str(run), "demos/loops/dataloader_optimizer.py",
                          "--steps", "5"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("perfmon: ")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"perfmon: runtime dir {rt} {problem}") and "not using it" in lines[0]
    assert "PERFMON_RUNTIME_DIR" in lines[0]
    assert "Traceback" not in res.stderr and "Traceback" not in (run / "stderr.log").read_text()
    assert "[perfmon] warning" not in res.stderr  # the agent had a safe dir: no socket error either
    assert _steps_recorded(run) == 5
    assert sorted(p.name for p in base.rglob("*")) == before  # nothing created in or through the unsafe dir


def test_a_script_whose_spawned_ranks_are_live_is_attached_as_their_job(tmp_path, monkeypatch):
    """`perfmon attach` with the script's pid or run dir, or alone, reaches the job of the ranks the script spawned
    itself (RUN/ranks/rank-K), not the script's own process, which trains nothing."""
    run = tmp_path / "run"
    parent = {"pid": 100, "run_dir": str(run), "steps": 0}
    ranks = [{"pid": 101 + k, "rank": k, "run_dir": str(run / "ranks" / f"rank-{k}"), "job_dir": str(run / "ranks"),
              "steps": 50} for k in range(2)]
    monkeypatch.setattr(discovery, "live_runs", lambda: [parent, *ranks])
    for target in ("100", str(run), None, "102"):
        found = discovery.find_run(target)
        assert found.get("job_dir") == str(run / "ranks") and [r["pid"] for r in found["ranks"]] == [101, 102]
    other = {"pid": 200, "run_dir": str(tmp_path / "other"), "steps": 5}
    monkeypatch.setattr(discovery, "live_runs", lambda: [parent, other])  # no ranks live: each is itself
    assert discovery.find_run("100") is parent and discovery.find_run("200") is other


def test_the_pid_of_the_process_that_started_a_run_names_that_run(tmp_path, monkeypatch):
    """`perfmon --headless train.py &` then `perfmon attach $!`: $! is perfmon's launcher, whose job is its child;
    it said "pid N is not a perfmon run"."""
    import psutil

    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        proc = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 30
        while not proc.children() and time.monotonic() < deadline:
            time.sleep(0.02)
        job = {"pid": proc.children()[0].pid, "run_dir": str(tmp_path / "run"), "steps": 3}
        monkeypatch.setattr(discovery, "live_runs", lambda: [job])
        assert discovery.find_run(str(launcher.pid)) is job
        monkeypatch.setattr(discovery, "live_runs", lambda: [])
        with pytest.raises(discovery.AttachError, match="is not a perfmon run"):
            discovery.find_run(str(launcher.pid))
    finally:
        for child in psutil.Process(launcher.pid).children():
            child.kill()
        launcher.kill()
        launcher.wait()


def test_spawned_ranks_are_followed_once_one_of_them_steps(tmp_path):
    from perfmon.analysis.job import STEPPING_TAIL, ranks_stepping

    job = tmp_path / "ranks"
    assert not ranks_stepping(job)  # nothing there yet (or a start that failed)
    (job / "rank-0").mkdir(parents=True)
    (job / "rank-1").mkdir()
    sample = b'{"seq":1,"v":1,"type":"sample","t":1.0}\n'
    (job / "rank-0" / "events.jsonl").write_bytes(b'{"seq":0,"v":1,"type":"hello"}\n' + sample * 10)
    outside = b'{"seq":2,"v":1,"type":"steps","fields":[],"rows":[],"outside":{"checkpoint_ms":3.0}}\n'
    (job / "rank-0" / "events.jsonl").write_bytes(b'{"seq":0,"v":1,"type":"hello"}\n' + sample * 10 + outside)
    assert not ranks_stepping(job)  # processes spawned to preprocess: readings and time outside steps, no step
    steps = b'{"seq":2,"v":1,"type":"steps","fields":[],"rows":[[1]]}\n'
    (job / "rank-1" / "events.jsonl").write_bytes(sample * (STEPPING_TAIL // len(sample)) + steps + sample * 100)
    assert ranks_stepping(job)


def test_two_launches_into_one_run_dir_at_once_leave_it_to_the_first(tmp_path):
    """Both found no recording there yet and went ahead, mixing their output, recordings and summaries."""
    from perfmon import paths
    from perfmon.monitor.launch import LaunchError, Target, TrainingProcess

    script = tmp_path / "quick.py"
    script.write_text("print('hi')\n")
    run = tmp_path / "run"
    run.mkdir()
    first = TrainingProcess(Target(str(script), None), run)
    first._lock_run_dir()  # the first launch, between its check for a recording and its agent's first line
    with pytest.raises(LaunchError, match="is in use by another perfmon launch"):
        TrainingProcess(Target(str(script), None), run).start()
    assert not (run / paths.OUTPUT_LOG).exists()  # the second wrote nothing there
    (tmp_path / "other").mkdir()
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                             "from perfmon.monitor.launch import Target, TrainingProcess; "
                             "TrainingProcess(Target('x.py', None), Path(sys.argv[1]))._lock_run_dir(); "
                             "print('held', flush=True); time.sleep(60)", str(tmp_path / "other")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline() == "held\n"
        with pytest.raises(LaunchError, match="in use"):  # another process's launch holds it
            TrainingProcess(Target(str(script), None), tmp_path / "other").start()
    finally:
        held.kill()  # a launcher killed: the kernel lets go of its lock, nothing stale is left
        held.wait()
    proc = TrainingProcess(Target(str(script), None), tmp_path / "other").start()
    assert proc.wait() == 0


def test_default_run_dirs_chosen_in_one_second_are_each_their_own(tmp_path):
    from perfmon.paths import default_run_dir

    first = default_run_dir("train.py", root=tmp_path, now=1e9, claim=True)
    second = default_run_dir("train.py", root=tmp_path, now=1e9, claim=True)
    assert first != second and first.is_dir() and second.is_dir() and second.name == first.name + "-2"


def test_a_job_that_ignores_sigint_is_told_apart():
    """A job started in the background by a script (`perfmon --headless train.py &`) ignores SIGINT: stopping it
    from an attached dashboard waited 30 s, then blamed the script for catching KeyboardInterrupt."""
    import signal

    ignoring = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                                 "signal.SIG_IGN); print(1, flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import sys; print(1, flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert ignoring.stdout.readline() == plain.stdout.readline() == b"1\n"  # both past their setup
        assert paths.ignores_signal(ignoring.pid, signal.SIGINT)
        assert not paths.ignores_signal(plain.pid, signal.SIGINT) and not paths.ignores_signal(2**22 + 7, 2)
    finally:
        for p in (ignoring, plain):
            p.kill()
            p.communicate()  # and closes its pipes
