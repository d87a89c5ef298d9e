"""Where the pipeline sends an allowed request, and how a failure there is told apart.

The engine treats the two ways an upstream call fails differently: nothing was sent
(connection refused) → the key is released, 502; sent but no answer (timeout, connection
lost) → outcome unknown, 504.

- `HttpUpstream`: an HTTP API, over one pooled aiohttp session (`fencegate serve`);
- `AppUpstream`: the ASGI app `FencegateMiddleware` wraps, called in-process.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import aiohttp
import yarl
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from fencegate.errors import FencegateError
from fencegate.gateway.headers import HOP_BY_HOP
from fencegate.gateway.routes import RoutePolicy
from fencegate.gateway.send_deadline import LeaseDeadlinePassed, check_send_deadline
from fencegate.types import ASGIApp, IncomingRequest, Message, Receive, Scope


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


class UpstreamRefused(FencegateError):
    """Nothing reached the upstream (connection refused, no route): running again is safe."""


class UpstreamOutcomeUnknown(FencegateError):
    """The request may have reached the upstream, but no answer came back in time."""


# forward(timeout) -> the upstream's answer; raises UpstreamRefused / UpstreamOutcomeUnknown.
Forward = Callable[[float], Awaitable[UpstreamResponse]]


class ResponseSink(Protocol):
    """Takes an answer's body as it arrives instead of once it is whole (an MCP route's
    event streams). ``start`` sees the head and says whether to stream this answer;
    ``chunk`` returns True once it wants no more of the body. A streamed answer's
    `UpstreamResponse` has an empty body: the sink had it."""

    async def start(self, status: int, headers: list[tuple[str, str]]) -> bool: ...

    async def chunk(self, data: bytes) -> bool: ...


class Upstream(Protocol):
    async def send(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        scope: Scope,
        receive: Receive,
        *,
        timeout: float,
    ) -> UpstreamResponse: ...


class StreamingUpstream(Protocol):
    """An upstream that can hand an answer's body to a `ResponseSink` as it arrives (both of
    fencegate's do; they say so with ``streams_answers = True``)."""

    streams_answers: bool

    async def send(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        scope: Scope,
        receive: Receive,
        *,
        timeout: float,
        sink: ResponseSink | None = None,
    ) -> UpstreamResponse: ...


def streaming(upstream: Upstream) -> StreamingUpstream | None:
    """The upstream as one that streams answers, if it is one."""
    if getattr(upstream, "streams_answers", False):
        return cast("StreamingUpstream", upstream)
    return None


# Not forwarded upstream: per-hop, or recomputed by the client session.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
# Not relayed back: per-hop; the body is whole so its length is recomputed on sending.
_NOT_RELAYED = HOP_BY_HOP | {"content-length"}
_NOT_RELAYED_HEAD = HOP_BY_HOP

# Below the keep-alive timeout of common servers (uvicorn: 5 s), so that a request is never
# written on a pooled connection the upstream is closing: that would be an unknown outcome.
KEEPALIVE_SECONDS = 4.0
CONNECT_TIMEOUT = 10.0


class HttpUpstream:
    streams_answers = True

    def __init__(self, *, max_connections: int = 200) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # One per distinct route timeout, built once rather than for every request.
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            keepalive_timeout=KEEPALIVE_SECONDS,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # relay the bytes as the upstream encoded them
            # Send the caller's headers, not ones the client library would invent.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
            request_class=_DeadlineCheckedRequest,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        scope: Scope,
        receive: Receive,
        *,
        timeout: float,
        sink: ResponseSink | None = None,
    ) -> UpstreamResponse:
        session = self._session
        if session is None:
            raise RuntimeError("the upstream client is not started")
        upstream = policy.upstream
        if upstream is None:
            raise UpstreamRefused(f"no upstream is configured for {policy.prefix}")
        query = f"?{request.query_string}" if request.query_string else ""
        # The target byte for byte as received: yarl must not re-encode or normalise it.
        url = yarl.URL(f"{upstream}{request.path}{query}", encoded=True)
        if request.empty_query:
            # yarl drops an empty query; a "?" kept in the raw path reaches the wire as sent.
            url = url.with_path(url.raw_path + "?", encoded=True)
        client_timeout = self._timeouts.get(timeout)
        if client_timeout is None:
            client_timeout = self._timeouts[timeout] = aiohttp.ClientTimeout(
                total=timeout, sock_connect=min(timeout, CONNECT_TIMEOUT)
            )
        try:
            async with session.request(
                request.method,
                url,
                headers=forwarded_headers(request, upstream),
                data=_DeadlineCheckedBody(request.body) if request.body else None,
                timeout=client_timeout,
                allow_redirects=False,
            ) as response:
                # A HEAD answer's Content-Length describes the body a GET would get.
                dropped = _NOT_RELAYED_HEAD if request.method == "HEAD" else _NOT_RELAYED
                relayed = [
                    (name, v.decode("latin-1"))
                    for k, v in response.raw_headers
                    if (name := k.decode("latin-1")).lower() not in dropped
                ]
                if sink is not None and await sink.start(response.status, relayed):
                    async for data in response.content.iter_any():
                        if await sink.chunk(data):
                            break
                    return UpstreamResponse(response.status, relayed, b"")
                body = await response.read()
                return UpstreamResponse(response.status, relayed, body)
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
            raise UpstreamRefused(str(exc) or type(exc).__name__) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            if (refused := _deadline_passed(exc)) is not None:
                raise refused from exc  # nothing was written
            detail = f"no answer within {timeout}s" if isinstance(exc, TimeoutError) else exc
            raise UpstreamOutcomeUnknown(str(detail) or type(exc).__name__) from exc


def _check_before_writing() -> None:
    # Called once the connection is ready and right before the request's head is written
    # (with no body, it leaves in the same call): the last moment to refuse a request whose
    # lease could have ended (a pause while waiting for a pooled connection, or for the loop).
    check_send_deadline()


class _DeadlineCheckedRequest(aiohttp.ClientRequest):
    """aiohttp's request, refusing to start writing past the send deadline (`send`). A
    request with a body has its head written with the body's first bytes, from a task that
    runs a loop step later (`_DeadlineCheckedBody` checks again there). These replace
    aiohttp's trace hooks, which cost some 15 µs of CPU per forwarded request."""

    async def send(self, conn: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        _check_before_writing()
        return await super().send(conn)


class _DeadlineCheckedBody(aiohttp.BytesPayload):
    """The request's body, checking the deadline right before its bytes (and the head held
    for them) are written. A process paused between `send`'s check and this write (SIGSTOP,
    a long GC pause) would otherwise send the whole request when it wakes. aiohttp wraps
    what this raises in a connection error whose cause `_deadline_passed` finds: nothing was
    written, and the connection is not reused. The body is bytes, written in one call."""

    async def write(self, writer: AbstractStreamWriter) -> None:
        check_send_deadline()
        await super().write(writer)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        check_send_deadline()
        await super().write_with_length(writer, content_length)


def _deadline_passed(exc: BaseException) -> LeaseDeadlinePassed | None:
    """The deadline refusal a client error wraps (aiohttp's body writer wraps what the
    body raises), if that is what ended the request."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, LeaseDeadlinePassed):
            return seen
        seen = seen.__cause__
    return None


@functools.lru_cache(maxsize=64)
def _netloc(upstream: str) -> str:
    # A handful of configured upstreams, each parsed once rather than on every request.
    return urlsplit(upstream).netloc


def forwarded_headers(request: IncomingRequest, upstream: str) -> CIMultiDict[str]:
    """The request's headers as the upstream should see them: per-hop ones removed
    (including those the Connection header names), Host set to the upstream's."""
    named = {
        token.strip().lower()
        for value in request.header_values("connection")
        for token in value.split(",")
    }
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in request.headers if k not in _NOT_FORWARDED and k not in named
    )
    headers["host"] = _netloc(upstream)
    headers["x-forwarded-host"] = request.authority
    headers["x-forwarded-proto"] = request.scheme
    return headers


class AppUpstream:
    """The wrapped ASGI app, called with the buffered body; its whole answer is captured."""

    # What the app raises is the app's, not a fault of fencegate's: it propagates as it is.
    app_errors_propagate = True
    streams_answers = True

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def send(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        scope: Scope,
        receive: Receive,
        *,
        timeout: float,
        sink: ResponseSink | None = None,
    ) -> UpstreamResponse:
        inner = dict(scope)
        # Exactly the headers the engine saw (verified signature headers removed).
        inner["headers"] = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        body_sent = False

        async def replay_body() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            return await receive()

        status = 500
        headers: list[tuple[str, str]] = []
        chunks: list[bytes] = []
        streaming = done = False

        async def capture(message: Message) -> None:
            nonlocal status, streaming, done
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers.extend(
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                )
                streaming = sink is not None and await sink.start(status, headers)
            elif message["type"] == "http.response.body":
                if not streaming:
                    chunks.append(message.get("body", b""))
                elif not done and sink is not None:
                    done = await sink.chunk(message.get("body", b""))

        check_send_deadline()
        try:
            async with asyncio.timeout(timeout):
                await self.app(inner, replay_body, capture)
        except TimeoutError as exc:
            raise UpstreamOutcomeUnknown(
                f"the application did not answer within {timeout}s"
            ) from exc
        return UpstreamResponse(status, headers, b"".join(chunks))
