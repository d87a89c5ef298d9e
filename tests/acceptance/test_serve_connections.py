"""Sockets cannot be hoarded: `fencegate serve` closes connections that send nothing, half a
request head, a stalled body, or stay idle after a response, and a crowd of such connections
larger than the process's open-files limit (or its connection limit) does not keep normal
requests out. A raw ``#`` in the target is refused, not forwarded with the fragment cut. Real
processes, real sockets."""

from __future__ import annotations

import contextlib
import select
import socket
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until_sync


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


# Bytes read past the end of a response on a socket: the start of the next (pipelined) one.
_unread: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_until_head_ends(sock: socket.socket, data: bytes) -> tuple[bytes, bytes]:
    """A response head (``data``: what was read of it already) and what came after it."""
    sock.settimeout(10)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def read_response(sock: socket.socket) -> bytes:
    """The next response on ``sock``: its head and its Content-Length body. What came in the
    same read after that body (a pipelined answer written right after it) is kept for the
    next call, not dropped."""
    head, body = read_until_head_ends(sock, _unread.pop(sock, b""))
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
    if body[length:]:
        _unread[sock] = body[length:]
    return head + b"\r\n\r\n" + body[:length]


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


def stalled_body_head(key: str) -> bytes:
    """A whole request head announcing 100 body bytes, and the first 10 of them."""
    return (
        f"POST /charges HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode() + b'{"pad": "x'


def unread_bytes(server_port: int, client_ports: set[int]) -> int | None:
    """What the gateway has not read yet of the connections from ``client_ports`` (its
    sockets' receive queues, /proc/net/tcp); None while one is not listed yet."""
    queues: dict[int, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queue = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == server_port:
            queues[int(remote.split(":")[1], 16)] = int(queue.split(":")[1], 16)
    if not client_ports <= queues.keys():
        return None
    return sum(queues[port] for port in client_ports)


def watch_until_closed(socks: list[socket.socket], *, limit: float) -> list[tuple[float, bytes]]:
    """For each socket, when (monotonic) the server closed it and what it sent before."""
    received = {sock: b"" for sock in socks}
    closed: dict[socket.socket, float] = {}
    deadline = time.monotonic() + limit
    while len(closed) < len(socks) and time.monotonic() < deadline:
        open_ones = [sock for sock in socks if sock not in closed]
        readable, _, _ = select.select(open_ones, [], [], 0.2)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                received[sock] += data
            else:
                closed[sock] = time.monotonic()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} still open after {limit}s"
    return [(closed[sock], received[sock]) for sock in socks]


def test_stalled_bodies_do_not_keep_a_new_client_out(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """``--max-connections 5``; five clients send a whole head with ``Content-Length: 100`` and
    10 bytes of body, then nothing. A new client is answered by the upstream: a stalled body
    is closed to make room, and every stalled body is answered 408 and closed after the body
    timeout (10 s by default). Nothing of theirs reaches the upstream."""
    keys = [f"stall-{n}-{uuid.uuid4().hex[:6]}" for n in range(5)]
    with GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--max-connections", "5"]
    ) as gateway:
        stalled = [connect(gateway.port) for _ in keys]
        try:
            for sock, key in zip(stalled, keys, strict=True):
                sock.sendall(stalled_body_head(key))
            stalled_at = time.monotonic()
            # The gateway has read every head (each request now waits for its body).
            ports = {sock.getsockname()[1] for sock in stalled}
            wait_until_sync(
                lambda: unread_bytes(gateway.port, ports) == 0, timeout=10, what="heads read"
            )
            newcomer = f"new-{uuid.uuid4().hex[:6]}"
            refused = 0

            def answered() -> bool:
                nonlocal refused
                with httpx.Client(base_url=gateway.url, timeout=5) as client:
                    answer = client.post("/charges", headers={"Idempotency-Key": newcomer}, json={})
                if answer.status_code == 503:
                    assert answer.json()["type"].endswith("/too-many-connections")
                    refused += 1
                    return False
                assert answer.status_code == 200, answer.text
                return True

            wait_until_sync(answered, timeout=5, what="the new client answered", interval=0.1)
            answered_after = time.monotonic() - stalled_at
            ends = watch_until_closed(stalled, limit=20)
            log = gateway.log_text()
        finally:
            for sock in stalled:
                sock.close()
    # Room was made by closing a stalled body, long before the body timeout.
    assert answered_after < 5, (answered_after, refused)
    assert upstream.count(newcomer) == 1
    evicted = [(at, data) for at, data in ends if not data]
    timed_out = [(at, data) for at, data in ends if data]
    assert len(evicted) == 1 and evicted[0][0] - stalled_at < 5, ends
    assert "closing the connection that waited longest" in log
    # The other four: 408 request-timeout once 10 s passed without a byte of their bodies.
    assert len(timed_out) == 4, ends
    for at, data in timed_out:
        assert 10 - 0.5 <= at - stalled_at <= 10 + 2, at - stalled_at
        assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), data
        assert b"/problems/request-timeout" in data
    assert all(upstream.count(key) == 0 for key in keys)


def test_a_body_is_timed_out_only_when_it_stops_coming(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """``--body-timeout 1``: a body sent a byte every 0.25 s for 4 s is answered; a body that
    stops is answered 408 and closed about a second after its last byte."""
    keys = [f"slow-{uuid.uuid4().hex[:6]}", f"stop-{uuid.uuid4().hex[:6]}"]
    body = b'{"pad": "' + b"x" * 6 + b'"}'  # 16 bytes
    head = (
        "POST /charges HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    with GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--body-timeout", "1"]
    ) as gateway:
        with (
            contextlib.closing(connect(gateway.port)) as slow,
            contextlib.closing(connect(gateway.port)) as stopped,
        ):
            slow.sendall(head.format(key=keys[0], length=len(body)).encode())
            stopped.sendall(head.format(key=keys[1], length=len(body)).encode() + body[:4])
            stopped_at = time.monotonic()
            said, closed_at = b"", None
            for byte in body:
                slow.sendall(bytes([byte]))
                # The slow client's pace (0.25 s a byte), watching the stopped one meanwhile.
                paced = time.monotonic() + 0.25
                while (left := paced - time.monotonic()) > 0:
                    if closed_at is None and select.select([stopped], [], [], left)[0]:
                        data = stopped.recv(65536)
                        said += data
                        if not data:
                            closed_at = time.monotonic()
                    elif closed_at is not None:
                        time.sleep(left)
            answer = read_response(slow)
            if closed_at is None:
                [(closed_at, rest)] = watch_until_closed([stopped], limit=10)
                said += rest
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert upstream.count(keys[0]) == 1
    assert said.startswith(b"HTTP/1.1 408 "), said
    assert 1 - 0.3 <= closed_at - stopped_at <= 1 + 1.5
    assert upstream.count(keys[1]) == 0


def test_a_pipelined_body_waiting_its_turn_is_not_timed_out(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """``--body-timeout 1``: a second request's head and half its body pipelined behind a
    request the upstream takes 2.5 s for; the client sends the rest once the first answer
    came. Its body's time starts with its turn: the connection is not closed under the first
    request (which would lose its answer), and both are answered."""
    keys = [f"first-{uuid.uuid4().hex[:6]}", f"second-{uuid.uuid4().hex[:6]}"]
    head, _, _ = request_bytes("/charges", keys[1]).partition(b"\r\n\r\n")
    second = head.replace(b"Length: 2", b"Length: 13") + b'\r\n\r\n{"pad": "'
    with GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--body-timeout", "1"]
    ) as gateway:
        with contextlib.closing(connect(gateway.port)) as sock:
            sock.sendall(request_bytes("/charges?delay=2.5", keys[0]) + second)
            first_answer = read_response(sock)
            sock.sendall(b'xx"}')  # the rest of the second body, once it can be read
            second_answer = read_response(sock)
    assert first_answer.startswith(b"HTTP/1.1 200 ") and keys[0].encode() in first_answer
    assert second_answer.startswith(b"HTTP/1.1 200 ") and keys[1].encode() in second_answer


def test_a_body_still_coming_is_not_closed_to_make_room(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """``--max-connections 1``: while one client sends its body a byte every 0.25 s, a new
    client is refused (503 too-many-connections) rather than the upload cut off; the upload
    is answered."""
    key = f"upload-{uuid.uuid4().hex[:6]}"
    head, _, _ = request_bytes("/charges", key).partition(b"\r\n\r\n")
    body = b'{"pad": "xxxxxx"}'
    with GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--max-connections", "1"]
    ) as gateway:
        with contextlib.closing(connect(gateway.port)) as uploading:
            uploading.sendall(head.replace(b"Length: 2", b"Length: %d" % len(body)) + b"\r\n\r\n")
            refused = []
            for n, byte in enumerate(body):
                uploading.sendall(bytes([byte]))
                if n in (4, 12):
                    with httpx.Client(base_url=gateway.url, timeout=5) as client:
                        refused.append(client.get("/healthz").status_code)
                time.sleep(0.25)  # the client's pace, not a wait for the server
            answer = read_response(uploading)
    assert refused == [503, 503]
    assert answer.startswith(b"HTTP/1.1 200 ") and key.encode() in answer


def read_head(sock: socket.socket) -> bytes:
    """A response head alone (a HEAD answer has no body, whatever its Content-Length)."""
    head, rest = read_until_head_ends(sock, b"")
    assert rest == b"", f"bytes after a HEAD answer's head: {rest!r}"
    return head


def test_answers_without_a_body_to_write_still_leave_whole(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """The gateway holds an answer's head to write it with its body in one system call. An
    answer with no body to write (HEAD) is sent all the same, and the connection goes on; a
    closing answer leaves whole before the close."""
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with contextlib.closing(connect(gateway.port)) as sock:
            sock.sendall(b"HEAD /charges HTTP/1.1\r\nHost: gw\r\n\r\n")
            head = read_head(sock)
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"content-length: " in head.lower()
            key = f"after-head-{uuid.uuid4().hex[:6]}"
            sock.sendall(request_bytes("/charges", key))
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 ") and key.encode() in answer
        with contextlib.closing(connect(gateway.port)) as sock:
            key = f"closing-{uuid.uuid4().hex[:6]}"
            sock.sendall(
                request_bytes("/charges", key).replace(
                    b"Host: gw\r\n", b"Host: gw\r\nConnection: close\r\n"
                )
            )
            answer = read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200 ") and key.encode() in answer
            assert seconds_until_closed(sock, limit=10) < 10
