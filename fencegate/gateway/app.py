"""Builds the gateway ASGI application from its configuration: the store, the engine, the
gateway registry's heartbeat, the reverse proxy, the authenticator and the periodic purge, all
started at lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from pathlib import Path
from typing import Any

from fencegate import tracing
from fencegate.gateway.answers import AnswerCache
from fencegate.gateway.config import GatewayConfig
from fencegate.gateway.engine import Engine
from fencegate.gateway.health import StoreHealth
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import Pipeline
from fencegate.gateway.proxy import ReverseProxy
from fencegate.gateway.reconciler import Reconciler, reconciling
from fencegate.gateway.registry import GatewayRegistry
from fencegate.gateway.routes import RouteTable
from fencegate.gateway.upstream import HttpUpstream
from fencegate.store import GatewayStore, StoreUnavailable, open_gateway_store
from fencegate.store.schema import operator_store_argument, require_schema
from fencegate.types import Authenticator, Receive, Scope, Send

logger = logging.getLogger("fencegate.gateway")


def load_authenticator(
    spec: str | dict[str, Any] | list[Any] | None,
    *,
    base_dir: Path | None = None,
    store_timeout: float = 2.0,
) -> Authenticator | None:
    """Step 1 is provided by `fencegate.signing`, imported only when keys are
    configured, so a gateway without signatures never loads it."""
    if not spec:
        logger.info(
            "no keys configured: the gateway runs single-tenant without signatures "
            "(every key and fence belongs to tenant 'default')"
        )
        return None
    from fencegate import signing

    return signing.load_authenticator(spec, base_dir=base_dir, store_timeout=store_timeout)


class GatewayApplication:
    """The ASGI app `fencegate serve` runs. Everything is opened at lifespan start-up."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        authenticator: Authenticator | None = None,
        authenticator_loaded: bool = False,
    ) -> None:
        """``authenticator_loaded`` says the keys were already read (``authenticator`` may
        then be None: single tenant); otherwise they are read at start-up."""
        self.config = config
        self._authenticator = authenticator
        self._authenticator_loaded = authenticator_loaded or authenticator is not None
        self.metrics = GatewayMetrics()
        self.store: GatewayStore | None = None
        self.engine: Engine | None = None
        self.registry: GatewayRegistry | None = None
        self.proxy: ReverseProxy | None = None
        self._client: HttpUpstream | None = None
        self._purger: asyncio.Task[None] | None = None
        self.reconciler: Reconciler | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self.proxy is None:
            raise RuntimeError("the gateway was not started: run it under a lifespan server")
        await self.proxy(scope, receive, send)

    async def startup(self) -> None:
        settings = self.config.settings
        # Traces only when OTEL_TRACES_EXPORTER (or the application's own provider) asks.
        tracing.configure(service_name="fencegate-gateway")
        authenticator = self._authenticator
        if not self._authenticator_loaded:
            authenticator = load_authenticator(
                self.config.authenticator_spec(),
                base_dir=self.config.base_dir(),
                store_timeout=settings.store_timeout,
            )
        self.store = await open_gateway_store(
            settings.database_url,
            run_migrations=settings.migrate,
            pool_max_size=settings.store_pool_size,
            history=settings.decision_history,
            require_synchronous_replication=settings.require_synchronous_replication,
        )
        await require_schema(
            self.store, database_url=settings.database_url, timeout=settings.store_timeout
        )
        engine = Engine(
            self.store,
            lease_seconds=settings.inflight_lease_seconds,
            store_timeout=settings.store_timeout,
            metrics=self.metrics,
            store_argument=operator_store_argument(settings.database_url),
            release_margin=settings.release_margin,
            answers=AnswerCache(settings.answer_cache) if settings.answer_cache > 0 else None,
        )
        # Registered before the first request: a key this process reserves is never
        # released from under it while it runs.
        self.registry = GatewayRegistry(
            self.store,
            engine.owner,
            heartbeat=settings.gateway_heartbeat,
            timeout=settings.store_timeout,
        )
        await self.registry.start()
        routes = RouteTable(self.config.policies(), default=self.config.default_policy())
        self._client = HttpUpstream()
        await self._client.start()
        self.engine = engine
        self.proxy = ReverseProxy(
            pipeline=Pipeline(
                engine=engine, routes=routes, upstream=self._client, authenticator=authenticator
            ),
            health=StoreHealth(
                self.store,
                database_url=settings.database_url,
                timeout=settings.store_timeout,
                decisions=engine.decisions,
            ),
            metrics=self.metrics,
        )
        if settings.purge_interval_seconds > 0:
            self._purger = asyncio.create_task(self._purge_forever())
        if settings.reconcile_interval > 0 and reconciling(routes):
            self.reconciler = Reconciler(
                self.store,
                routes=routes,
                upstream=self._client,
                instance=engine.owner,
                release_margin=settings.release_margin,
                interval=settings.reconcile_interval,
                store_timeout=settings.store_timeout,
                metrics=self.metrics,
                internal_errors=engine.internal_errors,
            )
            self.reconciler.start()

    async def shutdown(self) -> None:
        if self.reconciler is not None:
            await self.reconciler.close()
        if self._purger is not None:
            self._purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._purger
        if self.engine is not None:
            # Answers the upstream gave that the store has not taken yet: keep trying within
            # the grace period before the connections go.
            await self.engine.close(grace=self.config.settings.shutdown_grace_seconds)
        if self.registry is not None:
            # Heartbeats ran while the engine drained: its row goes only once it owes nothing.
            await self.registry.stop()
        if self._client is not None:
            await self._client.close()
        if self.store is not None:
            await self.store.close()
        tracing.flush()

    async def _purge_forever(self) -> None:
        settings = self.config.settings
        assert self.store is not None
        while True:
            await asyncio.sleep(settings.purge_interval_seconds)
            try:
                counts = await self.store.purge(
                    fence_ttl_seconds=settings.fence_ttl_seconds,
                    timeout=max(settings.store_timeout, 30.0),
                )
            except StoreUnavailable as exc:
                logger.warning("periodic purge skipped: %s", exc)
                continue
            if counts.keys or counts.fences or counts.nonces or counts.decisions:
                logger.info(
                    "purged %d keys, %d fences, %d nonces, %d decision history rows",
                    counts.keys,
                    counts.fences,
                    counts.nonces,
                    counts.decisions,
                )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    logger.error("gateway start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                # Everything built at start-up lives as long as the process: keep it out
                # of the collector's way, and collect young objects less often. Requests
                # make many short-lived objects and few cycles.
                gc.freeze()
                gc.set_threshold(7000, 20, 20)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
