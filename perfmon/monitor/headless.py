"""``perfmon --headless``: what nohup, Slurm and CI logs hold.

The script's stdout passes through to stdout and its stderr to stderr as they come, a status line
goes to stderr every ``interval`` seconds, and a summary table at exit. Same state, same numbers as the
dashboard.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from perfmon import paths
from perfmon.analysis.job import WarningFeed, stepping_spawn, warning_line
from perfmon.analysis.profile_window import summarised
from perfmon.analysis.report import format_finding, format_summary, status_line
from perfmon.analysis.rules import Config, Engine
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command, Stream
from perfmon.monitor.exit_like import exit_status
from perfmon.monitor.launch import (
    SUMMARY_FAILED,
    TrainingProcess,
    finalize_recording,
    print_summary,
    same_destination,
    signals_to,
)
from perfmon.monitor.sources import ReplaySource, Source, connect
from perfmon.tail import Tail


class LogTail:
    """Copies new bytes of a growing file to a stream as they come (the script's own output, as is)."""

    CHUNK = 1 << 20  # bytes held at a time (a monitor that was stopped meets all the script wrote meanwhile)
    MAX_CHUNKS = 16  # a call's most: a script that writes faster than our stdout takes it never holds pump

    def __init__(self, path: Path, out: BinaryIO) -> None:
        self.tail = Tail(path, max_read=self.CHUNK)
        self.out = out
        self.last = b"\n"  # the last byte copied: a line of perfmon's own must not go on the end of the script's
        #: ``out`` is a pipe whose reader left (``| head``): nothing more is copied to it
        self.broken = False

    def pump(self) -> int:
        """Copy what was appended since the last call; returns its size in bytes."""
        total = 0
        for _ in range(self.MAX_CHUNKS):
            data = self.tail.read()
            total += len(data)
            if data and not self.broken:
                self.last = data[-1:]
                try:
                    self.out.write(data)
                    self.out.flush()
                except BrokenPipeError:
                    self.broken = True
                except (OSError, ValueError):
                    pass
            if len(data) < self.CHUNK:
                break
        return total


class ScriptOutput:
    """The launched script's stdout and stderr (``RUN/output.log``, ``RUN/stderr.log``), each copied to ours; or
    ``combined``, both in ``RUN/output.log`` (ours are one file) copied to our stdout, in the order written."""

    def __init__(self, run_dir: Path, combined: bool = False) -> None:
        out = LogTail(run_dir / paths.OUTPUT_LOG, sys.stdout.buffer)
        self.tails = (out,) if combined else (out, LogTail(run_dir / paths.STDERR_LOG, sys.stderr.buffer))
        # what perfmon's own lines (on stderr) follow: the script's stderr, or whichever of its streams wrote last
        # where stdout and stderr are one file (a terminal, `2>&1` into a log or a pipe)
        self._beside = list(self.tails) if combined or same_destination() else [self.tails[1]]
        self._last = b"\n"
        self._said: tuple[Stream, ...] = ()  # the streams the job was told to break (break_job_streams)
        self._reached: frozenset[int] = frozenset()  # the ranks connected when it was told

    def fresh_line(self) -> str:
        """A newline where the script left a line open where perfmon's next line goes (a progress bar redrawn after
        a carriage return, ``print(end="")``): that line stays and perfmon's starts below it, as ``tqdm.write``
        does. Else ""."""
        if self._last == b"\n":
            return ""
        self._last = b"\n"
        return "\n"

    def pump(self) -> int:
        """Copy what each stream wrote since the last call (a bounded amount); returns the bytes copied."""
        total = 0
        for tail in self.tails:
            n = tail.pump()
            if n and tail in self._beside:
                self._last = tail.last
            total += n
        return total

    def broken_streams(self) -> tuple[Stream, ...]:
        """The job's streams whose copy goes to a pipe that lost its reader."""
        out = self.tails[0].broken
        if len(self.tails) == 1:
            return ("stdout", "stderr") if out else ()
        return (*(("stdout",) if out else ()), *(("stderr",) if self.tails[1].broken else ()))

    def break_job_streams(self, send: Callable[[Command], bool], reached: frozenset[int] = frozenset()) -> None:
        """``| head`` left: tell the job (``close_output``) to break its streams whose copy broke, so that its next
        print fails, as under plain python (it trained on, unseen). Said again until it is taken, where the broken
        streams change, and where ranks connected since (``reached``: those connected now; under plain torchrun
        every rank's print fails, the ranks sharing its stdout)."""
        broken = self.broken_streams()
        if (broken and (broken != self._said or not reached <= self._reached)
                and send(Command("close_output", streams=broken))):
            self._said, self._reached = broken, reached

    def drain(self) -> None:
        """Copy everything there is: the job is over."""
        while self.pump():
            pass


def _follow_spawned(proc: TrainingProcess, state: RunState, lock: threading.Lock, follower: threading.Thread,
                    source: Source, interval: float, err: Any, rules: Config | None, tail: ScriptOutput,
                    exports: Any, job_dir: Path) -> int:
    """The ranks' job summary, status lines and findings, as for ``perfmon --headless torchrun`` (the exports
    follow the job); the script's own recording is finished as usual, and its summary printed too only where
    the script trained steps of its own."""
    from perfmon.monitor.job_run import SpawnedRanks, other_spawns, run_headless_job

    status = run_headless_job(SpawnedRanks(proc, job_dir), interval, err, rules, exports=exports, tail=tail)
    returncode = proc.wait()
    follower.join(timeout=10.0)
    if isinstance(source, ReplaySource):
        source.close()
    with lock:
        summary = finalize_recording(proc.run_dir, state, returncode, rules)
        if state.steps and summary is not SUMMARY_FAILED:
            print_summary(lambda: format_summary(state, summary), proc.run_dir, err)
        for line in other_spawns(state.spawned, job_dir):
            print(line, file=err, flush=True)
    return status


def follow(source: Source, state: RunState, lock: threading.Lock) -> threading.Thread:
    """Fold ``source`` into ``state`` on a daemon thread."""

    def run() -> None:
        try:
            for msg in summarised(source.messages()):  # windows analysed from their traces
                with lock:
                    state.apply(msg)
        except OSError:
            pass

    thread = threading.Thread(target=run, name="perfmon-follow", daemon=True)
    thread.start()
    return thread


def run_headless(proc: TrainingProcess, interval: float, err: Any = None, rules: Config | None = None,
                 exports: Any = None) -> int:
    err = err or sys.stderr
    state = RunState()
    engine = Engine(rules)
    next_rules = time.monotonic() + 1.0
    warnings = WarningFeed()
    said_wandb = False
    lock = threading.Lock()
    tail = ScriptOutput(proc.run_dir, combined=proc.combined_output)
    fresh = tail.fresh_line if err is sys.stderr else str  # the script's output is copied to our own streams
    with signals_to(proc):
        source = connect(proc)
        if exports is not None:  # --prometheus, --tensorboard, --wandb (perfmon.monitor.exports)
            exports.watch(lock, lambda: state, cfg=rules, send=source.send)
        follower = follow(source, state, lock)
        next_status = time.monotonic() + interval
        while proc.alive():
            if state.spawned and (job_dir := stepping_spawn(state.spawned)) is not None:
                # the script spawned its ranks, and they train: follow them as a job from here
                return _follow_spawned(proc, state, lock, follower, source, interval, err, rules, tail, exports,
                                       job_dir)
            tail.pump()
            tail.break_job_streams(source.send)
            if time.monotonic() >= next_rules:
                with lock:
                    new = engine.update(state)
                    said_now = [warning_line(*w) for w in warnings.new(state)]
                    # --wandb: the job could not log (no active run): said once
                    failed = [r.message for r in state.command_results
                              if r.name == "log_metrics" and r.ok is False and r.message]
                if failed and not said_wandb:
                    said_wandb = True
                    said_now.append(warning_line("", failed[0]))
                for line in said_now:
                    print(fresh() + line, file=err, flush=True)
                for f in new:
                    print(f"{fresh()}[perfmon] finding{format_finding(f.severity, f.id, f.title, f.fix)[1:]}",
                          file=err, flush=True)
                next_rules += 1.0
            if time.monotonic() >= next_status:
                with lock:
                    line = status_line(state)
                print(fresh() + line, file=err, flush=True)
                next_status += interval
            time.sleep(0.1)
        returncode = proc.wait()
        if isinstance(source, ReplaySource):
            source.close()
        follower.join(timeout=2.0)
        if follower.is_alive():  # a monitor that was frozen reads the rest from the recording
            print(fresh() + "[perfmon] job ended; catching up with the recording...", file=err, flush=True)
            follower.join(timeout=600.0)
        tail.drain()
        with lock:
            for who, text in warnings.new(state):  # the job's last second: said here, or never
                print(fresh() + warning_line(who, text), file=err, flush=True)
            summary = finalize_recording(proc.run_dir, state, returncode, rules)
            if summary is not SUMMARY_FAILED:
                print_summary(lambda: format_summary(state, summary), proc.run_dir, err, fresh())
            if not (proc.run_dir / "events.jsonl").exists():
                print(f"perfmon: the run dir {proc.run_dir} was removed while the job ran (by the script?): its "
                      "recording went with it; the summary above is from the live stream", file=err, flush=True)
        if exports is not None:
            exports.close()
        return exit_status(returncode, proc.escalated)
