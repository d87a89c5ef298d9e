"""On Citus each gateway decision is one tenant's, on one shard: the gateway batches per
tenant, and ``fencegate_step`` (a distributed function on its tenant argument) runs on the
worker that holds the tenant's shard, as one local transaction there; so do a lease's
renewal, a nonce, a release and an outcome marked unknown. Nothing commits with
two-phase commit (the coordinator's ``pg_dist_transaction`` stays empty), and Citus's own
EXPLAIN of a step names one task, on that worker."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from fencegate.store import DecideRequest, Outcome, Reservation, StoredResponse, open_gateway_store
from fencegate.store.postgres import PostgresGatewayStore, Q, split_steps, step_arguments

T = 20.0
TENANTS = [f"tenant-{i}" for i in range(6)]


def decide_request(tenant: str, n: int) -> DecideRequest:
    return DecideRequest(
        tenant=tenant,
        key=f"key-{n}-{uuid.uuid4().hex[:8]}",
        fingerprint="f",
        entity=f"entity-{n}",
        fence=n,
        owner=f"gw/{uuid.uuid4().hex[:8]}",
        lease_seconds=30,
        ttl_seconds=3600,
        retry_unknown=False,
        request_id=f"r-{n}",
        method="POST",
        target="/v1/charges",
    )


async def shard_node(conn: asyncpg.Connection, tenant: str) -> int:
    """The port of the worker holding ``tenant``'s shard of the gateway's tables."""
    port = await conn.fetchval(
        "SELECT nodeport FROM citus_shards WHERE shardid = "
        "get_shard_id_for_distribution_column('fencegate_idempotency_keys', $1::text)",
        tenant,
    )
    return int(port)


async def test_a_decision_is_a_single_shard_transaction_on_the_tenants_worker(
    pg_url: str,
) -> None:
    store = await open_gateway_store(pg_url)
    conn = await asyncpg.connect(pg_url)
    try:
        assert isinstance(store, PostgresGatewayStore) and store.per_tenant
        # Citus's maintenance daemon deletes the records of finished two-phase commits (every
        # citus.recover_2pc_interval): recovered now, the count can only grow during the test.
        await conn.execute("SELECT recover_prepared_transactions()")
        before = await conn.fetchval("SELECT count(*) FROM pg_dist_transaction")
        # Many tenants at once: decisions, their answers, renewals, a replay each.
        requests = [decide_request(t, n) for n in range(1, 9) for t in TENANTS]
        decisions = await asyncio.gather(*(store.decide(r, timeout=T) for r in requests))
        assert {d.outcome for d in decisions} == {Outcome.RESERVED}
        holders = [
            Reservation(r.tenant, r.key or "", r.owner, d.attempt or 1, r.request_id)
            for r, d in zip(requests, decisions, strict=True)
        ]
        answer = StoredResponse(
            status=201, headers=[("content-type", "text/plain")], body=b"ok", sha256=""
        )
        assert all(await asyncio.gather(*(store.renew(h, 30, timeout=T) for h in holders)))
        assert all(await asyncio.gather(*(store.complete(h, answer, timeout=T) for h in holders)))
        replays = await asyncio.gather(*(store.decide(r, timeout=T) for r in requests))
        assert {d.outcome for d in replays} == {Outcome.REPLAY}
        # The failure paths too: a reservation released (5xx), one given up (503), one
        # whose outcome became unknown (timeout).
        failing = [decide_request(t, 100 + n) for n in range(3) for t in TENANTS]
        held = [
            Reservation(r.tenant, r.key or "", r.owner, d.attempt or 1, r.request_id)
            for r, d in zip(
                failing,
                await asyncio.gather(*(store.decide(r, timeout=T) for r in failing)),
                strict=True,
            )
        ]
        thirds = len(TENANTS)
        assert all(
            await asyncio.gather(
                *(store.release(h, upstream_status=502, timeout=T) for h in held[:thirds]),
                *(store.release_abandoned(h, timeout=T) for h in held[thirds : 2 * thirds]),
                *(store.mark_unknown(h, reason="timeout", timeout=T) for h in held[2 * thirds :]),
            )
        )
        nonces = [
            store.remember_nonce(f"key-of-{t}", uuid.uuid4().hex, 60, tenant=t, timeout=T)
            for t in TENANTS
        ]
        assert all(await asyncio.gather(*nonces))
        # Not one of them committed with two-phase commit.
        assert await conn.fetchval("SELECT count(*) FROM pg_dist_transaction") == before

        # Each tenant's step runs where its shard is: Citus's plan is one task, and the one
        # command it sends (citus.log_remote_commands) is the whole call, to that worker.
        sent: list[str] = []
        conn.add_log_listener(
            lambda _c, message: sent.append(
                str(message.message) + " " + str(getattr(message, "detail", ""))
            )
        )
        await conn.execute("SET citus.log_remote_commands = on")
        await conn.execute("SET client_min_messages = log")
        for tenant in TENANTS:
            port = await shard_node(conn, tenant)
            args = step_arguments(*split_steps([decide_request(tenant, 99)]), history=True)
            plan = "\n".join(
                r[0] for r in await conn.fetch("EXPLAIN (COSTS OFF) " + Q.step, tenant, *args, None)
            )
            assert "Task Count: 1" in plan, plan
            sent.clear()
            rows = await conn.fetch(Q.step, tenant, *args, None)
            assert [r["d_outcome"] for r in rows] == ["reserved"]
            steps = [m for m in sent if "fencegate_step" in m]
            assert len(steps) == 1, sent
            assert f":{port} " in steps[0] or f"port={port}" in steps[0], steps
            assert not [m for m in sent if "PREPARE TRANSACTION" in m], sent
        await conn.execute("RESET client_min_messages")
        assert await conn.fetchval("SELECT count(*) FROM pg_dist_transaction") == before
    finally:
        await conn.close()
        await store.close()


async def test_a_batch_that_mixed_tenants_would_commit_on_several_nodes(pg_url: str) -> None:
    """The contrast that shows what the per-tenant batches save: a step run on the
    coordinator for two tenants whose shards are on different workers commits on both, with
    two-phase commit."""
    conn = await asyncpg.connect(pg_url)
    try:
        first = TENANTS[0]
        nodes = {t: await shard_node(conn, t) for t in TENANTS}
        other = next(t for t in TENANTS[1:] if nodes[t] != nodes[first])
        # Citus's maintenance daemon deletes the records of finished two-phase commits (every
        # citus.recover_2pc_interval): recovered now, the count can only grow during the test.
        await conn.execute("SELECT recover_prepared_transactions()")
        before = await conn.fetchval("SELECT count(*) FROM pg_dist_transaction")
        items = [decide_request(first, 1), decide_request(other, 2)]
        args = step_arguments(*split_steps(items), history=True)
        # In a transaction block Citus does not delegate the call: it runs on the
        # coordinator, and its statements go to both workers.
        async with conn.transaction():
            # NULL: a batch of several tenants. (Outside a transaction block Citus would try to
            # delegate the call on that NULL, which crashes its planner: the gateway never
            # sends a mixed batch to Citus.)
            rows = await conn.fetch(Q.step, None, *args, None)
        assert len(rows) == 2
        assert await conn.fetchval("SELECT count(*) FROM pg_dist_transaction") > before
    finally:
        await conn.close()
