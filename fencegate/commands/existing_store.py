"""The store an operator command reads or acts on must already exist and be migrated.

Opening a SQLite file creates it, and an empty database answers every query with "no such
table": a command run from the wrong directory would then invent an empty store and print a
driver error. Instead, before the command runs, this names the store that was looked at and
what to do (``--database-url``, ``fencegate migrate``), and creates nothing.
"""

from __future__ import annotations

import asyncio
import sqlite3

import asyncpg

from fencegate.errors import CommandError
from fencegate.store.dburl import DatabaseURL, parse_database_url
from fencegate.store.pg import single_connection
from fencegate.store.queries import Queries
from fencegate.store.schema import SchemaMismatch, check_applied, redacted


def store_name(target: DatabaseURL) -> str:
    """The store as a person should read it in an error: kind, URL without password, file."""
    if target.kind == "sqlite":
        assert target.sqlite_path is not None
        return f"the SQLite store {target.url} ({target.sqlite_path.resolve()})"
    return f"PostgreSQL at {redacted(target.url)}"


def what_to_do(target: DatabaseURL) -> str:
    return (
        "name the gateway's store with --database-url (or FENCEGATE_DATABASE_URL), or create "
        f"it with `fencegate migrate --database-url {redacted(target.url)}`"
    )


def _sqlite_applied(target: DatabaseURL) -> list[str] | None:
    assert target.sqlite_path is not None
    q = Queries("sqlite")
    # mode=ro: a read-only open never creates the file.
    uri = f"{target.sqlite_path.resolve().as_uri()}?mode=ro"
    conn = sqlite3.connect(uri, uri=True)
    try:
        if conn.execute(q.migrations_table).fetchone() is None:
            return None
        return [str(row[0]) for row in conn.execute(q.applied_migrations)]
    finally:
        conn.close()


async def _postgres_applied(target: DatabaseURL, timeout: float) -> list[str] | None:
    q = Queries("postgresql")
    settings = {"search_path": target.schema} if target.schema else None
    async with single_connection(target, timeout=timeout, settings=settings) as conn:
        if not await conn.fetchval(q.migrations_table, timeout=timeout):
            return None
        return [str(r["name"]) for r in await conn.fetch(q.applied_migrations, timeout=timeout)]


def require_existing_store(url: str | None, *, timeout: float) -> None:
    """Raise `CommandError` (one line: which store, what to do) unless the store exists and
    holds the schema this fencegate needs."""
    try:
        target = parse_database_url(url)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    where = store_name(target)
    try:
        if target.kind == "sqlite":
            assert target.sqlite_path is not None
            if not target.sqlite_path.exists():
                raise CommandError(
                    f"there is no store here: {where} does not exist (nothing was created); "
                    f"{what_to_do(target)}"
                )
            applied = _sqlite_applied(target)
        else:
            applied = asyncio.run(asyncio.wait_for(_postgres_applied(target, timeout), timeout))
    except CommandError:
        raise
    except TimeoutError:
        raise CommandError(f"{where} did not answer within {timeout:g}s") from None
    except (OSError, sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise CommandError(f"cannot read {where}: {type(exc).__name__}: {exc}") from None
    try:
        check_applied(applied, target.kind, url)
    except SchemaMismatch as exc:
        if applied is None:
            raise CommandError(f"{where} holds no fencegate schema; {what_to_do(target)}") from None
        raise CommandError(f"{where}: {exc}") from None
