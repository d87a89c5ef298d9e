"""Why the documentation says synchronous replication (docs/operations/high-availability.md):
the same cluster with Patroni's default asynchronous replication loses acknowledged decisions
in a failover.

The gateway starts with one warning line naming the risk. Retrying clients send keyed, fenced
charges; the primary's WAL sender is paused (SIGSTOP: a standby a moment behind, as under
load or a slow network), the clients keep getting answers the primary alone has, then the
primary's host dies (Patroni and its postmaster SIGKILLed) and the standby is promoted. After
the failover some answers the clients received are gone: replaying those keys runs the charge
upstream again and returns a different answer (the fences accepted in those transactions are
gone with them). The test asserts that the loss happens, and prints how large it is.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import asyncpg
import pytest

from fencegate.store.migrations import migrate
from tests.support import postgres
from tests.support.failover_load import KeyedLoad, send
from tests.support.gateway import GatewayProcess
from tests.support.patroni import PatroniCluster, PatroniNode
from tests.support.tiers import needs
from tests.support.topology import missing
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def cluster() -> Iterator[PatroniCluster]:
    reason = missing("patroni", "etcd", "initdb")
    needs(reason, "topology")
    patroni = PatroniCluster(synchronous=False)
    try:
        patroni.start()
        yield patroni
    finally:
        patroni.stop()


async def wal_sender_pid(node: PatroniNode) -> int:
    """The primary's WAL sender: paused, it sends nothing more (pausing the standby's
    receiver instead would not do: the socket buffers would hold what it missed)."""
    conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{node.pg_port}/postgres")
    try:
        pid = await conn.fetchval("SELECT pid FROM pg_stat_replication")
    finally:
        await conn.close()
    assert pid, "the standby is not streaming"
    return int(pid)


async def test_an_asynchronous_standby_loses_acknowledged_decisions(
    cluster: PatroniCluster,
) -> None:
    database = await postgres.create_database(cluster.url)
    await cluster.wait_for_database(database)
    await migrate(database)
    with (
        UpstreamProcess() as upstream,
        GatewayProcess(
            upstream=upstream.url, database_url=database, extra_args=["--store-timeout", "2"]
        ) as gateway,
    ):
        warnings = [line for line in gateway.log_text().splitlines() if "asynchronously" in line]
        assert len(warnings) == 1, gateway.log_text()

        load = KeyedLoad([gateway.url], prefix="async", clients=6)
        load.start()
        try:
            await wait_until(
                lambda: len(load.result.answers) >= 30,
                timeout=60,
                what="load before the standby falls behind",
            )
            old = cluster.primary()
            standby = next(n for n in cluster.nodes if n is not old)
            os.kill(await wal_sender_pid(old), signal.SIGSTOP)
            behind_from = len(load.result.answers)
            await wait_until(
                lambda: len(load.result.answers) >= behind_from + 60,
                timeout=60,
                what="answers the standby has not received",
            )
            acknowledged_only_on_primary = len(load.result.answers) - behind_from
            old.stop()  # the primary's host dies (its paused WAL sender with it)
            died_at = time.monotonic()
            cluster.wait_for(lambda: standby.role() == "primary", 120, "the standby's promotion")
            await wait_until(
                lambda: load.result.first_success_after(died_at) is not None,
                timeout=120,
                what="a success after the failover",
            )
        finally:
            result = load.stop()
        differ = []
        for key, answer in result.answers.items():
            entity = f"async-entity-{key.rsplit('-', 2)[1]}"
            again = send(gateway.url, key, entity, result.accepted_fence[entity])
            if (again.status_code, again.content) != (answer.status, answer.body):
                differ.append(key)
        counts = upstream.stats()["counts"]
    twice = sorted(k for k, v in counts.items() if k.startswith("async") and v > 1)
    print(
        f"asynchronous failover: {len(result.answers)} keys answered, "
        f"{acknowledged_only_on_primary} while the standby was behind; after the failover "
        f"{len(differ)} answers replay differently, {len(twice)} keys ran twice upstream; "
        f"first success {result.first_success_after(died_at):.2f}s after the primary died"
    )
    assert differ, "no acknowledged answer was lost: the standby was not behind"
    assert twice, "no key ran twice"
    assert set(differ) >= set(twice)
