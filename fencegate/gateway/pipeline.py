"""One gateway request from ASGI to ASGI: route, body, step 1 (authenticate), the engine, then
the answer. The reverse proxy and the middleware are this same pipeline; they differ only in
the `Upstream` it sends allowed requests to (an HTTP API, or the wrapped ASGI app).

Every answer leaves through `answer`, so each decision is counted and logged exactly once,
rendered in its route's error format, and carries the request id.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from fencegate import tracing
from fencegate.errors import StoreUnavailable
from fencegate.gateway import spans
from fencegate.gateway.asgi import (
    ClientDisconnected,
    incoming_request,
    read_body,
    request_id_of,
    send_response,
)
from fencegate.gateway.decisions import DecisionTrace, log_decision
from fencegate.gateway.engine import (
    Engine,
    GatewayResponse,
    internal_error,
    problem_response,
    store_unavailable,
)
from fencegate.gateway.mcp import McpExchange, McpRoute
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.stripe_errors import stripe_error
from fencegate.gateway.target import Target, invalid_target, scope_target
from fencegate.gateway.upstream import Upstream, UpstreamResponse, streaming
from fencegate.problems import Problem
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


def route_request(routes: RouteTable, scope: Scope) -> tuple[Target, RoutePolicy]:
    """The target as sent and the route those same bytes select; raises `Problem` 400
    ``invalid-target`` for a target the upstream could read under another route."""
    target = scope_target(scope)
    policy = routes.match(target.route_path)
    if target.encoded_slash and not policy.allow_encoded_slashes:
        raise invalid_target(f"an encoded '/' in the path, which {policy.prefix} refuses")
    return target, policy


def start_trace(scope: Scope, target: Target | None) -> DecisionTrace:
    """The log line's first facts. A routed request logs its parsed target; a refused one
    the path as the server saw it, so that it too is logged as it was sent."""
    if target is not None:
        sent = target.raw
    else:
        raw = scope.get("raw_path")
        if not isinstance(raw, bytes | bytearray) or not raw:
            raw = str(scope.get("path", "/")).encode("latin-1", "replace")
        path = bytes(raw).split(b"?", 1)[0].decode("latin-1")
        query = scope.get("query_string", b"")
        sent = f"{path}?{query.decode('latin-1')}" if query else path
    return DecisionTrace(request_id=request_id_of(scope), method=scope["method"], target=sent)


def unroutable_policy(routes: RouteTable, scope: Scope) -> RoutePolicy:
    """The route whose error format answers a target that could not be routed: the one its
    server-decoded path would select, the closest guess at what the client talks to."""
    return routes.match(str(scope.get("path", "/")))


async def answer(
    send: Send,
    response: GatewayResponse,
    *,
    policy: RoutePolicy,
    trace: DecisionTrace,
    metrics: GatewayMetrics | None,
    owner: str,
    deliver: Callable[[GatewayResponse], Awaitable[None]] | None = None,
) -> None:
    """Count, log and send one gateway answer (``deliver``: an MCP route's, in its
    protocol)."""
    problem = response.problem
    if problem is not None and policy.error_format == "stripe":
        status, headers, body = stripe_error(problem)
        headers.append(("request-id", trace.request_id))  # where Stripe's clients read it
        response = dataclasses.replace(response, status=status, headers=headers, body=body)
    kind = problem.kind if problem is not None else ""
    if metrics is not None:
        metrics.count(response.decision, kind)
        if trace.tool is not None:
            metrics.count_tool_call(trace.tool, response.decision, kind)
    log_decision(
        trace, decision=response.decision, problem=kind, status=response.status, owner=owner
    )
    if trace.span is not None:
        spans.end_server_span(
            trace, decision=response.decision, problem=kind, status=response.status
        )
    if deliver is not None:
        await deliver(response)
    else:
        await send_response(send, response, request_id=trace.request_id)


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
        self.owner = engine.owner
        self.stripped = (
            frozenset(authenticator.stripped_headers) if authenticator is not None else frozenset()
        )
        # An in-process application's exceptions are its own: they propagate to its server
        # as they are (a proxy's upstream raises only for a fault of fencegate's).
        self._app_errors_propagate = bool(getattr(upstream, "app_errors_propagate", False))
        # Routes that speak MCP, by identity (the middleware hands over the route it matched).
        self._mcp = {
            id(p): McpRoute(p) for p in (*routes.routes, routes.default) if p.protocol == "mcp"
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            target, policy = route_request(self.routes, scope)
        except Problem as problem:
            policy = unroutable_policy(self.routes, scope)
            await self._answer(send, problem_response(problem), policy, start_trace(scope, None))
            return
        await self.handle(scope, receive, send, target, policy, start_trace(scope, target))

    async def handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        target: Target,
        policy: RoutePolicy,
        trace: DecisionTrace | None = None,
    ) -> None:
        """The request once routed (the middleware routes first, to pass unguarded requests
        straight to its app)."""
        if trace is None:
            trace = start_trace(scope, target)
        if tracing.TRACER is not None and trace.span is None:
            async with spans.server_span(scope, policy, trace):
                await self.handle(scope, receive, send, target, policy, trace)
            return
        try:
            body = await read_body(scope, receive, limit=policy.max_body_bytes)
        except ClientDisconnected:
            return
        except Problem as problem:
            await self._answer(send, problem_response(problem), policy, trace)
            return
        request = incoming_request(scope, body, target, request_id=trace.request_id)
        mcp_route = self._mcp.get(id(policy)) if self._mcp else None
        exchange = McpExchange(mcp_route, request, send, trace) if mcp_route else None
        tenant = DEFAULT_TENANT
        if self.authenticator is not None:
            try:
                tenant = await self.authenticator.authenticate(request, self.nonces)
            except Problem as problem:
                await self._answer(send, problem_response(problem), policy, trace, exchange)
                return
            except StoreUnavailable as exc:
                # The nonce could not be recorded.
                logger.error("store unavailable while checking a signature nonce: %s", exc)
                await self._answer(
                    send, problem_response(store_unavailable()), policy, trace, exchange
                )
                return
            except Exception as exc:
                await self._internal_error(send, exc, "authenticate", policy, trace, exchange)
                return
            if self.stripped:
                request = dataclasses.replace(
                    request,
                    headers=tuple((k, v) for k, v in request.headers if k not in self.stripped),
                )
        trace.tenant = tenant
        decided, decided_policy = request, policy
        if exchange is not None:
            exchange.request = request  # without the signature headers it verified
            try:
                decided, decided_policy = exchange.prepare()
            except Problem as problem:
                await self._answer(send, problem_response(problem), policy, trace, exchange)
                return

        upstream = self.upstream
        metrics = self.metrics
        step = trace  # narrowed to a DecisionTrace for the closure
        raised_upstream: BaseException | None = None

        async def forward(timeout: float) -> UpstreamResponse:
            nonlocal raised_upstream
            # Timed once, here: for the decision log and for the latency histogram.
            started = time.perf_counter()
            status: int | None = None
            try:
                if exchange is not None:
                    response = exchange.settle(
                        await self._send_mcp(
                            request,
                            policy,
                            scope,
                            receive,
                            timeout,
                            exchange,
                            traced=bool(step.span),
                        )
                    )
                elif step.span is None:
                    response = await upstream.send(request, policy, scope, receive, timeout=timeout)
                else:
                    response = await spans.send_upstream(
                        upstream, request, policy, scope, receive, timeout=timeout
                    )
                status = response.status
                return response
            except Exception as exc:
                raised_upstream = exc
                raise
            finally:
                step.upstream_called(started, status)
                if metrics is not None:
                    metrics.upstream_latency.observe(step.upstream_seconds or 0.0)

        try:
            response = await self.engine.handle(
                decided, decided_policy, tenant, forward, trace=trace
            )
        except Exception as exc:
            if exc is raised_upstream and self._app_errors_propagate:
                raise  # the wrapped application's own error, for its server to handle
            await self._internal_error(send, exc, "request", policy, trace, exchange)
            return
        await self._answer(send, response, policy, trace, exchange)

    async def _send_mcp(
        self,
        request: IncomingRequest,
        policy: RoutePolicy,
        scope: Scope,
        receive: Receive,
        timeout: float,
        exchange: McpExchange,
        *,
        traced: bool,
    ) -> UpstreamResponse:
        """An MCP route's request upstream, its event-stream answers streamed through the
        exchange as they arrive."""
        if traced:
            return await spans.send_upstream(
                self.upstream, request, policy, scope, receive, timeout=timeout, sink=exchange
            )
        streams = streaming(self.upstream)
        if streams is None:
            return await self.upstream.send(request, policy, scope, receive, timeout=timeout)
        return await streams.send(request, policy, scope, receive, timeout=timeout, sink=exchange)

    async def _internal_error(
        self,
        send: Send,
        exc: Exception,
        where: str,
        policy: RoutePolicy,
        trace: DecisionTrace,
        exchange: McpExchange | None = None,
    ) -> None:
        """A fault in fencegate's own code: 500 ``internal-error``, logged and counted."""
        self.engine.internal_errors.report(exc, where=where, about=f"request {trace.request_id}")
        forwarded = trace.upstream_seconds is not None
        problem = internal_error(trace.request_id, forwarded=forwarded)
        await self._answer(send, problem_response(problem), policy, trace, exchange)

    async def _answer(
        self,
        send: Send,
        response: GatewayResponse,
        policy: RoutePolicy,
        trace: DecisionTrace,
        exchange: McpExchange | None = None,
    ) -> None:
        await answer(
            send,
            response,
            policy=policy,
            trace=trace,
            metrics=self.metrics,
            owner=self.owner,
            deliver=exchange.deliver if exchange is not None else None,
        )
