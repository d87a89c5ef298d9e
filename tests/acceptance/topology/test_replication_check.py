"""The gateway and the workers check what they stand on: a primary with a streaming standby
that is asynchronous gets one warning line naming the risk and the fix, or with
``--require-synchronous-replication`` a refusal; a synchronous standby gets neither. The check
runs again on every new connection (after a failure or a failover)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from starlette.applications import Starlette

from fencegate import FencegateMiddleware
from fencegate.errors import StoreUnavailable
from fencegate.lease import LeaseQueue
from fencegate.store.migrations import migrate
from fencegate.store.replication import ReplicationNotSynchronous
from tests.integration.test_middleware_schema import start, stop
from tests.support import postgres
from tests.support.gateway import GatewayProcess
from tests.support.processes import child_env
from tests.support.tiers import needs
from tests.support.topology import PrimaryWithStandby, missing
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

RISK = "replicates asynchronously"
FIX = "synchronous_mode: true"


@pytest.fixture(scope="module")
def replicas() -> Iterator[PrimaryWithStandby]:
    reason = missing("initdb", "pg_basebackup")
    needs(reason, "topology")
    cluster = PrimaryWithStandby()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


async def set_synchronous(primary_url: str, on: bool) -> None:
    """Name the standby in synchronous_standby_names (or not) and wait until it is so."""
    conn = await asyncpg.connect(primary_url)
    try:
        names = "standby1" if on else ""
        await conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        await conn.execute("SELECT pg_reload_conf()")
        wanted = "sync" if on else "async"

        async def settled() -> bool:
            states = await conn.fetch("SELECT sync_state FROM pg_stat_replication")
            return [r["sync_state"] for r in states] == [wanted]

        await wait_until(settled, timeout=30, what=f"the standby to become {wanted}")
    finally:
        await conn.close()


@pytest.fixture
async def database(replicas: PrimaryWithStandby) -> AsyncIterator[str]:
    url = await postgres.create_database(replicas.primary.url)
    await migrate(url)
    try:
        yield url
    finally:
        await postgres.drop_database(replicas.primary.url, url)


def serve_refusal(database_url: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Start `fencegate serve` expecting it to refuse: its stderr."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--database-url",
            database_url,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(env),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr


async def test_an_asynchronous_standby_is_one_warning_line_and_the_flag_refuses(
    replicas: PrimaryWithStandby, database: str
) -> None:
    await set_synchronous(replicas.primary.url, False)
    with (
        UpstreamProcess() as upstream,
        GatewayProcess(upstream=upstream.url, database_url=database) as gateway,
    ):
        log = gateway.log_text()
    warnings = [line for line in log.splitlines() if RISK in line]
    assert len(warnings) == 1, log
    assert FIX in warnings[0] and "twice" in warnings[0]

    refused = serve_refusal(database, "--require-synchronous-replication")
    errors = [line for line in refused.splitlines() if "error:" in line]
    assert len(errors) == 1 and RISK in errors[0] and FIX in errors[0], refused
    by_env = serve_refusal(database, env={"FENCEGATE_REQUIRE_SYNCHRONOUS_REPLICATION": "true"})
    assert RISK in by_env

    with pytest.raises(ReplicationNotSynchronous):
        await LeaseQueue.connect(database, timeout=10, require_synchronous_replication=True)

    # The middleware refuses its service's start the same way (one line), and otherwise warns.
    service = Starlette()
    service.add_middleware(
        FencegateMiddleware, database_url=database, require_synchronous_replication=True
    )
    reply, inbox, task = await start(service)
    assert reply["type"] == "lifespan.startup.failed"
    assert RISK in reply["message"] and "\n" not in reply["message"]
    await stop(inbox, task)


async def test_a_synchronous_standby_is_silent_and_accepted(
    replicas: PrimaryWithStandby, database: str
) -> None:
    await set_synchronous(replicas.primary.url, True)
    with (
        UpstreamProcess() as upstream,
        GatewayProcess(
            upstream=upstream.url,
            database_url=database,
            extra_args=["--require-synchronous-replication"],
        ) as gateway,
    ):
        log = gateway.log_text()
    assert RISK not in log
    queue = await LeaseQueue.connect(database, timeout=10, require_synchronous_replication=True)
    await queue.close()


async def test_a_new_connection_checks_again(replicas: PrimaryWithStandby, database: str) -> None:
    """Started on a synchronous standby; replication turns asynchronous; the next connection
    the pool opens (as after a failover) is refused, so the queue's calls fail closed."""
    await set_synchronous(replicas.primary.url, True)
    queue = await LeaseQueue.connect(database, timeout=10, require_synchronous_replication=True)
    try:
        await queue.enqueue("k", {"n": 1})
        await set_synchronous(replicas.primary.url, False)
        await queue._driver._db.pool.expire_connections()  # type: ignore[attr-defined]
        with pytest.raises(StoreUnavailable) as refused:
            await queue.enqueue("k", {"n": 2})
        assert RISK in str(refused.value)
        await set_synchronous(replicas.primary.url, True)
        await queue.enqueue("k", {"n": 3})
    finally:
        await queue.close()
