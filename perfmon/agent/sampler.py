"""The agent's sampler: host, GPU and allocator telemetry, and model facts, at 1-2 Hz.

Runs off the training thread; its own CPU time is measured and reported (``cpu_s``) so its
cost is visible. Every collector failure is counted, never raised.

*Fed* (the job's launcher started it with ``PERFMON_SAMPLER=launcher``): the launcher reads the host and the GPUs
from outside the job, where that CPU is not the job's, and sends each reading over the socket
(:meth:`Sampler.take_fed`); the job adds only what it alone can read (the CUDA allocator, torch's threads, the
model) and records it. No thread of its own runs then, until the feed stops coming: a launcher killed or hung.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from perfmon import protocol
from perfmon.agent import own_threads
from perfmon.collectors.cuda_mem import CudaMemorySampler
from perfmon.collectors.host import HostSampler
from perfmon.collectors.nvml import NvmlSampler, cuda_initialized


def model_facts(roots: list[Any], optimizers: list[Any]) -> dict[str, Any] | None:
    """Parameter counts of the root modules, by dtype, and optimizer state bytes."""
    if not roots:
        return None
    seen: set[int] = set()
    total = nbytes = 0
    # trainable: what an optimizer updates, where an optimizer updates the roots' parameters. A target network
    # (TD3's, DQN's) keeps requires_grad=True and is never stepped: it is frozen, and it holds no gradients. (A
    # model trained through fp32 master copies, whose optimizer holds none of its own: requires_grad says.)
    optimized = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    wants_grad = [0, 0]  # numel, bytes: requires_grad
    stepped = [0, 0]  # numel, bytes: requires_grad and in an optimizer
    by_dtype: dict[str, int] = {}
    for root in roots:
        for p in root.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            total += n
            size = n * p.element_size()
            nbytes += size
            if p.requires_grad:
                wants_grad[0] += n
                wants_grad[1] += size
                if id(p) in optimized:
                    stepped[0] += n
                    stepped[1] += size
            key = str(p.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + n
    trainable, grad_bytes = stepped if stepped[0] else wants_grad
    opt_bytes = 0
    opt_names = []
    opt_flags = []
    for opt in optimizers:
        opt_names.append(type(opt).__name__)
        d = getattr(opt, "defaults", {})
        # foreach=None is torch's default: the foreach implementation where every parameter is on CUDA (and
        # the optimizer is not differentiable), the per-tensor loop on CPU: say where the parameters are
        devices = {p.device.type for g in opt.param_groups for p in g["params"] if hasattr(p, "device")}
        opt_flags.append({"name": type(opt).__name__, "fused": d.get("fused"), "foreach": d.get("foreach"),
                          "differentiable": bool(d.get("differentiable")), "devices": sorted(devices),
                          "param_tensors": sum(len(g["params"]) for g in opt.param_groups)})
        for st in list(opt.state.values()):
            for v in list(st.values()) if isinstance(st, dict) else ():
                if hasattr(v, "element_size") and hasattr(v, "numel"):
                    opt_bytes += v.numel() * v.element_size()
    return {
        "roots": [type(r).__name__ for r in roots],
        "params": total, "trainable": trainable, "frozen": total - trainable, "by_dtype": by_dtype,
        "param_bytes": nbytes, "grad_bytes": grad_bytes, "optimizer_bytes": opt_bytes,
        "optimizers": opt_names, "optimizer_flags": opt_flags, "static_bytes": nbytes + grad_bytes + opt_bytes,
    }


def perfmon_threads() -> set[int]:
    """perfmon's own threads in the job: not the trainer's when its CPU wait is read."""
    return own_threads.native_ids()


#: The model's facts are recounted at least this often even when nothing they depend on seems to change.
MODEL_RECOUNT_S = 60.0
#: A fed sampler samples for itself when no reading came for this many intervals (the launcher hung or was
#: killed; the publisher, which reads them, may sleep 2 s between ticks), or none within FEED_FIRST_S of the start
#: (it never connected).
FEED_MISSED = 5
FEED_FIRST_S = 5.0
#: The longest a fed sampler goes between two looks at the model and torch's threads while neither changes.
SLOW_FACTS_MAX_S = 8.0


class Sampler:
    """Samples every ``interval`` seconds and publishes ``sample`` and ``model`` messages."""

    def __init__(self, agent: Any, interval: float = 1.0, nvml_backend: Any = None, fed: bool = False) -> None:
        self.agent = agent
        #: the launcher sends the host and GPU readings (:meth:`take_fed`); no thread runs here meanwhile
        self.fed = fed
        self._fed_lock = threading.Lock()
        self._fed_since = 0.0
        self._fed_last: float | None = None
        self.interval = interval
        self.nvml = NvmlSampler(nvml_backend, pid=agent.pid)
        self.host = HostSampler(agent.pid, perfmon_threads)
        self.cuda = CudaMemorySampler(window_peaks=agent.meta.get("window_peaks", True))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._model_sent: tuple[int, int] | None = None
        self._model_seen: tuple | None = None  # what the model, optimizers and loaders looked like at the last count
        self._model_due = 0.0
        self._facts_every = 0.0  # how long a fed sampler waits before its next _slow_facts
        self._facts_due = 0.0
        self._facts_seen: tuple | None = None

    def start(self) -> None:
        reason = self.nvml.open()
        self.agent.meta["gpus"] = self.nvml.static
        self.agent.meta["gpu_reason"] = reason
        self._fed_since = time.monotonic()
        if not self.fed:
            self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="perfmon-sampler", daemon=True)
        self._thread.start()

    def take_fed(self, msg: dict[str, Any], line: bytes | None = None) -> bool:
        """Record a reading the launcher sent (``msg``, decoded from ``line``), with what only the job can read
        added. False where no feed is wanted (any more), or for a reading that is not one of this job's: a
        ``sample`` without host readings, or with other GPUs than the job sees.

        The line is recorded as it came, with the job's fields appended: it is checked, never encoded again (the
        job pays for this once a second, in caches its training left cold)."""
        if not self.fed:
            return False
        t0 = time.thread_time()
        host, gpus, t = msg.get("host"), msg.get("gpus"), msg.get("t")
        if not isinstance(host, dict) or not isinstance(gpus, list) or not isinstance(t, int | float):
            return False
        if [g.get("uuid") for g in gpus if isinstance(g, dict)] != [g.get("uuid") for g in self.nvml.static]:
            return False
        self._fed_last = time.monotonic()
        body = (protocol.encode(msg) if line is None else line).strip()
        if not (body.startswith(b"{") and body.endswith(b"}")):  # JSON that a splice would break
            return False
        try:
            text = body[:-1].decode()
        except UnicodeDecodeError:  # JSON in another encoding than perfmon writes
            return False
        self.agent.publish_text(text + self._job_fields(bool(gpus)) + "}")
        self._slow_facts()
        self.cpu_s = time.thread_time() - t0
        return True

    def _job_fields(self, any_gpu: bool) -> str:
        """What the job adds to a fed reading, as JSON members: who sampled, its own CPU for it, torch's
        threads, whether CUDA is initialised here (NVML's "no context yet" for the job then means "not
        visible"), and the CUDA allocator's counters (where CUDA is initialised, whether or not NVML sees a GPU,
        as the job's own sampler sends them)."""
        out = f',"sampled_by":"launcher","sampler_cpu_s":{round(self.cpu_s, 6)!r}'
        commands = self.agent.commands
        threads = commands.torch_threads if commands is not None else None
        if threads is not None:
            out += f',"torch_threads":{int(threads)}'
        if any_gpu and cuda_initialized():
            out += ',"cuda_context":true'
        mem = self.cuda.sample(self._cuda_device)  # None before torch initialises CUDA
        if mem is not None:
            out += ',"cuda_mem":' + json.dumps(mem, separators=(",", ":"))
        return out

    def _slow_facts(self) -> None:
        """Recount the model and reread torch's threads: at every fed reading until the model is known and while
        either changes (a job starting up), then, while they stay the same, half as often each time, down to
        once every SLOW_FACTS_MAX_S seconds."""
        now = time.monotonic()
        if now < self._facts_due:
            return
        commands = self.agent.commands
        if commands is not None:  # None before the script imports torch
            commands.refresh_torch_threads()  # read at the next step end: what a later look sees
        self._maybe_model()
        seen = (self._model_sent, commands.torch_threads if commands is not None else None)
        changed, self._facts_seen = seen != self._facts_seen, seen
        if changed or self._model_sent is None:
            self._facts_every = 0.0
        else:
            self._facts_every = min(SLOW_FACTS_MAX_S, max(self.interval, self._facts_every * 2))
        self._facts_due = now + self._facts_every * 0.999

    def check_feed(self) -> None:
        """Sample here from now on if the feed stopped coming (the publisher asks at each of its ticks)."""
        if not self.fed:
            return
        now, last = time.monotonic(), self._fed_last
        missed = max(FEED_MISSED * self.interval, FEED_FIRST_S)
        if (now - self._fed_since > FEED_FIRST_S) if last is None else (now - last > missed):
            self.feed_lost()

    def feed_lost(self) -> None:
        """The launcher's readings stopped (its connection closed, or nothing came): start this job's own."""
        with self._fed_lock:
            if not self.fed or self._stop.is_set():
                return
            self.fed = False
            self.host = HostSampler(self.agent.pid, perfmon_threads)  # its CPU % from now, not from the start
            self._start_thread()
        self.agent.close_feed()

    def stop(self) -> None:
        """Stop sampling, and count the model once more: a job shorter than a sample interval (or one whose
        sampler a loaded host kept waiting) still records what it trained."""
        with self._fed_lock:  # no thread starts after this
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._thread is None or not self._thread.is_alive():  # never beside a sample still running
            try:
                self._maybe_model()
            except Exception as exc:  # noqa: BLE001
                self.agent.record_error("sampler", exc)
        self.nvml.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            t0 = time.thread_time()
            try:
                self.sample_once()
            except Exception as exc:  # noqa: BLE001
                self.agent.record_error("sampler", exc)
            self.cpu_s = time.thread_time() - t0

    cpu_s = 0.0

    def sample_once(self) -> None:
        gpus = self.nvml.sample() if self.nvml.handles else []
        self._publish(self.host.sample(), gpus, time.time())

    def _publish(self, host: dict[str, Any], gpus: list[Any], t: float) -> None:
        commands = self.agent.commands
        if commands is not None:  # None before the script imports torch
            host["torch_threads"] = commands.torch_threads
            commands.refresh_torch_threads()  # read afresh for the next sample: one call at a step end
        self.agent.publish(protocol.message(
            "sample", t=t, host=host, gpus=gpus, cuda_mem=self.cuda.sample(self._cuda_device),
            sampler_cpu_s=round(self.cpu_s, 6), interval_s=self.interval,
        ))
        self._maybe_model()

    def _cuda_device(self) -> int:
        """The CUDA device the model's parameters live on (the sampler thread's own current device is 0)."""
        inst = self.agent.instrumentation
        for root in list(inst.roots) if inst is not None else ():
            try:
                p = next(root.parameters(), None)
            except Exception:  # noqa: BLE001
                continue
            if p is not None and p.device.type == "cuda":
                return p.device.index or 0
        return 0

    def _maybe_model(self) -> None:
        inst = self.agent.instrumentation
        if inst is None or "torch" not in sys.modules:
            return
        roots = list(inst.roots)
        opts = list(inst.optimizers)
        # Counting walks every parameter and optimizer tensor under the GIL (~3 ms for 1,000 tensors): only when
        # roots, optimizers, optimizer state (it appears at the first step) or loaders changed, or once a minute.
        try:
            seen = (tuple(map(id, roots)), tuple((id(o), len(o.state), len(o.param_groups)) for o in opts),
                    len(inst.loaders))
        except Exception:  # noqa: BLE001 - an odd optimizer: count every time
            seen = None
        now = time.monotonic()
        if seen is not None and seen == self._model_seen and now < self._model_due:
            return
        self._model_seen, self._model_due = seen, now + MODEL_RECOUNT_S
        try:
            facts = model_facts(roots, opts)
        except RuntimeError:  # the training thread changed optimizer state meanwhile: next time
            self._model_seen = None
            return
        if facts is None:
            return
        facts["loaders"] = list(inst.loaders.values())[-4:]
        key = (facts["params"], facts["optimizer_bytes"], str(facts["loaders"]))
        if key != self._model_sent:
            self._model_sent = key
            self.agent.publish(protocol.message("model", **facts))
