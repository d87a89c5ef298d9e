"""Apply the SQL files under `sql/<store>/` in name order, each once.

Files are named ``NNN_what.sql``. Applied names are recorded in ``fencegate_migrations``;
running `migrate` again is a no-op, and concurrent runs are serialised (an advisory lock on
PostgreSQL, the write lock on SQLite).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Literal

import asyncpg

from fencegate.store.dburl import parse_database_url
from fencegate.store.pg import single_connection
from fencegate.store.sqlfiles import store_folder
from fencegate.store.sqlite_db import SQLiteDatabase, write_transaction

_ADVISORY_LOCK_ID = 0x46454E43  # "FENC"

_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS fencegate_migrations (
    name TEXT PRIMARY KEY,
    applied_at TEXT NOT NULL
)
"""


# A migration is ``NNN_what.sql``; anything else in the folder (``schema.sql``, the current
# schema to read) is not one.
MIGRATION_NAME = re.compile(r"[0-9]{3}_[a-z0-9_]+\.sql")


def migration_files(kind: Literal["postgresql", "sqlite"]) -> list[tuple[str, str]]:
    """(name, sql) for every migration of one store, in order."""
    folder = store_folder(kind)
    files = sorted(
        (entry.name, entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if MIGRATION_NAME.fullmatch(entry.name)
    )
    return files


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


async def migrate_postgres(conn: asyncpg.Connection, *, schema: str | None = None) -> list[str]:
    """Apply pending migrations on ``conn``; with ``schema``, in that schema (created if
    needed), which the stores then put on their connections' search path."""
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
        for name, sql in migration_files("postgresql"):
            if name in done:
                continue
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO fencegate_migrations (name, applied_at) VALUES ($1, now()::text)",
                name,
            )
            applied.append(name)
    return applied


def migrate_sqlite_sync(conn: sqlite3.Connection) -> list[str]:
    applied: list[str] = []
    with write_transaction(conn):
        conn.execute(_MIGRATIONS_TABLE)
        done = {r[0] for r in conn.execute("SELECT name FROM fencegate_migrations")}
        for name, sql in migration_files("sqlite"):
            if name in done:
                continue
            for statement in split_sqlite_statements(sql):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO fencegate_migrations (name, applied_at) VALUES (?, datetime('now'))",
                (name,),
            )
            applied.append(name)
    return applied


async def migrate(database_url: str | None, *, timeout: float = 60.0) -> list[str]:
    """Apply pending migrations to the store a URL names; returns the names applied."""
    target = parse_database_url(database_url)
    if target.kind == "postgresql":
        # One connection outside any pool, as the connection layer opens it for a command:
        # `timeout` bounds the connect and the close, not the migrations themselves.
        async with single_connection(target, timeout=timeout) as conn:
            return await migrate_postgres(conn, schema=target.schema)
    assert target.sqlite_path is not None
    db = SQLiteDatabase(target.sqlite_path)
    try:
        return await db.run(migrate_sqlite_sync, timeout=timeout)
    finally:
        await db.close()
