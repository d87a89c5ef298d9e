"""One gateway request from ASGI to ASGI: route, body, step 1 (authenticate), then the
engine. The reverse proxy and the middleware share this; they differ only in how they
forward."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from fencegate.gateway.asgi import ClientDisconnected, incoming_request, read_body, send_response
from fencegate.gateway.engine import (
    Engine,
    Forward,
    GatewayResponse,
    problem_response,
    store_unavailable,
)
from fencegate.gateway.problems import Problem
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.target import Target, invalid_target, scope_target
from fencegate.types import (
    DEFAULT_TENANT,
    Authenticator,
    IncomingRequest,
    NonceStore,
    Receive,
    Scope,
    Send,
)

logger = logging.getLogger("fencegate.gateway")

# Builds the forward callable for one request under one route.
ForwardFactory = Callable[[IncomingRequest, RoutePolicy], Forward]


def route_request(routes: RouteTable, scope: Scope) -> tuple[Target, RoutePolicy]:
    """The target as sent and the route those same bytes select; raises `Problem` 400
    ``invalid-target`` for a target the upstream could read under another route."""
    target = scope_target(scope)
    policy = routes.match(target.route_path)
    if target.encoded_slash and not policy.allow_encoded_slashes:
        raise invalid_target(f"an encoded '/' in the path, which {policy.prefix} refuses")
    return target, policy


class Gate:
    def __init__(
        self,
        *,
        engine: Engine,
        routes: RouteTable,
        authenticator: Authenticator | None = None,
        nonces: NonceStore | None = None,
    ) -> None:
        self.engine = engine
        self.routes = routes
        self.authenticator = authenticator
        self.nonces = nonces if nonces is not None else engine.store
        self.stripped = (
            frozenset(authenticator.stripped_headers) if authenticator is not None else frozenset()
        )

    def route(self, scope: Scope) -> tuple[Target, RoutePolicy]:
        return route_request(self.routes, scope)

    async def handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        make_forward: ForwardFactory,
        routed: tuple[Target, RoutePolicy] | None = None,
    ) -> None:
        try:
            target, policy = routed or self.route(scope)
            body = await read_body(scope, receive, limit=policy.max_body_bytes)
        except ClientDisconnected:
            return
        except Problem as problem:
            await self._send(send, problem_response(problem))
            return
        request = incoming_request(scope, body, target)
        tenant = DEFAULT_TENANT
        if self.authenticator is not None:
            try:
                tenant = await self.authenticator.authenticate(request, self.nonces)
            except Problem as problem:
                await self._send(send, problem_response(problem))
                return
            except Exception as exc:
                # The nonce could not be recorded (the store failed in whatever way).
                logger.error("store unavailable while checking a signature nonce: %s", exc)
                await self._send(send, problem_response(store_unavailable()))
                return
            if self.stripped:
                request = dataclasses.replace(
                    request,
                    headers=tuple((k, v) for k, v in request.headers if k not in self.stripped),
                )
        response = await self.engine.handle(request, policy, tenant, make_forward(request, policy))
        await send_response(send, response)

    async def _send(self, send: Send, response: GatewayResponse) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.count(response.decision)
        await send_response(send, response)
