"""`FenceGateMiddleware`: the gateway as pure ASGI middleware for in-process services.

    app.add_middleware(FenceGateMiddleware, database_url="postgresql://…",
                       routes=[RoutePolicy(prefix="/invoices", fence_required=True)])

Requests whose method a route guards are buffered, checked and, when allowed, passed to the
wrapped app; its answer is captured, recorded and sent. Everything else goes straight
through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from fencegate.gateway.asgi import send_response
from fencegate.gateway.engine import (
    Engine,
    Forward,
    UpstreamOutcomeUnknown,
    UpstreamResponse,
    problem_response,
)
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import ForwardFactory, Gate, route_request
from fencegate.gateway.problems import Problem
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.types import ASGIApp, Authenticator, IncomingRequest, Message, Receive, Scope, Send

logger = logging.getLogger("fencegate.gateway")


class FenceGateMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        store: GatewayStore | None = None,
        database_url: str | None = None,
        routes: Iterable[RoutePolicy] = (),
        default_policy: RoutePolicy | None = None,
        authenticator: Authenticator | None = None,
        inflight_lease_seconds: float = 30.0,
        store_timeout: float = 2.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """``store`` is used as given (the caller closes it); otherwise the store named by
        ``database_url`` (default SQLite ``./fencegate.db``) is opened on first use and
        closed at lifespan shutdown."""
        self.app = app
        self._database_url = database_url
        self._owns_store = store is None
        self._store = store
        self._routes = RouteTable(routes, default=default_policy or RoutePolicy())
        self._authenticator = authenticator
        self._lease_seconds = inflight_lease_seconds
        self._store_timeout = store_timeout
        self.metrics = metrics or GatewayMetrics()
        self._gate: Gate | None = None
        self._opening = asyncio.Lock()
        if authenticator is None:
            logger.info(
                "fencegate runs single-tenant without signatures: every key and fence "
                "belongs to tenant %r",
                "default",
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            routed = route_request(self._routes, scope)
        except Problem as problem:
            self.metrics.count("invalid_target")
            await send_response(send, problem_response(problem, "invalid_target"))
            return
        if self._authenticator is None and not routed[1].guards(scope["method"]):
            await self.app(scope, receive, send)
            return
        gate = self._gate or await self._open()
        await gate.handle(scope, receive, send, self._forwarder(scope, receive), routed)

    async def _open(self) -> Gate:
        async with self._opening:
            if self._gate is None:
                if self._store is None:
                    self._store = await open_gateway_store(self._database_url)
                engine = Engine(
                    self._store,
                    lease_seconds=self._lease_seconds,
                    store_timeout=self._store_timeout,
                    metrics=self.metrics,
                )
                self._gate = Gate(
                    engine=engine, routes=self._routes, authenticator=self._authenticator
                )
            return self._gate

    async def close(self, *, grace: float = 10.0) -> None:
        if self._gate is not None:
            # Answers the store has not taken yet: keep trying within the grace period.
            await self._gate.engine.pending.drain(grace=grace)
        if self._owns_store and self._store is not None:
            await self._store.close()
            self._store = None
            self._gate = None

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.close()
            return message

        await self.app(scope, wrapped_receive, send)

    def _forwarder(self, scope: Scope, receive: Receive) -> ForwardFactory:
        def make(request: IncomingRequest, policy: RoutePolicy) -> Forward:
            return _AppForward(self.app, scope, receive, request).forward

        return make


class _AppForward:
    """Calls the wrapped app with the buffered body and captures its whole answer."""

    def __init__(self, app: ASGIApp, scope: Scope, receive: Receive, request: IncomingRequest):
        self.app = app
        self.receive = receive
        self.request = request
        inner = dict(scope)
        # Forward exactly the headers the engine saw (verified signature headers removed).
        inner["headers"] = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        self.scope = inner
        self._body_sent = False

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        return await self.receive()

    async def forward(self, timeout: float) -> UpstreamResponse:
        status = 500
        headers: list[tuple[str, str]] = []
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers.extend(
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                )
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            async with asyncio.timeout(timeout):
                await self.app(self.scope, self._receive, capture)
        except TimeoutError as exc:
            raise UpstreamOutcomeUnknown(
                f"the application did not answer within {timeout}s"
            ) from exc
        return UpstreamResponse(status, headers, b"".join(chunks))
