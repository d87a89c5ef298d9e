"""A worker whose tool calls a fenced service with httpx.

Run it (httpx comes with the ``httpx`` extra: ``pip install 'fencegate[httpx]'``)::

    python examples/worker_httpx.py

It serves the Starlette service of ``middleware_starlette.py`` (FencegateMiddleware in front
of invoice captures) on a loopback port, queues three capture jobs on a SQLite lease queue,
and runs a `Worker` until the queue is idle. The tool sends each capture through an
``httpx.AsyncClient`` whose ``auth`` is ``job.httpx_auth()``: every request carries the job's
``Idempotency-Key`` (job key + step), its fencing token and entity, is refused locally once
the lease is lost or cannot be confirmed, and is signed when the worker has a ``signer``
(e.g. ``fencegate.signing.HttpSigner.from_env()``).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    import httpx
except ModuleNotFoundError:  # the base install has aiohttp; httpx comes with the extra
    sys.exit("This example needs httpx: pip install 'fencegate[httpx]' (or pip install httpx).")

from fencegate.lease import JobContext, LeaseQueue, PermanentError, Worker
from fencegate.lease.events import EventLog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from middleware_starlette import build_app, serve_in_thread


def capture_tool(service: str) -> Any:
    async def capture_invoice(job: JobContext) -> dict[str, Any]:
        invoice = job.payload["invoice"]
        async with httpx.AsyncClient(auth=job.httpx_auth(step="capture"), timeout=10) as client:
            answer = await client.post(
                f"{service}/invoices/{invoice}/capture",
                json={"amount_cents": job.payload["amount_cents"]},
            )
        if answer.status_code == 412:
            raise PermanentError("a newer owner already acted on this invoice")
        answer.raise_for_status()
        return {"capture_id": answer.json()["capture_id"]}

    return capture_invoice


async def main(workdir: Path) -> int:
    service, server, thread = serve_in_thread(build_app(f"sqlite:///{workdir / 'service.db'}"))
    queue_url = f"sqlite:///{workdir / 'queue.db'}"
    queue = await LeaseQueue.connect(queue_url)
    await queue.migrate()
    invoices = ["inv-1042", "inv-1043", "inv-1044"]
    ids = [
        await queue.enqueue(
            "capture_invoice",
            {"invoice": invoice, "amount_cents": 4200},
            idempotency_key=f"payment:{invoice}",
            lease_seconds=10,
            heartbeat_seconds=2,
            jitter_seconds=2,
        )
        for invoice in invoices
    ]
    events = EventLog(sys.stdout)
    worker = Worker(queue_url, tools={"capture_invoice": capture_tool(service)}, events=events)
    await worker.run_until_idle()
    states = [(await queue.get(job_id)).state for job_id in ids]
    await queue.close()
    server.should_exit = True
    thread.join(10)
    print(f"jobs: {states}")
    return 0 if states == ["succeeded"] * len(ids) else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(asyncio.run(main(Path(tmp))))
