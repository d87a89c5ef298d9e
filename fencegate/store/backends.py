"""The one place a database URL's kind chooses a connection layer: asyncpg's pool for
``postgresql://…``, one thread and one connection for ``sqlite:///…``.

Every store user (the gateway store, the lease queue's drivers, the inspector) opens its
database here and runs its named queries through the layer it gets back, which owns the
deadlines and the one error rule of its backend (`PgDatabase.run`, `SQLiteDatabase.run`).
Nothing above the drivers asks which backend it has.
"""

from __future__ import annotations

from typing import Any, Protocol

from fencegate.store.dburl import DatabaseURL, parse_database_url
from fencegate.store.pg import PgDatabase
from fencegate.store.sqlite_db import SQLiteDatabase

Database = PgDatabase | SQLiteDatabase


class NamedQueries(Protocol):
    """What a part that only runs named queries needs of a connection layer (both have it)."""

    async def fetch(self, sql: str, args: Any, *, timeout: float) -> list[dict[str, Any]]: ...

    async def execute(self, sql: str, args: Any, *, timeout: float) -> int: ...

    async def close(self) -> None: ...


async def open_database(
    url: str | DatabaseURL | None,
    *,
    application_name: str,
    timeout: float,
    min_size: int = 1,
    max_size: int = 10,
    **pg_options: Any,
) -> Database:
    """The connection layer for the store a URL names (no URL: SQLite ``./fencegate.db``).
    Pool sizes and ``pg_options`` (see `PgDatabase.connect`) apply to PostgreSQL; a SQLite
    store is one connection on one thread."""
    target = url if isinstance(url, DatabaseURL) else parse_database_url(url)
    if target.kind == "postgresql":
        return await PgDatabase.connect(
            target,
            application_name=application_name,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            **pg_options,
        )
    assert target.sqlite_path is not None
    return SQLiteDatabase(target.sqlite_path)
