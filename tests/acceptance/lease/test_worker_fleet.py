"""A fleet: 8 workers over 2 processes drain 2,000 jobs. Every job ends exactly once
`succeeded`, no fencing token is ever granted twice, and the attempts history agrees with
what the workers logged."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from fencegate.lease import LeaseQueue
from tests.acceptance.lease.test_worker_kill import read, start_worker_process

JOBS = 2_000
PROCESSES = 2
WORKERS_PER_PROCESS = 4


async def test_two_processes_of_four_workers_run_each_job_once(
    store_url: str, tmp_path: Path
) -> None:
    queue = await LeaseQueue.connect(store_url)
    try:
        jobs = [
            {
                "kind": "work",
                "payload": {"n": n},
                "idempotency_key": f"fleet:{n}",
                "lease_seconds": 3.0,
                "heartbeat_seconds": 1.0,
                "jitter_seconds": 1.0,
            }
            for n in range(JOBS)
        ]
        ids: list[int] = []
        for start in range(0, JOBS, 500):
            ids += await queue.enqueue_many(jobs[start : start + 500], timeout=60)
        logs = [tmp_path / f"p{i}.jsonl" for i in range(PROCESSES)]
        procs = [
            start_worker_process(
                store_url,
                log,
                "--name",
                f"p{i}",
                "--workers",
                str(WORKERS_PER_PROCESS),
                "--concurrency",
                "4",
                "--lease-seconds",
                "3",
                "--heartbeat-seconds",
                "1",
                "--jitter-seconds",
                "1",
                "--until-idle",
            )
            for i, log in enumerate(logs)
        ]
        try:
            for proc in procs:
                out, _ = await asyncio.to_thread(proc.communicate, timeout=240)
                assert proc.returncode == 0, out.decode(errors="replace")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        finished = await queue.list_jobs(state="succeeded", kind="work", limit=JOBS + 1)
        histories = {job_id: await queue.attempts(job_id) for job_id in ids[::50]}
        others = [
            job
            for state in ("queued", "running", "failed", "cancelled")
            for job in await queue.list_jobs(state=state, limit=10)
        ]
    finally:
        await queue.close()

    assert others == []
    assert sorted(job.id for job in finished) == sorted(ids)
    assert all(job.result["n"] == job.payload["n"] for job in finished)

    events = [e for log in logs for e in read(log)]
    committed = collections.Counter(e["job"] for e in events if e["event"] == "result_committed")
    assert len(committed) == JOBS and set(committed.values()) == {1}
    claims = [e for e in events if e["event"] == "job_claimed"]
    tokens = [e["token"] for e in claims]
    assert len(tokens) == len(set(tokens))  # no token granted twice, across processes
    workers = {e["worker"] for e in claims}
    assert {str(w).split("-")[0] for w in workers} == {"p0", "p1"}
    assert len(workers) > PROCESSES  # more than one worker per process did work

    # The history is consistent with the jobs and with what the workers logged.
    by_job = {job.id: job for job in finished}
    token_owner = {e["token"]: e["worker"] for e in claims}
    for job_id, history in histories.items():
        job = by_job[job_id]
        assert [a.attempt for a in history] == list(range(1, job.attempt + 1))
        assert history[-1].outcome == "succeeded"
        assert history[-1].fencing_token == job.fencing_token == job.result["token"]
        assert all(a.outcome != "succeeded" for a in history[:-1])
        assert [a.fencing_token for a in history] == sorted(a.fencing_token for a in history)
        for attempt in history:
            assert token_owner[attempt.fencing_token] == attempt.owner_id
