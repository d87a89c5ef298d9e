"""`fencegate migrate --citus` requires a Citus coordinator: on a PostgreSQL without the
extension, or on SQLite, it says so in one line and changes nothing; without the flag the
same migrations run as always (the Citus tier, tests/acceptance/citus, runs it on Citus)."""

from __future__ import annotations

import subprocess
import sys

import asyncpg

from tests.support.processes import child_env


def migrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "migrate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({}),
    )


async def test_citus_is_required_only_when_asked(empty_pg_url: str, tmp_path: object) -> None:
    refused = migrate("--citus", "--database-url", empty_pg_url)
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "--citus: this database has no Citus extension" in line
    conn = await asyncpg.connect(empty_pg_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('fencegate_migrations')") is None
    finally:
        await conn.close()
    sqlite = migrate("--citus", "--database-url", f"sqlite:///{tmp_path}/f.db")
    assert sqlite.returncode != 0
    assert "Citus distributes PostgreSQL, not a SQLite store" in sqlite.stderr
    plain = migrate("--database-url", empty_pg_url)
    assert plain.returncode == 0, plain.stderr
    conn = await asyncpg.connect(empty_pg_url)
    try:
        assert await conn.fetchval(
            "SELECT count(*) FROM fencegate_migrations WHERE name = '003_tenant_keys.sql'"
        )
    finally:
        await conn.close()
