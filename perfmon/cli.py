"""Command line: argument parsing and dispatch only.

    perfmon [OPTIONS] SCRIPT [ARGS...]       dashboard of a training script
    perfmon [OPTIONS] -m MODULE [ARGS...]    like python -m
    perfmon [OPTIONS] torchrun [TORCHRUN OPTIONS] SCRIPT [ARGS...]   every rank of a torchrun job
    perfmon [OPTIONS] accelerate launch [OPTIONS] SCRIPT [ARGS...]   every process accelerate starts
    perfmon report RUN_DIR [--json]          summary of a recording
    perfmon serve [PID | RUN_DIR]            the dashboard in a browser

Options come before the script; everything after it goes to the script untouched.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from perfmon import __version__, paths

SUBCOMMANDS = ("report", "ls", "attach", "replay", "serve")


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"perfmon: error: {message} (see perfmon --help)\n")


def positive(text: str) -> float:
    """A finite number above 0 (argparse's ``float`` takes "nan", "inf" and "-3": a NaN interval made the
    TensorBoard logger spin a core)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def sampling_period(text: str) -> float:
    """:func:`positive`, at least 0.05 s: a sample costs about a millisecond (``1e-9`` took half a core)."""
    value = positive(text)
    if value < 0.05:
        raise argparse.ArgumentTypeError(f"must be at least 0.05 s, got {text!r}")
    return value


def _run_parser() -> _Parser:
    p = _Parser(
        prog="perfmon",
        description="Live performance monitor for PyTorch training, in the terminal.",
        usage="perfmon [OPTIONS] SCRIPT [ARGS...] | perfmon [OPTIONS] -m MODULE [ARGS...] | "
        "perfmon [OPTIONS] torchrun [TORCHRUN OPTIONS] SCRIPT [ARGS...] | "
        "perfmon [OPTIONS] accelerate launch [ACCELERATE OPTIONS] SCRIPT [ARGS...] | "
        "perfmon report RUN [--json] | perfmon trace PATH [--json] | perfmon ls | perfmon attach [PID|RUN] | "
        "perfmon replay RUN | perfmon serve [PID|RUN]",
        epilog="Options come before the script; everything after the script is passed to it untouched.",
    )
    p.add_argument("--headless", action="store_true", help="no dashboard: script output on stdout, status lines on stderr")
    p.add_argument("--interval", type=positive, default=10.0, metavar="S", help="headless status line period (default 10 s)")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="recording dir (default ./perfmon-runs/<time>-<script>/)")
    p.add_argument("--python", metavar="EXE", help="interpreter for the job (must have perfmon and torch installed)")
    p.add_argument("--sample-interval", type=sampling_period, default=1.0, metavar="S", help="telemetry sampling period (default 1 s)")
    p.add_argument("--profile-every", type=int, metavar="N", help="capture a profiler window every N steps")
    p.add_argument("--profile-interval", type=positive, metavar="S", help="capture a profiler window every S seconds")
    p.add_argument("--profile-schedule", default="1,1,3", metavar="W,U,A",
                   help="profiler window: wait, warmup, active steps (default 1,1,3)")
    p.add_argument("--profile-keep", type=int, default=20, metavar="N",
                   help="traces of periodic windows kept on disk, the newest (default 20; 0: all)")
    p.add_argument("--profile-memory", action="store_true",
                   help="profiler windows also record allocations (the trace's memory view; torch then prints a "
                   "warning line into the script's stderr)")
    p.add_argument("--count-flops", action="store_true", help="count one step's FLOPs at start (for MFU)")
    p.add_argument("--peak-tflops", type=positive, metavar="T", help="device peak TFLOP/s for MFU (default: from a table of GPUs)")
    p.add_argument("--no-window-peaks", action="store_true",
                   help="report allocator peaks since start only (no hidden per-window peak reset; see README)")
    p.add_argument("--rules", type=Path, metavar="FILE", help="rule thresholds to override (TOML, see README)")
    p.add_argument("--prometheus", metavar="[HOST:]PORT",
                   help="serve metrics for Prometheus on PORT (127.0.0.1 unless HOST is given)")
    p.add_argument("--tensorboard", action="store_true", help="log phase timings and findings as TensorBoard scalars "
                   "under RUN/tb/ (needs tensorboard)")
    p.add_argument("--wandb", action="store_true", help="log phase timings and findings into the script's own "
                   "active wandb run")
    p.add_argument("--log-interval", type=positive, default=10.0, metavar="S",
                   help="--tensorboard/--wandb logging period (default 10 s)")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script, like python -m")
    p.add_argument("--version", action="version", version=f"perfmon {__version__}")
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options of perfmon vs the script and its arguments: the first bare word (or -m X) splits them."""
    takes_value = {"--interval", "--run-dir", "--python", "--sample-interval", "--profile-every", "--profile-interval",
                   "--profile-schedule", "--profile-keep", "--peak-tflops", "--rules", "--prometheus", "--log-interval"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if arg.startswith("-m") and len(arg) > 2 and not arg.startswith("--"):
            return argv[: i + 1], argv[i + 1 :]
        if not arg.startswith("-"):
            return argv[:i], argv[i:]
        if arg in takes_value:
            i += 1
        i += 1
    return argv, []


_PYTHON = re.compile(r"python[0-9.]*")


def _is_python(word: str) -> bool:
    """``python``, ``python3.11`` or a path to one: an interpreter typed before the script, not a script."""
    return bool(_PYTHON.fullmatch(os.path.basename(word))) and not (os.path.isfile(word) and not os.access(word, os.X_OK))


def _strip_python(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """``python [-m MODULE] SCRIPT ARGS`` after perfmon's options: that python runs the job (``--python``) and the rest
    is the target. Other python options get a clear error: they have environment-variable forms perfmon passes on."""
    if args.python is None:
        args.python = rest[0]
    rest = rest[1:]
    if rest and rest[0] == "-m" and len(rest) > 1:
        args.module = rest[1]
        return rest[2:]
    if rest and rest[0].startswith("-m") and len(rest[0]) > 2:
        args.module = rest[0][2:]
        return rest[1:]
    if rest and rest[0].startswith("-"):
        form = _ENV_FORMS.get(rest[0][:2] if rest[0][:2] in ("-W", "-X") else rest[0])
        _run_parser().error(f"python option {rest[0]} is not supported after 'python': perfmon runs the script "
                            "itself; use " + (f"{form} instead" if form else "its environment form, where it has "
                                              "one (PYTHONUNBUFFERED=1 for -u, PYTHONSAFEPATH=1 for -P, "
                                              "PYTHONWARNINGS for -W, PYTHONDEVMODE=1 for -X dev, PYTHONOPTIMIZE=1 "
                                              "for -O)"))
    return rest


#: The launchers perfmon follows every worker of, however they are named: their modules and console scripts.
_LAUNCHER_MODULES = {"torch.distributed.run": ["torchrun"], "accelerate.commands.launch": ["accelerate", "launch"]}


def _launcher(module: str | None, rest: list[str]) -> list[str] | None:
    """``-m torch.distributed.run ...``, ``-m accelerate.commands.launch ...``, or a path to the ``torchrun`` or
    ``accelerate`` console script (``perfmon $(which torchrun) ...``), as ``torchrun ...`` or ``accelerate
    launch ...``: perfmon follows the workers, instead of running the launcher itself under the agent (whose
    process trains nothing). None for anything else."""
    if module is not None:
        head = _LAUNCHER_MODULES.get(module)
        return None if head is None else [*head, *rest]
    if not rest or os.sep not in rest[0] or not os.path.isfile(rest[0]) or rest[0].endswith(".py"):
        return None
    name = os.path.basename(rest[0])
    if name == "torchrun" or (name == "accelerate" and rest[1:2] == ["launch"]):
        return [name, *rest[1:]]
    return None


#: python's options that have an environment form perfmon passes on to the job
_ENV_FORMS = {"-u": "PYTHONUNBUFFERED=1", "-W": "PYTHONWARNINGS", "-X": "PYTHONDEVMODE=1 (-X dev) or the PYTHON* "
              "variable of the -X option", "-O": "PYTHONOPTIMIZE=1", "-OO": "PYTHONOPTIMIZE=2",
              "-P": "PYTHONSAFEPATH=1", "-B": "PYTHONDONTWRITEBYTECODE=1", "-b": "PYTHONWARNINGS=default::BytesWarning",
              "-v": "PYTHONVERBOSE=1", "-d": "PYTHONDEBUG=1"}


def _report(argv: list[str]) -> int:
    from perfmon.analysis.report import ReportError, report_main

    p = _Parser(prog="perfmon report", description="Summary of a recorded run.")
    p.add_argument("run_dir", type=Path, help="a run directory (holds events.jsonl), or its events.jsonl")
    p.add_argument("--json", action="store_true", help="machine-readable JSON (schema in README)")
    p.add_argument("--rules", type=Path, metavar="FILE", help="rule thresholds (TOML), as for a run")
    p.add_argument("--write-summary", action="store_true", help="write RUN/summary.json instead of printing")
    p.add_argument("--wait-ranks", type=float, default=0.0, metavar="S",
                   help="a job: first wait up to S seconds for every rank's recording to end")
    args = p.parse_args(argv)
    rules = _load_rules(args.rules)
    if rules is False:
        return 2
    try:
        return report_main(args.run_dir, args.json, rules=rules, write=args.write_summary, wait=args.wait_ranks)
    except ReportError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2


def _load_rules(path: Path | None) -> Any:
    """The --rules file as a Config (None: defaults; False: an error was printed, exit 2)."""
    if path is None:
        return None
    from perfmon.analysis.rules import Config

    try:
        return Config.from_toml(path)
    except (OSError, ValueError, TypeError) as exc:
        print(f"perfmon: error: --rules {path}: {exc}", file=sys.stderr)
        return False


def _metrics(address: str | None) -> Any:
    """The --prometheus endpoint, listening (before the job starts); None without the option; False when it
    cannot start (the line is printed: exit 2)."""
    if address is None:
        return None
    from perfmon.monitor.prometheus import Endpoint, MetricsError

    try:
        endpoint = Endpoint(address)
    except MetricsError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return False
    print(f"perfmon: metrics for Prometheus on {endpoint.url}", file=sys.stderr)
    return endpoint


def _exports(args: argparse.Namespace, run_dir: Path) -> Any:
    """--prometheus, --tensorboard, --wandb of a run, started before the job (None: none asked; False: one
    could not start, its line printed)."""
    items: list[Any] = []
    endpoint = _metrics(args.prometheus)
    if endpoint is False:
        return False
    if endpoint is not None:
        items.append(endpoint)
    if args.tensorboard or args.wandb:
        from perfmon.monitor.loggers import LoggerError, ScalarLoggers

        try:
            items.append(ScalarLoggers(Path(run_dir), tensorboard=args.tensorboard, wandb=args.wandb,
                                       interval=args.log_interval))
        except LoggerError as exc:
            print(f"perfmon: error: {exc}", file=sys.stderr)
            if endpoint is not None:
                endpoint.close()
            return False
    if not items:
        return None
    from perfmon.monitor.exports import Exports

    return Exports(items)


def _agent_env(args: argparse.Namespace) -> dict[str, str]:
    """Settings for the agent, passed through its environment."""
    sched = args.profile_schedule.split(",")
    if len(sched) != 3 or not all(x.strip().isdigit() for x in sched) or int(sched[2]) < 1:
        _run_parser().error(f"--profile-schedule wants WAIT,WARMUP,ACTIVE (ACTIVE >= 1), got {args.profile_schedule!r}")
    if int(sched[1]) == 0:
        print("perfmon: --profile-schedule with no warm-up step: the first active step of each window also pays "
              "the profiler's start-up, which skews it", file=sys.stderr)
    if args.profile_every is not None and args.profile_every < 1:
        _run_parser().error("--profile-every must be >= 1")
    env = {paths.SAMPLE_INTERVAL_ENV: str(args.sample_interval), "PERFMON_PROFILE_SCHEDULE": args.profile_schedule}
    if args.profile_every:
        env["PERFMON_PROFILE_EVERY"] = str(args.profile_every)
    if args.profile_interval:
        env["PERFMON_PROFILE_INTERVAL"] = str(args.profile_interval)
    if args.count_flops:
        env["PERFMON_COUNT_FLOPS"] = "1"
    if args.profile_memory:
        env["PERFMON_PROFILE_MEMORY"] = "1"
    if args.profile_keep < 0:
        _run_parser().error("--profile-keep must be >= 0 (0 keeps every trace)")
    env["PERFMON_PROFILE_KEEP"] = str(args.profile_keep)
    if args.peak_tflops:
        env["PERFMON_PEAK_TFLOPS"] = str(args.peak_tflops)
    if args.no_window_peaks:
        env["PERFMON_WINDOW_PEAKS"] = "0"
    return env


def _ls(argv: list[str]) -> int:
    from perfmon.monitor.discovery import group_jobs, live_runs
    from perfmon.recording import last_step

    p = _Parser(prog="perfmon ls", description="Live perfmon runs on this machine.")
    p.add_argument("--json", action="store_true", help="machine-readable: a JSON list, an object per run")
    args = p.parse_args(argv)
    runs = live_runs()
    for run in runs:  # how far each is: from its recording, which the job writes anyway
        steps = last_step(Path(run["run_dir"])) if isinstance(run.get("run_dir"), str) else None
        if steps is not None:
            run["steps"] = steps
    runs = group_jobs(runs)
    if args.json:
        import json

        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print("no live perfmon runs")
        return 0
    import time

    print(f"{'PID':>8}  {'STARTED':<19}  {'STEPS':>8}  {'MONITORS':>8}  SCRIPT / RUN DIR")
    for r in runs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("start") or 0))
        status = _status_of(r)
        print(f"{r['pid']:>8}  {started:<19}  {status.get('steps', '?'):>8}  {status.get('monitors', '?'):>8}  "
              f"{' '.join(r.get('argv') or [str(r.get('script'))])}\n{'':>51}{r.get('run_dir')}")
        if r.get("ranks"):
            ranks = r["ranks"]
            world = r.get("world_size") or "?"
            print(f"{'':>51}job of {len(ranks)}/{world} rank{'' if world == 1 else 's'} on this machine: " + ", ".join(
                f"rank {k.get('rank')} pid {k.get('pid')} step {k.get('steps', '?')}" for k in ranks))
    return 0


def _status_of(run: dict) -> dict:
    """Steps and attached monitors: monitors from the discovery file (the agent rewrites it when one comes or
    goes), steps from the recording, read from its end (:func:`perfmon.recording.last_step`; 0 before the first)."""
    return {"monitors": run.get("monitors", "?"), "steps": run["steps"] if isinstance(run.get("steps"), int) else 0}


def _remove_if_empty(run_dir: Path) -> None:
    try:
        run_dir.rmdir()
    except OSError:
        pass


def _attach(argv: list[str]) -> int:
    from perfmon.monitor.discovery import AttachError, find_run
    from perfmon.monitor.sources import LiveSource

    p = _Parser(prog="perfmon attach", description="Watch a running job: back-fill from its recording, then live.")
    p.add_argument("target", nargs="?", help="pid or run dir (default: the only live run)")
    p.add_argument("--prometheus", metavar="[HOST:]PORT", help="also serve metrics for Prometheus")
    args = p.parse_args(argv)
    metrics = _metrics(args.prometheus)
    if metrics is False:
        return 2
    try:
        run = find_run(args.target)
        if not _has_terminal():  # Textual would draw into a file or pipe, never read a key, and never end
            print(f"perfmon: error: perfmon attach draws the dashboard, and there is no terminal here (stdin and "
                  f"stdout must be one); for the numbers so far: perfmon report {run['run_dir']}", file=sys.stderr)
            return 2
        if run.get("ranks"):
            return _attach_job(run, metrics)
        source = LiveSource(Path(run["socket"]), Path(run["run_dir"]))
        source.connect()
    except AttachError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"perfmon: error: cannot connect to pid {run['pid']}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    from perfmon.analysis.state import RunState
    from perfmon.tui.app import PerfmonApp

    app = PerfmonApp(RunState(), source, Path(run["run_dir"]))
    if metrics is not None:
        metrics.watch(app.lock, lambda: app.state)
    app.run()
    source.close()
    outcome = getattr(app, "outcome", "")
    if outcome == "detached":
        print(f"perfmon: detached; training continues as pid {run['pid']}\n"
              f"  come back: perfmon attach {run['pid']}", file=sys.stderr)
    elif outcome == "stopped" and paths.ignores_signal(int(run["pid"]), signal.SIGINT):
        # not 30 s of waiting, then "the script may catch KeyboardInterrupt"
        print(f"perfmon: pid {run['pid']} ignores SIGINT, as a job started in the background (cmd &) by a script or "
              f"a non-interactive shell does: Ctrl-C cannot stop it, nor can this; kill {run['pid']} (SIGTERM) ends it",
              file=sys.stderr)
    elif outcome == "stopped":
        print(f"perfmon: SIGINT sent to pid {run['pid']} through its agent (like Ctrl-C); waiting for it to end "
              f"(Ctrl-C stops waiting)", file=sys.stderr, flush=True)
        print(_after_stop(int(run["pid"]), Path(run["run_dir"])), file=sys.stderr)
    elif outcome == "quit":  # the job ended while attached: how, as a stop would say it
        print(_after_stop(int(run["pid"]), Path(run["run_dir"]), wait_s=5.0, asked=False), file=sys.stderr)
    return 0


#: how long ``perfmon attach`` waits for a job it stopped to end before it says so and leaves it
STOP_WAIT_S = 30.0


def _after_stop(pid: int, run_dir: Path, wait_s: float = STOP_WAIT_S, asked: bool = True) -> str:
    """Wait (at most ``wait_s``) for a job stopped from an attached dashboard (``asked``; else one that ended while
    it was attached) to end; say how it ended, as its recording has it, or that it runs on (a script may catch
    KeyboardInterrupt, save and go on)."""
    from perfmon.analysis.report import load_recording

    deadline = time.monotonic() + wait_s
    try:
        while paths.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    if paths.pid_alive(pid) and not asked:
        return f"perfmon: pid {pid} is finishing (its exit is recorded); perfmon report {run_dir}"
    if paths.pid_alive(pid):
        return (f"perfmon: pid {pid} still runs after the SIGINT (the script may catch KeyboardInterrupt); "
                f"perfmon attach {pid} to follow it, kill {pid} to end it")
    try:
        state = load_recording(run_dir)
    except Exception:  # noqa: BLE001 - a recording gone or unreadable: the job's end is still worth saying
        return f"perfmon: pid {pid} ended"
    how = state.status if state.exit or state.execed else "no exit recorded"
    return f"perfmon: pid {pid} ended ({how}) after {state.steps} steps; perfmon report {run_dir}"


def _attach_job(run: dict, metrics: Any = None) -> int:
    """Attach to every rank of a live job (its ranks on this machine; their recordings for the rest)."""
    from perfmon.analysis.job import JobState
    from perfmon.analysis.state import RunState
    from perfmon.monitor.discovery import job_alive
    from perfmon.monitor.job_source import JobSource
    from perfmon.tui.app import PerfmonApp

    job_dir = Path(run["job_dir"])
    source = JobSource(job_dir, alive=lambda: job_alive(job_dir), follow=True)
    app = PerfmonApp(RunState(), source, job_dir, job=JobState())
    if metrics is not None:
        metrics.watch(app.lock, job=app.job)
    app.run()
    source.close()
    if getattr(app, "outcome", "") == "detached":
        print(f"perfmon: detached; the job continues\n  come back: perfmon attach {job_dir}", file=sys.stderr)
    return 0


def _speed(text: str) -> float:
    """A replay speed: what its keys reach (1x to 3600x); 0, a negative speed or nan froze or crashed the replay."""
    try:
        speed = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= speed <= 3600:  # nan fails both
        raise argparse.ArgumentTypeError(f"{text} is out of range: 1 to 3600 (x real time)")
    return speed


def _replay(argv: list[str]) -> int:
    from perfmon.analysis.report import ReportError, load_recording, run_dir_of, spawned_job_of
    from perfmon.monitor.sources import PacedReplaySource

    p = _Parser(prog="perfmon replay", description="The dashboard over a recording, played back in time "
                "(space pause, + - speed, [ start, ] end).")
    p.add_argument("run_dir", type=Path, help="a run directory (holds events.jsonl), or its events.jsonl")
    p.add_argument("--speed", type=_speed, default=60.0, help="playback speed, x real time, 1 to 3600 (default 60)")
    args = p.parse_args(argv)
    from perfmon.analysis.job import is_job_dir

    if not _has_terminal():  # Textual would draw into a file or pipe, never read a key, and spin a core forever
        print(f"perfmon: error: perfmon replay draws the dashboard, and there is no terminal here (stdin and stdout "
              f"must be one); for the numbers: perfmon report {args.run_dir}", file=sys.stderr)
        return 2
    if (ranks := spawned_job_of(run_dir_of(args.run_dir))) is not None:
        args.run_dir = ranks  # a script that spawned its ranks: replay their job
    if is_job_dir(args.run_dir):
        return _replay_job(args.run_dir)
    try:
        args.run_dir = run_dir_of(args.run_dir)
        load_recording(args.run_dir)  # one clear line for a bad dir before the screen opens
    except ReportError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    from perfmon.analysis.state import RunState
    from perfmon.tui.app import PerfmonApp

    PerfmonApp(RunState(), PacedReplaySource(args.run_dir, speed=args.speed), args.run_dir).run()
    return 0


def _serve(argv: list[str]) -> int:
    from perfmon.monitor.serve import ServeError, make_server

    p = _Parser(prog="perfmon serve", description="The dashboard in a browser (textual-serve): a live run or "
                "job (pid or run dir; default: the only live run) or a recording.")
    p.add_argument("target", nargs="?", help="pid or run dir (default: the only live run)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--token", help="the token every request must carry, on loopback too (default: a random one; "
                   "at least 12 characters)")
    p.add_argument("--prometheus", metavar="[HOST:]PORT", help="also serve metrics for Prometheus")
    args = p.parse_args(argv)
    try:
        server = make_server(args.target, args.host or "127.0.0.1", args.port, args.token,
                             host_given=args.host is not None)
    except ServeError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    follower = _follow_for_metrics(args.target, args.prometheus)
    if follower is False:
        return 2
    try:
        server.serve()
    finally:
        if follower is not None:
            follower.close()
    return 0


def _follow_for_metrics(target: str | None, address: str | None) -> Any:
    """``--prometheus`` beside ``serve``/``attach``: a headless follower of the run feeding the endpoint (None
    without the option; False: an error was printed)."""
    if address is None:
        return None
    endpoint = _metrics(address)
    if endpoint is False:
        return False
    from perfmon.monitor.follow import follow_for_metrics

    try:
        return follow_for_metrics(target, endpoint)
    except Exception as exc:  # noqa: BLE001 - nothing to follow: say so in one line
        endpoint.close()
        print(f"perfmon: error: --prometheus: {exc}", file=sys.stderr)
        return False


def _replay_job(run_dir: Path) -> int:
    """A job's recordings, every rank, read whole (no paced playback across ranks)."""
    from perfmon.analysis.job import JobState, load_job
    from perfmon.analysis.report import ReportError
    from perfmon.analysis.state import RunState
    from perfmon.monitor.job_source import JobSource
    from perfmon.tui.app import PerfmonApp

    try:
        load_job(run_dir)
    except ReportError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    PerfmonApp(RunState(), JobSource(run_dir, follow=False), run_dir, job=JobState()).run()
    return 0


def _has_terminal() -> bool:
    """A dashboard needs a terminal to draw on and to read keys from (cron, nohup, CI and pipes have none), or a
    Textual driver of its own: ``perfmon serve`` runs each browser tab's dashboard with the web driver, on pipes."""
    if os.environ.get("TEXTUAL_DRIVER"):
        return True
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def _closed_streams_to_devnull() -> None:
    """``perfmon ... >&-``: python leaves ``sys.stdout`` None for a closed fd 1, and perfmon (which writes there:
    the script's output, its summary) died of it, leaving the job to run on without it. A closed standard stream
    becomes /dev/null, where plain python's prints to it go nowhere too."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 - the process's own stream


def main(argv: list[str] | None = None) -> int:
    """Entry point; a closed pipe (``perfmon report RUN | head``) ends quietly."""
    _closed_streams_to_devnull()
    try:
        return _main(argv)
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return _report(argv[1:])
    if argv and argv[0] == "trace":
        from perfmon.analysis.trace import main as trace_main

        return trace_main(argv[1:])
    if argv and argv[0] in ("ls", "attach", "replay", "serve"):
        return {"ls": _ls, "attach": _attach, "replay": _replay, "serve": _serve}[argv[0]](argv[1:])
    opts, rest = _split(argv)
    if "--run-dir" in opts[:-1] and (word := opts[opts.index("--run-dir") + 1]).endswith(".py") and os.path.isfile(word):
        # the folder left out: argparse would say "unrecognized arguments" of the script's own options
        _run_parser().error(f"--run-dir takes a folder, and {word} is a script: perfmon --run-dir DIR {word} ...")
    args = _run_parser().parse_args(opts)
    if args.module is None and rest and _is_python(rest[0]):
        rest = _strip_python(args, rest)  # `perfmon python train.py`, as one types `nsys profile python train.py`
    if args.module is None and not rest:
        _run_parser().error("no script given")
    if args.module is not None and not args.module.strip():
        _run_parser().error("-m needs a module name")
    from perfmon.monitor.launch import LaunchError, Target, TrainingProcess, check_target, same_destination
    from perfmon.paths import default_run_dir

    launcher = _launcher(args.module, rest)
    if launcher is not None:
        args.module, rest = None, launcher
    if args.module is None and rest[0] == "torchrun":
        if rest[1:2] in (["-h"], ["--help"]):
            from perfmon.agent.torchrun import HELP

            print(HELP)
            return 0
        target = Target(script=None, module=None, args=rest[1:], launcher="torchrun")
    elif args.module is None and rest[0] == "accelerate":
        if rest[1:2] in (["-h"], ["--help"]) or rest[1:3] in (["launch", "-h"], ["launch", "--help"]):
            from perfmon.agent.accelerate_launch import HELP

            print(HELP)
            return 0
        target = Target(script=None, module=None, args=rest[1:], launcher="accelerate")
    else:
        target = Target(script=None if args.module else rest[0], module=args.module,
                        args=rest if args.module else rest[1:])
    env = _agent_env(args)
    rules = _load_rules(args.rules)
    if rules is False:
        return 2
    if args.rules is not None:
        env["PERFMON_RULES"] = str(Path(args.rules).resolve())  # for a summary.json written after a detach
    try:
        check_target(target, args.python)
    except LaunchError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    # a default name is claimed (made, atomically): two launches in one second never share a run dir
    try:
        run_dir = args.run_dir or default_run_dir(target.name, claim=True)
    except OSError as exc:  # a cwd the default ./perfmon-runs cannot be made in (read-only, someone else's)
        print(f"perfmon: error: cannot create run dir {Path.cwd() / 'perfmon-runs'}: {exc.strerror or exc}; "
              "choose one with --run-dir", file=sys.stderr)
        return 2
    exports = _exports(args, run_dir)
    if exports is False:
        if not args.run_dir:
            _remove_if_empty(run_dir)
        return 2
    no_terminal = not args.headless and not _has_terminal()
    args.headless = args.headless or no_terminal
    try:
        proc = TrainingProcess(target, run_dir, args.python, env, inherit_stdin=args.headless,
                               combined_output=same_destination()).start()
    except LaunchError as exc:
        print(f"perfmon: error: {exc}", file=sys.stderr)
        return 2
    if no_terminal:  # said once the job runs (a run dir refused is one line alone)
        print("perfmon: no terminal (stdin/stdout is not a TTY): running headless; script output on stdout, "
              "status on stderr (--headless says so explicitly)", file=sys.stderr)
    if args.headless and target.ranked:
        from perfmon.monitor.job_run import run_headless_job

        return run_headless_job(proc, args.interval, rules=rules, exports=exports)
    if args.headless:
        from perfmon.monitor.headless import run_headless

        return run_headless(proc, args.interval, rules=rules, exports=exports)
    from perfmon.monitor.dashboard import run_dashboard

    return run_dashboard(proc, rules, exports)


def entry() -> NoReturn:
    """The ``perfmon`` command: ends as the job ended, of its signal where one killed it."""
    from perfmon.monitor.exit_like import exit_like

    exit_like(main())


if __name__ == "__main__":
    entry()
