"""What the differential tests share: a migrated PostgreSQL database and SQLite file side by
side, and running the same change on both (clearing them, or moving the clock forward by
shifting every stored time back)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fencegate.store.migrations import migrate
from tests.support import postgres

# The gateway's tables, and moving their clock forward (every stored time shifted back).
GATEWAY_TABLES = (
    "fencegate_idempotency_keys",
    "fencegate_fences",
    "fencegate_decisions",
    "fencegate_gateways",
)
GATEWAY_PG_SHIFT = [
    "UPDATE fencegate_idempotency_keys SET locked_until = locked_until - $1::interval,"
    " reserved_at = reserved_at - $1::interval, created_at = created_at - $1::interval,"
    " completed_at = completed_at - $1::interval, expires_at = expires_at - $1::interval",
    "UPDATE fencegate_fences SET updated_at = updated_at - $1::interval",
    "UPDATE fencegate_decisions SET at = at - $1::interval, expires_at = expires_at - $1::interval",
]
GATEWAY_SQLITE_SHIFT = [
    "UPDATE fencegate_idempotency_keys SET locked_until = locked_until - ?,"
    " reserved_at = reserved_at - ?, created_at = created_at - ?,"
    " completed_at = completed_at - ?, expires_at = expires_at - ?",
    "UPDATE fencegate_fences SET updated_at = updated_at - ?",
    "UPDATE fencegate_decisions SET at = at - ?, expires_at = expires_at - ?",
]
# The lease queue's tables emptied (ids and tokens from 1 again), and its clock moved.
LEASE_PG_CLEAR = [
    "TRUNCATE fencegate_job_stages, fencegate_job_attempts, fencegate_job_keys, fencegate_jobs"
    " RESTART IDENTITY",
    "TRUNCATE fencegate_work_classes, fencegate_rate_limits",
    "ALTER SEQUENCE fencegate_fencing_tokens RESTART",
]
LEASE_SQLITE_CLEAR = [
    "DELETE FROM fencegate_job_stages",
    "DELETE FROM fencegate_job_attempts",
    "DELETE FROM fencegate_jobs",
    "DELETE FROM fencegate_work_classes",
    "DELETE FROM fencegate_rate_limits",
    "DELETE FROM sqlite_sequence WHERE name = 'fencegate_jobs'",
    "UPDATE fencegate_sequences SET value = 0 WHERE name = 'fencing_token'",
]
LEASE_PG_SHIFT = [
    "UPDATE fencegate_jobs SET lease_until = lease_until - $1::interval,"
    " heartbeat_at = heartbeat_at - $1::interval, run_after = run_after - $1::interval,"
    " created_at = created_at - $1::interval, updated_at = updated_at - $1::interval",
    "UPDATE fencegate_job_attempts SET claimed_at = claimed_at - $1::interval,"
    " ended_at = ended_at - $1::interval",
    "UPDATE fencegate_job_stages SET committed_at = committed_at - $1::interval",
]
LEASE_SQLITE_SHIFT = [
    "UPDATE fencegate_jobs SET lease_until = lease_until - ?, heartbeat_at = heartbeat_at - ?,"
    " run_after = run_after - ?, created_at = created_at - ?, updated_at = updated_at - ?",
    "UPDATE fencegate_job_attempts SET claimed_at = claimed_at - ?, ended_at = ended_at - ?",
    "UPDATE fencegate_job_stages SET committed_at = committed_at - ?",
]


def migrated_pair(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[str, str]]:
    """For a module-scoped fixture: (PostgreSQL URL, SQLite URL), both migrated; the
    PostgreSQL database is dropped afterwards."""
    server = postgres.server_url()
    pg_url = asyncio.run(postgres.create_migrated_database(server))
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp(name) / 'fencegate.db'}"
    asyncio.run(migrate(sqlite_url))
    try:
        yield pg_url, sqlite_url
    finally:
        asyncio.run(postgres.drop_database(server, pg_url))


async def run_on_both(
    pg_url: str,
    sqlite_url: str,
    pg_statements: Sequence[str],
    sqlite_statements: Sequence[str],
    *,
    seconds: float | None = None,
) -> None:
    """The statements on each store, in one connection each. With ``seconds``, each
    statement's parameters are that many seconds (an interval on PostgreSQL, as many times as
    SQLite's statement has ``?``)."""
    conn = await asyncpg.connect(pg_url)
    try:
        for sql in pg_statements:
            if seconds is None:
                await conn.execute(sql)
            else:
                await conn.execute(sql, timedelta(seconds=seconds))
    finally:
        await conn.close()
    with sqlite3.connect(Path(sqlite_url.removeprefix("sqlite:///"))) as db:
        for sql in sqlite_statements:
            db.execute(sql, () if seconds is None else (seconds,) * sql.count("?"))


async def rows_on_both(
    pg_url: str, sqlite_url: str, pg_sql: str, sqlite_sql: str
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """One read on each store, as (SQLite rows, PostgreSQL rows) of plain tuples."""
    conn = await asyncpg.connect(pg_url)
    try:
        pg_rows = [tuple(row) for row in await conn.fetch(pg_sql)]
    finally:
        await conn.close()
    with sqlite3.connect(Path(sqlite_url.removeprefix("sqlite:///"))) as db:
        lite_rows = [tuple(row) for row in db.execute(sqlite_sql)]
    return lite_rows, pg_rows
