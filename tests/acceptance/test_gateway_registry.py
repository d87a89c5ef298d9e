"""The gateway registry with real `fencegate serve` processes, on both stores: a running
gateway registers and heartbeats (alive three heartbeats ahead, database clock), leaves on
SIGTERM once it has stopped, and its row runs out after kill -9."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from fencegate.store import GatewayRow, GatewayStore, open_gateway_store
from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)

T = 30.0
HEARTBEAT = 0.5  # seconds between a test gateway's heartbeats: alive for 1.5 s after one


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[GatewayStore]:
    opened = await open_gateway_store(store_url, run_migrations=False, pool_max_size=2)
    try:
        yield opened
    finally:
        await opened.close()


async def row_of(store: GatewayStore, pid: int) -> GatewayRow | None:
    return next((g for g in await store.gateways(timeout=T) if g.pid == pid), None)


async def test_a_running_gateway_registers_heartbeats_and_leaves_on_sigterm(
    store_url: str, store: GatewayStore, upstream: UpstreamProcess
) -> None:
    with GatewayProcess(
        upstream=upstream.url,
        database_url=store_url,
        extra_args=["--gateway-heartbeat", str(HEARTBEAT)],
    ) as gateway:
        first = await wait_until(lambda: row_of(store, gateway.pid), timeout=T, what="its row")
        assert first is not None and first.alive
        assert first.instance.split(":")[1] == str(gateway.pid)
        assert first.alive_until - first.heartbeat_at == pytest.approx(3 * HEARTBEAT, abs=0.05)

        async def beat_after(seen: float) -> GatewayRow | None:
            row = await row_of(store, gateway.pid)
            return row if row is not None and row.heartbeat_at > seen else None

        second = await wait_until(lambda: beat_after(first.heartbeat_at), timeout=T, what="beat")
        assert second is not None
        third = await wait_until(lambda: beat_after(second.heartbeat_at), timeout=T, what="beat")
        assert third is not None
        assert third.started_at == first.started_at  # the same registration, kept alive
        gateway.signal(signal.SIGTERM)
        # uvicorn ends a graceful shutdown by re-raising the signal it caught.
        assert await asyncio.to_thread(gateway.wait_exit, timeout=T) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in gateway.log_text()
        assert await row_of(store, gateway.pid) is None, gateway.log_text()


async def test_a_killed_gateway_row_runs_out(
    store_url: str, store: GatewayStore, upstream: UpstreamProcess
) -> None:
    with GatewayProcess(
        upstream=upstream.url,
        database_url=store_url,
        extra_args=["--gateway-heartbeat", str(HEARTBEAT)],
    ) as gateway:
        pid = gateway.pid
        alive = await wait_until(lambda: row_of(store, pid), timeout=T, what="its row")
        assert alive is not None and alive.alive
        gateway.kill()
    left = await row_of(store, pid)
    assert left is not None  # a killed process deletes nothing

    async def ran_out() -> bool:
        row = await row_of(store, pid)
        return row is not None and not row.alive

    # Three heartbeats after the last one, by the database clock (two seconds of slack).
    await wait_until(
        ran_out, timeout=3 * HEARTBEAT + 2, what="the killed gateway's row running out"
    )
