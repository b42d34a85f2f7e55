"""``--prometheus [HOST:]PORT``: the monitor's numbers as a Prometheus / OpenMetrics endpoint.

Pull only: nothing is computed until a scrape, and then from the monitor's state (never the job), so the
training process pays nothing for it. One label set per rank for a multi-rank job (``rank``, ``node``).
Names follow Prometheus conventions: ``perfmon_`` prefix, base units (seconds, bytes, ratios 0..1),
``_total`` for counters. Needs ``prometheus_client`` (``pip install 'perfmon[metrics]'``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from perfmon.analysis.job import JobState, rank_rows
from perfmon.analysis.rules import Config, Finding, evaluate_job, evaluate_once
from perfmon.analysis.state import RunState
from perfmon.protocol import ALL_PHASES

#: Step time histogram buckets, seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INSTALL = "pip install 'perfmon[metrics]' (prometheus_client)"


class MetricsError(Exception):
    """The endpoint cannot start: one line for the user."""


@dataclass
class RankSnapshot:
    """One run's (or one rank's) numbers, copied under the state lock at a scrape."""

    labels: dict[str, str]
    running: bool
    steps: int
    samples: int
    step_buckets: list[float]  # cumulative, per BUCKETS
    step_count: float
    step_sum_s: float
    phase_s: dict[str, float]
    steps_per_s: float | None
    samples_per_s: float | None
    gpus: list[tuple[str, dict[str, float | None]]]  # (index, readings)
    allocator: dict[str, float | None]
    cpu_ratio: float | None
    rss_bytes: float | None
    mfu: float | None
    findings: list[Finding] = field(default_factory=list)


def _snapshot(labels: dict[str, str], state: RunState, findings: list[Finding]) -> RankSnapshot:
    totals = state.totals
    hist = totals["step"].hist
    # the histogram holds milliseconds. A fast job's live rows are weighted (each stands for rows summarised in
    # bulk): the buckets are scaled to the exact step count and rounded, as OpenMetrics wants whole counts
    count = hist.n
    scale = count / hist.weight if hist.weight > 0 else 0.0
    buckets = [min(round(b * scale), count) for b in hist.cumulative([b * 1000.0 for b in BUCKETS])]
    host = state.host
    cm = state.cuda_mem
    gpus = [(str(g.index if g.index is not None else i), {
        "util": g.util_gpu / 100.0 if g.util_gpu is not None else None, "used": g.mem_used_bytes,
        "total": g.total_bytes, "power": g.power_w}) for i, g in enumerate(state.gpus)]
    return RankSnapshot(
        labels=labels, running=state.exit is None, steps=state.steps, samples=state.samples_total,
        step_buckets=buckets, step_count=count, step_sum_s=totals["step"].total_ms / 1000.0,
        phase_s={p: totals[p].total_ms / 1000.0 for p in ALL_PHASES},
        steps_per_s=state.steps_per_s(), samples_per_s=state.samples_per_s(), gpus=gpus,
        allocator={"reserved": cm.reserved_bytes if cm else None, "allocated": cm.allocated_bytes if cm else None,
                   "peak_allocated": (cm.peak_allocated_bytes if cm else None) or state.peaks.allocated_bytes},
        cpu_ratio=host.cpu_percent / 100.0 if host and host.cpu_percent is not None else None,
        rss_bytes=host.rss_bytes if host else None, mfu=state.flops().mfu, findings=findings,
    )


class Sources:
    """What the endpoint reads: a single run's state, or a job's, under the monitor's lock (set by
    :meth:`Endpoint.watch` once the monitor has them: the endpoint listens before the job starts)."""

    def __init__(self, lock: threading.Lock | None = None, state: Callable[[], RunState | None] = lambda: None,
                 job: JobState | None = None, cfg: Config | None = None) -> None:
        self.lock = lock or threading.Lock()
        self.state = state
        self.job = job
        self.cfg = cfg or Config()

    def snapshots(self) -> list[RankSnapshot]:
        cfg = self.cfg
        with self.lock:
            if self.job is None:
                state = self.state()
                return [] if state is None else [_snapshot({}, state, evaluate_once(state, cfg))]
            across = evaluate_job(rank_rows(self.job, cfg.warmup_steps, cfg.min_steps), cfg)
            out = []
            for rank in sorted(self.job.ranks):
                state = self.job.ranks[rank]
                labels = {"rank": str(rank), "node": "" if state.meta.node is None else str(state.meta.node)}
                mine = [f for f in across if f.evidence.get("rank") in (rank, None)]  # a job-wide one: on every rank
                out.append(_snapshot(labels, state, mine + evaluate_once(state, cfg)))
            return out


def _families(snaps: list[RankSnapshot]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    keys = sorted({k for s in snaps for k in s.labels})

    def lv(s: RankSnapshot, *extra: str) -> list[str]:
        return [s.labels.get(k, "") for k in keys] + list(extra)

    def gauge(name: str, doc: str, value: Callable[[RankSnapshot], float | None]) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=keys)
        for s in snaps:
            v = value(s)
            if v is not None:
                fam.add_metric(lv(s), float(v))
        return fam

    hist = HistogramMetricFamily("perfmon_step_seconds", "Training step time (steps past profiler windows)",
                                 labels=keys)
    for s in snaps:
        hist.add_metric(lv(s), [(repr(b), c) for b, c in zip(BUCKETS, s.step_buckets, strict=True)]
                        + [("+Inf", s.step_count)], s.step_sum_s)
    yield hist
    phases = CounterMetricFamily("perfmon_phase_seconds", "Time in each step phase", labels=[*keys, "phase"])
    for s in snaps:
        for phase, secs in s.phase_s.items():
            phases.add_metric(lv(s, phase), secs)
    yield phases
    steps = CounterMetricFamily("perfmon_steps", "Training steps completed", labels=keys)
    samples = CounterMetricFamily("perfmon_samples", "Training samples consumed (batch sizes seen)", labels=keys)
    for s in snaps:
        steps.add_metric(lv(s), s.steps)
        samples.add_metric(lv(s), s.samples)
    yield steps
    yield samples
    yield gauge("perfmon_steps_per_second", "Steps per second over the recent steps", lambda s: s.steps_per_s)
    yield gauge("perfmon_samples_per_second", "Samples per second over the recent steps", lambda s: s.samples_per_s)
    yield gauge("perfmon_running", "1 while the job runs, 0 once it exited", lambda s: 1.0 if s.running else 0.0)
    gpu_keys = [*keys, "gpu"]
    for name, key, doc in (("perfmon_gpu_utilization_ratio", "util", "GPU busy (NVML), 0..1"),
                           ("perfmon_gpu_memory_used_bytes", "used", "GPU memory used by every process"),
                           ("perfmon_gpu_memory_total_bytes", "total", "GPU memory"),
                           ("perfmon_gpu_power_watts", "power", "GPU power draw")):
        fam = GaugeMetricFamily(name, doc, labels=gpu_keys)
        for s in snaps:
            for index, reading in s.gpus:
                if reading[key] is not None:
                    fam.add_metric(lv(s, index), float(reading[key] or 0.0))
        yield fam
    for key, doc in (("reserved", "CUDA caching allocator: reserved"), ("allocated", "CUDA allocator: allocated"),
                     ("peak_allocated", "CUDA allocator: peak allocated since start")):
        yield gauge(f"perfmon_allocator_{key}_bytes", doc, lambda s, key=key: s.allocator[key])
    yield gauge("perfmon_process_cpu_ratio", "The training process's CPU use (1 = one core busy)",
                lambda s: s.cpu_ratio)
    yield gauge("perfmon_process_resident_memory_bytes", "The training process's RSS", lambda s: s.rss_bytes)
    yield gauge("perfmon_mfu_ratio", "Model FLOP utilization, 0..1", lambda s: s.mfu)
    findings = GaugeMetricFamily("perfmon_finding", "Active findings: 1 per finding (id, severity)",
                                 labels=[*keys, "id", "severity"])
    for s in snaps:
        for f in s.findings:
            findings.add_metric(lv(s, f.id, f.severity), 1.0)
    yield findings


class _Collector:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        yield from _families(self.sources.snapshots())

    def describe(self) -> list[Any]:
        return []  # collected at each scrape: nothing to check at registration


def parse_address(value: str) -> tuple[str, int]:
    """``PORT`` (loopback) or ``HOST:PORT``; raises ValueError with a message for the user."""
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--prometheus wants PORT or HOST:PORT, got {value!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


class Endpoint:
    """The HTTP endpoint (prometheus_client's own server, on a thread of its own)."""

    def __init__(self, address: str, sources: Sources | None = None) -> None:
        sources = sources or Sources()
        self.sources = sources
        try:
            import prometheus_client
        except ImportError:
            raise MetricsError(f"--prometheus needs prometheus_client: {INSTALL}") from None
        try:
            self.host, self.port = parse_address(address)
        except ValueError as exc:
            raise MetricsError(str(exc)) from None
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(sources))  # type: ignore[arg-type]
        try:
            self.server, self.thread = prometheus_client.start_http_server(self.port, self.host,
                                                                           registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"--prometheus {address}: cannot listen ({exc.strerror or exc})") from None
        self.port = self.server.server_port

    def watch(self, lock: threading.Lock, state: Callable[[], RunState | None] | None = None,
              job: JobState | None = None, cfg: Config | None = None, send: Any = None) -> None:
        """Serve this monitor's state (``state()``: the run's) or job from now on."""
        self.sources.lock = lock
        if state is not None:
            self.sources.state = state
        self.sources.job = job
        if cfg is not None:
            self.sources.cfg = cfg

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
