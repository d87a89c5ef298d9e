"""An attempt's row is inserted when its lease is granted and updated, longer, when the
attempt ends: its pages keep room for that update, so that the ended row stays on its page
(a heap-only update) instead of adding an entry to each of the table's indexes."""

from __future__ import annotations

import asyncpg

from fencegate.lease import LeaseQueue

BATCH = 200


async def _pages(url: str) -> dict[int, int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT fencing_token, (ctid::text::point)[0]::bigint AS page"
            " FROM fencegate_job_attempts"
        )
    finally:
        await conn.close()
    return {row["fencing_token"]: row["page"] for row in rows}


async def test_an_ended_attempt_stays_on_its_page(pg_url: str) -> None:
    queue = await LeaseQueue.connect(pg_url, timeout=30)
    try:
        await queue.enqueue_many([{"kind": "k", "payload": n} for n in range(BATCH)], timeout=30)
        leases = await queue.claim("worker-with-a-typical-name:4242:abcdef", limit=BATCH)
        assert len(leases) == BATCH
        granted = await _pages(pg_url)
        # One statement for the whole batch: no earlier update's space is reclaimed meanwhile.
        done = await queue.complete_many([(lease, None) for lease in leases], timeout=30)
        assert all(done)
        ended = await _pages(pg_url)
    finally:
        await queue.close()
    stayed = sum(ended[token] == page for token, page in granted.items())
    assert stayed >= 0.7 * BATCH, f"{stayed} of {BATCH} ended attempts stayed on their page"
