"""The gateway registry as the stores keep it, on both backends: a process registers, its
heartbeats keep its row alive three heartbeats ahead (database clock), a clean stop deletes
it, rows of processes dead for long are purged, and the ASGI middleware registers while it
runs."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import asyncpg
import pytest

from fencegate import FencegateMiddleware
from fencegate.gateway.registry import GatewayRegistry
from fencegate.gateway.routes import RoutePolicy
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.store.dburl import parse_database_url
from tests.support.asgi import call
from tests.support.echo_app import EchoApp
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)

T = 30.0
GATEWAY = "gw-a:4242:0badcafe"  # Engine.owner: host:pid:uuid8


async def sql(url: str, pg: str, lite: str, *args: Any) -> None:
    """One statement on the store's database, outside fencegate (the test's own hand)."""
    target = parse_database_url(url)
    if target.kind == "postgresql":
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(pg, *args)
        finally:
            await conn.close()
        return
    assert target.sqlite_path is not None
    db = sqlite3.connect(target.sqlite_path)
    try:
        db.execute(lite, args)
        db.commit()
    finally:
        db.close()


async def test_a_registry_heartbeats_and_leaves_cleanly(store: GatewayStore) -> None:
    registry = GatewayRegistry(store, GATEWAY, heartbeat=0.2, timeout=T)
    await registry.start()
    try:
        [row] = await store.gateways(timeout=T)
        assert (row.instance, row.host, row.alive) == (GATEWAY, registry.host, True)
        assert row.alive_until - row.heartbeat_at == pytest.approx(0.6, abs=0.05)
        first = row.heartbeat_at

        async def beaten() -> bool:
            [now] = await store.gateways(timeout=T)
            return now.heartbeat_at > first

        await wait_until(beaten, timeout=T, what="a second heartbeat")
    finally:
        await registry.stop()
    assert await store.gateways(timeout=T) == []


async def test_a_heartbeat_the_store_does_not_take_is_logged_never_raised(
    store_url: str, store: GatewayStore, caplog: pytest.LogCaptureFixture
) -> None:
    away = await open_gateway_store(store_url, run_migrations=False, pool_max_size=2)
    await away.close()  # every call now fails, as with a store that is away
    registry = GatewayRegistry(away, GATEWAY, heartbeat=60, timeout=T)
    with caplog.at_level(logging.INFO, logger="fencegate.gateway"):
        await registry.start()  # starts anyway
        assert not await registry.beat()
        assert registry.healthy is False
        registry.store = store  # the store is back
        assert await registry.beat()
        await registry.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("could not heartbeat in the store" in m for m in said) == 1  # once, not per beat
    assert any("heartbeats in the store again" in m for m in said)
    assert await store.gateways(timeout=T) == []


async def test_rows_of_gateways_dead_for_long_are_purged(
    store: GatewayStore, store_url: str
) -> None:
    await store.heartbeat_gateway("gw-old:1:00000001", host="h", pid=1, alive_seconds=1, timeout=T)
    await store.heartbeat_gateway("gw-new:1:00000002", host="h", pid=2, alive_seconds=60, timeout=T)
    await sql(
        store_url,
        "UPDATE fencegate_gateways SET alive_until = now() - interval '2 days'"
        " WHERE instance = 'gw-old:1:00000001'",
        "UPDATE fencegate_gateways SET alive_until = alive_until - 2 * 86400"
        " WHERE instance = 'gw-old:1:00000001'",
    )
    assert await store.purge_gateways(dead_for_seconds=86400, timeout=T) == 1
    assert [g.instance for g in await store.gateways(timeout=T)] == ["gw-new:1:00000002"]


async def test_the_middleware_registers_while_it_runs(store_url: str) -> None:
    gate = FencegateMiddleware(
        EchoApp(), database_url=store_url, routes=[RoutePolicy(prefix="/v1")],
        store_timeout=T, gateway_heartbeat=0.5,
    )  # fmt: skip
    store = await open_gateway_store(store_url, run_migrations=False, pool_max_size=2)
    try:
        answer = await call(
            gate, "POST", "/v1/charges", body=b"{}", headers=[("idempotency-key", "m-1")]
        )
        assert answer.status == 200, answer.body
        assert gate.registry is not None
        [row] = await store.gateways(timeout=T)
        assert row.instance == gate.registry.instance and row.alive
        assert row.alive_until - row.heartbeat_at == pytest.approx(1.5, abs=0.05)
        await gate.close()
        assert await store.gateways(timeout=T) == []
    finally:
        await gate.close()
        await store.close()
