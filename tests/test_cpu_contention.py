"""The trainer's threads waiting for a CPU: the rule's table, and what the collector reads (a CPU quota and
affinity from a /proc and /sys tree of the test's own; the threads' run-queue wait from the real kernel)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from test_rules import FIELDS, find, make_state

from perfmon import protocol
from perfmon.analysis.rules import Config
from perfmon.collectors.cpus import _count_list, thread_wait_ns, usable_cpus
from perfmon.collectors.host import SLOW_EVERY, HostSampler

QUIET = {"cpu_percent": 100.0, "cpu_count": 2, "system_cpu_percent": 50.0, "workers": 0}


@pytest.mark.parametrize("host, title, fix", [
    # a container with a 2-CPU quota on a 16-CPU host: torch sizes its pool from the host
    ({"cpu_percent": 200.0, "trainer_wait_percent": 600.0, "cpu_count": 16, "usable_cpus": 2.0,
      "cpu_limit": "cgroup CPU quota (2 CPUs)", "torch_threads": 16, "system_cpu_percent": 14.0},
     "torch runs 16 threads on 2 usable CPUs (cgroup CPU quota (2 CPUs))", "torch.set_num_threads(2)"),
    # no limit: the script asked for more threads than the host has
    ({"cpu_percent": 190.0, "trainer_wait_percent": 190.0, "cpu_count": 2, "usable_cpus": 2.0,
      "torch_threads": 4, "system_cpu_percent": 96.0},
     "torch runs 4 threads on the host's 2 CPUs", "(or set OMP_NUM_THREADS=2): more threads than CPUs, and"),
    # a fractional quota: the whole CPUs it keeps busy
    ({"cpu_percent": 150.0, "trainer_wait_percent": 150.0, "cpu_count": 8, "usable_cpus": 1.5,
      "cpu_limit": "cgroup CPU quota (1.5 CPUs)", "torch_threads": 8, "system_cpu_percent": 20.0},
     "torch runs 8 threads on 1.5 usable CPUs", "torch.set_num_threads(1)"),
    # the 2-core host with one core taken by another job: torch's 2 threads get one CPU
    ({"cpu_percent": 100.0, "trainer_wait_percent": 80.0, "cpu_count": 2, "usable_cpus": 2.0,
      "torch_threads": 2, "system_cpu_percent": 100.0},
     "2 torch threads but 1.0 CPUs free: other processes use 1.0 of 2 CPUs", "torch.set_num_threads(1)"),
    # one torch thread, but child processes (no DataLoader said to have workers) and another job crowd the host
    ({"cpu_percent": 60.0, "trainer_wait_percent": 40.0, "cpu_count": 4, "usable_cpus": 4.0, "torch_threads": 1,
      "workers_cpu_percent": 250.0, "system_cpu_percent": 100.0, "workers": 3},
     "The trainer waits for a CPU 40% of the time it wants one", "child processes 2.5"),
])
def test_fires_and_names_the_cause(host, title, fix):
    f = find(make_state(host=host), "cpu-contention")
    assert f is not None
    assert title in f.title and fix in f.fix
    ev = f.evidence
    assert ev["wait_share"] == pytest.approx(host["trainer_wait_percent"]
                                             / (host["cpu_percent"] + host["trainer_wait_percent"]), abs=1e-3)
    assert ev["torch_threads"] == host["torch_threads"] and f.impact == pytest.approx(ev["wait_share"], abs=1e-3)


@pytest.mark.parametrize("host, fix", [
    # one torch thread, no workers, a busy host: no thread count to set (it said set_num_threads(1), as it was)
    ({"cpu_percent": 60.0, "trainer_wait_percent": 40.0, "cpu_count": 2, "usable_cpus": 2.0, "torch_threads": 1,
      "system_cpu_percent": 100.0, "workers": 0},
     "Other work takes the CPUs the trainer needs (other processes 1.4 CPUs): stop or move the other processes that "
     "use 1.4 CPUs, or a host, or CPUs, of its own."),
    # one torch thread and two DataLoader workers on a busy host (a helper's image loop): free 0.2 CPUs
    ({"cpu_percent": 60.0, "trainer_wait_percent": 60.0, "cpu_count": 2, "usable_cpus": 2.0, "torch_threads": 1,
      "workers_cpu_percent": 40.0, "system_cpu_percent": 100.0, "workers": 2},
     "stop or move the other processes that use 1.0 CPUs, fewer DataLoader workers, or a host, or CPUs, of its own."),
    # two torch threads and one CPU free: one thread would fit, so the count is named
    ({"cpu_percent": 100.0, "trainer_wait_percent": 80.0, "cpu_count": 2, "usable_cpus": 2.0, "torch_threads": 2,
      "system_cpu_percent": 100.0},
     "torch.set_num_threads(1)"),
])
def test_the_fix_names_only_what_the_job_can_turn_down(host, fix):
    f = find(make_state(host=host, model={"loaders": [{"num_workers": host.get("workers", 0)}]}), "cpu-contention")
    assert f is not None and fix in f.fix, f.fix
    assert "set_num_threads(1)" not in f.fix or host["torch_threads"] > 1


@pytest.mark.parametrize("children, num_workers, named", [
    (3, 4, "DataLoader workers 0.8"),  # the loader's workers (fewer alive than it may have)
    (1, 0, "child processes 0.8"),  # a rank that Lightning's ddp strategy started, no DataLoader workers
    (5, 4, "DataLoader workers and other child processes 0.8"),  # and wandb's service, say
])
def test_the_trainers_children_are_called_dataloader_workers_only_where_the_loaders_account_for_them(
        children, num_workers, named):
    host = {"cpu_percent": 100.0, "trainer_wait_percent": 100.0, "cpu_count": 2, "usable_cpus": 2.0,
            "torch_threads": 1, "workers_cpu_percent": 80.0, "system_cpu_percent": 100.0, "workers": children}
    f = find(make_state(host=host, model={"loaders": [{"num_workers": num_workers}]}), "cpu-contention")
    assert f is not None and named in f.fix, f.fix


@pytest.mark.parametrize("wait, cpu, severity", [
    (24.0, 100.0, None),        # 19%: under 20%
    (26.0, 100.0, "warn"),      # 21%
    (100.0, 100.0, "critical"),  # 50%
    (0.0, 0.0, None),           # an idle trainer
    (None, 100.0, None),        # a kernel without schedstat, or an old recording
])
def test_thresholds(wait, cpu, severity):
    host = {**QUIET, "torch_threads": 4, "cpu_percent": cpu, "trainer_wait_percent": wait}
    f = find(make_state(host=host), "cpu-contention")
    assert (f.severity if f else None) == severity


def test_thresholds_come_from_the_rules_file():
    host = {**QUIET, "torch_threads": 4, "trainer_wait_percent": 30.0}  # 23%
    assert find(make_state(host=host), "cpu-contention") is not None
    assert find(make_state(host=host), "cpu-contention", Config(cpu_wait_warn=0.3)) is None


def test_a_cgroup_v2_quota_on_a_parent_limits_the_process(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/job/step\n")
    (tmp_path / "proc/self/status").write_text("Name:\tpython\nCpus_allowed_list:\t0-7\n")
    (tmp_path / "sys/fs/cgroup/job/step").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/job/step/cpu.max").write_text("max 100000\n")
    (tmp_path / "sys/fs/cgroup/job/cpu.max").write_text("250000 100000\n")
    limit = usable_cpus(16, tmp_path)
    assert limit.usable == 2.5 and limit.limit == "cgroup CPU quota (2.5 CPUs)"


def test_a_cgroup_v1_quota_and_an_affinity_mask_the_tighter_wins(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\t0-1,4\n")
    quota = tmp_path / "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    quota.mkdir(parents=True)
    (quota / "cpu.cfs_quota_us").write_text("400000\n")
    (quota / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(16, tmp_path).limit == "CPU affinity (3 of 16 CPUs)"
    (quota / "cpu.cfs_quota_us").write_text("150000\n")
    assert usable_cpus(16, tmp_path).usable == 1.5
    (quota / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert usable_cpus(4, tmp_path).usable == 3.0


def test_no_cgroups_and_no_mask_leave_the_host(tmp_path):
    assert usable_cpus(8, tmp_path) == usable_cpus(8, tmp_path / "missing")
    assert usable_cpus(8, tmp_path).usable == 8.0 and usable_cpus(8, tmp_path).limit is None
    assert _count_list("0-3,8,10-11") == 7


def test_this_process_reads_its_real_limit():
    limit = usable_cpus(os.cpu_count() or 1)
    assert 0 < limit.usable <= (os.cpu_count() or 1)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux only")
def test_thread_wait_is_the_sum_over_threads_less_those_skipped():
    stop = threading.Event()
    spinners = [threading.Thread(target=lambda: stop.wait(30)) for _ in range(2)]
    for t in spinners:
        t.start()
    try:
        everyone = thread_wait_ns(os.getpid(), set())
        assert everyone is not None and everyone >= 0
        every_tid = {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}
        assert thread_wait_ns(os.getpid(), every_tid) is None  # nothing left to read
    finally:
        stop.set()
        for t in spinners:
            t.join()
    assert thread_wait_ns(2**22 + 12345, set()) is None  # no such process


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux only")
def test_the_host_sampler_sends_the_new_fields_on_its_slow_samples():
    """The wait is read every SLOW_EVERY samples; the second sample reads it too, so a job of a few seconds (the
    oversubscribed demo at one reading a second) gets a reading and cpu-contention can be said."""
    sampler = HostSampler(os.getpid(), skip_threads=set)
    samples = [sampler.sample() for _ in range(2 + SLOW_EVERY)]
    assert samples[0]["usable_cpus"] == sampler.limit.usable and "cpu_limit" in samples[0]
    assert samples[0]["trainer_wait_percent"] is None  # a rate needs two readings
    read = [i for i, s in enumerate(samples) if s["trainer_wait_percent"] is not None]
    assert read == [1, SLOW_EVERY] and all(samples[i]["trainer_wait_percent"] >= 0 for i in read)


def test_a_wait_reading_counts_when_steps_advanced_over_its_span_not_only_at_its_sample():
    """The wait is read every 5 samples over the time since the last reading; at 20 Hz sampling and a 2 Hz
    publisher the reading's own sample rarely follows a steps message. Steps anywhere in its span count."""
    state = make_state(host={**QUIET, "torch_threads": 4})  # a busy sample, no wait reading
    state.apply(protocol.message("sample", seq=50, t=1100.0, host={**QUIET, "torch_threads": 4,
                                                                    "trainer_wait_percent": 80.0}, gpus=[]))
    assert list(state.busy_trainer_waits) == [80.0]
    assert find(state, "cpu-contention") is not None
    # an idle stretch (no step since the last reading) is not the trainer starving
    state.apply(protocol.message("sample", seq=51, t=1101.0, host={**QUIET, "trainer_wait_percent": 0.0}, gpus=[]))
    assert list(state.busy_trainer_waits) == [80.0]
    state.apply(protocol.message("steps", fields=FIELDS, seq=52, rows=[[101, 1102.0, 10.0, 1, 3, 4, 1.5, 0.5, 32]]))
    state.apply(protocol.message("sample", seq=53, t=1103.0, host={**QUIET, "trainer_wait_percent": 0.0}, gpus=[]))
    assert list(state.busy_trainer_waits) == [80.0, 0.0]
