"""Request targets through a real gateway process to a real upstream: refused ones never
reach it, forwarded ones arrive byte for byte under their own route."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess
from tests.unit.test_target import FORWARDED, REFUSED

# Each route forwards to its own base path, so the upstream's raw path tells which route
# the gateway chose. None of them guards GET: the target alone decides.
ROUTES = {"/admin": "/r-admin", "/h": "/r-h", "/inv": "/r-inv", "/files": "/r-files"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("targets")
    with UpstreamProcess() as upstream:
        tables = [
            f'[[routes]]\nprefix = "{prefix}"\nupstream = "{upstream.url}{base}"\n'
            f'methods = ["POST"]\nallow_encoded_slashes = {str(prefix == "/files").lower()}\n'
            for prefix, base in ROUTES.items()
        ]
        config = Path(tmp / "routes.toml")
        config.write_text("\n".join(tables), encoding="utf-8")
        with GatewayProcess(
            upstream=upstream.url + "/r-default", config=config, workdir=tmp
        ) as process:
            yield process


def raw_get(port: int, target: bytes) -> tuple[int, dict[str, object] | None]:
    """GET exactly ``target`` (no client library in the way); the status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def route_base(raw_path: bytes) -> str:
    """The route an upstream's reading of the path (fully percent-decoded) falls under."""
    decoded = unquote_to_bytes(raw_path)
    for prefix, base in sorted(ROUTES.items(), key=lambda item: -len(item[0])):
        if decoded == prefix.encode() or decoded.startswith(prefix.encode() + b"/"):
            return base
    return "/r-default"


def check(gateway: GatewayProcess, raw_path: bytes, raw_query: bytes) -> None:
    target = raw_path + (b"?" + raw_query if raw_query else b"")
    status, body = raw_get(gateway.port, target)
    if status == 400:
        # Refused: by the gateway (invalid-target), or by the HTTP parser before it.
        if body is not None:
            assert str(body["type"]).endswith("/invalid-target"), body
        return
    assert status == 200, (target, status, body)
    assert body is not None
    assert body["raw_path"] == route_base(raw_path) + raw_path.decode(), (target, body)
    assert body["query"] == raw_query.decode()


@pytest.mark.parametrize("path", [*REFUSED, "/v1/a%2Fb"])
def test_refused_targets_never_reach_the_upstream(gateway: GatewayProcess, path: str) -> None:
    status, body = raw_get(gateway.port, path.encode())
    assert status == 400 and body is not None, (path, status)
    assert str(body["type"]).endswith("/invalid-target")


@pytest.mark.parametrize("path", FORWARDED)
def test_forwarded_targets_arrive_byte_for_byte(gateway: GatewayProcess, path: str) -> None:
    check(gateway, path.encode(), b"x=%2F&y=1&z=a+b")


def test_an_encoded_slash_passes_where_the_route_allows_it(gateway: GatewayProcess) -> None:
    check(gateway, b"/files/a%2Fb", b"")
    status, body = raw_get(gateway.port, b"/h/a%2Fb")
    assert status == 400 and body is not None and str(body["type"]).endswith("/invalid-target")


_PIECES = st.sampled_from(
    [
        "a",
        "Z",
        "0",
        "-",
        "_",
        "~",
        ".",
        "..",
        "/",
        "//",
        "admin",
        "h",
        "inv",
        "files",
        "%",
        "%2F",
        "%2f",
        "%2e",
        "%2E",
        "%2e%2e",
        "%5C",
        "\\",
        "%3F",
        "%23",
        "%00",
        "%25",
        "%41",
        "%61dmin",
        "%zz",
        "%2",
        ";",
        "=",
        "!",
        "'",
        "(",
        "*",
        "+",
        ",",
        "@",
        ":",
        "$",
        "&",
    ]
)


_QUERY = st.text(alphabet="ab=&%2F+/?:@.-_~!$'()*,;", max_size=12)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    first=st.sampled_from(["admin", "%61dmin", "%41dmin", "h", "inv", "files", "..", "%2e", ""]),
    pieces=st.lists(_PIECES, max_size=8),
    query=_QUERY,
)
def test_any_target_is_refused_or_arrives_as_sent_under_its_own_route(
    gateway: GatewayProcess, first: str, pieces: list[str], query: str
) -> None:
    check(gateway, ("/" + first + "".join(pieces)).encode(), query.encode())
