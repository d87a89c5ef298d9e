"""One Starlette app behind the Idempotency-Key middleware a user might pick, for the
middleware comparison in `benchmarks.gateway`: the same app, the same uvicorn settings as
the bare proxy, only the middleware differs.

    python -m benchmarks.peers --middleware fencegate --database-url postgresql://… --port N

The app counts executions per Idempotency-Key when a request reaches it (``GET /_count?key=K``,
never counted itself), and ``?delay=SECONDS`` makes it wait before answering, so that
concurrent copies of one key overlap in the correctness check.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MIDDLEWARES = (
    "none",
    "fencegate",
    "fastapi-idempotency-key",
    "asgi-idempotency-header",
    "fastapi-idempotency",
)

executions: collections.Counter[str] = collections.Counter()
_ids = itertools.count(1)


async def charges(request: Request) -> JSONResponse:
    executions[request.headers.get("idempotency-key", "")] += 1
    body = await request.body()
    delay = float(request.query_params.get("delay", "0"))
    if delay:
        await asyncio.sleep(delay)
    return JSONResponse({"id": f"ch_{next(_ids)}", "amount": 1250, "received": len(body)})


async def count(request: Request) -> JSONResponse:
    key = request.query_params["key"]
    return JSONResponse({"key": key, "count": executions[key]})


def build(
    middleware: str, *, database_url: str | None, redis_url: str, history: bool = True
) -> Any:
    lifespan_hooks: list[Any] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for hook in lifespan_hooks:
                await stack.enter_async_context(hook())
            yield

    app = Starlette(
        routes=[Route("/charges", charges, methods=["POST"]), Route("/_count", count)],
        lifespan=lifespan,
    )
    if middleware == "none":
        return app
    if middleware == "fencegate":
        from fencegate.gateway.middleware import FencegateMiddleware

        # FencegateMiddleware closes its store at lifespan shutdown by itself.
        app.add_middleware(FencegateMiddleware, database_url=database_url, decision_history=history)
        return app
    if middleware == "fastapi-idempotency-key":
        from fastapi_idempotency_key import IdempotencyMiddleware
        from fastapi_idempotency_key.backends.redis import RedisBackend

        app.add_middleware(IdempotencyMiddleware, backend=RedisBackend(redis_url=redis_url))
        return app
    if middleware == "asgi-idempotency-header":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.redis import RedisBackend as HeaderBackend
        from redis.asyncio import Redis

        app.add_middleware(
            IdempotencyHeaderMiddleware,  # type: ignore[arg-type]  # a dataclass, not typed as one
            backend=HeaderBackend(redis=Redis.from_url(redis_url)),
        )
        return app
    if middleware == "fastapi-idempotency":
        from fastapi_idempotency import IdempotencyMiddleware as ClaimMiddleware
        from fastapi_idempotency.stores.tortoise import TortoiseStore
        from tortoise import Tortoise

        assert database_url is not None

        @contextlib.asynccontextmanager
        async def tortoise() -> AsyncIterator[None]:
            await Tortoise.init(
                db_url=database_url.replace("postgresql://", "asyncpg://", 1),
                modules={"models": ["fastapi_idempotency.stores.tortoise"]},
                # Requests run outside the lifespan's context: let them find the ORM.
                _enable_global_fallback=True,
            )
            await Tortoise.generate_schemas(safe=True)
            try:
                yield
            finally:
                await Tortoise.close_connections()

        lifespan_hooks.append(tortoise)
        app.add_middleware(ClaimMiddleware, store=TortoiseStore())
        return app
    raise SystemExit(f"unknown middleware {middleware!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Idempotency-Key middlewares, side by side")
    parser.add_argument("--middleware", choices=MIDDLEWARES, required=True)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--decision-history", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(
        build(
            args.middleware,
            database_url=args.database_url,
            redis_url=args.redis_url,
            history=args.decision_history,
        ),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=2048,
    )


if __name__ == "__main__":
    main()
