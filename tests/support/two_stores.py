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


def migrated_pair(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[str, str]]:
    """For a module-scoped fixture: (PostgreSQL URL, SQLite URL), both migrated; the
    PostgreSQL database is dropped afterwards."""
    server = postgres.server_url()
    pg_url = asyncio.run(postgres.create_database(server))
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp(name) / 'fencegate.db'}"
    asyncio.run(migrate(pg_url))
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
