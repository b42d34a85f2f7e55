"""Monitor-side state: everything the dashboard, headless mode and reports show.

Fed by :meth:`RunState.apply` with decoded messages (live, attached, replayed: the same
path). Memory is bounded whatever the run length: a fixed recent window of steps, log-bucket
histograms since start, and multi-resolution time series.
"""

from __future__ import annotations

import math
import re
import signal as _signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from perfmon.protocol import ALL_PHASES, OUTSIDE_KINDS, PHASES, STEP_FIELDS, exception_line

RECENT_STEPS = 200
#: Telemetry kept as multi-resolution series (sparklines over the whole run).
HOST_MEANS = ("cpu_percent", "workers_cpu_percent", "system_cpu_percent")
SERIES = ("cpu", "rss", "gpu_util", "gpu_mem", "cuda_alloc", "workers_cpu")


class Histogram:
    """Log-spaced buckets (2% wide): quantiles within ~1% over any number of values.

    ``n`` counts values exactly; bucket counts may be weighted (a fast job's live stream sends the newest
    rows of each tick, each standing for the rows it summarises in bulk), so quantiles use ``weight``.
    """

    RATIO = 1.02

    def __init__(self) -> None:
        self.counts: dict[int, float] = {}
        self.n = 0
        self.weight = 0.0
        self.zeros = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.weight += 1.0
        if x <= 1e-6:
            self.zeros += 1
            return
        k = math.floor(math.log(x) * _INV_LOG_RATIO)
        self.counts[k] = self.counts.get(k, 0) + 1

    def add_many(self, values: list[float], weight: float = 1.0, extra: int = 0) -> None:
        """``add`` for each value, in one pass (the monitor folds thousands of steps per message); each
        counts ``weight`` times in the quantiles, and ``extra`` values summarised elsewhere count in ``n``."""
        log, floor, inv = math.log, math.floor, _INV_LOG_RATIO
        keys = [floor(log(x) * inv) for x in values if x > 1e-6]
        self.n += len(values) + extra
        self.weight += len(values) * weight
        self.zeros += (len(values) - len(keys)) * weight
        counts = self.counts
        for k, c in Counter(keys).items():
            counts[k] = counts.get(k, 0) + c * weight

    def quantile(self, q: float) -> float | None:
        if not self.n or self.weight <= 0:
            return None
        rank = q * (self.weight - 1) if self.weight >= 1 else 0.0
        seen = self.zeros
        if rank < seen:
            return 0.0
        for k in sorted(self.counts):
            seen += self.counts[k]
            if rank < seen:
                return self.RATIO ** (k + 0.5)  # bucket midpoint (geometric)
        return self.RATIO ** (max(self.counts) + 0.5)


_INV_LOG_RATIO = 1.0 / math.log(Histogram.RATIO)


class TimeSeries:
    """Fine recent, coarse old: each level keeps a fixed number of (bucket, mean, max) points."""

    LEVELS = ((1.0, 600), (10.0, 720), (60.0, 1440), (600.0, 1008))  # 10 min, 2 h, 24 h, 7 days

    def __init__(self) -> None:
        self.levels: list[deque[list[float]]] = [deque(maxlen=n) for _, n in self.LEVELS]

    def add(self, t: float, value: float) -> None:
        # O(1) per value: only the finest level is touched; a closed bucket rolls up once
        res = self.LEVELS[0][0]
        bucket = math.floor(t / res) * res
        points = self.levels[0]
        if points and points[-1][0] == bucket:
            p = points[-1]
            p[1] += value
            p[2] += 1
            if value > p[3]:
                p[3] = value
        else:
            if points:
                self._roll(1, points[-1])
            points.append([bucket, value, 1, value])

    def _roll(self, level: int, closed: list[float]) -> None:
        if level >= len(self.LEVELS):
            return
        res = self.LEVELS[level][0]
        bucket = math.floor(closed[0] / res) * res
        points = self.levels[level]
        if points and points[-1][0] == bucket:
            p = points[-1]
            p[1] += closed[1]
            p[2] += closed[2]
            p[3] = max(p[3], closed[3])
        else:
            if points:
                self._roll(level + 1, points[-1])
            points.append([bucket, closed[1], closed[2], closed[3]])

    def span_covered(self, level: int) -> float:
        res, n = self.LEVELS[level]
        return res * n

    def values(self, span: float | None, now: float | None = None) -> list[float]:
        """Bucket means over the last ``span`` seconds (None: the whole run), finest level that covers it."""
        now = now if now is not None else self._last()
        if now is None:
            return []
        level = len(self.LEVELS) - 1
        want = span if span is not None else now - self._first()
        for i in range(len(self.LEVELS)):
            first = self.levels[i][0][0] if self.levels[i] else now
            if now - first >= want or len(self.levels[i]) < self.LEVELS[i][1]:
                level = i
                break
        cut = now - want if span is not None else -math.inf
        return [p[1] / p[2] for p in self.levels[level] if p[0] >= cut - self.LEVELS[level][0]]

    def _last(self) -> float | None:
        return self.levels[0][-1][0] if self.levels[0] else None

    def _first(self) -> float:
        for points in reversed(self.levels):
            if points:
                return points[0][0]
        return 0.0


@dataclass
class PhaseTotals:
    total_ms: float = 0.0
    hist: Histogram = field(default_factory=Histogram)


@dataclass
class ExitInfo:
    code: int | None = None
    signal: str | None = None
    exception: str | None = None
    traceback: str | None = None
    t: float | None = None


class RunState:
    """Aggregates of one run, built from its message stream."""

    def __init__(self, recent: int = RECENT_STEPS) -> None:
        self.meta: dict[str, Any] = {}
        self.steps = 0
        self.recent: deque[dict[str, float]] = deque(maxlen=recent)
        self.totals: dict[str, PhaseTotals] = {p: PhaseTotals() for p in (*ALL_PHASES, "step")}
        self.samples_total = 0
        self.samples_steps = 0
        #: ms spent outside training steps, by kind (evaluation, checkpoint, other)
        self.outside_ms: dict[str, float] = dict.fromkeys(OUTSIDE_KINDS, 0.0)
        self.closures_total = 0  # closure evaluations (forwards inside optimizer.step), all steps
        self.closure_steps = 0  # steps that reported closures
        #: steps a fast job's live stream summarised (``bulk``): counted and summed exactly, their percentiles
        #: estimated from the rows sent beside them; the recording has every row
        self.bulk_steps = 0
        self.windowed_steps = 0  # steps inside profiler / FLOP-counter windows: left out of the phase statistics
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.step_series = TimeSeries()
        self.exit: ExitInfo | None = None
        self.last_seq = 0
        self.skipped = 0
        self.warnings: list[str] = []
        self.agent_errors: dict[str, int] = {}
        self.device_timed = False
        self.host: dict[str, Any] | None = None
        self.gpus: list[dict[str, Any]] = []
        self.cuda_mem: dict[str, Any] | None = None
        self.model: dict[str, Any] | None = None
        self.samples_seen = 0
        self.series: dict[str, TimeSeries] = {k: TimeSeries() for k in SERIES}
        self.peaks: dict[str, float] = {}
        self._cpu_sum = 0.0
        self._cpu_n = 0
        self.sampler_cpu_s = 0.0
        self.sample_interval = 1.0
        self.profiles: deque[dict[str, Any]] = deque(maxlen=20)
        self.profiling: dict[str, Any] | None = None
        self.command_results: deque[dict[str, Any]] = deque(maxlen=50)
        self.windows: deque[list[float]] = deque(maxlen=64)
        # raw memory readings (rss, cuda allocated) for leak detection, newest 600
        self.memory_samples: dict[str, deque[float]] = {"rss": deque(maxlen=600), "cuda_alloc": deque(maxlen=600)}  # [start, stop] of profiler/FLOP windows
        # host samples taken while steps advanced: the rules judge CPU use over these, not one instant
        self.busy_hosts: deque[dict[str, Any]] = deque(maxlen=10)
        self._steps_at_sample = 0

    # -- ingest -------------------------------------------------------------------------
    def apply(self, msg: dict[str, Any]) -> None:
        """Fold one message in; duplicates (by ``seq``) are ignored."""
        seq = msg.get("seq")
        if isinstance(seq, int):
            if seq <= self.last_seq:
                return
            self.last_seq = seq
        kind = msg.get("type")
        if kind == "reset":  # a replay restarting from the beginning (never from a socket or file)
            self.__init__(recent=self.recent.maxlen or RECENT_STEPS)  # type: ignore[misc]
            return
        try:
            if kind == "hello":
                self.meta.update({k: v for k, v in msg.items() if k not in ("v", "type", "seq", "live_seq")})
            elif kind == "steps":
                self._add_steps(msg)
            elif kind == "event":
                self._event(msg)
            elif kind == "sample":
                self._sample(msg)
            elif kind == "profile":
                self.profiles.append({k: v for k, v in msg.items() if k not in ("v", "type")})
                self.profiling = None
            elif kind == "model":
                # model facts arrive in pieces (parameters, then FLOPs): merge them
                self.model = {**(self.model or {}), **{k: v for k, v in msg.items() if k not in ("v", "type", "seq")}}
        except (TypeError, ValueError, KeyError):
            self.skipped += 1

    def _add_steps(self, msg: dict[str, Any]) -> None:
        """Fold a ``steps`` message's rows (a wrong-length row is dropped; a bad value stops the message).

        The monitor's hot loop: tens of thousands of rows a second from a fast job. Rows are read by
        column index, histograms are filled once per message, and step dicts are built only for the
        rows that end up in ``recent``.
        """
        outside = msg.get("outside")
        if isinstance(outside, dict):
            for kind in OUTSIDE_KINDS:
                value = outside.get(f"{kind}_ms")
                if isinstance(value, int | float) and value > 0:
                    self.outside_ms[kind] += float(value)
        fields = msg.get("fields", STEP_FIELDS)
        rows = msg.get("rows")
        if not isinstance(fields, list | tuple) or not isinstance(rows, list):
            return
        col = {f: k for k, f in enumerate(fields)}
        i_closures = col.get("closures")
        i_i, i_t, i_dur = col["i"], col["t"], col["dur_ms"]
        phase_cols = [(col.get(f"dev_{p}_ms"), col[f"{p}_ms"]) for p in PHASES]
        i_samples, i_dev_fwd = col.get("samples"), col.get("dev_forward_ms")

        def read(row: list[Any]) -> tuple[int, float, float, list[float], float, int]:
            dur = float(row[i_dur])
            values = [float(row[dev] if dev is not None and row[dev] is not None else row[host])
                      for dev, host in phase_cols]
            samples = row[i_samples] if i_samples is not None else None
            samples = int(samples) if isinstance(samples, int | float) and samples > 0 else 0
            return int(row[i_i]), float(row[i_t]), dur, values, max(0.0, dur - sum(values)), samples

        good = [r for r in rows if isinstance(r, list) and len(r) == len(fields)]
        columns: list[list[float]] = [[] for _ in ALL_PHASES] + [[]]  # per phase, then other, step
        series_add = self.step_series.add
        # profiler / FLOP-counter windows that may hold these rows (rows come in time order; windows are few)
        first_t = float(good[0][i_t]) - float(good[0][i_dur]) / 1000.0 if good else 0.0
        windows = [(b, e) for b, e in self.windows if e > first_t]
        windowed: list[bool] = []
        done = 0
        try:
            for row in good:
                index, t, dur, values, other, samples = read(row)
                if i_dev_fwd is not None and row[i_dev_fwd] is not None:
                    self.device_timed = True
                start = t - dur / 1000.0
                inside = bool(windows) and any(start < stop and t > begin for begin, stop in windows)
                windowed.append(inside)
                if inside:  # slowed down by the profiler: not in the phase statistics, counted apart
                    self.windowed_steps += 1
                else:
                    for column, value in zip(columns, (*values, other, dur), strict=True):
                        column.append(value)
                if index > self.steps:
                    self.steps = index
                if samples:
                    self.samples_total += samples
                    self.samples_steps += 1
                if i_closures is not None and isinstance(row[i_closures], int):
                    self.closures_total += row[i_closures]
                    self.closure_steps += 1
                if self.first_start is None or start < self.first_start:
                    self.first_start = start
                if self.last_end is None or t > self.last_end:
                    self.last_end = t
                series_add(t, dur)
                done += 1
        finally:  # the rows before a bad one count, as they did one by one
            bulk = self._bulk(msg.get("bulk"), done, columns[-1])
            weight = 1.0 + bulk / len(columns[-1]) if bulk else 1.0
            for name, column in zip((*ALL_PHASES, "step"), columns, strict=True):
                tot = self.totals[name]
                tot.total_ms += sum(column)
                tot.hist.add_many(column, weight, bulk)
            first = max(0, done - (self.recent.maxlen or done))
            for row, inside in zip(good[first:done], windowed[first:done], strict=True):
                index, t, dur, values, other, samples = read(row)
                self.recent.append({
                    "i": index, "t": t, "dur": dur, **dict(zip(PHASES, values, strict=True)), "other": other,
                    "samples": samples, "windowed": inside,
                })

    def _bulk(self, bulk: Any, done: int, kept: list[float]) -> int:
        """Fold a ``bulk`` summary (rows of a fast job not sent live); the count it adds to the histograms."""
        if not isinstance(bulk, dict) or done == 0 or not kept:
            return 0  # a message cut short by a bad row, or all of its rows in a profiler window: left out
        n, sums = bulk.get("n"), bulk.get("sum_ms")
        if not isinstance(n, int) or n <= 0 or not isinstance(sums, dict):
            return 0
        for name, key in ((*zip(ALL_PHASES, ALL_PHASES, strict=True), ("step", "dur"))):
            value = sums.get(key)
            if isinstance(value, int | float):
                self.totals[name].total_ms += float(value)
        for key, attr in (("samples", "samples_total"), ("samples_steps", "samples_steps"),
                          ("closures", "closures_total"), ("closure_steps", "closure_steps")):
            value = bulk.get(key)
            if isinstance(value, int) and value > 0:
                setattr(self, attr, getattr(self, attr) + value)
        last, start = bulk.get("last_i"), bulk.get("first_start")
        if isinstance(last, int) and last > self.steps:
            self.steps = last
        if isinstance(start, int | float) and (self.first_start is None or start < self.first_start):
            self.first_start = float(start)
        self.bulk_steps += n
        return n

    def _peak(self, key: str, value: Any) -> None:
        if isinstance(value, int | float):
            self.peaks[key] = max(self.peaks.get(key, value), value)

    def _sample(self, msg: dict[str, Any]) -> None:
        t = float(msg["t"])
        host = msg.get("host")
        self.samples_seen += 1
        if isinstance(msg.get("sampler_cpu_s"), int | float):
            self.sampler_cpu_s += msg["sampler_cpu_s"]
        if isinstance(msg.get("interval_s"), int | float):
            self.sample_interval = msg["interval_s"]
        if isinstance(host, dict):
            self.host = host
            if self.steps > self._steps_at_sample:
                self.busy_hosts.append(host)
            self._steps_at_sample = self.steps
            cpu = host.get("cpu_percent")
            if isinstance(cpu, int | float):
                self.series["cpu"].add(t, cpu)
                self._cpu_sum += cpu
                self._cpu_n += 1
                self._peak("cpu_percent", cpu)
            rss = host.get("rss_bytes")
            if isinstance(rss, int | float):
                self.series["rss"].add(t, rss)
                if self.steps > 10:  # past warm-up: imports and first allocations are not a leak
                    self.memory_samples["rss"].append(rss)
                self._peak("rss_bytes", rss)
            self._peak("workers_rss_bytes", host.get("workers_rss_bytes"))
            if host.get("workers") and isinstance(host.get("workers_cpu_percent"), int | float):
                self.series["workers_cpu"].add(t, host["workers_cpu_percent"])
        gpus = msg.get("gpus")
        if isinstance(gpus, list):
            self.gpus = [_proc_mem_known(g) for g in gpus if isinstance(g, dict)]
            if self.gpus:
                g0 = self.gpus[0]
                if isinstance(g0.get("util_gpu"), int | float):
                    self.series["gpu_util"].add(t, g0["util_gpu"])
                    self._peak("util_gpu", g0["util_gpu"])
                if isinstance(g0.get("mem_used_bytes"), int | float):
                    self.series["gpu_mem"].add(t, g0["mem_used_bytes"])
        cm = msg.get("cuda_mem")
        self.cuda_mem = cm if isinstance(cm, dict) else self.cuda_mem
        if self.cuda_mem and isinstance(self.cuda_mem.get("allocated_bytes"), int | float):
            self.series["cuda_alloc"].add(t, self.cuda_mem["allocated_bytes"])
            if self.steps > 10:
                self.memory_samples["cuda_alloc"].append(self.cuda_mem["allocated_bytes"])
        if self.cuda_mem:
            self._peak("peak_reserved_bytes", self.cuda_mem.get("peak_reserved_bytes"))
            self._peak("peak_allocated_bytes", self.cuda_mem.get("peak_allocated_bytes"))
            if self.steps > 10:  # past the first steps' one-off allocations (autotune workspaces, lazy state)
                self._peak("steady_peak_allocated_bytes", self.cuda_mem.get("window_peak_allocated_bytes"))

    def recent_host(self) -> dict[str, Any] | None:
        """The latest host sample with its CPU percentages averaged over the recent samples taken while
        training stepped (an instant right after the loop ends, or between bursts, would mislead)."""
        if not self.busy_hosts:
            return self.host
        out = dict(self.busy_hosts[-1])
        for key in HOST_MEANS:
            values = [h[key] for h in self.busy_hosts if isinstance(h.get(key), int | float)]
            if values:
                out[key] = sum(values) / len(values)
        return out

    @property
    def mean_cpu_percent(self) -> float | None:
        return self._cpu_sum / self._cpu_n if self._cpu_n else None

    def batch_size(self) -> int | None:
        """Typical samples per step over the recent window (median)."""
        values = sorted(s["samples"] for s in self.recent if s["samples"])
        return values[len(values) // 2] if values else None

    def flops(self) -> dict[str, Any]:
        """FLOPs per step, achieved FLOP/s from the recent step time, and MFU where a peak is known."""
        from perfmon.analysis.peaks import peak_tflops

        per_step = (self.model or {}).get("flops_per_step")
        step_ms = self.phase_stats(recent=True)["step"]["mean_ms"]
        achieved = per_step / (step_ms / 1000.0) if per_step and step_ms else None
        peak = self.meta.get("peak_tflops")
        source = "--peak-tflops" if peak else None
        if not peak and self.gpus:
            peak = peak_tflops(self.gpus[0].get("name"))
            source = f"{self.gpus[0].get('name')} dense bf16" if peak else None
        mfu = achieved / (peak * 1e12) if achieved and peak else None
        reason = None
        if mfu is None:
            reason = ("no FLOP count yet (press f)" if not per_step else
                      "no known peak for this device: pass --peak-tflops" if self.gpus else
                      "CPU run: MFU needs --peak-tflops")
        return {"flops_per_step": per_step, "achieved_flops": achieved, "peak_tflops": peak,
                "peak_source": source, "mfu": mfu, "reason": reason}

    def memory_budget(self) -> dict[str, Any]:
        """Static vs per-step peak memory, per-sample activation memory, the largest batch that fits."""
        model = self.model or {}
        static = model.get("static_bytes")
        out: dict[str, Any] = {"static_bytes": static, "peak_bytes": None, "activation_bytes": None,
                               "per_sample_bytes": None, "batch": self.batch_size(), "max_batch": None,
                               "capacity_bytes": None, "margin": None, "peak_source": None, "reason": None}
        if not self.cuda_mem or not self.gpus:
            out["reason"] = ("CPU run: no allocator statistics, activation memory cannot be told apart from "
                             "the process's RSS" if self.meta.get("cuda") is not True else "waiting for allocator statistics")
            return out
        capacity = self.gpus[0].get("total_bytes")
        # the steady-state per-step peak (sample windows past the first steps) where window peaks
        # are on; the peak since start otherwise, which may hold a first-step spike
        peak = self.peaks.get("steady_peak_allocated_bytes")
        out["peak_source"] = "steady state"
        if peak is None:
            peak, out["peak_source"] = self.cuda_mem.get("peak_allocated_bytes"), "since start"
        reserved_peak = self.cuda_mem.get("peak_reserved_bytes")
        out.update(capacity_bytes=capacity, peak_bytes=peak)
        if isinstance(capacity, int | float) and isinstance(reserved_peak, int | float) and capacity:
            out["margin"] = 1.0 - reserved_peak / capacity
        if not isinstance(static, int | float) or not isinstance(peak, int | float):
            out["reason"] = "waiting for model facts"
            return out
        activation = max(0, peak - static)
        out["activation_bytes"] = activation
        batch = out["batch"]
        if not batch or not activation:
            out["reason"] = "batch size unknown (no DataLoader batches seen)" if not batch else None
            return out
        per_sample = activation / batch
        out["per_sample_bytes"] = int(per_sample)
        if isinstance(capacity, int | float):
            # keep 5% of the device for the allocator's own slack and the CUDA context
            out["max_batch"] = max(0, int((capacity * 0.95 - static) // per_sample))
        return out

    def _event(self, msg: dict[str, Any]) -> None:
        kind = msg.get("kind")
        if kind == "exit":
            self.exit = ExitInfo(
                code=msg.get("code"), signal=msg.get("signal"), exception=exception_line(msg.get("exception")),
                traceback=msg.get("traceback"), t=msg.get("t"),
            )
            if isinstance(msg.get("agent_errors"), dict):
                self.agent_errors = dict(msg["agent_errors"])
            self.profiling = None  # no window is being captured once the job is over
        elif kind == "window_started" and isinstance(msg.get("t"), int | float):
            self.windows.append([float(msg["t"]), math.inf])
        elif kind == "window_stopped" and isinstance(msg.get("t"), int | float) and self.windows:
            self.windows[-1][1] = float(msg["t"])
        elif kind == "profile_started":
            self.profiling = {"reason": msg.get("reason"), "t": msg.get("t"), "step": self.steps}
        elif kind == "command_result":
            self.command_results.append({k: v for k, v in msg.items() if k not in ("v", "type")})
        elif kind == "warning" and isinstance(msg.get("message"), str):
            self.warnings.append(msg["message"])
            del self.warnings[:-50]

    def process_exited(self, returncode: int, t: float | None = None) -> None:
        """The launcher saw the process end: fill in what the agent could not say (signals)."""
        sig = _signal_name(-returncode) if returncode < 0 else None
        self.profiling = None
        if self.exit is None:
            self.exit = ExitInfo(code=None if sig else returncode, signal=sig, t=t or time.time())
        elif sig and not self.exit.signal:
            self.exit.signal, self.exit.code = sig, None

    # -- derived ------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """``starting``, ``running``, ``exited 0``, ``failed: ValueError``,
        ``failed: SyntaxError (syn.py line 2)``, ``killed by SIGKILL``: always one line."""
        if self.exit is None:
            return "running" if self.meta else "starting"
        if self.exit.signal:
            return f"killed by {self.exit.signal}"
        if self.exit.exception:
            m = re.match(r"([\w.]+)(?::.*?)?(\s\([^()]* line \d+\))?$", self.exit.exception)
            return f"failed: {m[1]}{m[2] or ''}" if m else "failed"
        return f"exited {self.exit.code}"

    @property
    def exit_status(self) -> int | None:
        """The shell-style status: code, or 128+N for a signal."""
        if self.exit is None:
            return None
        if self.exit.signal:
            num = getattr(_signal, self.exit.signal, None)
            return 128 + int(num) if num is not None else 1
        return self.exit.code

    def elapsed(self, now: float | None = None) -> float:
        start = self.meta.get("start")
        if not isinstance(start, int | float):
            return 0.0
        end = self.exit.t if self.exit and self.exit.t else (now if now is not None else time.time())
        return max(0.0, end - start)

    def steps_per_s(self, recent: bool = True) -> float | None:
        if recent:
            if len(self.recent) < 2:
                return None
            first, last = self.recent[0], self.recent[-1]
            span = last["t"] - (first["t"] - first["dur"] / 1000.0)
            # by index, not by row count: a fast job's live stream sends only the newest rows of each tick
            return (last["i"] - first["i"] + 1) / span if span > 0 else None
        if not self.steps or self.first_start is None or self.last_end is None:
            return None
        span = self.last_end - self.first_start
        return self.steps_folded / span if span > 0 else None

    @property
    def steps_folded(self) -> int:
        """Step rows folded in, profiled ones included (the phase statistics leave those out)."""
        return self.totals["step"].hist.n + self.windowed_steps

    def samples_per_s(self, recent: bool = True) -> float | None:
        if recent:
            rows = [s for s in self.recent if s["samples"]]
            if len(rows) < 2 or len(rows) < len(self.recent) // 2:
                return None
            rate = self.steps_per_s(recent=True)
            return None if rate is None else rate * sum(s["samples"] for s in self.recent) / len(self.recent)
        sps = self.steps_per_s(recent=False)
        if not self.samples_steps or sps is None:
            return None
        return sps * self.samples_total / self.steps_folded

    def outside_shares(self) -> dict[str, float] | None:
        """Share of the job's wall time spent outside training steps, by kind (None: none seen)."""
        total = sum(self.outside_ms.values())
        wall = self.elapsed() * 1000.0
        if total <= 0 or wall <= 0:
            return None
        return {k: min(1.0, v / wall) for k, v in self.outside_ms.items()}

    def closures_per_step(self) -> float | None:
        """Mean closure evaluations per step (LBFGS-style ``step(closure)``), None when there are none."""
        if not self.closures_total:
            return None
        return self.closures_total / max(1, self.closure_steps)

    def phase_stats(self, recent: bool = True) -> dict[str, dict[str, float | None]]:
        """Per phase (and ``step``): mean, p50, p95 in ms and share of step time."""
        out: dict[str, dict[str, float | None]] = {}
        if recent:
            rows = [s for s in self.recent if not s["windowed"]]
            total = sum(s["dur"] for s in rows) or 0.0
            for p in (*ALL_PHASES, "step"):
                values = sorted(s["dur" if p == "step" else p] for s in rows)
                out[p] = _stats(values, total)
        else:
            total = self.totals["step"].total_ms
            for p in (*ALL_PHASES, "step"):
                tot = self.totals[p]
                n = tot.hist.n
                out[p] = {
                    "mean_ms": tot.total_ms / n if n else None,
                    "p50_ms": tot.hist.quantile(0.5),
                    "p95_ms": tot.hist.quantile(0.95),
                    "share": tot.total_ms / total if total > 0 else None,
                }
        return out


def _stats(values: list[float], total: float) -> dict[str, float | None]:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p95_ms": None, "share": None}
    n = len(values)
    return {
        "mean_ms": sum(values) / n,
        "p50_ms": _quantile(values, 0.5),
        "p95_ms": _quantile(values, 0.95),
        "share": sum(values) / total if total > 0 else None,
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


#: A recording from before ``proc_mem_reason``: its 0 meant "pid not in NVML's process list", not 0 bytes.
LEGACY_PROC_MEM_REASON = "pid not in NVML's process list (container PID namespace?)"


def _proc_mem_known(gpu: dict[str, Any]) -> dict[str, Any]:
    """A GPU reading whose per-process memory is never a 0 that stands for "not found": older agents
    sent 0 when NVML did not list the pid; that is unknown (None, with the reason), not 0 bytes."""
    if "proc_mem_reason" not in gpu and gpu.get("proc_mem_bytes") == 0:
        return {**gpu, "proc_mem_bytes": None, "proc_mem_reason": LEGACY_PROC_MEM_REASON}
    return gpu
