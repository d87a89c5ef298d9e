"""Scheduling across real Worker processes, on SQLite and on PostgreSQL: the limits per kind
and per key hold for the whole fleet (sampled from the database while the workers run, and
from the tools' own start and end times), higher priorities are claimed first, and a
provider's rate holds over a 10 s window without a job holding a lease while it waits."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from fencegate.lease import Job, LeaseQueue
from tests.acceptance.lease.test_worker_kill import start_worker_process
from tests.support.waits import wait_until

INTERVALS = ("--lease-seconds", "3", "--heartbeat-seconds", "1", "--jitter-seconds", "1")
SHORT = {"lease_seconds": 3.0, "heartbeat_seconds": 1.0, "jitter_seconds": 1.0}


@contextlib.asynccontextmanager
async def worker_processes(
    url: str, tmp_path: Path, count: int, *args: str
) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    procs = [
        start_worker_process(url, tmp_path / f"p{i}.jsonl", "--name", f"p{i}", *INTERVALS, *args)
        for i in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


async def until_exited(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for proc in procs:
        out, _ = await asyncio.to_thread(proc.communicate, timeout=timeout)
        assert proc.returncode == 0, out.decode(errors="replace")


def most_at_once(spans: Sequence[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = running = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


async def all_jobs(queue: LeaseQueue) -> list[Job]:
    return await queue.list_jobs(limit=1000)


async def test_limits_per_kind_and_per_key_hold_across_processes(
    store_url: str, tmp_path: Path
) -> None:
    queue = await LeaseQueue.connect(store_url)
    try:
        await queue.enqueue_many(
            [
                {
                    "kind": "work",
                    "payload": {"seconds": 0.25},
                    # Each customer's six jobs queued together: only the limit per key keeps
                    # them from running side by side.
                    "concurrency_key": f"customer:{n // 6}",
                    **SHORT,
                }
                for n in range(30)
            ]
        )
        live_kind: list[int] = []
        live_key: list[int] = []
        args = ("--tool", "span", "--concurrency", "4", "--until-idle")
        limits = ("--max-running", "3", "--max-running-per-key", "1")
        async with worker_processes(store_url, tmp_path, 3, *args, *limits) as procs:

            async def sampled_until_exited() -> bool:
                if all(proc.poll() is not None for proc in procs):
                    return True
                now = await queue.now()
                running = [
                    j
                    for j in await queue.list_jobs(state="running", limit=100)
                    if j.lease_until is not None and j.lease_until > now
                ]
                live_kind.append(len(running))
                keys = [j.concurrency_key for j in running]
                live_key.append(max((keys.count(k) for k in keys), default=0))
                return False

            # Sampled from the database while they run, every 20 ms.
            await wait_until(
                sampled_until_exited, timeout=120, what="the workers to drain the queue"
            )
            await until_exited(procs, timeout=120)
        jobs = await all_jobs(queue)
        unfinished = {
            j.id: (
                j.state,
                j.run_after,
                [(a.owner_id, a.outcome) for a in await queue.attempts(j.id)],
            )
            for j in jobs
            if j.state != "succeeded"
        }
    finally:
        await queue.close()

    # Which jobs did not finish, when they may run again and how each attempt ended: a lease
    # lost under load is retried later, which the workers (--until-idle) leave for later.
    assert len(jobs) == 30 and not unfinished, unfinished
    # From the database, while they ran.
    assert live_kind and max(live_kind) <= 3 and max(live_key) <= 1
    # From the tools' own clocks: never more than 3 at once, one per customer; and the limit
    # was reached (12 slots would otherwise run more).
    spans = [(j.result["started"], j.result["ended"]) for j in jobs]
    assert most_at_once(spans) == 3
    for key in {j.concurrency_key for j in jobs}:
        mine = [(j.result["started"], j.result["ended"]) for j in jobs if j.concurrency_key == key]
        assert most_at_once(mine) == 1, key


async def test_higher_priorities_are_claimed_and_started_first(
    store_url: str, tmp_path: Path
) -> None:
    queue = await LeaseQueue.connect(store_url)
    try:
        low = [{"kind": "work", "payload": {"seconds": 0.02}, **SHORT} for _ in range(12)]
        high = [dict(job, priority=5) for job in low]
        await queue.enqueue_many(low + high)
        args = ("--tool", "span", "--concurrency", "2", "--until-idle")
        async with worker_processes(store_url, tmp_path, 1, *args) as procs:
            await until_exited(procs, timeout=120)
        jobs = await all_jobs(queue)
        claimed: dict[int, datetime] = {
            j.id: (await queue.attempts(j.id))[0].claimed_at for j in jobs
        }
    finally:
        await queue.close()

    assert {j.state for j in jobs} == {"succeeded"}
    highs = [j for j in jobs if j.priority == 5]
    lows = [j for j in jobs if j.priority == 0]
    assert max(claimed[j.id] for j in highs) <= min(claimed[j.id] for j in lows)
    assert max(j.result["started"] for j in highs) <= min(j.result["started"] for j in lows)


RATE = 20  # jobs a second for provider "stripe"


async def test_a_provider_rate_holds_over_ten_seconds_and_waiting_holds_no_lease(
    store_url: str, tmp_path: Path
) -> None:
    queue = await LeaseQueue.connect(store_url)
    jobs_count = RATE * 13
    try:
        await queue.enqueue_many(
            [{"kind": "work", "payload": {"seconds": 0}, **SHORT} for _ in range(jobs_count)]
        )
        # Not --until-idle: a worker whose work waits for tokens has nothing claimable now.
        args = ("--tool", "span", "--concurrency", "8")
        rate = ("--provider", "stripe", "--rate", str(RATE))
        leased_while_waiting: list[Any] = []
        async with worker_processes(store_url, tmp_path, 2, *args, *rate) as procs:

            async def sampled_until_drained() -> bool:
                waiting = await queue.list_jobs(state="queued", limit=jobs_count)
                leased_while_waiting.extend(j.id for j in waiting if j.owner_id or j.lease_until)
                return not waiting and not await queue.list_jobs(state="running", limit=1)

            # Sampled every 100 ms; the rate needs about 12 s for all of them.
            await wait_until(
                sampled_until_drained, timeout=60, interval=0.1, what="the rated jobs to finish"
            )
            for proc in procs:
                proc.terminate()
            await until_exited(procs, timeout=60)
        jobs = await all_jobs(queue)
        claims = sorted([(await queue.attempts(j.id))[0].claimed_at.timestamp() for j in jobs])
    finally:
        await queue.close()

    assert len(jobs) == jobs_count and {j.state for j in jobs} == {"succeeded"}
    assert leased_while_waiting == []
    # The bucket starts full (RATE tokens), then refills at RATE a second: over the 10 s
    # after the first two seconds, 10 x RATE claims, within 10 %.
    start = claims[0] + 2.0
    in_window = [t for t in claims if start <= t < start + 10.0]
    assert abs(len(in_window) - 10 * RATE) <= RATE, len(in_window)
    # And never ahead of the bucket: by any moment, at most the burst plus the refill. A
    # claim's time is when its transaction began (on PostgreSQL before it waited its turn),
    # the bucket's when it took the tokens: half a second of slack, as a transaction may wait
    # that long for its turn while the suite's other workers share the two cores.
    for index, at in enumerate(claims):
        assert index + 1 <= RATE + RATE * (at - claims[0] + 0.5) + 1, (index, at - claims[0])
    # The tools' own clocks agree.
    started = sorted(j.result["started"] for j in jobs)
    tool_window = [t for t in started if started[0] + 2.0 <= t < started[0] + 12.0]
    assert abs(len(tool_window) - 10 * RATE) <= RATE, len(tool_window)
