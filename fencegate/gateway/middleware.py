"""`FencegateMiddleware`: the gateway as pure ASGI middleware for in-process services.

    app.add_middleware(FencegateMiddleware, database_url="postgresql://…",
                       routes=[RoutePolicy(prefix="/invoices", fence_required=True)])

Requests whose method a route guards are buffered, checked and, when allowed, passed to the
wrapped app; its answer is captured, recorded and sent. Everything else goes straight
through.

At lifespan start-up the store is opened and its schema checked, as `fencegate serve` does:
a database nobody migrated stops the service's start with one line naming
`fencegate migrate`, instead of a 503 on every keyed request. (Run without a lifespan, the
check happens on the first guarded request, which is answered 503 with that line.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from fencegate import tracing
from fencegate.errors import StoreUnavailable
from fencegate.gateway.answers import DEFAULT_ANSWER_CACHE_SIZE, AnswerCache
from fencegate.gateway.engine import Engine, problem_response, store_unavailable
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import (
    Pipeline,
    answer,
    route_request,
    start_trace,
    unroutable_policy,
)
from fencegate.gateway.reconciler import DEFAULT_INTERVAL, Reconciler, reconciling
from fencegate.gateway.registry import GatewayRegistry
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.upstream import AppUpstream
from fencegate.problems import Problem
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.store.release_rule import DEFAULT_GATEWAY_HEARTBEAT, DEFAULT_RELEASE_MARGIN
from fencegate.store.replication import ReplicationNotSynchronous
from fencegate.store.schema import SchemaMismatch, operator_store_argument, require_schema
from fencegate.types import ASGIApp, Authenticator, Message, Receive, Scope, Send

logger = logging.getLogger("fencegate.gateway")


class FencegateMiddleware:
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
        decision_history: bool = True,
        require_synchronous_replication: bool = False,
        gateway_heartbeat: float = DEFAULT_GATEWAY_HEARTBEAT,
        release_margin: float = DEFAULT_RELEASE_MARGIN,
        reconcile_interval: float = DEFAULT_INTERVAL,
        answer_cache: int = DEFAULT_ANSWER_CACHE_SIZE,
    ) -> None:
        """``store`` is used as given (the caller closes it); otherwise the store named by
        ``database_url`` (default SQLite ``./fencegate.db``) is opened on first use and
        closed at lifespan shutdown. ``decision_history`` keeps one history row per
        decision in the store this opens (a given store keeps its own setting);
        ``require_synchronous_replication`` makes that store refuse a PostgreSQL whose
        standbys all replicate asynchronously (otherwise one warning line). Once it has its
        store, the middleware registers this process in the store's gateway registry and
        heartbeats every ``gateway_heartbeat`` seconds until it is closed. With a route that
        declares ``reconcile``, a reconciler settles its unknown outcomes every
        ``reconcile_interval`` seconds (0: none) once ``release_margin`` seconds have passed
        since each one's lease ended (see `fencegate.gateway.reconciler`); its 424 answers
        quote that margin. ``answer_cache`` completed answers are kept in memory, least
        recently used first out, and replay requests without a fence without a round trip
        to the store (0: none; `fencegate.gateway.answers`)."""
        self.app = app
        self._database_url = database_url
        self._owns_store = store is None
        self._store = store
        self._routes = RouteTable(routes, default=default_policy or RoutePolicy())
        self._authenticator = authenticator
        self._lease_seconds = inflight_lease_seconds
        self._store_timeout = store_timeout
        self._history = decision_history
        self._require_sync = require_synchronous_replication
        self._heartbeat = gateway_heartbeat
        self._release_margin = release_margin
        self._reconcile_interval = reconcile_interval
        self._answer_cache = answer_cache
        self.reconciler: Reconciler | None = None
        self.registry: GatewayRegistry | None = None
        self.metrics = metrics or GatewayMetrics()
        self._pipeline: Pipeline | None = None
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
            target, policy = route_request(self._routes, scope)
        except Problem as problem:
            # Answered without the store: a target that cannot be routed is refused first.
            await answer(
                send,
                problem_response(problem),
                policy=unroutable_policy(self._routes, scope),
                trace=start_trace(scope, None),
                metrics=self.metrics,
                owner=self._pipeline.owner if self._pipeline is not None else "",
            )
            return
        if self._authenticator is None and not policy.guards(scope["method"]):
            await self.app(scope, receive, send)
            return
        try:
            pipeline = self._pipeline or await self._open()
        except (StoreUnavailable, SchemaMismatch) as exc:
            logger.error("fencegate: cannot open the store: %s", exc)
            refused = store_unavailable()
            if isinstance(exc, SchemaMismatch):
                refused.detail = str(exc)
            await answer(
                send,
                problem_response(refused),
                policy=policy,
                trace=start_trace(scope, None),
                metrics=self.metrics,
                owner="",
            )
            return
        await pipeline.handle(scope, receive, send, target, policy)

    async def _open(self) -> Pipeline:
        async with self._opening:
            if self._pipeline is None:
                # Spans when OTEL_TRACES_EXPORTER, or the service's own provider, asks.
                tracing.configure(service_name="fencegate-middleware")
                store = self._store
                if store is None:
                    store = await open_gateway_store(
                        self._database_url,
                        history=self._history,
                        require_synchronous_replication=self._require_sync,
                    )
                try:
                    await require_schema(
                        store, database_url=self._database_url, timeout=self._store_timeout
                    )
                except BaseException:
                    if self._owns_store:
                        await store.close()
                    raise
                self._store = store
                engine = Engine(
                    self._store,
                    lease_seconds=self._lease_seconds,
                    store_timeout=self._store_timeout,
                    metrics=self.metrics,
                    # A store given without its URL: the 424 cannot say which one it is.
                    store_argument=operator_store_argument(self._database_url)
                    if self._owns_store or self._database_url
                    else "",
                    release_margin=self._release_margin,
                    answers=AnswerCache(self._answer_cache) if self._answer_cache > 0 else None,
                )
                registry = GatewayRegistry(
                    self._store,
                    engine.owner,
                    heartbeat=self._heartbeat,
                    timeout=self._store_timeout,
                )
                await registry.start()
                self.registry = registry
                upstream = AppUpstream(self.app)
                self._pipeline = Pipeline(
                    engine=engine,
                    routes=self._routes,
                    upstream=upstream,
                    authenticator=self._authenticator,
                )
                if self._reconcile_interval > 0 and reconciling(self._routes):
                    # Probes go to the wrapped app itself, past this middleware.
                    self.reconciler = Reconciler(
                        self._store,
                        routes=self._routes,
                        upstream=upstream,
                        instance=engine.owner,
                        release_margin=self._release_margin,
                        interval=self._reconcile_interval,
                        store_timeout=self._store_timeout,
                        metrics=self.metrics,
                        internal_errors=engine.internal_errors,
                    )
                    self.reconciler.start()
            return self._pipeline

    async def close(self, *, grace: float = 10.0) -> None:
        if self.reconciler is not None:
            await self.reconciler.close()
            self.reconciler = None
        if self._pipeline is not None:
            # Answers the store has not taken yet: keep trying within the grace period.
            await self._pipeline.engine.close(grace=grace)
        if self.registry is not None:
            # Heartbeats ran while the engine drained: the row goes once nothing is owed.
            await self.registry.stop()
            self.registry = None
        if self._owns_store and self._store is not None:
            await self._store.close()
            self._store = None
            self._pipeline = None

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.close()
            return message

        async def wrapped_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self._open()
                except (SchemaMismatch, ReplicationNotSynchronous) as exc:
                    # The server reports this and does not start: one clear line, once.
                    await send({"type": "lifespan.startup.failed", "message": f"fencegate: {exc}"})
                    return
                except StoreUnavailable as exc:
                    # An outage at start is not a misconfiguration: start, answer 503 until
                    # the store is back (the schema is checked when it is).
                    logger.warning("fencegate: store unavailable at start-up: %s", exc)
            await send(message)

        await self.app(scope, wrapped_receive, wrapped_send)


# The spelling of the design contract (DESIGN §4): `from fencegate import FenceGateMiddleware`.
FenceGateMiddleware = FencegateMiddleware
