"""Multi-node jobs: the hub/relay handshake (nothing without the job secret), the endpoint and secret, and two
torchrun "nodes" on this machine (``--nnodes 2``, c10d rendezvous on 127.0.0.1) seen from node 0: headless, and
in a real terminal (tmux) as a user sees it."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from test_e2e import PERFMON, REPO, env, listening, perfmon, report, wait_for  # noqa: F401  (env: private runtime dir)

from perfmon.messages.commands import Command
from perfmon.monitor import multinode
from perfmon.monitor.multinode import (
    Endpoint,
    HandshakeError,
    Hub,
    Relay,
    endpoint,
    hub_handshake,
    job_secret,
    relay_handshake,
)

DDP = REPO / "demos" / "ddp" / "train_ddp.py"


# -- handshake ------------------------------------------------------------------------------------
def _pair(hub_secret: bytes, relay_secret: bytes) -> tuple[Any, Any]:
    a, b = socket.socketpair()
    out: dict[str, Any] = {}

    def hub() -> None:
        try:
            out["hub"] = hub_handshake(a, hub_secret)
        except (HandshakeError, OSError) as exc:
            out["hub"] = exc
            a.close()

    thread = threading.Thread(target=hub)
    thread.start()
    try:
        relay: Any = relay_handshake(b, relay_secret, {"host": "n1"})
    except (HandshakeError, OSError) as exc:
        relay = exc
    thread.join(5)
    return out["hub"], relay


def test_handshake_with_the_job_secret_succeeds_both_ways() -> None:
    hub, relay = _pair(b"s" * 32, b"s" * 32)
    assert not isinstance(hub, Exception) and not isinstance(relay, Exception)
    assert hub[1]["host"] == "n1"


def test_a_relay_without_the_secret_is_refused_and_learns_nothing() -> None:
    hub, relay = _pair(b"s" * 32, b"x" * 32)
    assert isinstance(hub, HandshakeError) and "secret" in str(hub)
    assert isinstance(relay, Exception)  # the hub closed: no hub_ok, no data


def test_an_impostor_hub_gets_no_stream() -> None:
    """A relay checks the hub's proof before it sends anything of its ranks."""
    a, b = socket.socketpair()

    def impostor() -> None:
        a.sendall(b'{"type":"hub_hello","v":1,"nonce":"00"}\n')
        a.recv(4096)
        a.sendall(b'{"type":"hub_ok","mac":"forged"}\n')

    threading.Thread(target=impostor).start()
    with pytest.raises(HandshakeError, match="does not know the job secret"):
        relay_handshake(b, b"s" * 32, {})


def test_a_stranger_speaking_anything_else_is_refused() -> None:
    a, b = socket.socketpair()
    b.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(HandshakeError):
        hub_handshake(a, b"s" * 32)


class _Local:
    """A node's ranks, as the relay reads them: a few tagged messages, and the commands it was given."""

    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.done = threading.Event()

    def messages(self) -> Any:
        yield {"type": "hello", "seq": 1, "pid": 7, "rank": 2, "_rank": 2}
        yield {"type": "hello", "seq": 1, "pid": 8, "rank": 3, "_rank": 3}
        self.done.wait(10)

    def send(self, command: Command) -> bool:
        self.sent.append(command)
        return True

    def close(self) -> None:
        self.done.set()


def _hub(secret: bytes) -> tuple[Hub, Endpoint, queue.Queue]:
    got: queue.Queue = queue.Queue()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    hub = Hub(listener, secret, got.put, lambda: got.put("opened"), lambda: got.put("closed")).start()
    return hub, Endpoint(2, "127.0.0.1", port - 1, "t"), got


def test_relay_streams_its_ranks_to_the_hub_and_runs_the_hubs_commands() -> None:
    hub, ep, got = _hub(b"k" * 32)
    local = _Local()
    relay = Relay(ep, b"k" * 32, lambda: local, {"host": "n1"}, alive=lambda: True, retry_s=0.05).start()
    try:
        assert got.get(timeout=10) == "opened"
        assert [got.get(timeout=10)["_rank"] for _ in range(2)] == [2, 3]
        assert hub.send(Command("profile", at_step=40, ranks=(3,)))
        wait_for(lambda: local.sent, "the command at the relay")
        assert local.sent == [Command("profile", at_step=40, ranks=(3,))]  # the relay's job source routes it
    finally:
        relay.close()
        hub.close()


def test_a_relay_with_another_secret_delivers_nothing() -> None:
    hub, ep, got = _hub(b"k" * 32)
    local = _Local()
    relay = Relay(ep, b"wrong" * 7, lambda: local, {}, alive=lambda: True, retry_s=0.05).start()
    try:
        wait_for(lambda: hub.refused >= 2, "refused attempts")
        assert got.empty() and not relay.connected.is_set()
        assert "does not know the job secret" in (relay.error or "") or relay.error
    finally:
        relay.close()
        hub.close()


# -- endpoint and secret --------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "want"), [
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.5:29400", "--rdzv-id", "j1", "t.py"],
     Endpoint(2, "10.0.0.5", 29400, "j1")),
    (["--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=head", "t.py", "--nnodes", "9"],
     Endpoint(4, "head", 29400, "none")),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.9", "--master-port", "1234", "t.py"],
     Endpoint(2, "10.0.0.9", 1234, "none")),
    (["--nproc-per-node", "2", "t.py"], Endpoint(1, "127.0.0.1", 29500, "none")),
])
def test_endpoint_reads_torchruns_own_options(argv: list[str], want: Endpoint) -> None:
    assert endpoint(argv) == want
    assert endpoint(argv).multinode == (want.nnodes_max > 1)


def test_hub_port_is_the_rendezvous_port_plus_one_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = Endpoint(2, "h", 29400, "j")
    monkeypatch.delenv(multinode.HUB_PORT_ENV, raising=False)
    assert ep.hub_port == 29401
    monkeypatch.setenv(multinode.HUB_PORT_ENV, "31000")
    assert ep.hub_port == 31000


def test_job_secret_from_env_or_a_private_per_user_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(multinode.SECRET_ENV, raising=False)
    key = tmp_path / "cfg" / "key"
    a = job_secret(Endpoint(2, "h", 1, "job-a"), key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert job_secret(Endpoint(2, "h", 1, "job-a"), key) == a  # every node with this key agrees
    assert job_secret(Endpoint(2, "h", 1, "job-b"), key) != a  # one secret per job
    monkeypatch.setenv(multinode.SECRET_ENV, "shared")
    assert job_secret(Endpoint(2, "h", 1, "job-a"), key) != a
    assert job_secret(Endpoint(2, "h", 1, "job-b"), key) == job_secret(Endpoint(2, "x", 9, "c"), key)


# -- two nodes on this machine ----------------------------------------------------------------------
def _free_pair() -> int:
    """A port p with p and p + 1 free (the rendezvous, then perfmon's hub)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no free port pair")


def _node_args(port: int, steps: int) -> list[str]:
    return ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}", str(DDP), "--steps", str(steps),
            "--slow-rank", "3", "--delay", "0.01"]


@pytest.mark.e2e
def test_two_nodes_headless_hub_reports_every_rank_of_every_node(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    port = _free_pair()
    node0 = subprocess.Popen([*PERFMON, "--headless", "--run-dir", str(tmp_path / "n0"), *_node_args(port, 60)],
                             cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: listening(port + 1), "node 0's hub")
        node1 = perfmon(["--headless", "--run-dir", str(tmp_path / "n1"), *_node_args(port, 60)], env, timeout=180)
        out0, err0 = node0.communicate(timeout=180)
    finally:
        if node0.poll() is None:
            node0.kill()
        _kill_jobs(port)
    assert node1.returncode == 0 and node0.returncode == 0, err0[-3000:] + node1.stderr[-3000:]
    assert "this node is the hub" in err0 and "relaying this node's ranks" in node1.stderr
    assert sorted(p.name for p in (tmp_path / "n0").glob("rank-*")) == ["rank-0", "rank-1"]  # recorded locally
    assert sorted(p.name for p in (tmp_path / "n1").glob("rank-*")) == ["rank-2", "rank-3"]
    summary = __import__("json").loads((tmp_path / "n0" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["nodes"] == 2
    assert {(r["rank"], r["node"], r["steps"]) for r in summary["ranks"]} == {(0, 0, 60), (1, 0, 60), (2, 1, 60),
                                                                             (3, 1, 60)}
    straggler = next(f for f in summary["findings"] if f["id"] == "straggler")
    assert (straggler["evidence"]["rank"], straggler["evidence"]["node"]) == (3, 1)


def _kill_jobs(port: int) -> None:
    """Both nodes' torchrun and workers (each in its own session, as perfmon starts jobs: killing a perfmon
    or its terminal leaves them running), found by the job's rendezvous id."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if "perfmon.agent.torchrun" in cmdline and f"t{port}" in cmdline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to drive the dashboard in a terminal")
def test_two_nodes_seen_from_node_0s_dashboard_in_a_terminal(tmp_path: Path, env: dict[str, str]) -> None:  # noqa: F811
    port = _free_pair()
    session = f"pm{os.getpid()}{port}"
    sock = str(tmp_path / "tmux.sock")  # a tmux server of its own: nothing of the user's is touched
    tmux = ["tmux", "-S", sock]
    cmd = " ".join([*PERFMON, "--run-dir", str(tmp_path / "n0"), *_node_args(port, 3000)])
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                    f"cd {REPO} && {cmd}; sleep 60"], env=env, check=True)
    node1 = None
    try:
        wait_for(lambda: listening(port + 1), "node 0's hub")
        node1 = subprocess.Popen([*PERFMON, "--headless", "--run-dir", str(tmp_path / "n1"),
                                  *_node_args(port, 3000)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

        def ranks_view() -> str | None:
            subprocess.run([*tmux, "send-keys", "-t", session, "7"])
            text = screen()
            return text if "4/4 ranks on 2 nodes" in text and "← slowest" in text else None

        text = wait_for(ranks_view, "every rank of both nodes in node 0's ranks view", every=1.0)
        for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):  # each rank's row names its node
            assert re.search(rf"│\s*▶?\s+{rank}\s+{node}\s+[\d,]+\s", text), text
        subprocess.run([*tmux, "send-keys", "-t", session, "q"])
        wait_for(lambda: "stop training" in screen(), "the quit dialog")
        subprocess.run([*tmux, "send-keys", "-t", session, "s"])  # stop: node 0's torchrun ends the job everywhere
        node1.wait(timeout=120)
    finally:
        if node1 is not None and node1.poll() is None:
            node1.kill()
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        _kill_jobs(port)
