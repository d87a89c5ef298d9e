"""Store trouble through `fencegate serve` processes: a database nobody migrated, a schema
that changed under a running gateway, a table or a whole database dropped. Never a 500 for a
store fault and never a traceback to the client: 503 ``store-unavailable``, and ``/healthz``
says 503. (A bug in fencegate's own code is a 500: tests/integration/test_internal_errors.py.)"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from fencegate.store import GatewayStore, StoreUnavailable
from fencegate.store.migrations import migrate
from tests.support.gateway import GatewayProcess
from tests.support.processes import child_env
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until_sync

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`fencegate serve` that is expected to refuse to start (bounded by a timeout)."""
    return subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "serve", "--upstream", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=child_env(),
    )


def test_serve_refuses_a_postgres_database_nobody_migrated(
    empty_pg_url: str, tmp_path: Path
) -> None:
    refused = serve("--database-url", empty_pg_url, "--port", "0", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    [line] = [ln for ln in refused.stderr.splitlines() if ln.startswith("fencegate serve: error:")]
    assert "no fencegate schema" in line
    assert "Traceback" not in refused.stderr
    assert f"fencegate migrate --database-url {empty_pg_url}" in line


def test_serve_refuses_an_sqlite_file_it_may_not_migrate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    refused = serve("--database-url", url, "--no-migrate", "--port", "0", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "fencegate migrate --database-url" in refused.stderr


@pytest.mark.parametrize(
    ("forget", "said"),
    [
        ("001_baseline.sql", "lacks 001_baseline.sql"),
        # A function whose text changed since the database was migrated (an older release's).
        ("functions/fencegate_step.sql@%", "functions (fencegate_step.sql) are not this release's"),
    ],
)
def test_serve_refuses_a_schema_one_migration_behind(
    empty_pg_url: str, tmp_path: Path, forget: str, said: str
) -> None:
    async def behind() -> None:
        await migrate(empty_pg_url)
        conn = await asyncpg.connect(empty_pg_url)
        try:
            await conn.execute("DELETE FROM fencegate_migrations WHERE name LIKE $1", forget)
        finally:
            await conn.close()

    asyncio.run(behind())
    refused = serve("--database-url", empty_pg_url, "--port", "0", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert said in refused.stderr
    assert "fencegate migrate" in refused.stderr


def test_serve_with_migrate_starts_on_an_empty_database(
    empty_pg_url: str, upstream: UpstreamProcess
) -> None:
    with GatewayProcess(
        upstream=upstream.url, database_url=empty_pg_url, extra_args=["--migrate"]
    ) as gateway:
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200


def wait_for_status(url: str, status: int, *, timeout: float) -> httpx.Response:
    def answered() -> httpx.Response | None:
        answer = httpx.get(url, timeout=10)
        return answer if answer.status_code == status else None

    found = wait_until_sync(answered, timeout=timeout, what=f"{status} from {url}", interval=0.1)
    assert found is not None
    return found


def keyed_post(base: str) -> httpx.Response:
    return httpx.post(
        base + "/charges",
        content=b"{}",
        headers={
            "Idempotency-Key": f"k-{uuid.uuid4().hex}",
            "X-Execution-Fence": "1",
            "X-Execution-Entity": "order:1",
        },
        timeout=30,
    )


def assert_store_unavailable(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/store-unavailable")
    assert "Traceback" not in answer.text


def test_healthz_is_503_once_the_schema_is_not_the_one_needed(
    pg_url: str, upstream: UpstreamProcess
) -> None:
    with GatewayProcess(upstream=upstream.url, database_url=pg_url) as gateway:
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200

        async def roll_back() -> None:
            conn = await asyncpg.connect(pg_url)
            try:
                await conn.execute("DELETE FROM fencegate_migrations WHERE name LIKE 'functions/%'")
            finally:
                await conn.close()

        asyncio.run(roll_back())
        sick = wait_for_status(gateway.url + "/healthz", 503, timeout=15)
        assert "fencegate migrate" in sick.json()["detail"]


def test_a_dropped_table_is_503_on_both_stores(
    store_url: str, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    with GatewayProcess(upstream=upstream.url, database_url=store_url, workdir=tmp_path) as gw:
        assert keyed_post(gw.url).status_code == 200
        drop = "DROP TABLE fencegate_idempotency_keys"
        if store_url.startswith("sqlite"):
            with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
                conn.execute(drop)
        else:
            asyncio.run(_execute(store_url, drop + " CASCADE"))
        before = upstream.stats()["requests"]
        for _ in range(3):
            assert_store_unavailable(keyed_post(gw.url))
        assert upstream.stats()["requests"] == before
        assert "Traceback" not in gw.log_text()


async def _execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def test_a_database_dropped_under_a_running_gateway_is_503(
    empty_pg_url: str, pg_server_url: str, upstream: UpstreamProcess
) -> None:
    asyncio.run(migrate(empty_pg_url))
    with GatewayProcess(upstream=upstream.url, database_url=empty_pg_url) as gateway:
        assert keyed_post(gateway.url).status_code == 200
        name = empty_pg_url.rsplit("/", 1)[1]
        asyncio.run(_execute(pg_server_url, f'DROP DATABASE "{name}" WITH (FORCE)'))
        before = upstream.stats()["requests"]
        for _ in range(3):
            assert_store_unavailable(keyed_post(gateway.url))
        assert upstream.stats()["requests"] == before
        wait_for_status(gateway.url + "/healthz", 503, timeout=15)
        # The pool's attempts to reconnect are one line each, not asyncpg's 20-line traceback
        # every few seconds.
        wait_until_sync(
            lambda: "asyncpg.pool" in gateway.log_text(),
            timeout=30,
            what="the pool to report the dropped database",
        )
        text = gateway.log_text()
        assert "Traceback" not in text
        [pool_line, *_] = [line for line in text.splitlines() if "asyncpg.pool" in line]
        assert "does not exist" in pool_line


# What each driver raises when the store cannot answer (asyncpg's protocol error seen while
# recording an answer under load included), and what a bug in our own code raises.
STORE_FAULTS: dict[str, list[Exception]] = {
    "postgresql": [
        asyncpg.InternalClientError("cannot switch to state 12; another operation is in progress"),
        asyncpg.UndefinedTableError('relation "idempotency_keys" does not exist'),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
    "sqlite": [
        sqlite3.OperationalError("database is locked"),
        sqlite3.OperationalError("no such table: fencegate_idempotency_keys"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
}
BUGS = [KeyError("fingerprint"), RuntimeError("cannot schedule new futures"), ValueError("x")]


def _raising(error: Exception) -> Any:
    def fail(conn: object) -> Any:
        raise error

    return fail


async def test_every_store_fault_at_the_boundary_is_store_unavailable(
    store: GatewayStore,
) -> None:
    """Whatever the driver raises when the store cannot answer reads as the store failing."""
    for error in STORE_FAULTS[store.kind]:
        with pytest.raises(StoreUnavailable) as raised:
            await store._db.run(_raising(error), timeout=5)  # type: ignore[attr-defined]
        assert type(error).__name__ in str(raised.value)


async def test_a_bug_at_the_store_boundary_is_not_store_unavailable(store: GatewayStore) -> None:
    """A fault of our own code is not dressed as an outage: it propagates as it is."""
    for error in BUGS:
        with pytest.raises(type(error)) as raised:
            await store._db.run(_raising(error), timeout=5)  # type: ignore[attr-defined]
        assert raised.value is error


class GatewayOnSmallDisk(GatewayProcess):
    """`fencegate serve` whose SQLite file lies on a tmpfs of ``size`` mounted in a mount
    namespace of its own (gone with the process): its disk fills up for real."""

    def __init__(self, *, disk: Path, size: str, **kwargs: Any) -> None:
        super().__init__(database_url=f"sqlite:///{disk}/fencegate.db", **kwargs)
        self.disk = disk
        self.size = size

    def command(self) -> list[str]:
        mount = f'mount -t tmpfs -o size={self.size} tmpfs "$0" && exec "$@"'
        namespace = ["unshare", "--mount", "--propagation", "private"]
        return [*namespace, "sh", "-c", mount, str(self.disk), *super().command()]


def test_healthz_is_503_while_a_full_disk_refuses_every_keyed_request(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    with GatewayOnSmallDisk(disk=disk, size="2m", upstream=upstream.url) as gateway:
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200
        refused = None
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for n in range(400):  # 50 kB answers, stored: the 2 MB disk fills long before
                answer = client.post(
                    "/charges?size=50000", headers={"Idempotency-Key": f"fill-{n}"}, json={}
                )
                if answer.status_code == 503:
                    refused = answer
                    break
                assert answer.status_code == 200, answer.text
            assert refused is not None, "the disk never filled"
            assert refused.json()["type"].endswith("/store-unavailable")
            # Every keyed request now fails; the health check must say so, not 200.
            again = client.post("/charges", headers={"Idempotency-Key": "after"}, json={})
            assert again.status_code == 503
            sick = wait_for_status(gateway.url + "/healthz", 503, timeout=15)
    assert "the store refused the latest decision" in sick.json()["detail"]
