"""Migration 004 (names compared bytewise, ``COLLATE "C"``) on a database whose gateway
tables were distributed before it: a distribution column cannot change, so the tenant
column keeps its collation and every other name changes; the migration does not fail."""

from __future__ import annotations

import uuid

import asyncpg

from fencegate.store import Outcome, open_gateway_store
from fencegate.store.migrations import migrate
from tests.acceptance.citus.test_single_shard import decide_request
from tests.support.citus import CitusCluster

BYTEWISE = "004_bytewise_keys.sql"


async def collation(conn: asyncpg.Connection, table: str, column: str) -> str:
    return str(
        await conn.fetchval(
            "SELECT attcollation::regcollation::text FROM pg_attribute "
            "WHERE attrelid = $1::regclass AND attname = $2",
            table,
            column,
        )
    )


async def test_bytewise_names_on_a_database_distributed_before(
    citus_cluster: CitusCluster,
) -> None:
    url = await citus_cluster.create_database(f"upgrade_{uuid.uuid4().hex[:8]}")
    await migrate(url, citus=True)
    conn = await asyncpg.connect(url, timeout=30)
    try:
        # As a database distributed by 1.0 was: the names in the database's collation, and
        # migration 004 not applied (its tenant columns are distributed already).
        for table, column in (
            ("fencegate_idempotency_keys", "key"),
            ("fencegate_fences", "entity"),
            ("fencegate_jobs", "kind"),
        ):
            await conn.execute(
                f'ALTER TABLE {table} ALTER COLUMN {column} TYPE text COLLATE "default"'
            )
        await conn.execute("DELETE FROM fencegate_migrations WHERE name = $1", BYTEWISE)
        assert await collation(conn, "fencegate_idempotency_keys", "key") == '"default"'

        assert await migrate(url, citus=True) == [BYTEWISE]

        assert await collation(conn, "fencegate_idempotency_keys", "key") == '"C"'
        assert await collation(conn, "fencegate_fences", "entity") == '"C"'
        assert await collation(conn, "fencegate_jobs", "kind") == '"C"'
        # The distribution column is left as the first migration made it.
        assert await conn.fetchval(
            "SELECT count(*) FROM pg_dist_partition "
            "WHERE logicalrelid = 'fencegate_idempotency_keys'::regclass"
        )
    finally:
        await conn.close()
    store = await open_gateway_store(url)
    try:
        decision = await store.decide(decide_request("t", 1), timeout=20)
        assert decision.outcome is Outcome.RESERVED
    finally:
        await store.close()
