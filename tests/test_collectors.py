"""Collectors: NVML on the fake backend (every panel state), host on the real psutil."""

from __future__ import annotations

import os
import time

import pytest
from fake_nvml import (
    GIB,
    FakeNvml,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    h100,
)

from perfmon.collectors import nvml
from perfmon.collectors.host import HostSampler
from perfmon.collectors.nvml import NvmlSampler, visible_devices
from perfmon.tui.widgets import fmt


def test_no_nvml_library_says_so(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert s.open() == "no NVIDIA driver (NVML library not found)"
    assert s.sample() == []


def test_no_gpu_found(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml(devices=[]))
    assert s.open() == "no NVIDIA GPU found"


def test_real_backend_on_this_machine_never_raises():
    s = NvmlSampler()
    reason = s.open()
    assert reason is None or isinstance(reason, str)
    assert isinstance(s.sample(), list)


def test_full_reading(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml([h100(procs=[(os.getpid(), 3 * GIB), (1, GIB)])]))
    assert s.open() is None
    (g,) = s.sample()
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["total_bytes"] == 80 * GIB
    assert g["util_gpu"] == 97 and g["mem_used_bytes"] == 60 * GIB and g["proc_mem_bytes"] == 3 * GIB
    assert g["power_w"] == 650.0 and g["power_limit_w"] == 700.0 and g["temp_c"] == 71
    assert g["sm_clock_mhz"] == 1980 and g["throttled"] == [] and g["pcie_tx_kbs"] == 1200


def test_not_supported_and_lost_gpu_give_none_not_errors(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml([h100(power=NVMLError_NotSupported(), pcie=NVMLError_NotSupported())])
    s = NvmlSampler(fake)
    s.open()
    (g,) = s.sample()
    assert g["power_w"] is None and g["pcie_rx_kbs"] is None and g["util_gpu"] == 97
    for key in ("util", "mem", "temp", "sm", "reasons", "procs"):
        fake.devices[0][key] = NVMLError_GpuIsLost()
    (g,) = s.sample()
    assert g["util_gpu"] is None and g["mem_used_bytes"] is None and g["throttled"] == []


def test_throttle_reasons_decoded(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = NvmlSampler(FakeNvml([h100(reasons=0x1 | 0x4 | 0x40)]))
    s.open()
    (g,) = s.sample()
    assert g["throttle"] == ["gpu_idle", "sw_power_cap", "hw_thermal"]
    assert g["throttled"] == ["hw_thermal", "sw_power_cap"]


@pytest.mark.parametrize(
    "env, expected",
    [(None, [0, 1, 2]), ("2,0", [2, 0]), ("1,7,0", [1]), ("", []), ("GPU-bbbb", [1]), ("GPU-zzzz", []), ("bbbb", [1])],
)
def test_cuda_visible_devices(env, expected):
    uuids = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]
    assert visible_devices(3, uuids, env) == expected


def test_visible_devices_used_by_sampler(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    fake = FakeNvml([h100(uuid="GPU-a"), h100(uuid="GPU-b", name="other")])
    s = NvmlSampler(fake)
    assert s.open() is None
    assert [g["name"] for g in s.sample()] == ["other"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert NvmlSampler(fake).open() == "no GPU visible to this process"


def test_host_sampler_real_numbers():
    import psutil

    # an earlier test's Agent.finish may have left its detached summary writer running as this process's child
    psutil.wait_procs(psutil.Process().children(), timeout=120)
    s = HostSampler()
    sum(i * i for i in range(200_000))  # some CPU time between the two readings
    h = s.sample()
    assert h["rss_bytes"] > 10 * 1024 * 1024
    assert h["threads"] >= 1 and h["cpu_count"] >= 1 and h["mem_total_bytes"] > h["mem_used_bytes"] > 0
    assert h["workers"] == 0 and h["cpu_percent"] is not None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc")
def test_the_trainers_own_numbers_from_one_stat_read_match_psutil(monkeypatch):
    """CPU %, threads and RSS come from one read of /proc/PID/stat: the same as psutil's three reads over the same
    interval; where the file cannot be read, psutil's own."""
    import threading
    import time

    import psutil

    from perfmon.collectors import host as host_mod

    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)  # a thread more than the test runner has
    extra.start()
    try:
        proc, sampler = psutil.Process(), HostSampler()
        proc.cpu_percent(None)
        sampler.sample()
        end = time.process_time() + 0.3
        while time.process_time() < end:  # CPU time, however busy the machine
            pass
        ours, theirs = sampler.sample(), proc.cpu_percent(None)
        # read a moment apart: the intervals differ by that moment out of 0.3 s or more
        assert ours["cpu_percent"] == pytest.approx(theirs, abs=10.0) and ours["cpu_percent"] > 5.0
        assert ours["threads"] == proc.num_threads() >= 2
        assert ours["rss_bytes"] == pytest.approx(proc.memory_info().rss, rel=0.1)
        monkeypatch.setattr(host_mod, "_read_stat", lambda pid: None)  # not Linux
        fallback = HostSampler().sample()
        assert fallback["threads"] == proc.num_threads() and fallback["rss_bytes"] > 10 * 1024 * 1024
    finally:
        stop.set()
        extra.join()
    assert host_mod._read_stat(2**22 + 12345) is None  # no such process


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="Linux schedstat")
def test_workers_that_want_more_cpu_than_they_get_are_seen_waiting():
    """More CPU-bound children than CPUs: what they ran plus what they waited to run adds up to what they
    wanted (each a whole CPU), however busy the rest of the machine is."""
    import subprocess
    import sys
    import time

    n = (os.cpu_count() or 1) + 2
    burn = "import time\nend = time.monotonic() + 6\nwhile time.monotonic() < end: pass"
    kids = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(n)]
    try:
        sampler = HostSampler()
        sampler.sample()  # primes the CPU and wait counters
        time.sleep(2.0)  # the interval measured (not a wait for a condition)
        s = sampler.sample()
    finally:
        for k in kids:
            k.kill()
            k.wait()
    assert s["workers"] == n and s["workers_wait_percent"] is not None
    assert s["workers_wait_percent"] > 0  # more runnable children than CPUs: some always wait
    assert s["workers_cpu_percent"] + s["workers_wait_percent"] >= 0.8 * 100 * n


def test_host_sampler_survives_its_process_vanishing():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    s = HostSampler(child.pid)
    child.wait()
    h = s.sample()
    assert h["rss_bytes"] is None and h["system_cpu_percent"] is not None


# -- this process's GPU memory: bytes when NVML lists our pid, else "n/a" with the reason, never 0 -------
def _device_text(gpus: list[dict], width: int = 120) -> str:
    """The device panel's text for one sample message carrying ``gpus`` (through RunState)."""
    from collections import defaultdict

    from rich.style import Style

    from perfmon import protocol
    from perfmon.analysis.state import RunState
    from perfmon.tui.widgets.device import DeviceInfo, DeviceView

    state = RunState()
    state.apply(protocol.message("sample", t=1000.0, host={}, gpus=gpus, cuda_mem=None))
    view = DeviceView(DeviceInfo.from_state(state), defaultdict(Style))
    return "\n".join(line.plain for line in view.lines(width))


class _FakeAgent:
    """What the agent's Sampler needs of an agent: a pid, meta, publish, its commands (None before torch)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.meta: dict = {}
        self.instrumentation = None
        self.commands = None
        self.published: list[dict] = []

    def publish(self, msg: dict) -> None:
        self.published.append(msg)

    def record_error(self, where, exc) -> None:
        raise AssertionError(f"{where}: {exc}")


def _sample_through_the_agent(fake: FakeNvml) -> dict:
    """One ``sample`` message as the agent's sampler publishes it, on the fake NVML."""
    from perfmon.agent.sampler import Sampler

    agent = _FakeAgent()
    sampler = Sampler(agent, 1.0, nvml_backend=fake)
    assert sampler.nvml.open() is None
    sampler.sample_once()
    (msg,) = [m for m in agent.published if m["type"] == "sample"]
    return msg


def test_process_memory_when_nvml_lists_our_pid(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    msg = _sample_through_the_agent(FakeNvml([h100(procs=[(os.getpid(), 3 * GIB), (1, GIB)])]))
    (g,) = msg["gpus"]
    assert g["proc_mem_bytes"] == 3 * GIB and g["proc_mem_reason"] is None
    text = _device_text(msg["gpus"])
    assert f"this process {fmt.nbytes(3 * GIB)}" in text, text


@pytest.mark.parametrize("cuda_initialized, reason", [
    (True, nvml.PROC_NOT_VISIBLE),  # a container with its own PID namespace: NVML lists host pids
    (False, nvml.PROC_NO_CONTEXT),  # torch has not touched CUDA yet: nothing to list
])
def test_pid_absent_from_nvml_is_na_with_the_reason_never_0(monkeypatch, cuda_initialized, reason):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(nvml, "cuda_initialized", lambda: cuda_initialized)
    host_pid = os.getpid() + 100_000  # our process as the host sees it: not our pid
    for procs in ([(host_pid, 3 * GIB)], []):
        msg = _sample_through_the_agent(FakeNvml([h100(procs=procs)]))
        (g,) = msg["gpus"]
        assert g["proc_mem_bytes"] is None and g["proc_mem_reason"] == reason
        for width in (120, 60, 38):
            text = _device_text(msg["gpus"], width)
            assert "this process 0" not in text
            assert " ".join(text.split()).count(f"this process n/a: {reason}") == 1, text


def test_pid_absent_reason_fits_the_pcie_line_or_wraps_below_it(monkeypatch):
    g = {**h100_reading(), "proc_mem_bytes": None, "proc_mem_reason": nvml.PROC_NOT_VISIBLE}
    wide = _device_text([g], 160).splitlines()
    assert wide[-1].startswith("PCIe") and wide[-1].endswith(f"this process n/a: {nvml.PROC_NOT_VISIBLE}")
    for width in (80, 60, 40):
        lines = _device_text([g], width).splitlines()
        pcie = next(i for i, line in enumerate(lines) if line.startswith("PCIe"))
        assert "this process" not in lines[pcie] and all(line.startswith("      ") for line in lines[pcie + 1:])
        assert " ".join(" ".join(lines[pcie + 1:]).split()) == f"this process n/a: {nvml.PROC_NOT_VISIBLE}"
        assert all(len(line) <= width for line in lines[pcie + 1:])


def h100_reading() -> dict:
    """A full reading of the fake H100 (device 0, whatever CUDA_VISIBLE_DEVICES says)."""
    s = NvmlSampler(FakeNvml([h100(procs=[(os.getpid(), GIB)])]))
    saved = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        s.open()
    finally:
        if saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return s.sample()[0]


def test_no_per_process_bytes_from_nvml_is_na_not_0(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (g,) = _sample_through_the_agent(FakeNvml([h100(procs=[(os.getpid(), None)])]))["gpus"]
    assert g["proc_mem_bytes"] is None and g["proc_mem_reason"] == nvml.PROC_NO_BYTES
    fake = FakeNvml([h100(procs=NVMLError_NotSupported())])
    (g,) = _sample_through_the_agent(fake)["gpus"]
    assert g["proc_mem_bytes"] is None and g["proc_mem_reason"] == nvml.PROC_QUERY_FAILED


def test_a_gpu_we_do_not_use_is_0_when_nvml_sees_our_pid_on_another(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml([h100(procs=[(os.getpid(), 2 * GIB)]), h100(uuid="GPU-2", procs=[(1, GIB)])])
    g0, g1 = _sample_through_the_agent(fake)["gpus"]
    assert (g0["proc_mem_bytes"], g0["proc_mem_reason"]) == (2 * GIB, None)
    assert (g1["proc_mem_bytes"], g1["proc_mem_reason"]) == (0, None)  # NVML sees us: no context here


def test_an_older_recordings_0_is_shown_as_na():
    from perfmon import protocol
    from perfmon.analysis.state import RunState
    from perfmon.messages import LEGACY_PROC_MEM_REASON

    old = {k: v for k, v in h100_reading().items() if k != "proc_mem_reason"}
    old["proc_mem_bytes"] = 0
    state = RunState()
    state.apply(protocol.message("sample", t=1000.0, host={}, gpus=[old], cuda_mem=None))
    assert state.gpus[0].proc_mem_bytes is None and state.gpus[0].proc_mem_reason == LEGACY_PROC_MEM_REASON
    assert "this process 0" not in _device_text([old])


def test_workers_found_from_any_thread_and_between_full_scans():
    """Children forked by the main thread are seen at every sample; those of other threads (and grandchildren)
    at the next full scan of every thread; gone ones drop out."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from perfmon.collectors import host

    if host._child_pids(os.getpid()) is None:
        pytest.skip("no /proc/PID/task/TID/children on this kernel")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    parent = [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({sleeper!r}); time.sleep(60)"]
    sampler = HostSampler()
    try:
        assert sampler.sample()["workers"] == 0  # sample 1: a full scan
        main_child = subprocess.Popen(sleeper)
        assert sampler.sample()["workers"] == 1  # sample 2: the main thread's children only
        done = threading.Event()  # the thread stays: a thread's children move to another thread when it ends
        t = threading.Thread(target=lambda: (subprocess.Popen(parent), done.wait(60)))
        t.start()
        deadline = time.monotonic() + 60
        while len(host._child_pids(os.getpid()) or []) < 3:  # the other thread's child has forked its own
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert sampler.sample()["workers"] == 1  # not a full scan yet
        sampler._samples = host.FULL_SCAN_EVERY  # the next sample is a full scan
        assert sampler.sample()["workers"] == 3
        main_child.kill()
        main_child.wait()
        assert sampler.sample()["workers"] == 2
        done.set()
        t.join()
    finally:
        for pid in host._child_pids(os.getpid()) or []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_model_is_recounted_only_when_it_changes(monkeypatch):
    """Counting walks every parameter and optimizer tensor under the GIL: the sampler does it when the roots,
    optimizers, optimizer state or loaders change, and once every MODEL_RECOUNT_S, not at every sample."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from perfmon.agent import sampler as sampler_mod

    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    inst = SimpleNamespace(roots=[model], optimizers=[opt], loaders={})
    published: list[dict] = []
    agent = SimpleNamespace(pid=os.getpid(), meta={}, instrumentation=inst, publish=published.append)
    s = sampler_mod.Sampler(agent, interval=1.0)
    counts: list[int] = []
    real = sampler_mod.model_facts
    monkeypatch.setattr(sampler_mod, "model_facts", lambda r, o: (counts.append(1), real(r, o))[1])
    clock = [1000.0]
    monkeypatch.setattr(sampler_mod.time, "monotonic", lambda: clock[0])

    s._maybe_model()
    s._maybe_model()
    assert len(counts) == 1 and len(published) == 1  # nothing changed: not recounted
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # Adam's state appears
    s._maybe_model()
    assert len(counts) == 2 and len(published) == 2 and published[1]["optimizer_bytes"] > 0
    s._maybe_model()
    assert len(counts) == 2
    inst.loaders[1] = {"num_workers": 0}
    s._maybe_model()
    assert len(counts) == 3 and published[-1]["loaders"] == [{"num_workers": 0}]
    clock[0] += sampler_mod.MODEL_RECOUNT_S + 1  # nothing seen to change, but a minute passed: recounted
    s._maybe_model()
    assert len(counts) == 4 and len(published) == 3  # same facts: not re-sent


def test_a_job_shorter_than_a_sample_interval_still_records_its_model():
    """The sampler counts the model once more when it stops: a short job, or one whose sampler a loaded host
    kept waiting, ends with its model facts in the recording."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from perfmon.agent import sampler as sampler_mod

    model = nn.Linear(4, 2)
    inst = SimpleNamespace(roots=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], loaders={})
    published: list[dict] = []
    agent = SimpleNamespace(pid=os.getpid(), meta={}, instrumentation=inst, publish=published.append,
                            record_error=lambda where, exc: published.append({"error": where}))
    s = sampler_mod.Sampler(agent, interval=3600.0)
    s.start()  # its first sample would come in an hour
    s.stop()
    assert [m["type"] for m in published] == ["model"] and published[0]["params"] == 4 * 2 + 2


def test_trainable_is_what_an_optimizer_updates():
    """A target network (TD3, DQN) keeps requires_grad=True and is never stepped: it was counted trainable, with
    gradient bytes it never holds. A frozen teacher is frozen either way; with no optimizer yet, or one over
    master copies (mixed precision by hand), requires_grad is all there is to go by."""
    import copy

    import torch
    from torch import nn

    from perfmon.agent.sampler import model_facts

    actor, teacher = nn.Linear(4, 2), nn.Linear(4, 3).requires_grad_(False)
    target = copy.deepcopy(actor)
    opt = torch.optim.Adam(actor.parameters())
    facts = model_facts([actor, target, teacher], [opt])
    assert facts is not None
    assert (facts["params"], facts["trainable"], facts["frozen"]) == (10 + 10 + 15, 10, 10 + 15)
    assert facts["grad_bytes"] == 10 * 4
    before = model_facts([actor, target, teacher], [])
    assert before is not None and before["trainable"] == 20
    master = [p.detach().clone().float().requires_grad_() for p in actor.parameters()]  # fp32 master weights
    copies = model_facts([actor], [torch.optim.AdamW(master)])
    assert copies is not None and copies["trainable"] == 10  # its optimizer holds none of the model's own


MEMINFO = b"""MemTotal:       16000000 kB
MemFree:         2000000 kB
MemAvailable:    9000000 kB
Buffers:          100000 kB
Cached:          6000000 kB
SwapCached:            0 kB
SwapTotal:       4000000 kB
SwapFree:        3000000 kB
"""


@pytest.mark.parametrize("text, want", [
    (MEMINFO, (16_000_000 * 1024, 7_000_000 * 1024, 9_000_000 * 1024, 1_000_000 * 1024)),
    # a container's view where available exceeds total (LXC): free counts as available, as psutil does
    (MEMINFO.replace(b"9000000", b"99000000"), (16_000_000 * 1024, 14_000_000 * 1024, 2_000_000 * 1024,
                                                1_000_000 * 1024)),
    (MEMINFO.replace(b"SwapTotal", b"SwapTotalX"), (16_000_000 * 1024, 7_000_000 * 1024, 9_000_000 * 1024, None)),
    (MEMINFO.replace(b"MemAvailable", b"Other"), None),  # an old kernel: psutil estimates available
    (b"", None),
])
def test_meminfo_is_parsed_for_the_fields_used(text, want):
    from perfmon.collectors import host as host_mod

    assert host_mod.parse_meminfo(text) == want


@pytest.mark.parametrize("line, want", [
    # user nice system idle iowait irq softirq steal guest guest_nice: guests are inside user and nice
    (b"cpu  100 10 50 800 40 5 5 0 30 0\n", (170, 1010)),
    (b"cpu  100 10 50 800 40\n", (160, 1000)),  # old kernels: fewer columns
    (b"cpu0 100 10 50 800 40 5 5 0\n", None),  # a per-CPU line is not the total
    (b"cpu  x y\n", None),
    (b"", None),
])
def test_the_hosts_cpu_times_are_parsed_as_psutil_counts_them(line, want):
    from perfmon.collectors import host as host_mod

    assert host_mod.parse_cpu_line(line) == want


def test_host_memory_cpu_and_io_agree_with_psutil():
    """The /proc readings against psutil's own, taken together: the same totals, and used, available, swap,
    the host's CPU % and this process's bytes read within what moves between two reads."""
    import psutil

    from perfmon.collectors import host as host_mod

    sampler = host_mod.HostSampler(os.getpid())
    psutil.cpu_percent(None)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        sum(range(10_000))  # some CPU use to measure
    h = sampler.sample()
    theirs_cpu = psutil.cpu_percent(None)
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    assert h["mem_total_bytes"] == vm.total
    assert abs(h["mem_available_bytes"] - vm.available) < 0.02 * vm.total
    assert abs(h["mem_used_bytes"] - (vm.total - vm.available)) < 0.02 * vm.total
    assert abs(h["swap_used_bytes"] - sw.used) <= max(0.02 * sw.total, 1 << 20)
    assert h["system_cpu_percent"] is not None and abs(h["system_cpu_percent"] - theirs_cpu) < 25.0
    assert host_mod._read_io_bytes(os.getpid()) == psutil.Process().io_counters().read_bytes
    samples = [sampler.sample() for _ in range(host_mod.SLOW_EVERY)]
    assert all(s["swap_used_bytes"] is not None for s in samples)  # in every sample, not every few


def test_the_sampler_sends_the_trainers_torch_threads_and_asks_for_them_afresh(tmp_path):
    """The count comes from the commands (read on the training thread); each sample asks for the next reading."""
    from types import SimpleNamespace

    from perfmon.agent.commands import Commands
    from perfmon.agent.sampler import Sampler

    agent = _FakeAgent()
    sampler = Sampler(agent, 1.0, nvml_backend=FakeNvml([]))
    sampler.sample_once()
    assert "torch_threads" not in agent.published[-1]["host"]  # torch not imported by the script yet
    agent.run_dir = tmp_path
    agent.tracker = SimpleNamespace(count=0)
    agent.commands = Commands(agent, {})
    agent.commands.torch_threads = 7
    sampler.sample_once()
    host = [m for m in agent.published if m["type"] == "sample"][-1]["host"]
    assert host["torch_threads"] == 7 and "usable_cpus" in host
    assert agent.commands.pending and [q[0] for q in agent.commands._queue] == ["read_threads"]


def test_a_fed_sampler_looks_at_the_model_and_threads_less_often_while_they_stay_the_same(monkeypatch):
    """A fed reading costs the job little: after the model is known, its facts and torch's threads are looked
    at half as often each time nothing changed (1, 2, 4, 8 s, then every SLOW_FACTS_MAX_S), and at every
    reading again once something did."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from perfmon import protocol
    from perfmon.agent import sampler as sampler_mod

    model = nn.Linear(4, 2)
    inst = SimpleNamespace(roots=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], loaders={})
    commands = SimpleNamespace(torch_threads=4, refresh_torch_threads=lambda: None)
    texts: list[str] = []
    agent = SimpleNamespace(pid=os.getpid(), meta={}, instrumentation=inst, publish=lambda msg: None,
                            publish_text=texts.append, commands=commands)
    s = sampler_mod.Sampler(agent, interval=1.0, fed=True)
    clock = [1000.0]
    monkeypatch.setattr(sampler_mod.time, "monotonic", lambda: clock[0])
    looks: list[float] = []
    real = s._maybe_model
    monkeypatch.setattr(s, "_maybe_model", lambda: (looks.append(clock[0] - 1000.0), real())[1])
    reading = protocol.message("sample", t=1.0, host={"cpu_percent": 1.0}, gpus=[])
    for second in range(40):
        if second == 20:
            commands.torch_threads = 8  # the script called torch.set_num_threads
        assert s.take_fed(reading)
        clock[0] += 1.0
    assert looks[:7] == [0, 1, 2, 4, 8, 16, 24]  # known at the first look; then 1, 2, 4, 8, 8 s apart
    assert [t for t in looks if 16 < t <= 27] == [24, 25, 26]  # the change is seen at the next look, then again 1 s
    assert len(texts) == 40 and all('"torch_threads":' in t for t in texts)
