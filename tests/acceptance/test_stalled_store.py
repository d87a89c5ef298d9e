"""A stalled PostgreSQL store strands no key: `fencegate serve` with a 1 s store timeout, and
another transaction holding an entity's fence row for longer while new keys with a fence for
that entity arrive. They are refused with 503 store-unavailable, which promises that nothing
was forwarded and nothing was left behind: once the row is free, each key's retry is
forwarded exactly once (never 409 in-flight, never 424 outcome-unknown)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import asyncpg
import httpx
import pytest

from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

KEYS = 10
ENTITY = "acct-1"


@pytest.fixture
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def charge(key: str, fence: int) -> dict[str, str]:
    return {
        "Idempotency-Key": key,
        "X-Execution-Fence": str(fence),
        "X-Execution-Entity": ENTITY,
    }


async def retry_until_answered(client: httpx.AsyncClient, key: str) -> list[int]:
    """What a client does after a 503 (Retry-After: 1): send the same request again until
    the answer is not a 503. Every status seen, in order."""
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = await client.post("/charges", headers=charge(key, 2), json={"key": key})
        seen.append(response.status_code)
        if response.status_code != 503:
            return seen
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
    return seen


async def test_keys_refused_while_the_store_stalls_run_once_when_retried(
    pg_url: str, upstream: UpstreamProcess
) -> None:
    with GatewayProcess(
        upstream=upstream.url, database_url=pg_url, extra_args=["--store-timeout", "1"]
    ) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            # The entity's fence row exists: the stalled transaction below holds it.
            first = await client.post("/charges", headers=charge("before", 1), json={})
            assert first.status_code == 200
            holder = await asyncpg.connect(pg_url)
            try:
                await holder.execute("BEGIN")
                await holder.execute(
                    "SELECT 1 FROM fencegate_fences WHERE entity = $1 FOR UPDATE", ENTITY
                )
                keys = [f"stalled-{i}" for i in range(KEYS)]
                refused = await asyncio.gather(
                    *(client.post("/charges", headers=charge(k, 2), json={"key": k}) for k in keys)
                )
                statuses = [r.status_code for r in refused]
                assert statuses == [503] * KEYS, statuses
                assert {r.json()["type"].rsplit("/", 1)[-1] for r in refused} == {
                    "store-unavailable"
                }
                # The row stays held past the gateway's patience (3 s in all, store timeout
                # 1 s): whatever the refused decisions left running on the server has had
                # every chance to wait for it.
                held_since = await holder.fetchval("SELECT now()")

                async def held_long_enough() -> bool:
                    elapsed = await holder.fetchval("SELECT clock_timestamp() - $1", held_since)
                    return bool(elapsed.total_seconds() >= 2.0)

                await wait_until(held_long_enough, timeout=30, what="the row held 2 s more")
            finally:
                await holder.execute("ROLLBACK")
                await holder.close()

            retries = await asyncio.gather(*(retry_until_answered(client, k) for k in keys))
        counts = {k: await upstream.acount(k) for k in keys}
    stranded = [k for k, seen in zip(keys, retries, strict=True) if seen[-1] != 200]
    assert not stranded, (
        f"{len(stranded)} of {KEYS} keys stranded: "
        f"{ {k: s for k, s in zip(keys, retries, strict=True) if k in stranded} }"
    )
    assert all(set(seen) <= {200, 503} for seen in retries), retries
    assert counts == dict.fromkeys(keys, 1)
