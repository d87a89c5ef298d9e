"""``/v1/q?`` (an empty query) and ``/v1/q`` are different request targets (RFC 3986 §3.4
keeps the empty query); the gateway forwards the target byte for byte, so the upstream must
see the "?" too. A real gateway process in front of a raw TCP upstream that answers with the
request line it received: no HTTP library on that side to normalise it away."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_target_gateway import raw_get
from tests.support.gateway import GatewayProcess

pytestmark = pytest.mark.timeout(120)


class RequestLineUpstream:
    """Answers every request with ``{"request_line": "..."}``, one connection at a time."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RequestLineUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                body = json.dumps({"request_line": line}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp: Path = tmp_path_factory.mktemp("empty-query")
    with (
        RequestLineUpstream() as upstream,
        GatewayProcess(upstream=upstream.url, workdir=tmp) as process,
    ):
        yield process


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        (b"/v1/q?", "GET /v1/q? HTTP/1.1"),
        (b"/v1/q", "GET /v1/q HTTP/1.1"),
        (b"/v1/q?a=1", "GET /v1/q?a=1 HTTP/1.1"),
    ],
)
def test_the_target_reaches_the_upstream_byte_for_byte(
    gateway: GatewayProcess, target: bytes, forwarded: str
) -> None:
    status, body = raw_get(gateway.port, target)
    assert status == 200 and body is not None
    assert body["request_line"] == forwarded
