"""Two OS processes with eight asyncio tasks each drain 2,000 jobs from one store: every job
ends `succeeded` exactly once, no fencing token is granted twice, and the attempts history of
every job is closed and ends in success."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import orjson

from fencegate.lease import LeaseQueue

JOBS = 2_000
PROCESSES = 2
TASKS = 8
ROOT = Path(__file__).resolve().parents[2]


async def drain(
    url: str, process: str, *, tasks: int, deadline_seconds: float
) -> dict[str, list[int]]:
    """Claim, heartbeat and complete until the queue is empty; report what was done."""
    queue = await LeaseQueue.connect(url, timeout=30, pool_max_size=4)
    completed: list[int] = []
    tokens: list[int] = []
    rejected: list[int] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + deadline_seconds

    async def work(owner: str) -> None:
        idle = 0
        # Bounded: every job is claimed at most a few times, and the clock is bounded too.
        for _ in range(JOBS * 2):
            if loop.time() > stop_at:
                return
            leases = await queue.claim(owner, kinds=["noop"], limit=1, timeout=30)
            if not leases:
                idle += 1
                if idle >= 3:
                    return
                await asyncio.sleep(0.05)
                continue
            idle = 0
            [lease] = leases
            tokens.append(lease.fencing_token)
            renewed = await queue.extend(lease, timeout=30)
            assert renewed is not None
            if await queue.complete(renewed, {"by": owner}, timeout=30):
                completed.append(lease.job_id)
            else:
                rejected.append(lease.job_id)

    try:
        await asyncio.gather(*(work(f"{process}/t{i}") for i in range(tasks)))
    finally:
        await queue.close()
    return {"completed": completed, "tokens": tokens, "rejected": rejected}


async def run_processes(url: str) -> list[dict[str, list[int]]]:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import asyncio, sys, orjson\n"
            "from tests.lease.test_queue_concurrency import drain\n"
            "out = asyncio.run(drain(sys.argv[1], sys.argv[2], tasks=int(sys.argv[3]),"
            " deadline_seconds=150))\n"
            "sys.stdout.buffer.write(orjson.dumps(out))\n",
            url,
            f"p{n}",
            str(TASKS),
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


async def test_two_processes_drain_the_queue_exactly_once(store_url: str) -> None:
    queue = await LeaseQueue.connect(store_url, timeout=30)
    try:
        ids: list[int] = []
        for start in range(0, JOBS, 500):
            ids += await queue.enqueue_many(
                [{"kind": "noop", "payload": {"n": n}} for n in range(start, start + 500)],
                timeout=30,
            )
        assert len(set(ids)) == JOBS

        reports = await run_processes(store_url)

        completed = [job_id for report in reports for job_id in report["completed"]]
        assert sorted(completed) == sorted(ids), "every job completed exactly once"
        assert all(report["completed"] for report in reports), "both processes did work"
        rejected = [job_id for report in reports for job_id in report["rejected"]]
        assert rejected == [], "a live lease was taken from its owner"
        granted = [token for report in reports for token in report["tokens"]]
        assert len(granted) == len(set(granted)), "no fencing token granted twice"

        jobs = await queue.list_jobs(limit=JOBS + 10, timeout=30)
        assert {job.state for job in jobs} == {"succeeded"}
        assert len(jobs) == JOBS
        history_tokens: list[int] = []
        for job in jobs:
            history = await queue.attempts(job.id, timeout=30)
            assert history, f"job {job.id} has no attempts"
            assert all(a.ended_at is not None for a in history)
            assert history[-1].outcome == "succeeded"
            assert history[-1].fencing_token == job.fencing_token
            assert job.result == {"by": history[-1].owner_id}
            history_tokens += [a.fencing_token for a in history]
        assert len(history_tokens) == len(set(history_tokens))
        assert set(history_tokens) <= set(granted)
    finally:
        await queue.close()
