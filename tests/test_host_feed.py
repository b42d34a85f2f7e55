"""The launcher's host feed: the job records readings taken outside it, and samples for itself when they stop."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import fake_nvml
import pytest
from test_e2e import DEADLINE, wait_for

from perfmon import protocol
from perfmon.agent import sampler as sampler_mod
from perfmon.agent.runtime import Agent
from perfmon.monitor.host_feed import HostFeed
from perfmon.recording import last_step


def samples(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "events.jsonl").read_bytes().splitlines():
        msg = json.loads(line)
        if msg.get("type") == "sample":
            out.append(msg)
    return out


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "perfmon-sampler"]


@pytest.fixture
def fed_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    meta = {"script": "train.py", "argv": ["train.py"], "pid": os.getpid(), "start": 1000.0}
    agent = Agent(tmp_path / "run", meta, tick=0.05, sample_interval=0.1, fed=True)
    agent.start()
    yield agent
    agent.finish({"code": 0})


def feed_for(agent: Agent, **kw: Any) -> HostFeed:
    return HostFeed(os.getpid(), agent.server.path, lambda: True, interval=0.1, **kw).start()


def test_the_job_records_the_launchers_readings_and_runs_no_sampler_of_its_own(fed_agent):
    assert not sampler_threads()
    feed = feed_for(fed_agent)
    try:
        wait_for(lambda: feed.sent >= 3 and len(samples(fed_agent.run_dir)) >= 3, "three fed readings")
        got = samples(fed_agent.run_dir)
        assert all(s["sampled_by"] == "launcher" for s in got)
        assert got[-1]["host"]["rss_bytes"] > 0 and got[-1]["host"]["threads"] >= 2
        assert got[-1]["interval_s"] == 0.1 and got[-1]["sampler_cpu_s"] >= 0.0
        assert not sampler_threads()
        assert fed_agent.server.client_count == 0  # a feed is no monitor
        assert fed_agent.sampler.fed
    finally:
        feed.stop()


def test_when_the_feed_goes_away_the_job_samples_for_itself(fed_agent):
    feed = feed_for(fed_agent)
    wait_for(lambda: samples(fed_agent.run_dir), "a fed reading")
    feed.stop()  # its connection closes, as when the launcher is killed
    wait_for(lambda: not fed_agent.sampler.fed, "the job to take over")
    wait_for(lambda: any("sampled_by" not in s for s in samples(fed_agent.run_dir)), "the job's own reading")
    assert len(sampler_threads()) == 1


def test_a_job_that_no_launcher_feeds_samples_for_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler_mod, "FEED_FIRST_S", 0.2)
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    agent = Agent(tmp_path / "run", {"script": "train.py"}, tick=0.05, sample_interval=0.1, fed=True)
    agent.start()
    try:
        wait_for(lambda: samples(agent.run_dir), "the job's own reading")
        assert "sampled_by" not in samples(agent.run_dir)[0]
    finally:
        agent.finish({"code": 0})


def connect(agent: Agent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(agent.server.path))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(DEADLINE)
    try:
        while sock.recv(65536):  # the stream before it spoke, then the end
            pass
    except ConnectionResetError:
        pass
    return True


def a_reading(**over: Any) -> bytes:
    msg = protocol.message("sample", t=time.time(), host={"cpu_percent": 50.0, "rss_bytes": 1}, gpus=[],
                           interval_s=0.1)
    msg.update(over)
    return protocol.encode(msg)


@pytest.mark.parametrize("bad", [b"{not json\n", a_reading(host="busy"), a_reading(t=None)],
                         ids=["garbage", "host not an object", "no time"])
def test_a_feed_that_sends_what_cannot_be_used_is_closed_and_the_job_samples_for_itself(fed_agent, bad):
    sock = connect(fed_agent)
    with sock:
        sock.sendall(a_reading())
        wait_for(lambda: samples(fed_agent.run_dir), "the first reading")
        sock.sendall(bad)
        assert closed_by_peer(sock)
    wait_for(lambda: not fed_agent.sampler.fed, "the job to take over")
    assert [s.get("sampled_by") for s in samples(fed_agent.run_dir)][0] == "launcher"
    wait_for(lambda: samples(fed_agent.run_dir)[-1].get("sampled_by") is None, "the job's own reading")


def test_a_second_feed_is_refused_while_the_first_one_feeds(fed_agent):
    first = connect(fed_agent)
    with first:
        first.sendall(a_reading())
        wait_for(lambda: samples(fed_agent.run_dir), "the first feed's reading")
        with connect(fed_agent) as second:
            second.sendall(a_reading(host={"cpu_percent": 99.0}))
            assert closed_by_peer(second)
        first.sendall(a_reading(host={"cpu_percent": 51.0}))
        wait_for(lambda: len(samples(fed_agent.run_dir)) >= 2, "the first feed's next reading")
    assert [s["host"]["cpu_percent"] for s in samples(fed_agent.run_dir)][:2] == [50.0, 51.0]


def test_readings_of_other_gpus_than_the_jobs_are_refused(tmp_path, monkeypatch):
    """The job saw no GPU; a launcher that sees one (another CUDA_VISIBLE_DEVICES) must not feed it."""
    monkeypatch.setenv("PERFMON_RUNTIME_DIR", str(tmp_path / "rt"))
    agent = Agent(tmp_path / "run", {"script": "train.py"}, tick=0.05, sample_interval=0.1, fed=True)
    agent.start()
    try:
        assert agent.meta["gpus"] == []
        feed = HostFeed(os.getpid(), agent.server.path, lambda: True, interval=0.1,
                        nvml_backend=fake_nvml.FakeNvml([fake_nvml.h100()]))
        feed.start()
        wait_for(lambda: feed.ended, "the feed to give up")
        assert "other GPUs" in feed.ended
        wait_for(lambda: not agent.sampler.fed, "the job to take over")
        wait_for(lambda: samples(agent.run_dir), "the job's own reading")
        assert all("sampled_by" not in s for s in samples(agent.run_dir))
    finally:
        agent.finish({"code": 0})


def test_perfmon_ls_reads_a_runs_step_count_from_its_recording(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [[i, 1000.0 + i, 1.0, 0, 0, 0, 0, 1.0, 0] for i in range(1, 2001)]
    lines = [protocol.message("hello", pid=1), protocol.message("steps", fields=list(protocol.STEP_FIELDS),
                                                                  rows=rows[:1500]),
             protocol.message("steps", fields=list(protocol.STEP_FIELDS), rows=rows[1500:])]
    lines += [protocol.message("sample", t=1.0, host={"cpu_percent": 1.0})] * 3000  # a long stretch with no step
    (run / "events.jsonl").write_bytes(b"".join(map(protocol.encode, lines)) + b'{"v":1,"type":"ste')
    assert last_step(run) == 2000
    from perfmon import recording

    for size in (97, 4096):  # far more samples after the last steps than one read holds: it reads further back
        monkeypatch.setattr(recording, "STEPS_TAIL", size)
        assert last_step(run) == 2000
    assert last_step(tmp_path) is None  # no recording
    (run / "events.jsonl").write_bytes(protocol.encode(lines[0]))
    assert last_step(run) is None  # no step yet


def test_a_feed_leaves_an_agent_that_takes_none_alone(tmp_path):
    """An older perfmon in the job (``--python`` another environment) samples for itself and would refuse every
    reading: its hello, which does not name its threads, is enough to tell."""
    path = tmp_path / "old.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    with listener:
        feed = HostFeed(os.getpid(), path, lambda: True, interval=0.05).start()
        conn, _ = listener.accept()
        with conn:
            conn.sendall(protocol.encode(protocol.message("hello", pid=os.getpid(), gpus=[], live_seq=0)))
            wait_for(lambda: feed.ended, "the feed to give up")
            conn.settimeout(DEADLINE)
            assert conn.recv(65536) == b""  # it sent nothing, and closed
    assert "takes no feed" in feed.ended and feed.sent == 0


def test_a_reading_is_recorded_as_the_launcher_sent_it_with_the_jobs_fields_appended(fed_agent):
    """The job never encodes a fed reading again: the launcher's line, byte for byte, then what only the job
    can read (torch's threads here), which the reader folds into the host reading."""
    from types import SimpleNamespace

    from perfmon import messages

    fed_agent.commands = SimpleNamespace(torch_threads=6, refresh_torch_threads=lambda: None, finish=lambda: None)
    sent = a_reading(host={"cpu_percent": 50.0, "rss_bytes": 1, "note": "as sent"})
    with connect(fed_agent) as sock:
        sock.sendall(sent)
        wait_for(lambda: b'"note":"as sent"' in (fed_agent.run_dir / "events.jsonl").read_bytes(), "the reading")
        line = next(x for x in (fed_agent.run_dir / "events.jsonl").read_bytes().splitlines() if b"as sent" in x)
        head, _, rest = line.partition(b",")
        assert head.startswith(b'{"seq":') and rest.startswith(sent.rstrip(b"\n")[1:-1] + b',"sampled_by":')
        msg = json.loads(line)
        assert msg["sampled_by"] == "launcher" and msg["torch_threads"] == 6 and msg["sampler_cpu_s"] >= 0.0
        sample = messages.parse(msg)
        assert sample.host.torch_threads == 6 and sample.host.cpu_percent == 50.0
