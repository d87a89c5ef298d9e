"""Databases as the releases before 1.0 built them, for the upgrade tests.

The pre-1.0 migrations are read from the repository's history, as they were in the last
commit before 1.0 squashed them into the baseline (their function bodies are not kept in
the tree: each function has one home, ``sql/postgres/functions/``). A database built with
the first N of them is one that an earlier release migrated and that stopped there.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import asyncpg

from fencegate.store.dburl import StoreKind
from fencegate.store.migrations import split_sqlite_statements
from tests.support.processes import REPO_ROOT

# The last commit before 1.0: its sql/<store>/NNN_*.sql are the migrations as released.
LAST_PRE_1_0 = "8b67c41"
FOLDER = {"postgresql": "sql/postgres", "sqlite": "sql/sqlite"}

_BOOKKEEPING = (
    "CREATE TABLE IF NOT EXISTS fencegate_migrations "
    "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True,
        timeout=30,
    ).stdout  # fmt: skip


def history_missing() -> str | None:
    """Why the pre-1.0 files cannot be read (no git, or a checkout without the history)."""
    try:
        _git("cat-file", "-e", f"{LAST_PRE_1_0}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        return f"needs the repository's history (commit {LAST_PRE_1_0}): a git clone"
    return None


def pre_1_0_migrations(kind: StoreKind) -> list[tuple[str, str]]:
    """(name, sql) of every pre-1.0 migration of one store, as released, in order."""
    names = _git("ls-tree", "--name-only", f"{LAST_PRE_1_0}:{FOLDER[kind]}").split()
    wanted = sorted(n for n in names if n[:3].isdigit() and n.endswith(".sql"))
    return [(n, _git("show", f"{LAST_PRE_1_0}:{FOLDER[kind]}/{n}")) for n in wanted]


async def build_pre_1_0(url: str, kind: StoreKind, *, stages: int | None = None) -> list[str]:
    """Apply the first ``stages`` pre-1.0 migrations (all when None) as the old migrator did,
    recording their names; returns them."""
    files = pre_1_0_migrations(kind)[:stages]
    if kind == "sqlite":
        conn = sqlite3.connect(Path(url.removeprefix("sqlite:///")))
        try:
            conn.execute(_BOOKKEEPING)
            for name, sql in files:
                for statement in split_sqlite_statements(sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO fencegate_migrations VALUES (?, datetime('now'))", (name,)
                )
            conn.commit()
        finally:
            conn.close()
        return [name for name, _ in files]
    pg = await asyncpg.connect(url)
    try:
        async with pg.transaction():
            await pg.execute(_BOOKKEEPING)
            for name, sql in files:
                await pg.execute(sql)
                await pg.execute("INSERT INTO fencegate_migrations VALUES ($1, now()::text)", name)
    finally:
        await pg.close()
    return [name for name, _ in files]
