"""The middleware checks its store's schema at start, as `fencegate serve` does: behind it a
PostgreSQL database nobody migrated stops the service's start with one line naming
`fencegate migrate`, instead of answering 503 to every keyed request."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate import FencegateMiddleware
from fencegate.types import ASGIApp, Message
from tests.support.asgi import call


def service(database_url: str) -> Starlette:
    async def charge(request: Request) -> JSONResponse:
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charges", charge, methods=["GET", "POST"])])
    app.add_middleware(FencegateMiddleware, database_url=database_url)
    return app


async def start(app: ASGIApp) -> tuple[Message, asyncio.Queue[Message], asyncio.Task[None]]:
    """Run the lifespan's start as a server does: the first message the app sends back."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}

    async def run() -> None:
        await app(scope, inbox.get, outbox.put)

    task = asyncio.create_task(run())
    reply = await asyncio.wait_for(outbox.get(), 30)
    return reply, inbox, task


async def stop(inbox: asyncio.Queue[Message], task: asyncio.Task[None]) -> None:
    await inbox.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(task, 30)


async def test_start_fails_once_with_the_command_that_fixes_it(empty_pg_url: str) -> None:
    reply, inbox, task = await start(service(empty_pg_url))
    assert reply["type"] == "lifespan.startup.failed"
    assert "no fencegate schema" in reply["message"]
    assert f"fencegate migrate --database-url {empty_pg_url}" in reply["message"]
    await stop(inbox, task)


async def test_a_migrated_store_starts_and_answers(pg_url: str) -> None:
    app = service(pg_url)
    reply, inbox, task = await start(app)
    assert reply["type"] == "lifespan.startup.complete"
    answer = await call(app, "POST", "/charges", headers=[("idempotency-key", "k1")])
    assert answer.status == 201
    replay = await call(app, "POST", "/charges", headers=[("idempotency-key", "k1")])
    assert replay.header("idempotent-replayed") == "true"
    await stop(inbox, task)


async def test_without_a_lifespan_the_first_keyed_request_says_why(empty_pg_url: str) -> None:
    app = service(empty_pg_url)
    refused = await call(app, "POST", "/charges", headers=[("idempotency-key", "k1")])
    assert refused.status == 503
    problem = refused.json()
    assert problem["type"].endswith("/store-unavailable")
    assert f"fencegate migrate --database-url {empty_pg_url}" in problem["detail"]
    # Nothing keyed reached the service; an unguarded read still goes straight through.
    assert (await call(app, "GET", "/charges")).status == 201
