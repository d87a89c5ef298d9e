"""Releasing a key safely (DESIGN §8), in the stores, on both backends: a key is released or
given an answer by anyone but its gateway only when no copy of its request can still reach
the upstream; the refusal says why and from when it is safe; ``force`` overrides it and is
marked as such; the rule is checked in the step that makes the change; an operator's action
and its audit row land together or not at all; what `keys show` and the console read of a
key."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import pytest

from fencegate.lease import LeaseQueue
from fencegate.operator_actions import (
    cancel_job,
    key_fields,
    refusal,
    resolve_key,
    retry_job,
    stored_answer,
)
from fencegate.store import (
    DecideRequest,
    GatewayStore,
    KeyRecord,
    Outcome,
    Reservation,
    ResolveResult,
)
from fencegate.store.dburl import parse_database_url
from fencegate.store.inspect import Inspector
from fencegate.store.release import utc
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)

T = 30.0
TENANT = "t1"
GATEWAY = "gw-a:4242:0badcafe"  # Engine.owner: host:pid:uuid8
ANSWER = stored_answer(201, b'{"id": "ch_1"}', "application/json")


def request(key: str, owner: str, *, lease: float) -> DecideRequest:
    return DecideRequest(
        tenant=TENANT, key=key, fingerprint="fp", entity="e1", fence=None, owner=owner,
        lease_seconds=lease, ttl_seconds=3600.0, retry_unknown=False, request_id=owner,
        method="POST", target="/v1/charges",
    )  # fmt: skip


async def in_flight(store: GatewayStore, key: str, *, lease: float = 30.0) -> Reservation:
    owner = f"{GATEWAY}/1"
    decision = await store.decide(request(key, owner, lease=lease), timeout=T)
    assert decision.outcome is Outcome.RESERVED and decision.attempt is not None
    return Reservation(TENANT, key, owner, decision.attempt, owner)


async def lease_ran_out(store: GatewayStore, key: str) -> KeyRecord:
    async def expired() -> KeyRecord | None:
        record = await store.get_key(TENANT, key, timeout=T)
        return record if record is not None and record.unknown else None

    found = await wait_until(expired, timeout=T, what="the in-flight lease running out")
    assert found is not None
    return found


async def marked_unknown(store: GatewayStore, key: str) -> Reservation:
    holder = await in_flight(store, key)
    assert await store.mark_unknown(holder, timeout=T)
    return holder


async def gateway_alive(store: GatewayStore, instance: str = GATEWAY) -> None:
    await store.heartbeat_gateway(instance, host="gw-a", pid=4242, alive_seconds=300, timeout=T)


async def sql(url: str, pg: str, lite: str, *args: Any) -> list[Any]:
    """One statement on the store's database, outside fencegate (the test's own hand)."""
    target = parse_database_url(url)
    if target.kind == "postgresql":
        conn = await asyncpg.connect(url)
        try:
            return [tuple(r) for r in await conn.fetch(pg, *args)]
        finally:
            await conn.close()
    assert target.sqlite_path is not None
    db = sqlite3.connect(target.sqlite_path)
    try:
        rows = db.execute(lite, args).fetchall()
        db.commit()
        return rows
    finally:
        db.close()


# -- the release rule, as resolve_key applies it ------------------------------------------------


async def test_a_key_whose_gateway_is_alive_is_not_released(store: GatewayStore) -> None:
    await gateway_alive(store)
    await in_flight(store, "k", lease=0.3)
    await lease_ran_out(store, "k")
    refused = await store.resolve_key(TENANT, "k", None, resolved_by="op", margin=0, timeout=T)
    assert refused.result is ResolveResult.BLOCKED
    assert refused.before is not None and refused.before.release_blocker == "owner_alive"
    words = refusal(refused)
    assert f"its gateway {GATEWAY} is alive (last heartbeat " in words
    assert "s ago); it will record or release the key itself" in words
    assert await store.get_key(TENANT, "k", timeout=T) is not None
    # Recording an answer is refused alike: the gateway may still record the real one.
    answered = await store.resolve_key(TENANT, "k", ANSWER, resolved_by="op", margin=0, timeout=T)
    assert answered.result is ResolveResult.BLOCKED

    # Its process stops cleanly (its row goes): nothing is on its way any more.
    assert await store.deregister_gateway(GATEWAY, timeout=T)
    done = await store.resolve_key(TENANT, "k", None, resolved_by="op", margin=0, timeout=T)
    assert done.result is ResolveResult.RELEASED
    assert await store.get_key(TENANT, "k", timeout=T) is None


async def test_a_live_lease_is_never_released(store: GatewayStore) -> None:
    await in_flight(store, "k", lease=60.0)
    refused = await store.resolve_key(TENANT, "k", None, resolved_by="op", margin=0, timeout=T)
    assert refused.result is ResolveResult.BLOCKED
    words = refusal(refused)
    assert f"its gateway {GATEWAY} holds it under a live lease (" in words
    assert "may be sending it now" in words


async def test_within_the_margin_release_is_refused_with_the_time_it_becomes_safe(
    store: GatewayStore,
) -> None:
    await marked_unknown(store, "k")
    margin = 2.0
    refused = await store.resolve_key(TENANT, "k", None, resolved_by="op", margin=margin, timeout=T)
    assert refused.result is ResolveResult.BLOCKED
    record = refused.before
    assert record is not None and record.release_blocker == "release_margin"
    assert record.locked_until is not None
    safe_from = utc(record.locked_until + margin)
    words = refusal(refused)
    assert "its outcome became unknown " in words
    assert "a request sent before then may still be on its way: safe to release from " in words
    assert f"from {safe_from} (release margin 2 s), or use --force" in words
    assert key_fields(record)["release_safe_from"] == safe_from

    async def safe() -> bool:
        now = await store.get_key(TENANT, "k", margin=margin, timeout=T)
        return now is not None and now.release_blocker is None

    await wait_until(safe, timeout=T, what="the release margin passing")
    done = await store.resolve_key(
        TENANT, "k", ANSWER, resolved_by="operator:me", margin=margin, timeout=T
    )
    assert done.result is ResolveResult.COMPLETED and not done.forced
    assert done.after is not None
    assert (done.after.state, done.after.resolution) == ("completed", "operator")


async def test_a_lease_that_ended_within_the_margin_says_so(store: GatewayStore) -> None:
    await in_flight(store, "k", lease=0.3)
    await lease_ran_out(store, "k")
    refused = await store.resolve_key(TENANT, "k", None, resolved_by="op", margin=60, timeout=T)
    assert refused.result is ResolveResult.BLOCKED
    assert "its lease ended " in refusal(refused)
    assert "(release margin 60 s)" in refusal(refused)


async def test_force_skips_the_rule_and_is_marked_forced(
    store: GatewayStore, store_url: str
) -> None:
    await gateway_alive(store)
    await in_flight(store, "k", lease=60.0)
    forced = await store.resolve_key(
        TENANT, "k", ANSWER, resolved_by="operator:me", force=True, timeout=T
    )
    assert forced.result is ResolveResult.COMPLETED and forced.forced
    assert forced.before is not None and forced.before.release_blocker == "lease_live"
    assert forced.after is not None and forced.after.resolution == "forced"
    history = await sql(
        store_url,
        "SELECT decision FROM fencegate_decisions WHERE key = 'k' ORDER BY id",
        "SELECT decision FROM fencegate_decisions WHERE key = 'k' ORDER BY id",
    )
    assert [row[0] for row in history] == ["reserved", "resolved_forced"]
    # Never for a completed key: there is nothing to release.
    again = await store.resolve_key(TENANT, "k", None, resolved_by="op", force=True, timeout=T)
    assert again.result is ResolveResult.NOT_UNKNOWN


async def hold_row_then(store_url: str) -> AsyncIterator[None]:
    """Yields while another session holds the key row's lock (SQLite: the write lock) having
    changed it as a second gateway would: it took the key over and its request timed out just
    now (outcome unknown since now, so it may still be on its way). Commits when resumed."""
    target = parse_database_url(store_url)
    change_pg = (
        "UPDATE fencegate_idempotency_keys SET owner = 'gw-b:1:00000000/1', attempt = 2,"
        " state = 'outcome_unknown', locked_until = now() WHERE tenant = 't1' AND key = 'k'"
    )
    if target.kind == "postgresql":
        conn = await asyncpg.connect(store_url)
        try:
            async with conn.transaction():
                await conn.execute(change_pg)
                yield
        finally:
            await conn.close()
        return
    assert target.sqlite_path is not None
    db = sqlite3.connect(target.sqlite_path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "UPDATE fencegate_idempotency_keys SET owner = 'gw-b:1:00000000/1', attempt = 2,"
            " state = 'outcome_unknown', locked_until = (julianday('now') - 2440587.5) * 86400.0"
            " WHERE tenant = 't1' AND key = 'k'"
        )
        yield
        db.execute("COMMIT")
    finally:
        db.close()


async def resolve_waiting(store: GatewayStore, store_url: str) -> asyncio.Event:
    """An event set once the store's resolve waits for the lock ``hold_row_then`` holds."""
    waiting = asyncio.Event()
    loop = asyncio.get_running_loop()
    if store.kind == "sqlite":
        # The resolve's write transaction has begun (and waits in SQLite's busy handler).
        conn = store._db._connect()  # type: ignore[attr-defined]  # the store's own handle
        seen = threading.Event()

        def trace(statement: str) -> None:
            if statement.startswith("BEGIN IMMEDIATE"):
                seen.set()
                loop.call_soon_threadsafe(waiting.set)

        conn.set_trace_callback(trace)
        return waiting

    async def blocked() -> bool:
        rows = await sql(
            store_url,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fencegate-gateway'"
            " AND wait_event_type = 'Lock'",
            "",
        )
        return bool(rows[0][0])

    async def watch() -> None:
        await wait_until(blocked, timeout=T, what="the resolve waiting for the row lock")
        waiting.set()

    task = asyncio.create_task(watch())
    waiting.task = task  # type: ignore[attr-defined]  # kept alive until the test ends
    return waiting


async def test_the_rule_is_checked_in_the_step_that_releases(
    store: GatewayStore, store_url: str
) -> None:
    """No check-then-act: while the resolve waits for the key, another gateway takes it over
    and its request times out just now. The resolve then sees that key (a copy may be on its
    way) and refuses; checked before the wait, it would release it."""
    await in_flight(store, "k", lease=0.3)
    await lease_ran_out(store, "k")
    # Its lease ended long ago, and its gateway is not registered: safe to release now.
    await sql(
        store_url,
        "UPDATE fencegate_idempotency_keys SET locked_until = locked_until - interval '100 s'",
        "UPDATE fencegate_idempotency_keys SET locked_until = locked_until - 100",
    )
    before = await store.get_key(TENANT, "k", margin=30, timeout=T)
    assert before is not None and before.release_blocker is None
    holding = hold_row_then(store_url)
    await anext(holding)
    waiting = await resolve_waiting(store, store_url)
    resolve = asyncio.create_task(
        store.resolve_key(TENANT, "k", None, resolved_by="op", margin=30, timeout=T)
    )
    await asyncio.wait_for(waiting.wait(), T)
    with pytest.raises(StopAsyncIteration):
        await anext(holding)  # the other session commits
    done = await resolve
    assert done.result is ResolveResult.BLOCKED, done
    assert done.before is not None and done.before.release_blocker == "release_margin"
    record = await store.get_key(TENANT, "k", timeout=T)
    assert record is not None and (record.state, record.attempt) == ("outcome_unknown", 2)


# -- an operator's action and its audit row: one transaction ------------------------------------


async def refuse_audits_by(store_url: str, actor: str) -> None:
    """The audit table refuses rows from ``actor``: a failure between an action's change and
    its audit row, injected in the store."""
    await sql(
        store_url,
        f"ALTER TABLE fencegate_audit ADD CONSTRAINT refused CHECK (actor <> '{actor}')",
        f"CREATE TRIGGER refused BEFORE INSERT ON fencegate_audit WHEN NEW.actor = '{actor}'"
        " BEGIN SELECT RAISE(ABORT, 'audit refused'); END",
    )


async def audit_actions(store_url: str) -> list[tuple[str, str]]:
    inspector = await Inspector.open(store_url)
    try:
        return [(r["actor"], r["action"]) for r in await inspector.audit_log(timeout=T)]
    finally:
        await inspector.close()


async def test_a_resolve_and_its_audit_row_land_together_or_not_at_all(
    store: GatewayStore, store_url: str
) -> None:
    await marked_unknown(store, "k")
    await refuse_audits_by(store_url, "operator:refused")
    with pytest.raises(Exception, match="refused"):
        await resolve_key(
            store, tenant=TENANT, key="k", answer=None, actor="operator:refused", reason="x",
            margin=0, timeout=T,
        )  # fmt: skip
    record = await store.get_key(TENANT, "k", timeout=T)
    assert record is not None and record.state == "outcome_unknown"  # not released
    assert await audit_actions(store_url) == []

    done = await resolve_key(
        store, tenant=TENANT, key="k", answer=None, actor="operator:me", reason="no charge",
        margin=0, timeout=T,
    )  # fmt: skip
    assert done.result is ResolveResult.RELEASED
    assert await audit_actions(store_url) == [("operator:me", "keys.resolve_released")]


async def test_a_forced_resolve_is_audited_as_forced(store: GatewayStore, store_url: str) -> None:
    await marked_unknown(store, "k")
    done = await resolve_key(
        store, tenant=TENANT, key="k", answer=ANSWER, actor="operator:me", reason="ticket 9",
        force=True, timeout=T,
    )  # fmt: skip
    assert done.result is ResolveResult.COMPLETED
    inspector = await Inspector.open(store_url)
    try:
        [row] = await inspector.audit_log(timeout=T)
    finally:
        await inspector.close()
    assert (row["action"], row["reason"]) == ("keys.resolve_forced", "ticket 9")
    assert orjson.loads(row["before"])["release"].startswith("not yet: its outcome became")
    assert orjson.loads(row["after"])["resolution"] == "forced"


async def test_a_job_action_and_its_audit_row_land_together_or_not_at_all(
    queue: LeaseQueue, store_url: str
) -> None:
    job = await queue.enqueue("charge", {"n": 1}, idempotency_key="j-1", timeout=T)
    await refuse_audits_by(store_url, "operator:refused")
    inspector = await Inspector.open(store_url)
    try:
        with pytest.raises(Exception, match="refused"):
            await cancel_job(
                queue, inspector, job, actor="operator:refused", reason=None, timeout=T
            )
        assert (await queue.get(job, timeout=T)).state == "queued"  # not cancelled
        cancelled = await cancel_job(
            queue, inspector, job, actor="operator:me", reason=None, timeout=T
        )
        assert cancelled is not None and cancelled["state"] == "cancelled"
        with pytest.raises(Exception, match="refused"):
            await retry_job(queue, inspector, job, actor="operator:refused", reason=None, timeout=T)
        assert (await queue.get(job, timeout=T)).state == "cancelled"  # not queued again
        retried = await retry_job(
            queue, inspector, job, actor="operator:me", reason="go", timeout=T
        )
        assert retried is not None and retried["state"] == "queued"
        rows = await inspector.audit_log(timeout=T)
    finally:
        await inspector.close()
    assert [(r["actor"], r["action"]) for r in rows] == [
        ("operator:me", "jobs.retry"),
        ("operator:me", "jobs.cancel"),
    ]
    retry_row = rows[0]
    assert orjson.loads(retry_row["before"])["state"] == "cancelled"
    assert orjson.loads(retry_row["after"])["state"] == "queued"


# -- what people see ----------------------------------------------------------------------------


async def test_keys_show_the_request_the_limit_the_resolution_and_the_reconcile_state(
    store: GatewayStore, store_url: str
) -> None:
    await gateway_alive(store)
    await marked_unknown(store, "k")
    # What the reservation and the unknown mark write, and the reconciler's schedule.
    await sql(
        store_url,
        "UPDATE fencegate_idempotency_keys SET method = 'POST', target = '/v1/charges',"
        " unknown_reason = 'no answer within 2.0s', reconcile_after = now() + interval '5 s',"
        " reconcile_tries = 2, reconcile_note = 'probe answered 503'",
        "UPDATE fencegate_idempotency_keys SET method = 'POST', target = '/v1/charges',"
        " unknown_reason = 'no answer within 2.0s',"
        " reconcile_after = (julianday('now') - 2440587.5) * 86400.0 + 5,"
        " reconcile_tries = 2, reconcile_note = 'probe answered 503'",
    )
    record = await store.get_key(TENANT, "k", margin=30, timeout=T)
    assert record is not None
    fields = key_fields(record)
    assert (fields["method"], fields["target"], fields["entity"]) == ("POST", "/v1/charges", "e1")
    assert fields["unknown_reason"] == "no answer within 2.0s"
    assert (fields["gateway"], fields["gateway_alive"]) == (GATEWAY, True)
    assert str(fields["release"]).startswith("not yet: its outcome became unknown ")
    assert record.locked_until is not None
    assert fields["release_safe_from"] == utc(record.locked_until + 30)
    assert (fields["reconcile_tries"], fields["reconcile_note"]) == (2, "probe answered 503")
    assert fields["reconcile_after"] is not None
    assert fields["resolution"] is None
    now = await store.get_key(TENANT, "k", margin=0, timeout=T)
    assert now is not None and key_fields(now)["release"] == "safe now (release margin 0 s)"
