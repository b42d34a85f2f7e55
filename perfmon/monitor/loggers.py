"""Phase timings and findings for the tools people already log to: ``--tensorboard`` (scalars under
``RUN/tb/``) and ``--wandb`` (into the job's own active Weights & Biases run).

Both are fed by the monitor every ``interval`` seconds and once at the end, from its state: the job computes
nothing for them. TensorBoard files are written here with ``tensorboard``'s own event writer (no torch in the
monitor). W&B lives in the job (the script's ``wandb.init``): the monitor sends the numbers as a
``log_metrics`` command, and the agent adds them to the script's run at the next step boundary, on the
training thread, with ``commit=False`` (they join the script's next ``wandb.log`` step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from perfmon.analysis.job import JobState, rank_rows
from perfmon.analysis.rules import Config, Finding, evaluate_job, evaluate_once
from perfmon.analysis.rules.base import SEVERITIES
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command
from perfmon.protocol import ALL_PHASES

TB_INSTALL = "pip install tensorboard"


class LoggerError(Exception):
    """A logger cannot start: one line for the user."""


def scalars(state: RunState, findings: list[Finding]) -> dict[str, float]:
    """What one run (or rank) logs: recent phase times (ms), shares, rates, device and host, MFU, and each
    finding's severity (1 info, 2 warn, 3 critical; 0 once it cleared)."""
    out: dict[str, float] = {}
    stats = state.phase_stats(recent=True)
    for phase in (*ALL_PHASES, "step"):
        stat = stats[phase]
        if stat.mean_ms is not None:
            out[f"perfmon/{phase}_ms"] = stat.mean_ms
        if phase != "step" and stat.share is not None:
            out[f"perfmon/{phase}_share"] = stat.share
    if stats["step"].p50_ms is not None:
        out["perfmon/step_p50_ms"] = stats["step"].p50_ms
    for key, value in (("steps_per_s", state.steps_per_s()), ("samples_per_s", state.samples_per_s()),
                       ("mfu", state.flops().mfu)):
        if value is not None:
            out[f"perfmon/{key}"] = value
    utils = [g.util_gpu for g in state.gpus if g.util_gpu is not None]
    if utils:
        out["perfmon/gpu_util_percent"] = sum(utils) / len(utils)
    if state.cuda_mem is not None and state.cuda_mem.allocated_bytes is not None:
        out["perfmon/cuda_allocated_gib"] = state.cuda_mem.allocated_bytes / 2**30
    host = state.host
    if host is not None:
        if host.cpu_percent is not None:
            out["perfmon/cpu_percent"] = host.cpu_percent
        if host.rss_bytes is not None:
            out["perfmon/rss_gib"] = host.rss_bytes / 2**30
    for f in findings:
        out[f"perfmon/finding/{f.id}"] = float(SEVERITIES.index(f.severity) + 1)
    return out


class _TensorBoard:
    """Scalars into ``RUN/tb/perfmon/`` (TensorBoard's event file format), one series per rank in a job."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise LoggerError(f"--tensorboard needs tensorboard: {TB_INSTALL}") from None
        self.Event, self.Summary = Event, Summary
        self.dir = run_dir / "tb" / "perfmon"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LoggerError(f"--tensorboard: cannot create {self.dir} ({exc.strerror or exc})") from None
        self.writer = EventFileWriter(str(self.dir))

    def write(self, step: int, values: dict[str, float]) -> None:
        summary = self.Summary(value=[self.Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self.writer.add_event(self.Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ScalarLoggers:
    """Every ``interval`` seconds (and at :meth:`close`): scalars to TensorBoard and/or the job's W&B run."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False,
                 interval: float = 10.0) -> None:
        self.tb = _TensorBoard(run_dir) if tensorboard else None
        self.wandb = wandb
        self.interval = interval
        self.lock: threading.Lock = threading.Lock()
        self.state: Callable[[], RunState | None] = lambda: None
        self.job: JobState | None = None
        self.cfg = Config()
        self.send: Callable[[Command], bool] | None = None
        self._cleared: dict[str, set[str]] = {}  # finding tags logged before, per series: they log 0 when gone
        self._last: dict[str, tuple[int, dict[str, float]]] = {}  # each series' last point
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perfmon-loggers", daemon=True)
        self.written = 0

    def watch(self, lock: threading.Lock, state: Callable[[], RunState | None] | None = None,
              job: JobState | None = None, cfg: Config | None = None,
              send: Callable[[Command], bool] | None = None) -> None:
        """Log this monitor's state (or job) from now on; ``send``: a command to the job (W&B)."""
        self.lock = lock
        if state is not None:
            self.state = state
        self.job = job
        self.cfg = cfg or self.cfg
        self.send = send
        if not self._thread.is_alive():
            self._thread.start()

    def _series(self) -> list[tuple[str, int | None, int, dict[str, float]]]:
        """(tag prefix, rank, step, scalars) per run or rank, read under the lock."""
        cfg = self.cfg
        with self.lock:
            if self.job is None:
                state = self.state()
                if state is None or not state.steps:
                    return []
                return [("", None, state.steps, scalars(state, evaluate_once(state, cfg)))]
            across = evaluate_job(rank_rows(self.job, cfg.warmup_steps, cfg.min_steps), cfg)
            out = []
            for rank in sorted(self.job.ranks):
                state = self.job.ranks[rank]
                if state.steps:
                    mine = [f for f in across if f.evidence.get("rank") in (rank, None)]
                    out.append((f"rank{rank}/", rank, state.steps, scalars(state, mine + evaluate_once(state, cfg))))
            return out

    def flush(self) -> None:
        for prefix, rank, step, values in self._series():
            key = prefix or "run"
            gone = self._cleared.setdefault(key, set()) - set(values)
            values.update({tag: 0.0 for tag in gone if tag.startswith("perfmon/finding/")})
            self._cleared[key] |= {t for t in values if t.startswith("perfmon/finding/")}
            if self._last.get(key) == (step, values):  # nothing new since the last point (a quiet job, the end
                continue  # right after a tick): the same point twice is one too many on every chart
            self._last[key] = (step, dict(values))
            if self.tb is not None:
                self.tb.write(step, {prefix + tag: v for tag, v in values.items()})
            if self.wandb and self.send is not None:
                # each rank logs its own numbers into its own run
                self.send(Command("log_metrics", metrics=values, ranks=(rank,) if rank is not None else None))
            self.written += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a logger must not take the monitor down
                pass

    def close(self) -> None:
        self._stop.set()
        try:
            self.flush()
        except Exception:  # noqa: BLE001
            pass
        if self.tb is not None:
            self.tb.close()
