"""The little ASGI plumbing the gateway needs, without a framework on the hot path."""

from __future__ import annotations

import itertools
import os
import re
import secrets

from fencegate.errors import FencegateError
from fencegate.gateway.engine import GatewayResponse, body_too_large
from fencegate.gateway.target import Target
from fencegate.types import IncomingRequest, Receive, Scope, Send

# A caller's request id is kept only when it is short and plain: it goes into logs and the
# decision history.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

# A made-up request id: a random prefix per process and a counter, unique without asking the
# kernel for randomness on every request. A forked process draws its own prefix.
_ID_PREFIX = secrets.token_hex(5)
_id_numbers = itertools.count(1)


def _new_id_prefix() -> None:
    global _ID_PREFIX
    _ID_PREFIX = secrets.token_hex(5)


os.register_at_fork(after_in_child=_new_id_prefix)


class ClientDisconnected(FencegateError):
    """The client went away before its request body arrived."""


async def read_body(scope: Scope, receive: Receive, *, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed ``limit`` (from
    Content-Length, or while reading), without reading the rest."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
            if declared > limit:
                raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def request_id_of(scope: Scope) -> str:
    """The caller's X-Request-Id when it is a sane one, else a new one: known before the body
    is read, so that every answer (even a 413) carries it."""
    for name, value in scope["headers"]:
        if name.lower() == b"x-request-id":
            text: str = value.decode("latin-1")
            if _SANE_REQUEST_ID.fullmatch(text):
                return text
    return f"{_ID_PREFIX}{next(_id_numbers):06x}"


def incoming_request(
    scope: Scope, body: bytes, target: Target, *, request_id: str | None = None
) -> IncomingRequest:
    authority = ""
    headers: list[tuple[str, str]] = []
    for name, value in scope["headers"]:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "host" and not authority:
            authority = text
        headers.append((key, text))
    if not authority and scope.get("server"):
        host, port = scope["server"]
        authority = f"{host}:{port}" if port else str(host)
    return IncomingRequest(
        method=scope["method"],
        scheme=scope.get("scheme", "http"),
        authority=authority,
        path=target.raw_path,
        query_string=target.raw_query,
        headers=tuple(headers),
        body=body,
        decoded_path=target.route_path,
        empty_query=target.empty_query,
        request_id=request_id or request_id_of(scope),
    )


_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


async def send_response(
    send: Send, response: GatewayResponse, *, request_id: str | None = None
) -> None:
    """``request_id`` replaces any X-Request-Id of the answer (an upstream's, or a stored
    one in a replay): the caller gets back the id its own request is logged under."""
    # The body is whole, so its length is known: framing headers are recomputed, except a
    # Content-Length given with no body (a HEAD answer describes the GET's body).
    headers = []
    length: bytes | None = None
    for k, v in response.headers:
        name = k.lower()
        if name == "content-length" and not response.body:
            length = v.encode("latin-1")
        elif name not in _FRAMING and not (request_id is not None and name == "x-request-id"):
            headers.append((name.encode("latin-1"), v.encode("latin-1")))
    headers.append((b"content-length", length or str(len(response.body)).encode()))
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
