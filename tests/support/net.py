"""Loopback helpers: free ports, waiting for a listener, a TCP relay a test can cut."""

from __future__ import annotations

import itertools
import os
import queue
import random
import select
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

# Ports handed out for servers the tests start (free_port): below Linux's ephemeral range
# (32768-60999), where no client socket takes them, and a block of its own for each
# pytest-xdist worker, so that two workers never hand out the same port. The start within the
# block is random, so that two runs at once rarely try the same port first; a port found
# taken (a service, another run) is skipped.
PORT_BASE = 20000
PORT_BLOCK = 1000
PORT_BLOCKS = 12


def port_block(worker: str | None) -> range:
    """The ports of an xdist worker ("gw3"; None without xdist)."""
    digits = (worker or "gw0").removeprefix("gw")
    index = int(digits) % PORT_BLOCKS if digits.isdigit() else 0
    return range(PORT_BASE + index * PORT_BLOCK, PORT_BASE + (index + 1) * PORT_BLOCK)


_block = port_block(os.environ.get("PYTEST_XDIST_WORKER"))
_first = random.randrange(PORT_BLOCK)
_next_ports = itertools.cycle(
    [_block[(_first + offset) % PORT_BLOCK] for offset in range(PORT_BLOCK)]
)


def free_port() -> int:
    """A loopback port nobody listens on, for a server this test is about to start. Unique
    within this process (and this worker's block) until the block has gone round."""
    for _ in range(PORT_BLOCK):
        port = next(_next_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_block.start}-{_block.stop - 1}")


def wait_for_port(port: int, *, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def through_port(url: str, port: int) -> str:
    """A one-host database URL sent to 127.0.0.1:``port`` instead (a relay in between)."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit((parts.scheme, f"{user}127.0.0.1:{port}", parts.path, parts.query, ""))


class TcpRelay:
    """A real TCP relay on 127.0.0.1 between a client and a server (e.g. PostgreSQL).

    - ``silence()``: connections stay open but no byte passes either way, like a network
      partition (the peers only notice through their own timeouts);
    - ``deafen()``: the client's bytes still reach the server, the server's answers are
      dropped (a statement runs and commits; its caller never hears of it);
    - ``deafen_on(marker)``: ``deafen()`` once the client has sent ``marker`` (a value only
      one statement carries): that statement reaches the server, its answer is lost;
    - ``heal()``: bytes flow again; bytes sent while silent are dropped, as a partition would;
    - ``cut()``: every connection is reset and new ones are refused until ``heal()``.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._silent = False
        self._deaf = False
        self._deaf_on: bytes | None = None
        self._refusing = False
        self._closed = False
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @classmethod
    def to_database(cls, url: str) -> TcpRelay:
        """A relay to the server a one-host ``postgresql://`` URL names."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def url_for(self, url: str) -> str:
        """``url`` (a one-host database URL) reaching its server through this relay."""
        return through_port(url, self.port)

    def __enter__(self) -> TcpRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def silence(self) -> None:
        self._silent = True

    def deafen(self) -> None:
        self._deaf = True

    def deafen_on(self, marker: bytes) -> None:
        self._deaf_on = marker

    def heal(self) -> None:
        self._silent = False
        self._deaf = False
        self._deaf_on = None
        self._refusing = False

    def cut(self) -> None:
        self._refusing = True
        self._reset_all()

    def close(self) -> None:
        self._closed = True
        self._reset_all()
        try:
            self._listener.close()
        except OSError:
            pass

    def _reset_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                    s.close()
                except OSError:
                    pass

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._closed:
                ready, _, _ = select.select([a, b], [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if not self._silent and not (self._deaf and s is b):
                        peers[s].sendall(data)
                    if s is a and self._deaf_on is not None and self._deaf_on in data:
                        self._deaf = True
        except (OSError, ValueError):
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


class SlowPath:
    """A TCP path on 127.0.0.1 that holds every byte from the client for ``hold`` seconds
    before it reaches the server (a slow or congested network): what the client wrote has
    left it, and arrives later, even after the client gave up and closed (its FIN arrives
    after its data, as on a real network). Answers come back at once. ``hold`` may be
    changed at any time; it applies to bytes read from then on."""

    def __init__(self, target_host: str, target_port: int, *, hold: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.hold = hold
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.accepted = 0  # connections taken so far
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def __enter__(self) -> SlowPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in [self._listener, *sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
                self.accepted += 1
            held: queue.Queue[tuple[float, bytes]] = queue.Queue()
            for job, args in (
                (self._read_held, (client, held)),
                (self._deliver_held, (held, server)),
                (self._pass_back, (server, client)),
            ):
                threading.Thread(target=job, args=args, daemon=True).start()

    def _read_held(self, source: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        """Client to server: each chunk is due ``hold`` seconds after it was read; b"" is
        the client's end of stream."""
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            held.put((time.monotonic() + self.hold, data))
            if not data:
                return

    def _deliver_held(self, held: queue.Queue[tuple[float, bytes]], dest: socket.socket) -> None:
        try:
            while not self._closed:
                due, data = held.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    dest.shutdown(socket.SHUT_WR)
                    return
                dest.sendall(data)
        except OSError:
            return

    def _pass_back(self, source: socket.socket, dest: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                try:
                    dest.sendall(data)
                except OSError:
                    pass  # the client is gone; the server's answer is lost on the way
        except OSError:
            pass
        finally:
            for s in (source, dest):
                try:
                    s.close()
                except OSError:
                    pass
