"""Fixtures shared by every tier: real PostgreSQL and real SQLite, one fresh database per
test, and a lease queue on it. Each test is also marked with its tier (its directory)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fencegate.lease import LeaseQueue
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.store.migrations import migrate
from tests.support import postgres
from tests.support.pre_1_0 import build_pre_1_0

# The run must leave the working tree as it found it (tracked files, untracked files); the
# run's folder holds the private PostgreSQL cluster every xdist worker shares; how the tests
# are spread over xdist's workers.
pytest_plugins = ["tests.support.clean_tree", "tests.support.run_folder", "tests.support.parallel"]


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    return postgres.server_url()


# Set (to "pre-1.0") by tests/integration/test_upgrade.py: every store a test gets was first
# built by the migrations of the releases before 1.0, then upgraded by this one.
UPGRADE_FROM = os.environ.get("FENCEGATE_TEST_UPGRADE_FROM")


@pytest.fixture
async def pg_url(pg_server_url: str) -> AsyncIterator[str]:
    """A new, migrated PostgreSQL database for one test (a copy of the run's template, or,
    in an upgrade run, one the pre-1.0 migrations built and this release upgraded)."""
    if UPGRADE_FROM:
        url = await postgres.create_database(pg_server_url)
        await build_pre_1_0(url, "postgresql")
        await migrate(url)
    else:
        url = await postgres.create_migrated_database(pg_server_url)
    try:
        yield url
    finally:
        await postgres.drop_database(pg_server_url, url)


@pytest.fixture
async def empty_pg_url(pg_server_url: str) -> AsyncIterator[str]:
    """A new PostgreSQL database nobody migrated."""
    url = await postgres.create_database(pg_server_url)
    try:
        yield url
    finally:
        await postgres.drop_database(pg_server_url, url)


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> str:
    """A new, migrated SQLite file for one test."""
    url = f"sqlite:///{tmp_path / 'fencegate.db'}"
    if UPGRADE_FROM:
        await build_pre_1_0(url, "sqlite")
    await migrate(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(store_kind: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """The same test once on SQLite and once on PostgreSQL."""
    fixture = "sqlite_url" if store_kind == "sqlite" else "pg_url"
    yield request.getfixturevalue(fixture)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[GatewayStore]:
    """The gateway's store on a fresh database, once per store kind."""
    gateway_store = await open_gateway_store(store_url, run_migrations=False)
    try:
        yield gateway_store
    finally:
        await gateway_store.close()


@pytest.fixture
async def queue(store_url: str) -> AsyncIterator[LeaseQueue]:
    """A queue on a fresh migrated store: the test's own view, beside any worker's."""
    q = await LeaseQueue.connect(store_url, timeout=10)
    try:
        yield q
    finally:
        await q.close()


TIERS = ("unit", "integration", "acceptance")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, read from its directory under tests/."""
    root = Path(__file__).parent
    for item in items:
        try:
            tier = item.path.relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if root / "acceptance" / "topology" in item.path.parents:
            item.add_marker(pytest.mark.topology)
        if root / "acceptance" / "citus" in item.path.parents:
            item.add_marker(pytest.mark.citus)
