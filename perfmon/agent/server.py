"""The agent's Unix socket: any number of monitors attach, read the stream, send commands.

A command line is parsed here, once, into a :class:`perfmon.messages.commands.Command`; a line that is not a
valid command is answered ``ok=False`` here and goes no further.

One daemon thread runs a selector loop. Writes never block the caller: each client has a
bounded outbound buffer; a monitor that does not read (frozen, stopped) has lines dropped
and counted, and recovers the gap from the recording (lines carry ``seq``).

A client may instead *feed* the agent: the launcher that started the job samples its host and GPU telemetry from
outside it and sends each reading as a ``sample`` line, so the job runs no sampler of its own. The first such line
hands the connection over (``on_feed``): it leaves this loop, gets none of the stream and is no monitor; the agent
reads it at its own ticks, so a reading wakes no thread of the job.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfmon import protocol
from perfmon.agent.descriptors import Fingerprint, fingerprint, still_ours
from perfmon.messages.commands import Command, CommandError, parse_command

#: Per-client outbound buffer limit; beyond it, lines are dropped for that client.
CLIENT_BUFFER = 8 * 1024 * 1024


LOST = ("the script closed perfmon's socket descriptors (os.closerange?): monitors are cut off from the job; its "
        "recording goes on")


class _Client:
    __slots__ = ("sock", "out", "inbuf", "dropped", "peer_pid")

    def __init__(self, sock: socket.socket, peer_pid: int | None) -> None:
        self.sock = sock
        self.out = bytearray()
        self.inbuf = bytearray()
        self.dropped = 0
        self.peer_pid = peer_pid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a Unix socket peer on Linux, else None."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
        return struct.unpack("3i", raw)
    except OSError:
        return None


class Server:
    """Serves ``path``; ``greeting()`` gives the first bytes a new client reads.

    ``lock`` is held while a client is registered and its greeting queued, so a publisher
    holding the same lock never sends a client a line older than its greeting.
    """

    def __init__(
        self,
        path: Path,
        greeting: Callable[[], bytes],
        on_command: Callable[[Command, Callable[[bytes], None]], None],
        lock: threading.Lock,
        on_error: Callable[[str, BaseException], None],
        on_feed: Callable[[socket.socket, dict[str, Any], bytes], bool] | None = None,
    ) -> None:
        """``on_feed(sock, first reading, bytes after it)``: takes the connection of a client whose line was a
        ``sample``, or says False (the connection is closed); None: such lines are refused like any bad line."""
        self.path = path
        self._greeting = greeting
        self._on_command = on_command
        self._lock = lock
        self._on_error = on_error
        self._on_feed = on_feed
        self._clients: dict[int, _Client] = {}
        self._clients_lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = False
        #: the script closed our descriptors (``os.closerange``, daemon-style code): their numbers may be its own
        #: files now, so nothing here reads, writes or closes them any more
        self.lost = False
        self._inodes: dict[int, Fingerprint | None] = {}
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.refused = 0
        self.bad_lines = 0

    @property
    def client_count(self) -> int:
        return len(self._clients)

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bound under a private name and renamed once it listens: a monitor that sees the path can connect (one
        # that came between bind and listen was refused, and fell back to reading the recording)
        staging = self.path.with_name(f".{os.getpid()}.listening")
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            try:
                listener.bind(str(staging))
            except OSError:  # a name too long for a socket address (the path itself fits): bound in place
                staging = self.path
                listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(staging, 0o600)
        listener.listen(16)
        if staging != self.path:
            os.replace(staging, self.path)
        listener.setblocking(False)
        self._listener = listener
        self._inodes = {sock.fileno(): fingerprint(sock.fileno()) for sock in (listener, self._wake_r, self._wake_w)}
        self._sel.register(listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="perfmon-server", daemon=True)
        self._thread.start()

    def broadcast(self, data: bytes) -> None:
        """Send ``data`` to every client (caller holds ``lock``).

        A client with nothing queued gets it straight away with a non-blocking send from the caller's thread;
        only what the socket does not take is queued for the server thread, which is then woken. So a monitor
        that keeps up costs one ``send`` per message and no thread switch."""
        if self.lost:
            return
        if self._descriptors_lost():  # three fstats a tick: never a send on the script's descriptor
            self.lost = True
            self._on_error("server", OSError(LOST))  # said now: the server thread may never wake again to say it
            return
        queued = False
        with self._clients_lock:
            for client in self._clients.values():
                if client.out:
                    if len(client.out) + len(data) > CLIENT_BUFFER:
                        client.dropped += 1
                    else:
                        client.out += data
                        queued = True
                    continue
                try:
                    n = client.sock.send(data)
                except BlockingIOError:
                    n = 0
                except OSError:
                    n = len(data)  # a closed peer: the server thread sees it and drops the client
                if n < len(data):
                    client.out += data[n:]
                    queued = True
        if queued:
            self._wake()

    def _wake(self) -> None:
        if self.lost:
            return
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Flush what clients can take within a moment, then close everything."""
        if self.lost or self._descriptors_lost():
            self._abandon()
            return
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._clients_lock:
            for client in self._clients.values():
                _close_quietly(client.sock)
            self._clients.clear()
        if self._listener is not None:
            _close_quietly(self._listener)
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def _descriptors_lost(self) -> bool:
        """Our sockets' descriptors no longer are our sockets (closed, or the numbers reused by the script)."""
        return not all(still_ours(fd, taken) for fd, taken in self._inodes.items())

    def _abandon(self) -> None:
        """Let go of every descriptor without closing it: their numbers are the script's now."""
        self.lost = self._stop = True
        with self._clients_lock:
            socks = [c.sock for c in self._clients.values()]
            self._clients.clear()
        for sock in [*socks, self._listener, self._wake_r, self._wake_w]:
            if sock is not None:
                try:
                    sock.detach()
                except OSError:
                    pass
        _ABANDONED.append(self._sel)  # its epoll descriptor, too: never closed by its finaliser

    def forget_in_child(self) -> None:
        """In a process forked from the job (a DataLoader worker, a script's own child): close its copies of the
        sockets, without a lock (another thread of the parent may have held one at the fork) and without removing
        the parent's socket file. A child that kept them kept every monitor's connection open after the job
        ended: a headless perfmon waited for the child, up to 10 minutes."""
        for sock in [*(c.sock for c in list(self._clients.values())), self._listener, self._wake_r, self._wake_w]:
            if sock is not None:
                _close_quietly(sock)
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass

    # -- loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if self.lost:  # seen (and said) by a broadcast: let go here, where the descriptors are used
                self._abandon()
                return
            try:
                self._update_interest()
                events = self._sel.select(timeout=5.0)  # woken by _wake for anything sooner (writes, close)
                for key, mask in events:
                    self._handle(key, mask)
                if self._stop and not any(c.out for c in self._clients.values()):
                    return
            except Exception as exc:  # noqa: BLE001 - the server must never die silently
                if self._descriptors_lost():
                    self._abandon()
                    self._on_error("server", OSError(LOST))
                    return
                self._on_error("server", exc)
                if self._stop:
                    return

    def _update_interest(self) -> None:
        with self._clients_lock:
            for fd, client in self._clients.items():
                want = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.out else 0)
                if self._sel.get_key(fd).events != want:
                    self._sel.modify(client.sock, want, fd)

    def _handle(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data == "accept":
            self._accept()
        elif key.data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        else:
            client = self._clients.get(key.data)
            if client is None:
                return
            if mask & selectors.EVENT_READ:
                self._read(key.data, client)
            if mask & selectors.EVENT_WRITE and key.data in self._clients:
                self._write(key.data, client)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()  # type: ignore[union-attr]
        except (BlockingIOError, OSError):
            return
        creds = peer_credentials(sock)
        if creds is not None and creds[1] != os.getuid():
            self.refused += 1
            _close_quietly(sock)
            return
        sock.setblocking(False)
        client = _Client(sock, creds[0] if creds else None)
        fd = sock.fileno()
        with self._lock:  # no publish can slip between the greeting and registration
            client.out += self._greeting()
            with self._clients_lock:
                self._clients[fd] = client
        self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, fd)

    def _drop(self, fd: int, client: _Client) -> None:
        with self._clients_lock:
            self._clients.pop(fd, None)
        try:
            self._sel.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        _close_quietly(client.sock)

    def _write(self, fd: int, client: _Client) -> None:
        with self._clients_lock:
            data = bytes(client.out[: 1 << 20])
        try:
            n = client.sock.send(data)
        except BlockingIOError:
            return
        except OSError:
            self._drop(fd, client)
            return
        with self._clients_lock:
            del client.out[:n]

    def _read(self, fd: int, client: _Client) -> None:
        try:
            chunk = client.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(fd, client)
            return
        client.inbuf += chunk
        while b"\n" in client.inbuf:
            line, _, rest = bytes(client.inbuf).partition(b"\n")
            client.inbuf = bytearray(rest)
            self._command(line, client)
            if fd not in self._clients:  # handed over as a feed
                return
        if len(client.inbuf) > protocol.MAX_LINE:
            self.bad_lines += 1
            client.inbuf.clear()

    def _command(self, line: bytes, client: _Client) -> None:
        try:
            msg = protocol.decode(line, allowed=("command", "sample") if self._on_feed else ("command",))
            if msg["type"] == "sample":
                self._hand_over(msg, client)
                return
            command = parse_command(msg)
        except protocol.DecodeError as exc:
            command = CommandError(str(exc))
        if isinstance(command, CommandError):
            self.bad_lines += 1
            reply = protocol.message("event", kind="command_result", **command.result())
            self._reply(client, protocol.encode(reply))
            return

        def reply(data: bytes) -> None:
            self._reply(client, data)

        self._on_command(command, reply)

    def _hand_over(self, msg: dict[str, Any], client: _Client) -> None:
        """A client that sends a reading is a feed: it leaves this loop for the agent (or is closed)."""
        with self._clients_lock:
            self._clients.pop(client.sock.fileno(), None)
        try:
            self._sel.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        assert self._on_feed is not None
        if not self._on_feed(client.sock, msg, bytes(client.inbuf)):
            _close_quietly(client.sock)

    def _reply(self, client: _Client, data: bytes) -> None:
        with self._clients_lock:
            if len(client.out) + len(data) <= CLIENT_BUFFER:
                client.out += data
        self._wake()


#: kept, never closed: what a server that lost its descriptors held (closing them would close the script's files)
_ABANDONED: list[Any] = []


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
