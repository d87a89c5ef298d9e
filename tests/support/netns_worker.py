"""One side of the unpleasant test across hosts, run on its own host (network namespace):
``python -m tests.support.netns_worker ROLE --db URL --gateway URL --work DIR``.

- ``enqueue --invoice INV``: queue the capture job, print its id.
- ``w1``: run Worker w1; its tool captures through the gateway (the fenced client, step
  ``capture``). Once ``DIR/healed`` exists (the test cut this host off meanwhile and let W2
  finish), try everything an old owner could, and write the outcomes to ``DIR/w1.json``.
- ``w2``: run Worker w2 until the job has succeeded or failed; write its answers to
  ``DIR/w2.json``.

Events go to ``DIR/ROLE.events`` (JSON lines), so the test sees W1's request go out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from fencegate.errors import StoreUnavailable
from fencegate.lease import JobContext, LeaseQueue, Worker
from fencegate.lease.events import EventLog
from fencegate.lease.execution import OwnershipLost
from tests.support.waits import wait_until

STEP = "capture"


async def main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    if args.role == "enqueue":
        async with await LeaseQueue.connect(args.db, timeout=10) as queue:
            job_id = await queue.enqueue(
                "capture",
                {"invoice": args.invoice, "amount": 4200},
                idempotency_key=f"payment:{args.invoice}:capture",
                lease_seconds=3.0,
                heartbeat_seconds=0.5,
                jitter_seconds=1.0,
            )
        print(job_id)
        return
    answers: list[dict[str, Any]] = []
    jobs: list[JobContext] = []

    async def capture(job: JobContext) -> dict[str, Any]:
        jobs.append(job)
        url = f"{args.gateway}/payments/{job.payload['invoice']}/capture?delay=2.0"
        response = await job.http().post(url, json={"amount": 4200}, step=STEP)
        body = await response.json()
        answers.append(
            {
                "token": job.fencing_token,
                "status": response.status,
                "replayed": response.headers.get("Idempotent-Replayed"),
                "execution": body.get("execution"),
            }
        )
        return {"execution": body.get("execution"), "status": response.status}

    worker = Worker(
        args.db,
        tools={"capture": capture},
        worker_id=args.role,
        events=EventLog(work / f"{args.role}.events"),
        store_timeout=1.0,
        grace_seconds=2.0,
        http_timeout=20.0,
        poll_seconds=0.2,
    )
    running = asyncio.create_task(worker.run())
    if args.role == "w2":
        async with await LeaseQueue.connect(args.db, timeout=10) as queue:

            async def finished() -> bool:
                return (await queue.get(args.job)).state in ("succeeded", "failed")

            await wait_until(finished, timeout=120, what="the job to finish")
            final = await queue.get(args.job)
        worker.stop()
        await asyncio.wait_for(running, 60)
        (work / "w2.json").write_text(
            json.dumps(
                {
                    "answers": answers,
                    "state": final.state,
                    "owner": final.owner_id,
                    "result": final.result,
                }
            )
        )
        return
    await wait_until((work / "healed").exists, timeout=300, what="the link back")
    [job] = jobs
    lease = job.lease
    assert worker.queue is not None
    late: dict[str, Any] = {"token": lease.fencing_token, "answers": answers}
    deadline = time.monotonic() + 60
    while "complete" not in late and time.monotonic() < deadline:
        try:  # the first calls after the link came back may meet dead connections
            late["extend"] = await worker.queue.extend(lease, timeout=5)
            late["complete"] = await worker.queue.complete(lease, {"execution": 1}, timeout=5)
        except StoreUnavailable:
            await asyncio.sleep(0.2)
    try:
        await job.http().post(f"{args.gateway}/x", json={}, step=STEP)
        late["own_client"] = "sent"
    except OwnershipLost:
        late["own_client"] = "OwnershipLost"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{args.gateway}/payments/{job.payload['invoice']}/capture",
            json={"amount": 4200},
            headers={
                "Idempotency-Key": f"payment:{job.payload['invoice']}:capture:{STEP}",
                "X-Execution-Fence": str(lease.fencing_token),
                "X-Execution-Entity": f"job:{job.id}",
            },
        ) as response:
            late["raw_status"] = response.status
            late["raw_problem"] = await response.json(content_type=None)
    worker.stop()
    await asyncio.wait_for(running, 60)
    late["events"] = [e["event"] for e in worker.events.records]
    (work / "w1.json").write_text(json.dumps(late, default=str))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["enqueue", "w1", "w2"])
    parser.add_argument("--db", required=True)
    parser.add_argument("--gateway", default="")
    parser.add_argument("--work", required=True)
    parser.add_argument("--invoice", default="")
    parser.add_argument("--job", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
