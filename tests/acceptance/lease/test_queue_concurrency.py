"""Two OS processes with several asyncio tasks each drain one store: every job ends
`succeeded` exactly once, no fencing token is granted twice, and the attempts history of every
job is closed and ends in success. In the second test some first attempts are abandoned (their
owner never renews nor completes), so their leases expire and other tasks reclaim them while
the rest of the queue is drained."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from fencegate.lease import LeaseQueue

PROCESSES = 2
ROOT = Path(__file__).resolve().parents[3]


async def drain(
    url: str,
    process: str,
    *,
    tasks: int,
    abandon_every: int,
    deadline_seconds: float,
) -> dict[str, list[int]]:
    """Claim, heartbeat and complete until no job is queued or running; report what was done.
    With ``abandon_every=n``, the first attempt of every job whose id is a multiple of n is
    dropped on the floor, as by a worker that froze."""
    queue = await LeaseQueue.connect(url, timeout=30, pool_max_size=4)
    completed: list[int] = []
    tokens: list[int] = []
    rejected: list[int] = []
    abandoned: list[int] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + deadline_seconds

    async def unfinished() -> bool:
        for state in ("queued", "running"):
            if await queue.list_jobs(state=state, limit=1, timeout=30):
                return True
        return False

    async def work(owner: str) -> None:
        # Bounded by the clock; each pass either finishes a job or sleeps.
        while loop.time() < stop_at:
            leases = await queue.claim(owner, kinds=["noop"], limit=1, timeout=30)
            if not leases:
                if not await unfinished():
                    return
                await asyncio.sleep(0.05)
                continue
            [lease] = leases
            tokens.append(lease.fencing_token)
            if abandon_every and lease.attempt == 1 and lease.job_id % abandon_every == 0:
                abandoned.append(lease.job_id)
                continue
            renewed = await queue.extend(lease, timeout=30)
            if renewed is not None and await queue.complete(renewed, {"by": owner}, timeout=30):
                completed.append(lease.job_id)
            else:
                rejected.append(lease.job_id)

    try:
        await asyncio.gather(*(work(f"{process}/t{i}") for i in range(tasks)))
    finally:
        await queue.close()
    return {
        "completed": completed,
        "tokens": tokens,
        "rejected": rejected,
        "abandoned": abandoned,
    }


async def run_processes(url: str, *, tasks: int, abandon_every: int) -> list[dict[str, Any]]:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import asyncio, sys, orjson\n"
            "from tests.acceptance.lease.test_queue_concurrency import drain\n"
            "out = asyncio.run(drain(sys.argv[1], sys.argv[2], tasks=int(sys.argv[3]),"
            " abandon_every=int(sys.argv[4]), deadline_seconds=150))\n"
            "sys.stdout.buffer.write(orjson.dumps(out))\n",
            url,
            f"p{n}",
            str(tasks),
            str(abandon_every),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for n in range(PROCESSES)
    ]
    reports = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 200)
        assert proc.returncode == 0, err.decode()[-2000:]
        reports.append(orjson.loads(out))
    return reports


async def enqueue(queue: LeaseQueue, count: int, **policy: Any) -> list[int]:
    ids: list[int] = []
    for start in range(0, count, 500):
        ids += await queue.enqueue_many(
            [
                {"kind": "noop", "payload": {"n": n}, **policy}
                for n in range(start, min(count, start + 500))
            ],
            timeout=30,
        )
    assert len(set(ids)) == count
    return ids


async def check_every_job_succeeded_once(
    queue: LeaseQueue, ids: list[int], reports: list[dict[str, Any]]
) -> list[int]:
    """The checks both tests share; returns every token granted."""
    completed = [job_id for report in reports for job_id in report["completed"]]
    assert sorted(completed) == sorted(ids), "every job completed exactly once"
    assert all(report["completed"] for report in reports), "both processes did work"
    granted = [token for report in reports for token in report["tokens"]]
    assert len(granted) == len(set(granted)), "no fencing token granted twice"

    jobs = await queue.list_jobs(limit=len(ids) + 10, timeout=30)
    assert len(jobs) == len(ids)
    assert {job.state for job in jobs} == {"succeeded"}
    history_tokens: list[int] = []
    for job in jobs:
        history = await queue.attempts(job.id, timeout=30)
        assert history, f"job {job.id} has no attempts"
        assert all(a.ended_at is not None for a in history)
        assert [a.outcome for a in history[:-1]] == ["lease_expired"] * (len(history) - 1)
        assert history[-1].outcome == "succeeded"
        assert history[-1].fencing_token == job.fencing_token
        assert [a.attempt for a in history] == list(range(1, len(history) + 1))
        assert job.result == {"by": history[-1].owner_id}
        history_tokens += [a.fencing_token for a in history]
    assert len(history_tokens) == len(set(history_tokens))
    assert sorted(history_tokens) == sorted(granted)
    return granted


async def test_two_processes_drain_the_queue_exactly_once(store_url: str) -> None:
    queue = await LeaseQueue.connect(store_url, timeout=30)
    try:
        ids = await enqueue(queue, 2_000)
        reports = await run_processes(store_url, tasks=8, abandon_every=0)
        rejected = [job_id for report in reports for job_id in report["rejected"]]
        assert rejected == [], "a live lease was taken from its owner"
        await check_every_job_succeeded_once(queue, ids, reports)
    finally:
        await queue.close()


async def test_abandoned_leases_are_reclaimed_under_contention(store_url: str) -> None:
    queue = await LeaseQueue.connect(store_url, timeout=30)
    try:
        # 1.0s > 1 x 0.25s + 0.5s: short enough that the abandoned jobs come back quickly.
        ids = await enqueue(
            queue, 400, lease_seconds=1.0, heartbeat_seconds=0.25, jitter_seconds=0.5
        )
        reports = await run_processes(store_url, tasks=4, abandon_every=7)
        abandoned = sorted(job_id for report in reports for job_id in report["abandoned"])
        assert abandoned == [job_id for job_id in sorted(ids) if job_id % 7 == 0]
        await check_every_job_succeeded_once(queue, ids, reports)
        for job_id in abandoned:
            first, *rest = await queue.attempts(job_id, timeout=30)
            assert first.outcome == "lease_expired"
            assert first.error == "lease expired on attempt 1 of 5"
            assert rest and rest[-1].fencing_token > first.fencing_token
    finally:
        await queue.close()
