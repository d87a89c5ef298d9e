"""What the step keeps of a request, and `pending` rather than `unknown` while the key's
gateway is alive (DESIGN §8), on both stores."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from typing import Any

import asyncpg

from fencegate.store import DecideRequest, GatewayStore, Outcome, Reservation
from tests.support.waits import wait_until

T = 30.0

BASE = DecideRequest(
    tenant="t1",
    key="k",
    fingerprint="f" * 64,
    entity=None,
    fence=None,
    owner="gw-a:1:abc/1",
    lease_seconds=0.05,
    ttl_seconds=3600.0,
    retry_unknown=False,
    method="POST",
    target="/v1/charges",
)


async def run_sql(url: str, pg: str, lite: str, *args: Any) -> list[tuple[Any, ...]]:
    """One statement on the store's own database (PostgreSQL ``$n``, SQLite ``?``)."""
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as lite_conn:
            return [tuple(r) for r in lite_conn.execute(lite, args).fetchall()]
    pg_conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await pg_conn.fetch(pg, *args)]
    finally:
        await pg_conn.close()


async def register(url: str, instance: str, *, alive_seconds: float) -> None:
    await run_sql(
        url,
        "INSERT INTO fencegate_gateways (instance, host, pid, alive_until) "
        "VALUES ($1, 'h', 1, now() + make_interval(secs => $2))",
        "INSERT INTO fencegate_gateways (instance, host, pid, started_at, heartbeat_at, "
        "alive_until) VALUES (?, 'h', 1, 0, 0, "
        "(julianday('now') - 2440587.5) * 86400.0 + ?)",
        instance,
        alive_seconds,
    )


async def key_row(url: str, *columns: str) -> tuple[Any, ...]:
    listed = ", ".join(columns)
    rows = await run_sql(
        url,
        f"SELECT {listed} FROM fencegate_idempotency_keys WHERE tenant = 't1' AND key = 'k'",  # noqa: S608
        f"SELECT {listed} FROM fencegate_idempotency_keys WHERE tenant = 't1' AND key = 'k'",  # noqa: S608
    )
    assert len(rows) == 1
    return rows[0]


async def lease_over(store: GatewayStore) -> None:
    async def over() -> bool:
        record = await store.get_key("t1", "k", timeout=T)
        return record is not None and record.unknown

    await wait_until(over, timeout=T, what="the in-flight lease running out")


async def test_a_key_whose_gateway_is_alive_is_pending_not_unknown(
    store: GatewayStore, store_url: str
) -> None:
    await register(store_url, "gw-a:1:abc", alive_seconds=600)
    await store.decide(BASE, timeout=T)
    await lease_over(store)
    asked = await store.decide(replace(BASE, owner="gw-b:2:def/1"), timeout=T)
    assert asked.outcome is Outcome.PENDING
    # Its gateway stops heartbeating: now nobody will settle it but an operator (or the
    # reconciler).
    await run_sql(
        store_url,
        "UPDATE fencegate_gateways SET alive_until = now() - interval '1 second'",
        "UPDATE fencegate_gateways SET alive_until = 0",
    )
    asked = await store.decide(replace(BASE, owner="gw-b:2:def/2"), timeout=T)
    assert asked.outcome is Outcome.UNKNOWN


async def test_a_key_marked_unknown_by_its_live_gateway_is_unknown(
    store: GatewayStore, store_url: str
) -> None:
    """The gateway itself said the outcome is unknown: it owes nothing more."""
    await register(store_url, "gw-a:1:abc", alive_seconds=600)
    first = await store.decide(replace(BASE, lease_seconds=30), timeout=T)
    assert first.attempt is not None
    held = Reservation("t1", "k", BASE.owner, first.attempt)
    assert await store.mark_unknown(held, reason="no answer within 2.0s", timeout=T)
    asked = await store.decide(replace(BASE, owner="gw-b:2:def/1"), timeout=T)
    assert asked.outcome is Outcome.UNKNOWN
    assert await key_row(store_url, "unknown_reason") == ("no answer within 2.0s",)


async def test_a_key_keeps_its_request_and_only_a_reconciling_route_keeps_the_body(
    store: GatewayStore, store_url: str
) -> None:
    await store.decide(replace(BASE, lease_seconds=30, request_body=b'{"a":1}'), timeout=T)
    method, target, body, after = await key_row(
        store_url, "method", "target", "request_body", "reconcile_after"
    )
    assert (method, target, body, after) == ("POST", "/v1/charges", None, None)

    other = replace(BASE, key="k2", lease_seconds=30, reconcile=True, request_body=b'{"a":1}')
    await store.decide(other, timeout=T)
    rows = await run_sql(
        store_url,
        "SELECT request_body, reconcile_after IS NOT NULL FROM fencegate_idempotency_keys "
        "WHERE key = 'k2'",
        "SELECT request_body, reconcile_after IS NOT NULL FROM fencegate_idempotency_keys "
        "WHERE key = 'k2'",
    )
    assert [(bytes(b), bool(s)) for b, s in rows] == [(b'{"a":1}', True)]
