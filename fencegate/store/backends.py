"""The one place a database URL's kind chooses a connection layer: asyncpg's pool for
``postgresql://…``, one thread and one connection for ``sqlite:///…``.

Every store user (the gateway store, the lease queue's drivers, the inspector) opens its
database here (`open_database`, or `open_part` for a part with a class per backend) and runs
its named queries through the layer it gets back, which owns the deadlines and the one error
rule of its backend (`PgDatabase.run`, `SQLiteDatabase.run`). A part's class is chosen by the
layer it is given (`Part.over`); nothing above the drivers asks which backend it has.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import asyncpg

from fencegate.errors import StoreTimedOut, StoreUnavailable
from fencegate.store.dburl import DatabaseURL, parse_database_url, redacted
from fencegate.store.pg import PgDatabase, single_connection
from fencegate.store.queries import Queries
from fencegate.store.sqlite_db import SQLiteDatabase

Database = PgDatabase | SQLiteDatabase

P = TypeVar("P")


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


@dataclass(frozen=True, slots=True)
class Part(Generic[P]):
    """One store user with a class per backend (the gateway store, the lease driver): how it
    is built over each connection layer, and the pool it asks PostgreSQL for."""

    application_name: str
    postgresql: Callable[..., P]  # called with a `PgDatabase` and the part's own options
    sqlite: Callable[..., P]  # called with a `SQLiteDatabase` and the part's own options
    # `PgDatabase.connect` options this part's statements depend on (plans, codecs, ages).
    pg_options: Mapping[str, Any] = field(default_factory=dict)

    def over(self, db: Database, **options: Any) -> P:
        """The part's class for the connection layer ``db``, built on it."""
        build: Mapping[type[Database], Callable[..., P]] = {
            PgDatabase: self.postgresql,
            SQLiteDatabase: self.sqlite,
        }
        return build[type(db)](db, **options)


async def open_part(
    part: Part[P],
    url: str | DatabaseURL | None,
    *,
    timeout: float,
    min_size: int = 1,
    max_size: int = 10,
    require_synchronous_replication: bool = False,
    **options: Any,
) -> P:
    """``part`` over the store a URL names: its connection layer from `open_database` (with
    the part's pool options), its class from `Part.over` (given ``options``)."""
    db = await open_database(
        url,
        application_name=part.application_name,
        timeout=timeout,
        min_size=min_size,
        max_size=max_size,
        require_synchronous_replication=require_synchronous_replication,
        **part.pg_options,
    )
    try:
        return part.over(db, **options)
    except BaseException:
        await db.close()
        raise


def describe_store(target: DatabaseURL) -> str:
    """The store as a person should read it in an error: kind, URL without password, file."""
    if target.kind == "sqlite":
        assert target.sqlite_path is not None
        return f"the SQLite store {target.url} ({target.sqlite_path.resolve()})"
    return f"PostgreSQL at {redacted(target.url)}"


async def applied_migrations_read_only(target: DatabaseURL, *, timeout: float) -> list[str] | None:
    """The migrations a store records (None: no migrations table), read without creating
    anything: `FileNotFoundError` for a SQLite file that does not exist. Any other failure is
    `StoreUnavailable` naming the store (`StoreTimedOut` past ``timeout``): no driver error
    leaves the backend layer."""
    where = describe_store(target)
    try:
        return await asyncio.wait_for(_applied(target, timeout=timeout), timeout)
    except FileNotFoundError:
        raise
    except TimeoutError:
        raise StoreTimedOut(f"{where} did not answer within {timeout:g}s") from None
    except (OSError, sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StoreUnavailable(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc


async def _applied(target: DatabaseURL, *, timeout: float) -> list[str] | None:
    if target.kind == "sqlite":
        return await asyncio.to_thread(_sqlite_applied, target)
    q = Queries("postgresql")
    settings = {"search_path": target.schema} if target.schema else None
    async with single_connection(target, timeout=timeout, settings=settings) as conn:
        if not await conn.fetchval(q.migrations_table, timeout=timeout):
            return None
        return [str(r["name"]) for r in await conn.fetch(q.applied_migrations, timeout=timeout)]


def _sqlite_applied(target: DatabaseURL) -> list[str] | None:
    assert target.sqlite_path is not None
    if not target.sqlite_path.exists():
        raise FileNotFoundError(target.sqlite_path)
    q = Queries("sqlite")
    # mode=ro: a read-only open never creates the file.
    conn = sqlite3.connect(f"{target.sqlite_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        if conn.execute(q.migrations_table).fetchone() is None:
            return None
        return [str(row[0]) for row in conn.execute(q.applied_migrations)]
    finally:
        conn.close()
