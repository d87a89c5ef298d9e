"""The reverse proxy: forwards allowed requests to a route's upstream over one pooled
aiohttp session, and serves ``GET /healthz`` and ``GET /metrics``.

It tells the two ways an upstream call fails apart, because the engine treats them
differently: nothing was sent (connection refused) → the key is released, 502; sent but
no answer (timeout, connection lost) → outcome unknown, 504.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import aiohttp
import yarl
from multidict import CIMultiDict

from fencegate.gateway.engine import (
    HOP_BY_HOP,
    Forward,
    UpstreamOutcomeUnknown,
    UpstreamRefused,
    UpstreamResponse,
)
from fencegate.gateway.health import StoreHealth
from fencegate.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import Gate
from fencegate.gateway.problems import Problem
from fencegate.gateway.routes import RoutePolicy
from fencegate.types import IncomingRequest, Scope, Send

logger = logging.getLogger("fencegate.gateway")

# Not forwarded upstream: per-hop, or recomputed by the client session.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
# Not relayed back: per-hop; the body is whole so its length is recomputed on sending.
_NOT_RELAYED = HOP_BY_HOP | {"content-length"}
_NOT_RELAYED_HEAD = HOP_BY_HOP

# Below the keep-alive timeout of common servers (uvicorn: 5 s), so that a request is never
# written on a pooled connection the upstream is closing: that would be an unknown outcome.
KEEPALIVE_SECONDS = 4.0
CONNECT_TIMEOUT = 10.0


class UpstreamClient:
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
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def forwarder(self, request: IncomingRequest, policy: RoutePolicy) -> Forward:
        session = self._session
        if session is None:
            raise RuntimeError("the upstream client is not started")
        upstream = policy.upstream
        query = f"?{request.query_string}" if request.query_string else ""
        # The target byte for byte as received: yarl must not re-encode or normalise it.
        url = yarl.URL(f"{upstream}{request.path}{query}", encoded=True) if upstream else None
        headers = forwarded_headers(request, upstream or "")
        head = request.method == "HEAD"

        async def forward(timeout: float) -> UpstreamResponse:
            if url is None:
                raise UpstreamRefused(f"no upstream is configured for {policy.prefix}")
            client_timeout = self._timeouts.get(timeout)
            if client_timeout is None:
                client_timeout = self._timeouts[timeout] = aiohttp.ClientTimeout(
                    total=timeout, sock_connect=min(timeout, CONNECT_TIMEOUT)
                )
            try:
                async with session.request(
                    request.method,
                    url,
                    headers=headers,
                    data=request.body if request.body else None,
                    timeout=client_timeout,
                    allow_redirects=False,
                ) as response:
                    body = await response.read()
                    # A HEAD answer's Content-Length describes the body a GET would get.
                    dropped = _NOT_RELAYED_HEAD if head else _NOT_RELAYED
                    relayed = [
                        (name, v.decode("latin-1"))
                        for k, v in response.raw_headers
                        if (name := k.decode("latin-1")).lower() not in dropped
                    ]
                    return UpstreamResponse(response.status, relayed, body)
            except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as exc:
                raise UpstreamRefused(str(exc) or type(exc).__name__) from exc
            except (TimeoutError, aiohttp.ClientError) as exc:
                detail = f"no answer within {timeout}s" if isinstance(exc, TimeoutError) else exc
                raise UpstreamOutcomeUnknown(str(detail) or type(exc).__name__) from exc

        return forward


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
    headers["host"] = urlsplit(upstream).netloc
    headers["x-forwarded-host"] = request.authority
    headers["x-forwarded-proto"] = request.scheme
    return headers


class ReverseProxy:
    """The gateway's HTTP surface. Pure ASGI: no routing framework on the hot path."""

    def __init__(
        self,
        *,
        gate: Gate,
        client: UpstreamClient,
        health: StoreHealth,
        metrics: GatewayMetrics,
    ) -> None:
        self.gate = gate
        self.client = client
        self.health = health
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: object, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] in ("GET", "HEAD"):
            if path == "/healthz":
                await self._healthz(send)
                return
            if path == "/metrics":
                await _send_plain(send, 200, self.metrics.render(), METRICS_CONTENT_TYPE)
                return
        await self.gate.handle(scope, receive, send, self.client.forwarder)  # type: ignore[arg-type]

    async def _healthz(self, send: Send) -> None:
        problem = await self.health.problem()
        if problem is not None:
            logger.warning("health check failed: %s", problem)
            body = Problem(503, "store-unavailable", "Store unavailable", problem).body()
            await _send_plain(send, 503, body, "application/problem+json")
            return
        await _send_plain(send, 200, b'{"status":"ok"}', "application/json")


async def _send_plain(send: Send, status: int, body: bytes, content_type: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
