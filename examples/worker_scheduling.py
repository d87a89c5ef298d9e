"""Scheduling decided by the database: a limit per tool, a limit per customer, priorities and a
provider's rate limit, on the embedded SQLite store.

Run it::

    python examples/worker_scheduling.py

It declares three work classes and a rate limit, queues work for each, runs two `Worker`s
on one SQLite queue until every job is done, and prints what the tools themselves saw:

- ``browse``: ``WorkClass(max_running=2)``, at most two browser sessions at once across
  both workers;
- ``create_case``: ``WorkClass(max_running_per_key=1)`` with ``concurrency_key=
  "customer:…"`` on each job: one running job per customer, other customers go ahead;
- ``charge``: ``WorkClass(provider="stripe")`` and ``RateLimit("stripe", 5, per_seconds=1.0)``:
  five charges a second for the whole fleet (after a first burst of five); a charge waiting
  for a token holds no lease;
- ``priority=10`` on one ``browse`` job queued last: it runs first.

On PostgreSQL the same code holds for every worker on every host (``LeaseQueue.connect(
"postgresql://…")``).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from fencegate.lease import JobContext, LeaseQueue, RateLimit, WorkClass, Worker
from fencegate.lease.events import EventLog

CLASSES = [
    WorkClass(kind="browse", max_running=2),
    WorkClass(kind="create_case", max_running_per_key=1),
    WorkClass(kind="charge", provider="stripe"),
]
RATES = [RateLimit("stripe", 5, per_seconds=1.0)]


class Seen:
    """What the tools saw: how many ran at once (per kind and per customer), in which order."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.order: list[str] = []
        self.charged_at: list[float] = []

    async def run(self, *names: str, seconds: float) -> None:
        for name in names:
            self.running[name] = self.running.get(name, 0) + 1
            self.peak[name] = max(self.peak.get(name, 0), self.running[name])
        try:
            await asyncio.sleep(seconds)
        finally:
            for name in names:
                self.running[name] -= 1


def tools(seen: Seen) -> dict[str, Any]:
    async def browse(job: JobContext) -> str:
        seen.order.append(job.payload["page"])
        await seen.run("browse", seconds=0.2)
        return str(job.payload["page"])

    async def create_case(job: JobContext) -> str:
        await seen.run("create_case", str(job.lease.concurrency_key), seconds=0.1)
        return "created"

    async def charge(job: JobContext) -> str:
        seen.charged_at.append(time.monotonic())
        return "charged"

    return {"browse": browse, "create_case": create_case, "charge": charge}


async def main(workdir: Path) -> None:
    url = f"sqlite:///{workdir / 'queue.db'}"
    queue = await LeaseQueue.connect(url)
    await queue.migrate()
    for n in range(6):
        await queue.enqueue("browse", {"page": f"page-{n}"})
    await queue.enqueue("browse", {"page": "the user's request"}, priority=10)
    for n in range(6):
        await queue.enqueue("create_case", {"n": n}, concurrency_key=f"customer:c-{n % 2}")
    for n in range(15):
        await queue.enqueue("charge", {"invoice": n})

    seen = Seen()
    workers = [
        Worker(
            url,
            tools=tools(seen),
            work_classes=CLASSES,
            rate_limits=RATES,
            worker_id=f"w{i}",
            concurrency=8,
            poll_seconds=0.1,
            events=EventLog(keep=0),
        )
        for i in range(2)
    ]
    runs = [asyncio.create_task(worker.run()) for worker in workers]
    for _ in range(300):  # every job done within 30 s
        if not await queue.list_jobs(state="queued", limit=1) and not await queue.list_jobs(
            state="running", limit=1
        ):
            break
        await asyncio.sleep(0.1)
    for worker in workers:
        worker.stop()
    await asyncio.gather(*runs)
    states = sorted({job.state for job in await queue.list_jobs(limit=100)})
    await queue.close()

    spread = seen.charged_at[-1] - seen.charged_at[0]
    print(f"browse: at most {seen.peak['browse']} at once (max_running=2)")
    print(f"browse: first to run: {seen.order[0]} (priority=10, queued last)")
    print(
        "create_case: at most "
        f"{max(seen.peak['customer:c-0'], seen.peak['customer:c-1'])} per customer at once, "
        f"{seen.peak['create_case']} at once in all (max_running_per_key=1)"
    )
    print(
        f"charge: {len(seen.charged_at)} charges over {spread:.1f} s "
        "(5 at once, then 5 a second: RateLimit('stripe', 5, per_seconds=1.0))"
    )
    print(f"jobs: {states}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(main(Path(workdir)))
