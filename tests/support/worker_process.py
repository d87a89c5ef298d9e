"""A worker process for the kill and fleet tests: ``python -m tests.support.worker_process``.

Runs ``--workers`` Workers in one process (one event loop, each with its own heartbeat
thread and connection), writes every event as JSON lines to ``--events``, stops gracefully
on SIGTERM (through `run_worker`), or with ``--until-idle`` exits once there is nothing left
to do.

Tools (by ``--tool``): ``sleep`` waits ``payload["seconds"]``; ``echo`` returns the payload's
``n`` and the token that ran it; ``span`` waits ``payload["seconds"]`` and returns when it
started and ended (the host's clock), so a test can count how many ran at once.

Scheduling (``--max-running``, ``--max-running-per-key``, ``--provider`` with ``--rate``
per second) is declared on the work class, as a deployment declares it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from fencegate.lease import RateLimit, WorkClass
from fencegate.lease.events import EventLog
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.worker import Worker, run_worker


async def sleep_tool(job: JobContext) -> dict[str, Any]:
    await asyncio.sleep(float(job.payload["seconds"]))
    return {"slept": job.payload["seconds"]}


async def echo_tool(job: JobContext) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"n": job.payload["n"], "token": job.fencing_token}


async def post_tool(job: JobContext) -> dict[str, Any]:
    """POST to ``payload["url"]`` through the job's fenced client (aiohttp)."""
    response = await job.http().post(job.payload["url"], json={"n": job.payload.get("n", 1)})
    return {"status": response.status}


async def post_httpx_tool(job: JobContext) -> dict[str, Any]:
    """The same through an httpx client whose ``auth`` is the job's."""
    import httpx

    async with httpx.AsyncClient(auth=job.httpx_auth(), timeout=30) as client:
        response = await client.post(job.payload["url"], json={"n": job.payload.get("n", 1)})
    return {"status": response.status_code}


async def span_tool(job: JobContext) -> dict[str, Any]:
    started = time.time()
    await asyncio.sleep(float(job.payload["seconds"]))
    return {"started": started, "ended": time.time(), "key": job.lease.concurrency_key}


TOOLS = {
    "sleep": sleep_tool,
    "echo": echo_tool,
    "post": post_tool,
    "post_httpx": post_httpx_tool,
    "span": span_tool,
}


def build(args: argparse.Namespace, events: EventLog) -> list[Worker]:
    metrics = WorkerMetrics()
    fast = WorkClass(
        kind=args.kind,
        lease_seconds=args.lease_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        jitter_seconds=args.jitter_seconds,
        backoff_base_seconds=0.05,
        backoff_max_seconds=0.2,
        max_running=args.max_running,
        max_running_per_key=args.max_running_per_key,
        provider=args.provider,
    )
    rates = [RateLimit(args.provider, args.rate)] if args.provider and args.rate else []
    return [
        Worker(
            args.url,
            tools={args.kind: TOOLS[args.tool]},
            worker_id=f"{args.name}-w{i}",
            concurrency=args.concurrency,
            work_classes=[fast],
            rate_limits=rates,
            events=events,
            metrics=metrics,
            poll_seconds=0.2,
            grace_seconds=args.grace_seconds,
        )
        for i in range(args.workers)
    ]


async def until_idle(workers: list[Worker]) -> None:
    await asyncio.gather(*(w.run_until_idle() for w in workers))


def main(args: argparse.Namespace) -> None:
    events = EventLog(args.events, keep=0)
    workers = build(args, events)
    if args.until_idle:
        asyncio.run(until_idle(workers))
    else:
        run_worker(*workers)  # until SIGTERM, as a deployment runs it
    events.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--name", default="p")
    parser.add_argument("--kind", default="work")
    parser.add_argument("--tool", choices=sorted(TOOLS), default="echo")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lease-seconds", type=float, default=2.0)
    parser.add_argument("--heartbeat-seconds", type=float, default=0.5)
    parser.add_argument("--jitter-seconds", type=float, default=0.5)
    parser.add_argument("--grace-seconds", type=float, default=5.0)
    parser.add_argument("--until-idle", action="store_true")
    parser.add_argument("--max-running", type=int)
    parser.add_argument("--max-running-per-key", type=int)
    parser.add_argument("--provider")
    parser.add_argument("--rate", type=int, help="jobs per second for --provider")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
