"""Sockets cannot be hoarded: `fencegate serve` closes connections that send nothing, half a
request head, or stay idle after a response, and a crowd of such connections larger than the
process's open-files limit does not keep normal requests out. A raw ``#`` in the target is
refused, not forwarded with the fragment cut. Real processes, real sockets."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


class LimitedGateway(GatewayProcess):
    """`fencegate serve` whose open-files limit is ``open_files`` (soft and hard), as on a
    host whose default limit is low."""

    def __init__(self, *, open_files: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.open_files = open_files

    def command(self) -> list[str]:
        return [
            "prlimit",
            f"--nofile={self.open_files}:{self.open_files}",
            "--",
            *super().command(),
        ]


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def seconds_until_closed(sock: socket.socket, *, limit: float) -> float:
    """How long until the server closes ``sock`` (reads and drops what it sends); fails
    after ``limit`` seconds."""
    started = time.monotonic()
    sock.settimeout(0.5)
    while time.monotonic() - started < limit:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
        if not data:
            return time.monotonic() - started
    raise AssertionError(f"the server kept the connection open for {limit}s")


def request_bytes(target: str, key: str) -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()


def read_response(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_silent_half_sent_and_idle_connections_are_closed_within_their_timeouts(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    with GatewayProcess(
        upstream=upstream.url,
        workdir=tmp_path,
        extra_args=["--header-timeout", "2", "--idle-timeout", "1"],
    ) as gateway:
        silent = connect(gateway.port)
        half = connect(gateway.port)
        half.sendall(b"POST /charges HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: k-1\r\n")
        trickle = connect(gateway.port)
        idle = connect(gateway.port)
        idle.sendall(request_bytes("/charges", "k-2"))
        assert read_response(idle).startswith(b"HTTP/1.1 200 ")
        # A head sent a byte at a time still has to be whole within the header timeout.
        started = time.monotonic()
        closed_trickle = None
        for byte in b"POST /charges HTTP/1.1\r\nHost: gw\r\n":
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                closed_trickle = time.monotonic() - started
                break
            time.sleep(0.2)  # the slow client's pace, not a wait for the server
        with contextlib.closing(silent), contextlib.closing(half), contextlib.closing(idle):
            assert seconds_until_closed(silent, limit=10) <= 2 + 2
            assert seconds_until_closed(half, limit=10) <= 2 + 2
            assert seconds_until_closed(idle, limit=10) <= 1 + 2
        with contextlib.closing(trickle):
            if closed_trickle is None:
                closed_trickle = (time.monotonic() - started) + seconds_until_closed(
                    trickle, limit=10
                )
            assert closed_trickle <= 2 + 2


def test_a_silent_connection_is_closed_within_30_seconds_by_default(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with contextlib.closing(connect(gateway.port)) as silent:
            assert seconds_until_closed(silent, limit=30) <= 10 + 2  # the default, 10 s


def test_more_idle_sockets_than_open_files_do_not_keep_normal_requests_out(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """256 open files for the gateway; 600 connections that send nothing or half a head,
    opened in waves between normal requests, each on a new connection: every normal request
    is answered by the upstream."""
    hoarded: list[socket.socket] = []
    statuses: list[int] = []
    with LimitedGateway(open_files=256, upstream=upstream.url, workdir=tmp_path) as gateway:
        try:
            for wave in range(6):
                for i in range(100):
                    sock = socket.socket()
                    sock.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        sock.connect(("127.0.0.1", gateway.port))
                    if i % 2:
                        with contextlib.suppress(OSError):
                            sock.send(b"POST /charges HTTP/1.1\r\nHost: gw\r\n")
                    hoarded.append(sock)
                for n in range(3):
                    key = f"wave-{wave}-{n}-{uuid.uuid4().hex[:6]}"
                    with httpx.Client(base_url=gateway.url, timeout=15) as client:
                        answer = client.post("/charges", headers={"Idempotency-Key": key}, json={})
                    statuses.append(answer.status_code)
                    assert answer.json()["key"] == key
            log = gateway.log_text()
        finally:
            for sock in hoarded:
                sock.close()
    assert statuses == [200] * 18, statuses
    assert "connection limit" in log  # it made room by closing hoarded connections
    assert "Too many open files" not in log


@pytest.mark.parametrize("target", ["/h/x#frag", "/h/x?a=1#frag", "/h/x#"])
def test_a_raw_fragment_in_the_target_is_refused_not_cut_off(
    upstream: UpstreamProcess, tmp_path: Path, target: str
) -> None:
    """The HTTP parser cuts ``#…`` off before the application sees the target; the gateway
    refuses it with 400 invalid-target instead of forwarding ``/h/x``."""
    key = f"frag-{uuid.uuid4().hex[:8]}"
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with contextlib.closing(connect(gateway.port)) as sock:
            sock.sendall(request_bytes(target, key))
            answer = read_response(sock)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 400 Bad Request", answer
    assert b"application/problem+json" in rest
    assert b"/problems/invalid-target" in rest
    assert upstream.count(key) == 0


def test_blank_lines_between_requests_do_not_keep_a_connection_open(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """The parser skips blank lines between requests: a client sending nothing else is
    closed once the header timeout has passed since its first blank line."""
    with GatewayProcess(
        upstream=upstream.url,
        workdir=tmp_path,
        extra_args=["--header-timeout", "2", "--idle-timeout", "1"],
    ) as gateway:
        with contextlib.closing(connect(gateway.port)) as sock:
            sock.sendall(request_bytes("/charges", f"crlf-{uuid.uuid4().hex[:6]}"))
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            started = time.monotonic()
            closed_after = None
            while time.monotonic() - started < 15:
                try:
                    sock.sendall(b"\r\n")
                except OSError:
                    closed_after = time.monotonic() - started
                    break
                time.sleep(0.3)  # the client's pace, faster than the idle timeout
    assert closed_after is not None, "blank lines kept the connection open for 15 s"
    assert closed_after <= 2 + 3


def test_pipelined_requests_are_each_answered(upstream: UpstreamProcess, tmp_path: Path) -> None:
    """Two requests in one write: the second head waits behind the first response and is
    neither timed out nor counted as idle."""
    keys = [f"pipe-{n}-{uuid.uuid4().hex[:6]}" for n in range(2)]
    with GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--header-timeout", "1"]
    ) as gateway:
        with contextlib.closing(connect(gateway.port)) as sock:
            slow = request_bytes("/charges?delay=1.5", keys[0])
            sock.sendall(slow + request_bytes("/charges", keys[1]))
            first, second = read_response(sock), read_response(sock)
    assert first.startswith(b"HTTP/1.1 200 ") and keys[0].encode() in first
    assert second.startswith(b"HTTP/1.1 200 ") and keys[1].encode() in second
