"""The reverse proxy: `GET /healthz` and `GET /metrics`, and every other request through the
gateway pipeline to an HTTP upstream."""

from __future__ import annotations

import logging

from fencegate.gateway.health import StoreHealth
from fencegate.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import Pipeline
from fencegate.problems import Problem
from fencegate.types import Receive, Scope, Send

logger = logging.getLogger("fencegate.gateway")


class ReverseProxy:
    """The gateway's HTTP surface. Pure ASGI: no routing framework on the hot path."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        health: StoreHealth,
        metrics: GatewayMetrics,
    ) -> None:
        self.pipeline = pipeline
        self.health = health
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        await self.pipeline(scope, receive, send)

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
