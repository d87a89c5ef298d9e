"""LeaseQueue.list_jobs pages through the queue newest first, on both stores."""

from __future__ import annotations

from fencegate.lease import LeaseQueue


async def test_list_jobs_pages_newest_first_without_gaps_or_repeats(store_url: str) -> None:
    queue = await LeaseQueue.connect(store_url)
    try:
        ids = [await queue.enqueue("report", {"n": n}, idempotency_key=f"r:{n}") for n in range(7)]
        seen: list[int] = []
        before: int | None = None
        while True:
            page = await queue.list_jobs(limit=3, before=before, timeout=30)
            seen += [job.id for job in page]
            if len(page) < 3:
                break
            before = page[-1].id
        assert seen == sorted(ids, reverse=True)
        queued = await queue.list_jobs(state="queued", kind="report", limit=2, before=ids[2])
        assert [job.id for job in queued] == [ids[1], ids[0]]
    finally:
        await queue.close()
