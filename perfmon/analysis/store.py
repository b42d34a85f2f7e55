"""What a run's messages said: counters, histograms, series, the recent steps, the latest readings.

Fed by :meth:`Store.apply` (live, attached, replayed: the same path), with the typed messages of
:mod:`perfmon.messages`. Memory is bounded whatever the run length: a fixed recent window of steps,
log-bucket histograms since start, multi-resolution time series. What is derived from it (rates,
shares, the memory budget, MFU, the status) is :mod:`perfmon.analysis.metrics`.
"""

from __future__ import annotations

import math
import signal as _signal
import time
from collections import deque
from typing import Any

from perfmon.analysis.records import Capturing, ExitInfo, Peaks, PhaseTotals, Step, higher
from perfmon.analysis.series import TimeSeries
from perfmon.messages import (
    AgentWarning,
    CommandResult,
    CudaMem,
    Exec,
    Exit,
    GpuSample,
    Hello,
    HostSample,
    Invalid,
    Message,
    ModelInfo,
    ProfileStarted,
    ProfileWindow,
    RanksSpawned,
    Reset,
    Sample,
    StepRows,
    WindowEdge,
    merged,
    parse,
)
from perfmon.protocol import ALL_PHASES, OUTSIDE_KINDS, RECORDING_STOPPED

RECENT_STEPS = 200
#: Telemetry kept as multi-resolution series (sparklines over the whole run).
SERIES = ("cpu", "rss", "gpu_util", "gpu_mem", "cuda_alloc", "workers_cpu")
WARM_UP_STEPS = 10  # memory readings before this are imports and first allocations, not a leak


class Store:
    """Everything received from one run, folded in; nothing here is an opinion about it."""

    def __init__(self, recent: int = RECENT_STEPS) -> None:
        self._recent_len = recent
        self.reset()

    def reset(self) -> None:
        """Forget everything (a replay starting over)."""
        self.meta = Hello()
        self.steps = 0  # the highest step index seen
        self.recent: deque[Step] = deque(maxlen=self._recent_len)
        self.totals: dict[str, PhaseTotals] = {p: PhaseTotals() for p in (*ALL_PHASES, "step")}
        self.samples_total = 0
        self.samples_steps = 0  # steps that counted samples
        #: ms spent outside training steps, by kind (evaluation, checkpoint, other)
        self.outside_ms: dict[str, float] = dict.fromkeys(OUTSIDE_KINDS, 0.0)
        self.closures_total = 0  # closure evaluations (calls of optimizer.step(closure)'s closure), all steps
        self.closure_steps = 0  # steps that reported closures
        self.prefetch_ms = 0.0  # other threads' DataLoader fetches (a prefetching generator), all steps
        #: steps a fast job's live stream summarised (``bulk``): counted and summed exactly, their percentiles
        #: estimated from the rows sent beside them; the recording has every row
        self.bulk_steps = 0
        self.windowed_steps = 0  # steps inside profiler / FLOP-counter windows: not in the phase statistics
        self.first_start: float | None = None
        self.last_end: float | None = None
        #: step 1 as it was folded (not in a window, sent as a row): the whole-run figures leave it out once there
        #: are more (``metrics``); it holds what ran before the loop was learned (lazy init, compilation, setup)
        self.first_step: Step | None = None
        self.step_series = TimeSeries()
        self.device_timed = False  # some step had device (CUDA event) phase times
        self.exit: ExitInfo | None = None
        self.last_seq = 0
        self.skipped = 0  # messages that could not be read (or were cut short)
        self.warnings: list[str] = []  # the newest 50
        #: the ranks the job spawned itself (torch.multiprocessing.spawn), a job dir each call, in order
        self.spawned: list[RanksSpawned] = []
        self.execed: Exec | None = None  # the script replaced itself with another program (os.exec*)
        self.warnings_seen = 0  # all there were: what a printer of new warnings counts from
        self.recording_stopped = False  # the agent said its recording stopped: the stream has more than it
        self.agent_errors: dict[str, float] = {}
        self.host: HostSample | None = None
        self.last_sample_t: float | None = None  # the newest telemetry sample's time
        self.gpus: list[GpuSample] = []
        self.cuda_mem: CudaMem | None = None
        self.model: ModelInfo | None = None
        self.samples_seen = 0  # telemetry samples, not training samples
        self.series: dict[str, TimeSeries] = {k: TimeSeries() for k in SERIES}
        self.peaks = Peaks()
        self.cpu_sum = 0.0  # the trainer's CPU %, summed over the samples that had it
        self.cpu_n = 0
        self.sampler_cpu_s = 0.0
        self.sample_interval = 1.0
        self.profiles: deque[ProfileWindow] = deque(maxlen=20)
        self.profiling: Capturing | None = None
        self.command_results: deque[CommandResult] = deque(maxlen=50)
        self.windows: deque[list[float]] = deque(maxlen=64)  # [start, stop] of profiler/FLOP windows
        # memory readings past warm-up, newest 600, for leak detection
        self.rss_samples: deque[float] = deque(maxlen=600)
        self.cuda_alloc_samples: deque[float] = deque(maxlen=600)
        # host samples taken while steps advanced: CPU use is judged over these, not one instant
        self.busy_hosts: deque[HostSample] = deque(maxlen=10)
        self._steps_at_sample = 0
        # the trainer's CPU wait comes every few samples, over the time since its last reading: judged over the
        # readings whose span saw steps advance (one sample in five may not itself follow a steps message)
        self.busy_trainer_waits: deque[float] = deque(maxlen=4)
        self._steps_at_wait = 0

    @property
    def steps_folded(self) -> int:
        """Step rows folded in, profiled ones included (the phase statistics leave those out)."""
        return self.totals["step"].hist.n + self.windowed_steps

    # -- ingest -------------------------------------------------------------------------
    def apply(self, msg: dict[str, Any] | Message) -> None:
        """Fold one message in (decoded, or already parsed); duplicates (by ``seq``) are ignored."""
        m = parse(msg) if isinstance(msg, dict) else msg
        seq = m.seq
        if isinstance(seq, int):
            if seq <= self.last_seq:
                return
            self.last_seq = seq
        if isinstance(m, ProfileWindow):
            self.profiles.append(m)
            self.profiling = None
        elif isinstance(m, StepRows):
            self._fold_steps(m)
        elif isinstance(m, Sample):
            self._sample(m)
        elif isinstance(m, Hello):
            self.meta = merged(self.meta, m)
        elif isinstance(m, ModelInfo):  # model facts arrive in pieces (parameters, then FLOPs)
            self.model = merged(self.model or ModelInfo(), m)
        elif isinstance(m, Reset):  # a replay restarting from the beginning
            self.reset()
        elif isinstance(m, Invalid):
            self.skipped += 1
        else:
            self._event(m)

    def _fold_steps(self, m: StepRows) -> None:
        """The rows of a ``steps`` message, column by column (the monitor's hot loop); ``Step`` rows are
        made only for those that end up in ``recent``."""
        for kind, ms in m.outside.items():
            self.outside_ms[kind] += ms
        self.device_timed = self.device_timed or m.device_timed
        n = len(m)
        if n:
            self._fold_rows(m, n)
        if m.cut:  # the rows before the bad value count, as they did one by one
            self.skipped += 1

    def _fold_rows(self, m: StepRows, n: int) -> None:
        t, dur = m.t, m.dur
        starts = [end - d / 1000.0 for end, d in zip(t, dur, strict=True)]
        other = [max(0.0, d - (a + b + c + e)) for d, a, b, c, e in zip(dur, *m.phases, strict=True)]
        # profiler / FLOP-counter windows that may hold these rows (rows come in time order; windows are few)
        windows = [(b, e) for b, e in self.windows if e > starts[0]]
        inside = None
        if windows:
            inside = [any(s < stop and end > begin for begin, stop in windows)
                      for s, end in zip(starts, t, strict=True)]
        columns = [*m.phases, other, dur]  # per phase, then other, step
        if inside is not None and any(inside):  # slowed down by the profiler: not in the statistics
            self.windowed_steps += sum(inside)
            columns = [[v for v, w in zip(c, inside, strict=True) if not w] for c in columns]
        self.steps = max(self.steps, max(m.i))
        counted = [s for s in m.samples if s]
        self.samples_total += sum(counted)
        self.samples_steps += len(counted)
        if m.closures is not None:
            closures = [c for c in m.closures if c is not None]
            self.closures_total += sum(closures)
            self.closure_steps += len(closures)
        if m.prefetch is not None:
            self.prefetch_ms += sum(m.prefetch)
        first, last = min(starts), max(t)
        if self.first_start is None or first < self.first_start:
            self.first_start = first
        if self.last_end is None or last > self.last_end:
            self.last_end = last
        if m.i[0] == 1:  # step 1 is warm-up (compilation, first calls): the chart and its range leave it out, as
            self.step_series.add_many(t[1:], dur[1:])  # the tables do (it drew a 1.1 s bar over 52 ms steps)
        else:
            self.step_series.add_many(t, dur)
        bulk = self._bulk(m, columns[-1])
        weight = 1.0 + bulk / len(columns[-1]) if bulk else 1.0
        for name, column in zip((*ALL_PHASES, "step"), columns, strict=True):
            tot = self.totals[name]
            tot.total_ms += sum(column)
            tot.hist.add_many(column, weight, bulk)
        k = max(0, n - (self.recent.maxlen or n))
        flags = inside[k:] if inside is not None else [False] * (n - k)
        prefetch = m.prefetch[k:] if m.prefetch is not None else [0.0] * (n - k)
        self.recent.extend(map(Step._make, zip(m.i[k:], t[k:], dur[k:], *(p[k:] for p in m.phases),
                                               other[k:], m.samples[k:], flags, prefetch, strict=True)))
        if self.first_step is None and m.i[0] == 1 and not (inside and inside[0]):
            self.first_step = Step(1, t[0], dur[0], *(p[0] for p in m.phases), other[0], m.samples[0] or 0, False,
                                   m.prefetch[0] if m.prefetch is not None else 0.0)

    def _bulk(self, m: StepRows, kept: list[float]) -> int:
        """Fold a ``bulk`` summary (rows of a fast job not sent live); the count it adds to the histograms."""
        bulk = m.bulk
        if bulk is None or not kept:
            return 0  # all of the message's rows in a profiler window: left out
        for name, key in (*zip(ALL_PHASES, ALL_PHASES, strict=True), ("step", "dur")):
            if key in bulk.sum_ms:
                self.totals[name].total_ms += bulk.sum_ms[key]
        self.samples_total += bulk.samples
        self.samples_steps += bulk.samples_steps
        self.closures_total += bulk.closures
        self.closure_steps += bulk.closure_steps
        self.prefetch_ms += bulk.prefetch_ms
        if bulk.last_i is not None and bulk.last_i > self.steps:
            self.steps = bulk.last_i
        if bulk.first_start is not None and (self.first_start is None or bulk.first_start < self.first_start):
            self.first_start = bulk.first_start
        self.bulk_steps += bulk.n
        return bulk.n

    def _sample(self, m: Sample) -> None:
        t, peaks, series = m.t, self.peaks, self.series
        self.samples_seen += 1
        if t is not None and (self.last_sample_t is None or t > self.last_sample_t):
            self.last_sample_t = t
        if m.sampler_cpu_s is not None:
            self.sampler_cpu_s += m.sampler_cpu_s
        if m.interval_s is not None:
            self.sample_interval = m.interval_s
        host = m.host
        if host is not None:
            self.host = host
            if self.steps > self._steps_at_sample:
                self.busy_hosts.append(host)
            self._steps_at_sample = self.steps
            if host.trainer_wait_percent is not None:
                if self.steps > self._steps_at_wait:
                    self.busy_trainer_waits.append(host.trainer_wait_percent)
                self._steps_at_wait = self.steps
            if host.cpu_percent is not None:
                series["cpu"].add(t, host.cpu_percent)
                self.cpu_sum += host.cpu_percent
                self.cpu_n += 1
                peaks.cpu_percent = higher(peaks.cpu_percent, host.cpu_percent)
            if host.rss_bytes is not None:
                series["rss"].add(t, host.rss_bytes)
                if self.steps > WARM_UP_STEPS:
                    self.rss_samples.append(host.rss_bytes)
                peaks.rss_bytes = higher(peaks.rss_bytes, host.rss_bytes)
            peaks.workers_rss_bytes = higher(peaks.workers_rss_bytes, host.workers_rss_bytes)
            if host.workers and host.workers_cpu_percent is not None:
                series["workers_cpu"].add(t, host.workers_cpu_percent)
        if m.gpus is not None:
            self.gpus = list(m.gpus)
            if self.gpus:
                g0 = self.gpus[0]
                if g0.util_gpu is not None:
                    series["gpu_util"].add(t, g0.util_gpu)
                    peaks.util_gpu = higher(peaks.util_gpu, g0.util_gpu)
                if g0.mem_used_bytes is not None:
                    series["gpu_mem"].add(t, g0.mem_used_bytes)
        self.cuda_mem = m.cuda_mem or self.cuda_mem  # a sample without one: the last reading stands
        cm = self.cuda_mem
        if cm is None:
            return
        if cm.allocated_bytes is not None:
            series["cuda_alloc"].add(t, cm.allocated_bytes)
            if self.steps > WARM_UP_STEPS:
                self.cuda_alloc_samples.append(cm.allocated_bytes)
        peaks.reserved_bytes = higher(peaks.reserved_bytes, cm.peak_reserved_bytes)
        peaks.allocated_bytes = higher(peaks.allocated_bytes, cm.peak_allocated_bytes)
        if self.steps > WARM_UP_STEPS:  # past the first steps' one-off allocations (autotune, lazy state)
            steady = higher(peaks.steady_allocated_bytes, cm.window_peak_allocated_bytes)
            peaks.steady_allocated_bytes = steady

    def _event(self, m: Message) -> None:
        if isinstance(m, Exit):
            self.exit = ExitInfo(code=m.code, signal=m.signal, exception=m.exception, traceback=m.traceback,
                                 t=m.t)
            if m.agent_errors is not None:
                self.agent_errors = dict(m.agent_errors)
            self.profiling = None  # no window is being captured once the job is over
        elif isinstance(m, WindowEdge):
            if m.started:
                self.windows.append([m.t, math.inf])
            elif self.windows:
                self.windows[-1][1] = m.t
        elif isinstance(m, ProfileStarted):
            self.profiling = Capturing(m.reason, m.t, self.steps)
        elif isinstance(m, CommandResult):
            self.command_results.append(m)
        elif isinstance(m, Exec):
            self.execed = None if m.failed else m
        elif isinstance(m, RanksSpawned):
            if all(s.job_dir != m.job_dir for s in self.spawned):
                self.spawned.append(m)
        elif isinstance(m, AgentWarning):
            self.recording_stopped = self.recording_stopped or m.message.startswith(RECORDING_STOPPED)
            self.warnings.append(m.message)
            self.warnings_seen += 1
            del self.warnings[:-50]

    def warnings_since(self, seen: int) -> list[str]:
        """The warnings that came after the first ``seen`` (``warnings_seen`` then), as many as are kept; all of
        them after a reset (a replay that started over: fewer were seen than ``seen``)."""
        n = self.warnings_seen - seen if seen <= self.warnings_seen else self.warnings_seen
        return self.warnings[-n:] if n > 0 else []

    def process_exited(self, returncode: int, t: float | None = None) -> None:
        """The launcher saw the process end: fill in what the agent could not say (signals)."""
        sig = _signal_name(-returncode) if returncode < 0 else None
        self.profiling = None
        if self.exit is None:
            self.exit = ExitInfo(code=None if sig else returncode, signal=sig, t=t or time.time())
        elif sig and not self.exit.signal:
            self.exit.signal, self.exit.code = sig, None


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"

