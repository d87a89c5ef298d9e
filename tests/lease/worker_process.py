"""A worker process for the kill and fleet tests: ``python -m tests.lease.worker_process``.

Runs ``--workers`` Workers in one process (one event loop, each with its own heartbeat
thread and connection), writes every event as JSON lines to ``--events``, stops gracefully
on SIGTERM, and with ``--until-idle`` exits once there is nothing left to do.

Tools (by ``--tool``): ``sleep`` waits ``payload["seconds"]``; ``echo`` returns the payload's
``n`` and the token that ran it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from fencegate.lease import WorkClass
from fencegate.lease.events import EventLog
from fencegate.lease.job import JobContext
from fencegate.lease.metrics import WorkerMetrics
from fencegate.lease.worker import Worker


async def sleep_tool(job: JobContext) -> dict[str, Any]:
    await asyncio.sleep(float(job.payload["seconds"]))
    return {"slept": job.payload["seconds"]}


async def echo_tool(job: JobContext) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"n": job.payload["n"], "token": job.fencing_token}


TOOLS = {"sleep": sleep_tool, "echo": echo_tool}


async def main(args: argparse.Namespace) -> None:
    events = EventLog(args.events, keep=0)
    metrics = WorkerMetrics()
    fast = WorkClass(
        kind=args.kind,
        lease_seconds=args.lease_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        jitter_seconds=args.jitter_seconds,
        backoff_base_seconds=0.05,
        backoff_max_seconds=0.2,
    )
    workers = [
        Worker(
            args.url,
            tools={args.kind: TOOLS[args.tool]},
            worker_id=f"{args.name}-w{i}",
            concurrency=args.concurrency,
            work_classes=[fast],
            events=events,
            metrics=metrics,
            poll_seconds=0.2,
            grace_seconds=5.0,
        )
        for i in range(args.workers)
    ]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [w.stop() for w in workers])
    if args.until_idle:
        await asyncio.gather(*(w.run_until_idle() for w in workers))
    else:
        await asyncio.gather(*(w.run() for w in workers))
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
    parser.add_argument("--until-idle", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
