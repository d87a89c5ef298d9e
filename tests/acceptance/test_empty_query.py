"""``/v1/q?`` (an empty query) and ``/v1/q`` are different request targets (RFC 3986 §3.4
keeps the empty query); the gateway forwards the target byte for byte, so the upstream must
see the "?" too. A real gateway process in front of a raw TCP upstream that answers with the
request line it received: no HTTP library on that side to normalise it away."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_target_gateway import raw_get
from tests.support.gateway import GatewayProcess
from tests.support.raw_upstream import RawUpstream

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp: Path = tmp_path_factory.mktemp("empty-query")
    with (
        RawUpstream() as upstream,
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
