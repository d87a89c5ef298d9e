"""Apply the SQL files under `sql/<store>/`: versioned migrations once each, in name order,
then (PostgreSQL) each function whose text changed.

- Versioned migrations are named ``NNN_what.sql``; ``001_baseline.sql`` is the 1.0 schema.
  A database made before 1.0 (its `fencegate_migrations` names files of ``legacy/``) gets the
  legacy files it lacks instead of the baseline, and then counts as at the baseline.
- Functions (``functions/NAME.sql``, one function each, with the trigger that calls it) are
  repeatable migrations, as Flyway has them: applied after the versioned ones whenever their
  text changes, so a change to a function is one edit of one file. Each is recorded in
  `fencegate_migrations` as ``functions/NAME.sql@<sha256 prefix>``, so the schema check at
  start-up sees an outdated function like a missing migration.

Running `migrate` again is a no-op, and concurrent runs are serialised (an advisory lock on
PostgreSQL, the write lock on SQLite).

On a Citus coordinator (the ``citus`` extension installed, or ``citus=True``), the gateway's
tables and functions are then distributed by tenant (``citus/distribute.sql``, idempotent,
run every time: a function replaced since is distributed again); the lease queue stays on
the coordinator. The same migrations run everywhere.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from importlib.resources.abc import Traversable
from typing import Literal

import asyncpg

from fencegate.errors import FencegateError
from fencegate.store.dburl import parse_database_url
from fencegate.store.pg import CITUS_INSTALLED, single_connection
from fencegate.store.sqlfiles import store_folder
from fencegate.store.sqlite_db import SQLiteDatabase, write_transaction

_ADVISORY_LOCK_ID = 0x46454E43  # "FENC"

_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS fencegate_migrations (
    name TEXT PRIMARY KEY,
    applied_at TEXT NOT NULL
)
"""


# A migration is ``NNN_what.sql``; anything else in the folder (``queries/``, ``functions/``,
# ``legacy/``) is not one.
MIGRATION_NAME = re.compile(r"[0-9]{3}_[a-z0-9_]+\.sql")


BASELINE = "001_baseline.sql"
FUNCTIONS = "functions"
LEGACY = "legacy"
CITUS_DISTRIBUTE = "citus/distribute.sql"


class CitusMissing(FencegateError, ValueError):
    """``citus=True`` on a database without the Citus extension."""


def _sql_files(folder: Traversable) -> list[tuple[str, str]]:
    if not folder.is_dir():
        return []
    return sorted(
        (entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if MIGRATION_NAME.fullmatch(entry.name)
    )


def migration_files(kind: Literal["postgresql", "sqlite"]) -> list[tuple[str, str]]:
    """(name, sql) for every versioned migration of one store, in order."""
    return _sql_files(store_folder(kind))


def legacy_files(kind: Literal["postgresql", "sqlite"]) -> list[tuple[str, str]]:
    """(name, sql) of the pre-1.0 migrations that bring an old database to the baseline."""
    return _sql_files(store_folder(kind) / LEGACY)


def function_files(kind: Literal["postgresql", "sqlite"]) -> list[tuple[str, str]]:
    """(recorded name, sql) of every function file: ``functions/NAME.sql@<sha256 prefix>``."""
    folder = store_folder(kind) / FUNCTIONS
    if not folder.is_dir():
        return []
    files = sorted(
        (entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    )
    return [(function_record(name, sql), sql) for name, sql in files]


def function_record(file_name: str, sql: str) -> str:
    digest = hashlib.sha256(sql.encode()).hexdigest()[:16]
    return f"{FUNCTIONS}/{file_name}@{digest}"


def pending(kind: Literal["postgresql", "sqlite"], done: set[str]) -> list[tuple[str, str | None]]:
    """The versioned migrations a database with ``done`` applied still needs, in order; a
    None body is only recorded (the baseline, once the legacy files have built it)."""
    steps: list[tuple[str, str | None]] = []
    legacy = legacy_files(kind)
    if BASELINE not in done and done & {name for name, _ in legacy}:
        steps = [(name, sql) for name, sql in legacy if name not in done]
        steps.append((BASELINE, None))
        done = done | {BASELINE}
    steps += [(name, sql) for name, sql in migration_files(kind) if name not in done]
    return steps


def split_sqlite_statements(script: str) -> list[str]:
    """Split a script into complete statements (trigger bodies contain semicolons)."""
    statements: list[str] = []
    current = ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip():
                statements.append(current.strip())
            current = ""
    if current.strip() and not all(
        ln.strip().startswith("--") or not ln.strip() for ln in current.splitlines()
    ):
        raise ValueError(f"incomplete SQL statement at end of migration: {current[:80]!r}")
    return statements


async def migrate_postgres(
    conn: asyncpg.Connection, *, schema: str | None = None, citus: bool | None = None
) -> list[str]:
    """Apply pending migrations on ``conn``; with ``schema``, in that schema (created if
    needed), which the stores then put on their connections' search path. ``citus``: True
    requires a Citus coordinator and distributes the gateway's tables, None does so where
    the extension is installed, False never."""
    installed = bool(await conn.fetchval(CITUS_INSTALLED))
    if citus and not installed:
        raise CitusMissing(
            "--citus: this database has no Citus extension (run CREATE EXTENSION citus on "
            "the coordinator and each worker, and add the workers, first)"
        )
    applied = await _migrate_postgres(conn, schema=schema)
    if installed and citus is not False:
        await distribute_on_citus(conn, schema=schema)
    return applied


async def distribute_on_citus(conn: asyncpg.Connection, *, schema: str | None = None) -> None:
    """``citus/distribute.sql``: the gateway's tables and functions distributed by tenant."""
    sql = store_folder("postgresql").joinpath(CITUS_DISTRIBUTE).read_text(encoding="utf-8")
    async with conn.transaction():
        if schema is not None:
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _ADVISORY_LOCK_ID)
        # Distributing functions after tables in one transaction needs one connection per
        # node throughout.
        await conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        await conn.execute(sql)


async def _migrate_postgres(conn: asyncpg.Connection, *, schema: str | None) -> list[str]:
    applied: list[str] = []
    async with conn.transaction():
        if schema is not None:
            # The name was checked against [a-z_][a-z0-9_]* when the URL was parsed. SET
            # LOCAL: behind a transaction pooler the server connection is shared afterwards.
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _ADVISORY_LOCK_ID)
        await conn.execute(_MIGRATIONS_TABLE)
        done = {r["name"] for r in await conn.fetch("SELECT name FROM fencegate_migrations")}
        for name, sql in pending("postgresql", done):
            if sql is not None:
                await conn.execute(sql)
            await _record(conn, name)
            applied.append(name)
        for record, sql in function_files("postgresql"):
            if record in done:
                continue
            await _apply_function(conn, record, sql)
            await conn.execute(
                "DELETE FROM fencegate_migrations WHERE name LIKE $1",
                record.split("@", 1)[0] + "@%",
            )
            await _record(conn, record)
            applied.append(record)
    return applied


async def _record(conn: asyncpg.Connection, name: str) -> None:
    await conn.execute(
        "INSERT INTO fencegate_migrations (name, applied_at) VALUES ($1, now()::text)", name
    )


async def _apply_function(conn: asyncpg.Connection, record: str, sql: str) -> None:
    """``CREATE OR REPLACE`` the file's function; one whose result or parameters changed
    cannot be replaced, so the old one is dropped first (nothing depends on it but the
    trigger its own file creates again)."""
    try:
        async with conn.transaction():  # a savepoint: the failed attempt leaves nothing
            await conn.execute(sql)
        return
    except asyncpg.InvalidFunctionDefinitionError:
        pass
    function = record.split("/", 1)[1].split("@", 1)[0].removesuffix(".sql")
    olds = await conn.fetch(
        "SELECT p.oid::regprocedure::text AS signature FROM pg_proc p "
        "WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace",
        function,
    )
    for old in olds:
        await conn.execute(f"DROP FUNCTION {old['signature']}")
    await conn.execute(sql)


def migrate_sqlite_sync(conn: sqlite3.Connection) -> list[str]:
    applied: list[str] = []
    with write_transaction(conn):
        conn.execute(_MIGRATIONS_TABLE)
        done = {r[0] for r in conn.execute("SELECT name FROM fencegate_migrations")}
        for name, sql in pending("sqlite", done):
            for statement in split_sqlite_statements(sql or ""):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO fencegate_migrations (name, applied_at) VALUES (?, datetime('now'))",
                (name,),
            )
            applied.append(name)
    return applied


async def migrate(
    database_url: str | None, *, timeout: float = 60.0, citus: bool | None = None
) -> list[str]:
    """Apply pending migrations to the store a URL names; returns the names applied.
    ``citus``: see `migrate_postgres` (True on SQLite is an error)."""
    target = parse_database_url(database_url)
    if target.kind == "postgresql":
        # One connection outside any pool, as the connection layer opens it for a command:
        # `timeout` bounds the connect and the close, not the migrations themselves.
        async with single_connection(target, timeout=timeout) as conn:
            return await migrate_postgres(conn, schema=target.schema, citus=citus)
    if citus:
        raise CitusMissing("--citus: Citus distributes PostgreSQL, not a SQLite store")
    assert target.sqlite_path is not None
    db = SQLiteDatabase(target.sqlite_path)
    try:
        return await db.run(migrate_sqlite_sync, timeout=timeout)
    finally:
        await db.close()
