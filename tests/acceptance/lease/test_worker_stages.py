"""Requests made inside a job's stages, to a real upstream process, carry the stage in
their idempotency key."""

from __future__ import annotations

import asyncio

from fencegate.lease import LeaseQueue
from fencegate.lease.job import JobContext
from tests.support.upstream import UpstreamProcess
from tests.support.workers import (
    SHORT,
    make_worker,
)


async def test_requests_inside_a_stage_carry_the_stage_in_their_key(
    store_url: str, queue: LeaseQueue
) -> None:
    with UpstreamProcess() as upstream:

        async def notify(job: JobContext) -> dict[str, list[str]]:
            async def send(channel: str) -> str:
                answer = await job.http().post(f"{upstream.url}/notify/{channel}", json={})
                return str((await answer.json())["key"])

            # Two stages at once: each request is keyed by its own stage.
            keys = await asyncio.gather(
                job.stage("email", lambda: send("email")),
                job.stage("sms", lambda: send("sms")),
            )
            return {"keys": list(keys)}

        job_id = await queue.enqueue("notify", {}, idempotency_key="notify:c-1048", **SHORT)
        worker = make_worker(store_url, {"notify": notify})
        await asyncio.wait_for(worker.run_until_idle(), 60)
    job = await queue.get(job_id)
    assert job.result == {
        "keys": ["notify:c-1048:email:POST /notify/email", "notify:c-1048:sms:POST /notify/sms"]
    }
