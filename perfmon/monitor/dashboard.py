"""The dashboard run: start watching a launched job, then hand its outcome back to the shell."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from perfmon import paths
from perfmon.analysis.report import format_summary
from perfmon.analysis.rules import Config
from perfmon.analysis.state import RunState
from perfmon.monitor.exit_like import exit_status
from perfmon.monitor.launch import (
    SUMMARY_FAILED,
    TrainingProcess,
    finalize_recording,
    print_summary,
    signals_to,
    stdin_hint,
)
from perfmon.monitor.left_in_terminal import print_output_tail
from perfmon.monitor.sources import connect


def _early_exit(proc: TrainingProcess) -> int:
    """The job ended before the agent listened: show its stdout and stderr (each on ours) and pass its status on."""
    returncode = proc.wait()
    for name, stream in ((paths.OUTPUT_LOG, sys.stdout), (paths.STDERR_LOG, sys.stderr)):
        try:
            stream.write((proc.run_dir / name).read_text(errors="replace")[-20000:])
            stream.flush()
        except OSError:
            pass
    return exit_status(returncode, proc.escalated)


def run_dashboard(proc: TrainingProcess, rules: Config | None = None, exports: Any = None) -> int:
    """Open the Textual dashboard on ``proc``; returns perfmon's exit status."""
    from perfmon.tui.app import PerfmonApp
    from perfmon.tui.shell import SIGNALLED, SPAWNED, STOPPED

    if proc.target.ranked:
        return _run_job_dashboard(proc, rules, exports)
    source = connect(proc)
    if not proc.alive() and not (proc.run_dir / "events.jsonl").exists():
        return _early_exit(proc)
    state = RunState()
    app = PerfmonApp(state, source, proc.run_dir, proc, rules=rules)
    if exports is not None:
        exports.watch(app.lock, lambda: app.state, cfg=rules, send=source.send)
    early = EarlySummary(proc, app, rules)
    early.start()
    app.run()
    early.cancel()
    outcome = getattr(app, "outcome", "quit")
    if outcome == SPAWNED and app.spawned_job is not None:  # the script's ranks, as a job, from here
        return _follow_spawned(proc, state, source, rules, exports, app.spawned_job)
    if exports is not None:
        exports.close()
    if outcome == "detached" and proc.alive():
        source.close()
        print(
            f"perfmon: detached; training continues as pid {proc.pid}\n"
            f"  come back: perfmon attach {proc.pid}\n"
            f"  output:    {proc.output_files()}\n"
            f"  recording: {proc.run_dir / 'events.jsonl'}  (perfmon report {proc.run_dir})",
            file=sys.stderr,
        )
        return 0
    returncode = _wait_for_job(proc, outcome, f"training (pid {proc.pid})")
    # Let the stream finish so the final state (and any exit record we add) is complete.
    source.close()
    # the dashboard stopped reading when it closed: a job stopped from it ended after that
    summary = finalize_recording(proc.run_dir, state, returncode, rules,
                                 complete=outcome not in (STOPPED, SIGNALLED))
    # the dashboard's screen is gone: the script's last lines and its error stay in the terminal, as plain python
    # leaves them, and the summary below them, as a headless run ends
    traceback = state.exit.traceback if state.exit is not None else None
    shown = print_output_tail(proc.run_dir, proc.combined_output, sys.stdout, sys.stderr, traceback)
    if traceback and traceback.rstrip("\n").rsplit("\n", 1)[-1] not in shown:
        sys.stderr.write(traceback if traceback.endswith("\n") else traceback + "\n")
    if summary is not SUMMARY_FAILED and state.steps:  # without a step, the status line below says it all
        print_summary(lambda: format_summary(state, summary), proc.run_dir, sys.stderr)
    print(f"perfmon: {state.status}; run dir {proc.run_dir}", file=sys.stderr)
    hint = stdin_hint(state.exit.exception if state.exit else None)
    if hint:
        print(f"perfmon: {hint}", file=sys.stderr)
    return exit_status(returncode, proc.escalated)


class EarlySummary(threading.Thread):
    """summary.json as soon as the job ends under an open dashboard, not only once the dashboard closes: a
    terminal that hangs up (an SSH drop) while it shows the ended job kills perfmon before its ending writes
    it, and the agent has left that summary to this launcher."""

    STREAM_WAIT_S = 5.0  # for the agent's last messages (its exit record) to reach the dashboard's state

    def __init__(self, proc: TrainingProcess, app: Any, rules: Config | None, job: Any = None) -> None:
        super().__init__(name="perfmon-early-summary", daemon=True)
        self.proc, self.app, self.rules, self.job = proc, app, rules, job  # job: a torchrun job's JobState
        self._cancelled = threading.Event()
        self._writing = threading.Lock()
        self.written = False

    def run(self) -> None:
        returncode = self.proc.wait()
        deadline = time.monotonic() + self.STREAM_WAIT_S
        while self.job is None and not self.app.stream_ended and time.monotonic() < deadline:
            if self._cancelled.wait(0.05):
                return
        with self._writing:
            if self._cancelled.is_set():
                return
            # the lock only while the dashboard's state is read: a fast job's summary reads its whole recording
            if self.job is not None:
                from perfmon.monitor.job_run import finalize_job

                finalize_job(self.proc.run_dir, self.job, returncode, self.rules, lock=self.app.lock)
            else:
                finalize_recording(self.proc.run_dir, self.app.state, returncode, self.rules,
                                   complete=self.app.stream_ended, lock=self.app.lock)
            self.written = True

    def cancel(self) -> None:
        """The dashboard closed: its own ending writes the summary from now on (never this thread after it)."""
        self._cancelled.set()
        with self._writing:
            pass


def _follow_spawned(proc: TrainingProcess, state: RunState, source: Any, rules: Config | None,
                    exports: Any, job_dir: Path) -> int:
    """The dashboard of the ranks the script spawned (its exports follow them); the script's own recording is
    finished once the script ends (not on a detach: the script is left running)."""
    from perfmon.monitor.job_run import SpawnedRanks, other_spawns

    status = _run_job_dashboard(SpawnedRanks(proc, job_dir), rules, exports, nodes=False)
    source.close()
    if proc.alive():  # detached
        return status
    finalize_recording(proc.run_dir, state, proc.wait(), rules)
    if state.steps:
        print(f"perfmon: the script's own process trained too ({state.steps} steps): perfmon report {proc.run_dir}"
              f" (its ranks: perfmon report {job_dir})", file=sys.stderr)
    for line in other_spawns(state.spawned, job_dir):
        print(line, file=sys.stderr)
    return status


def _wait_for_job(proc: TrainingProcess, outcome: str, what: str) -> int:
    """After the dashboard left: wait for the job to end (escalating a stop asked from the dashboard, never a
    SIGTERM passed on), Ctrl-C and SIGTERM still reaching it meanwhile; returns its exit status."""
    from perfmon.tui.shell import SIGNALLED, STOPPED

    with signals_to(proc):
        if outcome == STOPPED and proc.alive():
            print(f"perfmon: stopping {what}...", file=sys.stderr)
            _wait_stopping(proc)
        elif outcome == SIGNALLED and proc.alive():
            print(f"perfmon: SIGTERM passed on to {what}; waiting for it to end...", file=sys.stderr)
        return proc.wait()


def _wait_stopping(proc: TrainingProcess, grace: float = 10.0) -> None:
    """SIGINT was sent; escalate if the job ignores it."""
    done = threading.Event()

    def waiter() -> None:
        proc.wait()
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    for _ in range(2):
        if done.wait(grace):
            return
        proc.stop()
    done.wait()


def _run_job_dashboard(proc: TrainingProcess, rules: Config | None, exports: Any = None, nodes: bool = True) -> int:
    """The dashboard over every rank of a ``perfmon torchrun`` or ``perfmon accelerate launch`` job (``nodes``
    False: ranks a script spawned, all on this node)."""
    from perfmon.analysis.job import JobState
    from perfmon.monitor.job_run import finalize_job, job_source, start_nodes
    from perfmon.tui.app import PerfmonApp

    job = JobState()
    source = job_source(proc)
    node, line = start_nodes(proc, source) if nodes else (None, None)
    app = PerfmonApp(RunState(), source, proc.run_dir, proc, rules=rules, job=job)
    if exports is not None:
        exports.watch(app.lock, job=job, cfg=rules, send=source.send)
    if line:
        app.notice = line
    early = EarlySummary(proc, app, rules, job=job)
    early.start()
    app.run()
    early.cancel()
    if exports is not None:
        exports.close()
    if node is not None and not (getattr(app, "outcome", "") == "detached" and proc.alive()):
        node.close()
    outcome = getattr(app, "outcome", "quit")
    launcher = (proc.target.launcher or "the script's") if nodes else "the script's"
    if outcome == "detached" and proc.alive():
        print(f"perfmon: detached; the job continues ({launcher} pid {proc.pid})\n"
              f"  come back: perfmon attach {proc.run_dir}\n"
              f"  output:    {proc.output_files()}\n"
              f"  recording: {proc.run_dir}/rank-*/events.jsonl  (perfmon report {proc.run_dir})", file=sys.stderr)
        return 0
    returncode = _wait_for_job(proc, outcome, f"the job ({launcher} pid {proc.pid})")
    source.close()
    summary = finalize_job(proc.run_dir, job, returncode, rules)
    from perfmon.analysis.job_report import job_status

    if summary is not SUMMARY_FAILED:
        print_summary(lambda: f"perfmon: {job_status(job) if summary else 'no rank recorded anything'}; run dir "
                      f"{proc.run_dir}", proc.run_dir, sys.stderr)
    return exit_status(returncode, proc.escalated)
