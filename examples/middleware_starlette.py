"""`FencegateMiddleware` in a Starlette service: the gateway's checks in-process.

Serve it::

    uvicorn middleware_starlette:app --app-dir examples --port 8000

or check it in one command (it serves itself on a free loopback port for the check)::

    python examples/middleware_starlette.py --check

Invoices are captured at most once per ``Idempotency-Key``; the fence protects each invoice
(the entity comes from the path), so a stale worker's late capture is refused with 412.
The store is SQLite at ``FENCEGATE_DATABASE_URL`` (default ``./fencegate.db``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate import FencegateMiddleware
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
                FencegateMiddleware,
                database_url=database_url or os.environ.get("FENCEGATE_DATABASE_URL"),
                routes=[policy],
            )
        ],
    )


app = build_app()


def serve_in_thread(service: Starlette) -> tuple[str, uvicorn.Server, threading.Thread]:
    """The service on a free loopback port, in a thread (only what the base install has)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(service, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    """(status, headers, JSON body) of one request; an error status is an answer, not a raise."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        base, server, thread = serve_in_thread(build_app(f"sqlite:///{tmp}/fencegate.db"))
        try:
            url = f"{base}/invoices/inv-1042/capture"
            key = {"Idempotency-Key": "payment:inv-1042:capture"}
            for title, fence in (("owner, token 7", "7"), ("retry", "7"), ("stale, token 6", "6")):
                status, headers, answer = call(
                    "POST", url, {"amount_cents": 4200}, {**key, "X-Execution-Fence": fence}
                )
                replayed = headers.get("Idempotent-Replayed") == "true"
                what = answer.get("capture_id") or answer.get("type")
                print(f"{title:<16} -> {status} {what}" + (" (replayed)" * replayed))
            seen = call("GET", f"{base}/invoices/inv-1042")[2]["captures"]
        finally:
            server.should_exit = True
            thread.join(10)
    print(f"captures executed: {len(seen)}")
    return 0 if len(seen) == 1 else 1


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(check())
    uvicorn.run(app, host="127.0.0.1", port=8000)
