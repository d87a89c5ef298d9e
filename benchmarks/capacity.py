"""What one decision and one job cost PostgreSQL: the figures of the capacity model
(docs/operations/capacity.md).

Runs on a private PostgreSQL (initdb on a free loopback port, as the topology tests do), so
that the WAL and the counters it reads are fencegate's alone. For the gateway store (keyed,
fenced decisions: a new key reserved then its answer recorded, and a replay) and the lease
queue (enqueue, claim, complete), one at a time and then many at once, it prints per unit:

- round trips (calls into the store's connection pool: each one statement in one
  transaction, so also the commits; many callers at once share them, see the batching),
- WAL bytes (``pg_current_wal_lsn()`` before and after),
- and the size of each table's rows (``pg_column_size`` of a row, ``pg_total_relation_size``
  per row with indexes and TOAST).

``python -m benchmarks.capacity [--decisions 2000] [--jobs 1000] [--concurrency 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

import asyncpg

from fencegate.lease import LeaseQueue
from fencegate.store import DecideRequest, Reservation, StoredResponse, open_gateway_store
from fencegate.store.migrations import migrate
from fencegate.store.postgres import PostgresGatewayStore
from tests.support.topology import PgNode, give_to_server_user, missing

T = 30.0
REQUEST = DecideRequest(
    tenant="acme", key="k", fingerprint="f" * 64, entity="invoice-1", fence=1, owner="gw-a",
    lease_seconds=30.0, ttl_seconds=86400.0, retry_unknown=False,
)  # fmt: skip
# A typical JSON API answer: a few headers and a 300-byte body.
RESPONSE = StoredResponse(
    201,
    [("content-type", "application/json"), ("request-id", "req_" + "x" * 20)],
    b'{"id": "ch_' + b"0" * 24 + b'", "object": "charge", "amount": 4200' + b" " * 230 + b"}",
    "sha256-of-the-body",
)

TABLES = (
    "fencegate_idempotency_keys",
    "fencegate_fences",
    "fencegate_decisions",
    "fencegate_jobs",
    "fencegate_job_attempts",
)

COUNTERS = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') AS lsn"


class Counters:
    """The WAL position around a piece of work (nothing else writes to this server)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def read(self) -> dict[str, Any]:
        conn = await asyncpg.connect(self.url)
        try:
            row = await conn.fetchrow(COUNTERS)
            assert row is not None
            return dict(row)
        finally:
            await conn.close()

    @staticmethod
    def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
        return {
            "wal_bytes": float(after["lsn"] - before["lsn"]),
        }


def per(unit: int, totals: dict[str, float], round_trips: int) -> dict[str, float]:
    return {**{k: v / unit for k, v in totals.items()}, "round_trips": round_trips / unit}


async def gateway_costs(url: str, n: int, concurrency: int, history: bool) -> dict[str, Any]:
    store = await open_gateway_store(url, run_migrations=False, timeout=10.0, history=history)
    assert isinstance(store, PostgresGatewayStore)
    calls = 0
    run = store._db.run

    async def counted(fn: Any, *, timeout: float) -> Any:
        nonlocal calls
        calls += 1
        return await run(fn, timeout=timeout)

    store._db.run = counted  # type: ignore[method-assign]
    counters = Counters(url)
    tag = uuid.uuid4().hex[:6]
    results: dict[str, Any] = {}
    try:

        async def one(i: int, entities: int = 100) -> None:
            # Each entity's fences rise with i: one caller at a time over 100 entities; many
            # callers at once each on its own (a stale fence would reserve nothing).
            entity = f"invoice-{i % entities}"
            request = replace(REQUEST, key=f"{tag}-{i}", entity=entity, fence=i)
            decision = await store.decide(request, timeout=T)
            assert decision.attempt is not None
            holder = Reservation(request.tenant, request.key or "", request.owner, decision.attempt)
            assert await store.complete(holder, RESPONSE, timeout=T)

        before, calls = await counters.read(), 0
        for i in range(n):
            await one(i)
        results["new key, one at a time"] = per(
            n, counters.diff(before, await counters.read()), calls
        )

        before, calls = await counters.read(), 0
        for i in range(n):
            await store.decide(
                replace(REQUEST, key=f"{tag}-{i}", entity=f"invoice-{i % 100}", fence=n + i),
                timeout=T,
            )
        results["replay, one at a time"] = per(
            n, counters.diff(before, await counters.read()), calls
        )

        before, calls = await counters.read(), 0
        started = time.perf_counter()
        pending = iter(range(n, 2 * n))

        async def caller() -> None:
            for i in pending:
                await one(i, entities=2 * n)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        totals = counters.diff(before, await counters.read())
        results[f"new key, {concurrency} at once"] = {
            **per(n, totals, calls),
            "per_second": n / elapsed,
        }
    finally:
        await store.close()
    return results


async def queue_costs(url: str, n: int) -> dict[str, Any]:
    counters = Counters(url)
    async with await LeaseQueue.connect(url, timeout=T) as queue:
        driver: Any = queue._driver
        before = await counters.read()
        driver.round_trips = 0
        for i in range(n):
            await queue.enqueue(
                "charge", {"invoice": i, "amount": 4200}, idempotency_key=f"job-{i}"
            )
        done = 0
        while done < n:
            leases = await queue.claim("capacity", kinds=["charge"], limit=50)
            for lease in leases:
                assert await queue.complete(lease, {"charged": True})
            done += len(leases)
        totals = counters.diff(before, await counters.read())
        return {"job (enqueue, claim, complete)": per(n, totals, driver.round_trips)}


async def sizes(url: str) -> dict[str, dict[str, float]]:
    conn = await asyncpg.connect(url)
    try:
        found = {}
        for table in TABLES:
            rows = await conn.fetchval(f"SELECT count(*) FROM {table}")  # noqa: S608 (our names)
            if not rows:
                continue
            row_bytes = await conn.fetchval(
                f"SELECT avg(pg_column_size(t.*)) FROM {table} t"  # noqa: S608
            )
            total = await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", table)
            found[table] = {
                "rows": rows,
                "row_bytes": float(row_bytes),
                "bytes_per_row_total": total / rows,
            }
        return found
    finally:
        await conn.close()


def table(title: str, rows: dict[str, dict[str, float]], columns: list[str]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(["", *columns]) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{values.get(c, 0):,.1f}" for c in columns) + " |")


async def main(args: argparse.Namespace) -> None:
    reason = missing("initdb")
    if reason:
        raise SystemExit(reason)
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="fencegate-capacity-"))
    give_to_server_user(root)
    node = PgNode(root, "pg")
    node.init_primary()
    node.start()
    try:
        columns = ["round_trips", "wal_bytes"]
        for history in (True, False):
            conn = await asyncpg.connect(node.url)
            name = f"capacity_{int(history)}"
            await conn.execute(f"CREATE DATABASE {name}")
            await conn.close()
            url = node.url.rsplit("/", 1)[0] + "/" + name
            await migrate(url)
            costs = await gateway_costs(url, args.decisions, args.concurrency, history)
            if history:
                costs.update(await queue_costs(url, args.jobs))
            table(
                f"Store cost per unit (decision history {'on' if history else 'off'})",
                costs,
                [*columns, "per_second"],
            )
            if history:
                table(
                    "Row sizes (bytes)",
                    await sizes(url),
                    ["rows", "row_bytes", "bytes_per_row_total"],
                )
    finally:
        node.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
