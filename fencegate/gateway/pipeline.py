"""One gateway request from ASGI to ASGI: route, body, step 1 (authenticate), the engine, then
the answer. The reverse proxy and the middleware are this same pipeline; they differ only in
the `Upstream` it sends allowed requests to (an HTTP API, or the wrapped ASGI app).

Every answer leaves through `_answer`, so each decision is counted exactly once.
"""

from __future__ import annotations

import dataclasses
import logging

from fencegate.gateway.asgi import ClientDisconnected, incoming_request, read_body, send_response
from fencegate.gateway.engine import Engine, GatewayResponse, problem_response, store_unavailable
from fencegate.gateway.problems import Problem
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.target import Target, invalid_target, scope_target
from fencegate.gateway.upstream import Upstream, UpstreamResponse
from fencegate.types import (
    DEFAULT_TENANT,
    Authenticator,
    NonceStore,
    Receive,
    Scope,
    Send,
)

logger = logging.getLogger("fencegate.gateway")


def route_request(routes: RouteTable, scope: Scope) -> tuple[Target, RoutePolicy]:
    """The target as sent and the route those same bytes select; raises `Problem` 400
    ``invalid-target`` for a target the upstream could read under another route."""
    target = scope_target(scope)
    policy = routes.match(target.route_path)
    if target.encoded_slash and not policy.allow_encoded_slashes:
        raise invalid_target(f"an encoded '/' in the path, which {policy.prefix} refuses")
    return target, policy


class Pipeline:
    """The gateway as a pure ASGI app (HTTP scopes only)."""

    def __init__(
        self,
        *,
        engine: Engine,
        routes: RouteTable,
        upstream: Upstream,
        authenticator: Authenticator | None = None,
        nonces: NonceStore | None = None,
    ) -> None:
        self.engine = engine
        self.routes = routes
        self.upstream = upstream
        self.authenticator = authenticator
        self.nonces = nonces if nonces is not None else engine.store
        self.metrics = engine.metrics
        self.stripped = (
            frozenset(authenticator.stripped_headers) if authenticator is not None else frozenset()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            target, policy = route_request(self.routes, scope)
        except Problem as problem:
            await self._answer(send, problem_response(problem))
            return
        await self.handle(scope, receive, send, target, policy)

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, target: Target, policy: RoutePolicy
    ) -> None:
        """The request once routed (the middleware routes first, to pass unguarded requests
        straight to its app)."""
        try:
            body = await read_body(scope, receive, limit=policy.max_body_bytes)
        except ClientDisconnected:
            return
        except Problem as problem:
            await self._answer(send, problem_response(problem))
            return
        request = incoming_request(scope, body, target)
        tenant = DEFAULT_TENANT
        if self.authenticator is not None:
            try:
                tenant = await self.authenticator.authenticate(request, self.nonces)
            except Problem as problem:
                await self._answer(send, problem_response(problem))
                return
            except Exception as exc:
                # The nonce could not be recorded (the store failed in whatever way).
                logger.error("store unavailable while checking a signature nonce: %s", exc)
                await self._answer(send, problem_response(store_unavailable()))
                return
            if self.stripped:
                request = dataclasses.replace(
                    request,
                    headers=tuple((k, v) for k, v in request.headers if k not in self.stripped),
                )

        upstream = self.upstream

        async def forward(timeout: float) -> UpstreamResponse:
            return await upstream.send(request, policy, scope, receive, timeout=timeout)

        await self._answer(send, await self.engine.handle(request, policy, tenant, forward))

    async def _answer(self, send: Send, response: GatewayResponse) -> None:
        if self.metrics is not None:
            self.metrics.count(response.decision)
        await send_response(send, response)
