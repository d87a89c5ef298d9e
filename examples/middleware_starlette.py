"""`FenceGateMiddleware` in a Starlette service: the gateway's checks in-process.

Serve it::

    uvicorn middleware_starlette:app --app-dir examples --port 8000

or check it without a server (requests go through the ASGI app in memory)::

    python examples/middleware_starlette.py --check

Invoices are captured at most once per ``Idempotency-Key``; the fence protects each invoice
(the entity comes from the path), so a stale worker's late capture is refused with 412.
The store is SQLite at ``FENCEGATE_DATABASE_URL`` (default ``./fencegate.db``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate import FenceGateMiddleware
from fencegate.gateway.routes import EntityRule, RoutePolicy

captures: list[dict[str, Any]] = []


async def capture(request: Request) -> JSONResponse:
    body = await request.json()
    record = {
        "capture_id": f"cap_{len(captures) + 1:04d}",
        "invoice": request.path_params["invoice"],
        "amount_cents": body["amount_cents"],
    }
    captures.append(record)
    return JSONResponse(record, status_code=201)


async def invoice(request: Request) -> JSONResponse:
    mine = [c for c in captures if c["invoice"] == request.path_params["invoice"]]
    return JSONResponse({"invoice": request.path_params["invoice"], "captures": mine})


def build_app(database_url: str | None = None) -> Starlette:
    policy = RoutePolicy(
        prefix="/invoices",
        fence_required=True,
        entity=EntityRule("/invoices/{invoice}/capture"),
    )
    return Starlette(
        routes=[
            Route("/invoices/{invoice}/capture", capture, methods=["POST"]),
            Route("/invoices/{invoice}", invoice, methods=["GET"]),
        ],
        middleware=[
            Middleware(
                FenceGateMiddleware,
                database_url=database_url or os.environ.get("FENCEGATE_DATABASE_URL"),
                routes=[policy],
            )
        ],
    )


app = build_app()


async def check() -> int:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        service = build_app(f"sqlite:///{tmp}/fencegate.db")
        transport = httpx.ASGITransport(app=service)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            url = "/invoices/inv-1042/capture"
            key = {"Idempotency-Key": "payment:inv-1042:capture"}
            for title, fence in (("owner, token 7", "7"), ("retry", "7"), ("stale, token 6", "6")):
                answer = await client.post(
                    url, json={"amount_cents": 4200}, headers={**key, "X-Execution-Fence": fence}
                )
                replayed = answer.headers.get("Idempotent-Replayed") == "true"
                what = answer.json().get("capture_id") or answer.json().get("type")
                print(f"{title:<16} -> {answer.status_code} {what}" + (" (replayed)" * replayed))
            seen = (await client.get("/invoices/inv-1042")).json()["captures"]
    print(f"captures executed: {len(seen)}")
    return 0 if len(seen) == 1 else 1


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(asyncio.run(check()))
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
