"""A database migrated by any release before 1.0 upgrades in place: built with the first N
pre-1.0 migrations (as they were released, from the repository's history), then migrated by
this release, it has exactly the schema a fresh database gets: tables, types, indexes,
functions and triggers. And the contract holds on it: the protocol conformance suite runs
against upgraded databases (FENCEGATE_TEST_UPGRADE_FROM)."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fencegate.lease import LeaseQueue
from fencegate.store.dburl import StoreKind
from fencegate.store.migrations import BASELINE, migrate
from tests.support import postgres
from tests.support.catalogue import pg_catalogue, sqlite_catalogue
from tests.support.pre_1_0 import build_pre_1_0, history_missing, pre_1_0_migrations
from tests.support.processes import REPO_ROOT, child_env

MISSING = history_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

STAGES = range(1, 10)  # the pre-1.0 migrations: 001 … 013, nine files per store


def same(upgraded: list[str], fresh: list[str]) -> None:
    diff = list(difflib.unified_diff(fresh, upgraded, "fresh 1.0", "upgraded", lineterm=""))
    assert not diff, "\n".join(diff[:80])


def test_there_are_nine_pre_1_0_migrations_per_store() -> None:
    for kind in ("postgresql", "sqlite"):
        names = [name for name, _ in pre_1_0_migrations(kind)]
        assert len(names) == len(STAGES) and names[0] == "001_gateway.sql", names


@pytest.mark.parametrize("stages", STAGES)
async def test_a_postgresql_database_of_any_pre_1_0_release_upgrades_in_place(
    stages: int, pg_server_url: str, pg_url: str
) -> None:
    old = await postgres.create_database(pg_server_url)
    try:
        built = await build_pre_1_0(old, "postgresql", stages=stages)
        applied = await migrate(old)
        assert BASELINE in applied and not set(built) & set(applied)
        assert await migrate(old) == []  # and again is a no-op
        same(await pg_catalogue(old), await pg_catalogue(pg_url))
    finally:
        await postgres.drop_database(pg_server_url, old)


@pytest.mark.parametrize("stages", STAGES)
async def test_a_sqlite_database_of_any_pre_1_0_release_upgrades_in_place(
    stages: int, tmp_path: Path, sqlite_url: str
) -> None:
    old = f"sqlite:///{tmp_path / 'old.db'}"
    await build_pre_1_0(old, "sqlite", stages=stages)
    assert BASELINE in await migrate(old)
    assert await migrate(old) == []
    same(
        sqlite_catalogue(Path(old.removeprefix("sqlite:///"))),
        sqlite_catalogue(Path(sqlite_url.removeprefix("sqlite:///"))),
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_the_protocol_conformance_suite_passes_on_upgraded_databases(kind: StoreKind) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", kind,
         "tests/integration/test_protocol_conformance.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=580, check=False,
        env=child_env({"FENCEGATE_TEST_UPGRADE_FROM": "pre-1.0", **_database_env()}),
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail


def _database_env() -> dict[str, str]:
    url = os.environ.get("FENCEGATE_TEST_DATABASE_URL")
    return {"FENCEGATE_TEST_DATABASE_URL": url} if url else {}


async def test_an_upgraded_and_a_fresh_sqlite_store_hand_out_the_same_first_token(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Rows a migration seeds are schema too (the fencing tokens' counter on SQLite)."""
    old = f"sqlite:///{tmp_path / 'old.db'}"
    await build_pre_1_0(old, "sqlite")
    await migrate(old)
    tokens = []
    for url in (old, sqlite_url):
        async with await LeaseQueue.connect(url) as queue:
            await queue.enqueue("k", {}, idempotency_key="one")
            [lease] = await queue.claim("w", kinds=["k"], limit=1)
            tokens.append(lease.fencing_token)
    assert tokens == [1, 1]
