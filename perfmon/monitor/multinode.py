"""Multi-node jobs (torchrun ``--nnodes N``): every node's ranks visible from one dashboard.

Each node runs ``perfmon torchrun ...`` with the same torchrun options, as it runs torchrun. Every node's
agents record locally (``RUN/rank-K/`` on that node). The perfmon on the machine of the rendezvous endpoint is
the **hub**: it listens on that endpoint's address, port ``rendezvous port + 1`` (``PERFMON_HUB_PORT`` to
choose another). The perfmon on every other node is a **relay**: it connects to the hub and streams its own
ranks' messages (read from their agents as a local monitor does) and passes the hub's commands to them.

Threat model. Nothing listens beyond the per-user Unix sockets unless the job is multi-node; then only the
hub, only on the rendezvous address, only for as long as the job runs. Both ends prove they know the job's
secret before anything else is sent (HMAC-SHA256 challenge-response with fresh nonces each way, compared in
constant time), so a stranger who can reach the port can neither read the telemetry nor send a command, and
a relay never streams to an impostor hub. The secret is ``PERFMON_JOB_SECRET`` when set (the same on every
node), else derived from a per-user key (``~/.config/perfmon/key``, 0600, made on first use: a home shared
by the nodes, as on most clusters, shares it) and the rendezvous id and endpoint. Commands are the agents'
whitelist (profile, empty_cache, count_flops, memory_snapshot, export, stop). The stream is not encrypted:
on an untrusted network, an eavesdropper could read step timings and telemetry (never code or data), so
tunnel it (SSH, WireGuard) there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfmon import protocol
from perfmon.messages.commands import Command, parse_command
from perfmon.monitor.launch import torchrun_options

HUB_PORT_ENV = "PERFMON_HUB_PORT"
SECRET_ENV = "PERFMON_JOB_SECRET"
MAX_HANDSHAKE = 4096
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Endpoint:
    """Where the job's nodes meet, from torchrun's own options."""

    nnodes_max: int
    host: str
    port: int
    rdzv_id: str

    @property
    def multinode(self) -> bool:
        return self.nnodes_max > 1

    @property
    def hub_port(self) -> int:
        value = os.environ.get(HUB_PORT_ENV, "")
        return int(value) if value.isdigit() else self.port + 1


def _option(argv: list[str], *names: str) -> str | None:
    """The value of a torchrun option (``--opt value`` or ``--opt=value``, ``-`` and ``_`` spellings), among
    the options before the script; else torchrun's environment form (``PET_NNODES`` for ``--nnodes``)."""
    want = {n for name in names for n in (name, "--" + name[2:].replace("-", "_"))}
    argv = torchrun_options(argv)  # what follows the script is the script's own
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in want:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    for name in names:
        value = os.environ.get("PET_" + name[2:].replace("-", "_").upper())
        if value:
            return value
    return None


def endpoint(torchrun_argv: list[str]) -> Endpoint:
    """The job's rendezvous as torchrun reads it (c10d endpoint, else the static master address)."""
    nnodes = _option(torchrun_argv, "--nnodes") or "1"
    try:
        nnodes_max = int(nnodes.split(":")[-1])
    except ValueError:
        nnodes_max = 1
    rdzv = _option(torchrun_argv, "--rdzv-endpoint") or ""
    backend = _option(torchrun_argv, "--rdzv-backend") or "static"
    if rdzv:
        host, _, port = rdzv.rpartition(":") if ":" in rdzv else (rdzv, "", "")
        port_n = int(port) if port.isdigit() else (29400 if backend == "c10d" else 29500)
    else:
        host = _option(torchrun_argv, "--master-addr") or "127.0.0.1"
        port = _option(torchrun_argv, "--master-port") or "29500"
        port_n = int(port) if port.isdigit() else 29500
    return Endpoint(nnodes_max, host.strip("[]") or "127.0.0.1", port_n, _option(torchrun_argv, "--rdzv-id") or "none")


def job_secret(ep: Endpoint, key_path: Path | None = None) -> bytes:
    """The job's secret: ``PERFMON_JOB_SECRET``, else HMAC(per-user key, rendezvous id and endpoint)."""
    given = os.environ.get(SECRET_ENV)
    if given:
        return hashlib.sha256(given.encode()).digest()
    path = key_path or Path.home() / ".config" / "perfmon" / "key"
    key = _read_key(path)
    if key is None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".key.{socket.gethostname()}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # whole or not at all: another node (shared home) may be making it too
        except FileExistsError:
            pass  # it won: use theirs
        finally:
            tmp.unlink(missing_ok=True)
        key = _read_key(path)
        if key is None:
            raise OSError(f"cannot read the per-user key {path}")
    return hmac.new(key, f"{ep.rdzv_id}|{ep.host}|{ep.port}".encode(), hashlib.sha256).digest()


def _read_key(path: Path) -> bytes | None:
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        return None
    return key if len(key) == 32 else None


def _mac(secret: bytes, role: str, mine: str, theirs: str) -> str:
    return hmac.new(secret, f"{role}|{mine}|{theirs}".encode(), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


class _Lines:
    """Complete JSON lines from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def next(self, limit: int = protocol.MAX_LINE) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            if len(self.buf) > limit:
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            return {}
        return msg if isinstance(msg, dict) else {}


class HandshakeError(Exception):
    pass


def hub_handshake(sock: socket.socket, secret: bytes) -> tuple[_Lines, dict[str, Any]]:
    """The hub's side: challenge, check the relay's proof, prove itself. Raises HandshakeError."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    lines = _Lines(sock)
    nonce = secrets.token_hex(16)
    _send(sock, {"type": "hub_hello", "v": 1, "nonce": nonce})
    hello = lines.next(MAX_HANDSHAKE)
    if not hello or hello.get("type") != "relay_hello" or not isinstance(hello.get("nonce"), str):
        raise HandshakeError("not a perfmon relay")
    if not hmac.compare_digest(str(hello.get("mac", "")), _mac(secret, "relay", nonce, hello["nonce"])):
        raise HandshakeError("wrong job secret")
    _send(sock, {"type": "hub_ok", "mac": _mac(secret, "hub", hello["nonce"], nonce)})
    sock.settimeout(None)
    return lines, hello


def relay_handshake(sock: socket.socket, secret: bytes, about: dict[str, Any]) -> _Lines:
    """The relay's side: answer the challenge, check the hub's proof. Raises HandshakeError."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    lines = _Lines(sock)
    hello = lines.next(MAX_HANDSHAKE)
    if not hello or hello.get("type") != "hub_hello" or not isinstance(hello.get("nonce"), str):
        raise HandshakeError("not a perfmon hub")
    nonce = secrets.token_hex(16)
    _send(sock, {**about, "type": "relay_hello", "nonce": nonce, "mac": _mac(secret, "relay", hello["nonce"], nonce)})
    ok = lines.next(MAX_HANDSHAKE)
    if not ok or not hmac.compare_digest(str(ok.get("mac", "")), _mac(secret, "hub", nonce, hello["nonce"])):
        raise HandshakeError("the hub does not know the job secret")
    sock.settimeout(None)
    return lines


class Hub:
    """Listens for the other nodes' relays; their ranks' messages go to ``deliver``, commands go back to them.

    ``opened``/``closed`` are called as a relay's stream starts and ends (the job source counts them as
    streams that are not over yet)."""

    def __init__(self, sock: socket.socket, secret: bytes, deliver: Callable[[dict[str, Any]], None],
                 opened: Callable[[], None], closed: Callable[[], None]) -> None:
        self.sock = sock
        self.secret = secret
        self.deliver = deliver
        self.opened, self.closed = opened, closed
        self.relays: list[socket.socket] = []
        self.refused = 0  # connections that failed the handshake
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="perfmon-hub", daemon=True)

    @classmethod
    def bind(cls, ep: Endpoint, **kw: Any) -> Hub | None:
        """Listen on the rendezvous address; None when another process (the hub, on this machine) holds
        the port or this machine does not have that address (it is another node)."""
        try:
            infos = socket.getaddrinfo(ep.host, ep.hub_port, type=socket.SOCK_STREAM)
        except OSError:
            return None
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.bind(addr)
                sock.listen(64)
            except OSError:
                sock.close()
                continue
            return cls(sock, **kw)
        return None

    def start(self) -> Hub:
        self.thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="perfmon-hub-relay").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            lines, _ = hub_handshake(conn, self.secret)
        except (HandshakeError, OSError, ValueError):
            self.refused += 1
            conn.close()
            return
        with self._lock:
            self.relays.append(conn)
        self.opened()
        try:
            while not self._stop.is_set():
                msg = lines.next()
                if msg is None:
                    break
                if msg:
                    self.deliver(msg)
        except OSError:
            pass
        finally:
            with self._lock:
                if conn in self.relays:
                    self.relays.remove(conn)
            conn.close()
            self.closed()

    def send(self, command: Command) -> bool:
        """A command to every relay (each passes it to its ranks, or to those ``command.ranks`` names)."""
        with self._lock:
            relays = list(self.relays)
        wire = command.to_wire()
        sent = False
        for conn in relays:
            try:
                _send(conn, wire)
                sent = True
            except OSError:
                pass
        return sent

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            for conn in self.relays:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Relay:
    """Streams this node's ranks to the hub (connecting until it answers), and runs its commands here.

    ``make_source()`` opens this node's ranks afresh for each connection (a stream starts over: the hub drops
    what it already has by ``seq``); the hub's commands go to that source's ranks."""

    def __init__(self, ep: Endpoint, secret: bytes, make_source: Callable[[], Any], about: dict[str, Any],
                 alive: Callable[[], bool], retry_s: float = 1.0) -> None:
        self.ep, self.secret, self.make_source = ep, secret, make_source
        self.source: Any = None
        self.about = about
        self.alive = alive
        self.retry_s = retry_s
        self.connected = threading.Event()
        self.error: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="perfmon-relay", daemon=True)

    def start(self) -> Relay:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and self.alive():
            try:
                sock = socket.create_connection((self.ep.host, self.ep.hub_port), timeout=HANDSHAKE_TIMEOUT_S)
            except OSError as exc:
                self.error = f"hub {self.ep.host}:{self.ep.hub_port} not reachable ({exc.strerror or exc})"
                self._stop.wait(self.retry_s)
                continue
            try:
                lines = relay_handshake(sock, self.secret, self.about)
            except (HandshakeError, OSError) as exc:
                self.error = f"hub {self.ep.host}:{self.ep.hub_port}: {exc}"
                sock.close()
                self._stop.wait(self.retry_s)
                continue
            self.connected.set()
            self.error = None
            threading.Thread(target=self._commands, args=(lines,), daemon=True, name="perfmon-relay-cmd").start()
            finished = self._forward(sock)
            sock.close()
            self.connected.clear()
            if finished:
                return

    def _forward(self, sock: socket.socket) -> bool:
        """Send this node's stream; True when it is over (the job ended here), False if the hub went away."""
        source = self.source = self.make_source()
        try:
            for msg in source.messages():
                if self._stop.is_set():
                    return True
                sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
            return True
        except OSError:
            return False
        finally:
            source.close()

    def _commands(self, lines: _Lines) -> None:
        try:
            while True:
                msg = lines.next()
                if msg is None:
                    return
                source = self.source
                command = parse_command(msg) if msg.get("type") == "command" else None
                # the hub authenticated; a line that is not a valid command (a newer hub's?) is skipped
                if isinstance(command, Command) and source is not None:
                    source.send(command)
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        if self.source is not None:
            self.source.close()


def start(torchrun_argv: list[str], source: Any, make_source: Callable[[], Any], alive: Callable[[], bool],
          ) -> Hub | Relay | None:
    """For a multi-node job: the hub (this machine has the rendezvous address and the port is free), feeding
    ``source`` with the other nodes' ranks; else a relay of this node's ranks to it. None on one node."""
    ep = endpoint(torchrun_argv)
    if not ep.multinode:
        return None
    secret = job_secret(ep)
    hub = Hub.bind(ep, secret=secret, deliver=source.deliver, opened=source.remote_opened,
                   closed=source.remote_closed)
    if hub is not None:
        source.remote = hub
        return hub.start()
    return Relay(ep, secret, make_source, {"host": socket.gethostname(), "pid": os.getpid()}, alive).start()
