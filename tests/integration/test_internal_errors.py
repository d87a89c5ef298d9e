"""A bug is not an outage: a fault in fencegate's own decision code answers 500
``internal-error`` (nothing forwarded, the key not left reserved, the PostgreSQL connection
kept), while a store that cannot answer still answers 503 ``store-unavailable``.

The gateway is `fencegate serve`'s own application, in process (so that a fault can be put
into its code), in front of a real upstream process, on both stores. The faults are put into
fencegate's code, never into the store: the store runs for real."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from fencegate import FencegateMiddleware
from fencegate.gateway.app import GatewayApplication
from fencegate.gateway.config import load_config
from fencegate.store import DecideRequest, Decision, GatewayStore
from tests.support.asgi import Answer, call
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(120)

PROBLEM_MEMBERS = {"type", "title", "status", "detail", "request_id"}


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def gateway(store_url: str, upstream: UpstreamProcess) -> AsyncIterator[GatewayApplication]:
    config = load_config(
        {"upstream": upstream.url, "database_url": store_url, "store_timeout": 1.0}
    )
    app = GatewayApplication(config)
    await app.startup()
    try:
        yield app
    finally:
        await app.shutdown()


async def post(app: GatewayApplication, key: str) -> Answer:
    return await call(app, "POST", "/charges", headers=[("idempotency-key", key)], body=b"{}")


def boom(*args: Any, **kwargs: Any) -> Any:
    raise KeyError("injected")


def fault_in_the_fingerprint(app: GatewayApplication, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the store is asked: nothing can be reserved."""
    monkeypatch.setattr("fencegate.gateway.engine.request_fingerprint", boom)


def fault_inside_the_store_call(app: GatewayApplication, monkeypatch: pytest.MonkeyPatch) -> None:
    """In fencegate's code that runs inside the store's call (on PostgreSQL while holding
    its connection, on SQLite inside the write transaction)."""
    assert app.store is not None
    if app.store.kind == "sqlite":
        monkeypatch.setattr("fencegate.store.sqlite._decide", boom)
    else:
        monkeypatch.setattr("fencegate.store.postgres.server_budget_ms", boom)


def fault_after_the_reservation(app: GatewayApplication, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the decision committed its reservation: the key is reserved when the bug hits."""
    store = app.store
    assert store is not None
    decide = store.decide

    async def decide_then_fail(request: DecideRequest, *, timeout: float) -> Decision:
        await decide(request, timeout=timeout)
        raise KeyError("injected")

    monkeypatch.setattr(store, "decide", decide_then_fail)


async def gateway_backends(store_url: str) -> set[int] | None:
    """The PostgreSQL backends of the gateway's pool (None on SQLite)."""
    if store_url.startswith("sqlite"):
        return None
    conn = await asyncpg.connect(store_url)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'fencegate-gateway'"
        )
        return {int(row["pid"]) for row in rows}
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("inject", "where"),
    [
        (fault_in_the_fingerprint, "request"),
        (fault_inside_the_store_call, "decide"),
        (fault_after_the_reservation, "decide"),
    ],
    ids=["fingerprint", "inside-store-call", "after-reservation"],
)
async def test_a_bug_in_the_decision_code_is_500_internal_error_and_nothing_is_forwarded(
    gateway: GatewayApplication,
    store_url: str,
    upstream: UpstreamProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    inject: Callable[[GatewayApplication, pytest.MonkeyPatch], None],
    where: str,
) -> None:
    caplog.set_level(logging.ERROR, logger="fencegate.gateway")
    key = f"bug-{inject.__name__}-{gateway.store.kind if gateway.store else ''}"
    assert (await post(gateway, "warm-up-" + key)).status == 200
    backends = await gateway_backends(store_url)
    requests_before = (await upstream.astats())["requests"]

    inject(gateway, monkeypatch)
    failed = [await post(gateway, key), await post(gateway, key + "-again")]

    for answer in failed:
        assert answer.status == 500, answer.body
        assert answer.header("content-type") == "application/problem+json"
        body = answer.json()
        assert body["type"] == "https://fencegate.dev/problems/internal-error"
        assert body["title"] == "Internal error" and body["status"] == 500
        assert set(body) == PROBLEM_MEMBERS
        assert body["request_id"] == answer.header("x-request-id")
        assert "KeyError" not in answer.body.decode() and "injected" not in answer.body.decode()
    assert (await upstream.astats())["requests"] == requests_before, "something was forwarded"

    # Logged with its traceback once for the kind, then in one line; counted.
    logged = [r for r in caplog.records if "internal error in" in r.getMessage()]
    assert len(logged) == 2 and logged[0].exc_info is not None and logged[1].exc_info is None
    assert "seen 2 times" in logged[1].getMessage()
    metrics = gateway.metrics.render().decode()
    assert f'fencegate_internal_errors_total{{where="{where}"}} 2.0' in metrics
    assert 'problem="store-unavailable"' not in metrics

    # Fixed: the key is not left reserved (a reservation the fault left behind is released
    # in the background), and the retry runs normally, once.
    monkeypatch.undo()
    store = gateway.store
    assert store is not None

    async def released() -> bool:
        return await store.get_key("default", key, timeout=5) is None

    await wait_until(released, timeout=15, what="the key to be released")
    retried = await post(gateway, key)
    assert retried.status == 200, retried.body
    assert await upstream.acount(key) == 1
    # No PostgreSQL connection of the gateway was closed for the bug (the background
    # release may have opened another).
    after = await gateway_backends(store_url)
    assert backends is None or (after is not None and backends <= after), (backends, after)


async def test_a_store_that_cannot_answer_is_still_503(
    gateway: GatewayApplication, store_url: str, upstream: UpstreamProcess
) -> None:
    """Another transaction holds a lock the decision needs past the store timeout."""
    assert (await post(gateway, "outage-warm-up")).status == 200
    release = await hold_the_keys_table(store_url)
    try:
        requests_before = (await upstream.astats())["requests"]
        refused = await post(gateway, "outage")
        assert refused.status == 503, refused.body
        assert refused.json()["type"] == "https://fencegate.dev/problems/store-unavailable"
        assert (await upstream.astats())["requests"] == requests_before
    finally:
        await release()
    assert "fencegate_internal_errors_total{" not in gateway.metrics.render().decode()


async def hold_the_keys_table(store_url: str) -> Callable[[], Awaitable[None]]:
    """Lock the store as another writer would; returns how to let go."""
    if store_url.startswith("sqlite"):
        path = urlsplit(store_url).path[1:]
        blocker = sqlite3.connect(path, timeout=1, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")

        async def release_sqlite() -> None:
            blocker.execute("ROLLBACK")
            blocker.close()

        return release_sqlite
    conn = await asyncpg.connect(store_url)
    await conn.execute("BEGIN")
    await conn.execute("LOCK TABLE fencegate_idempotency_keys IN ACCESS EXCLUSIVE MODE")

    async def release_pg() -> None:
        await conn.execute("ROLLBACK")
        await asyncio.wait_for(conn.close(), 10)

    return release_pg


class RaisingApp:
    """An application whose handler fails once with its own error, then answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the application's own failure")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def test_under_the_middleware_the_apps_own_error_propagates_and_ours_is_500(
    store: GatewayStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapped application's exception is its own: it reaches its server as it is (the key
    released, so the retry runs). A fault of fencegate's is a 500 ``internal-error``, and the
    application is not called."""
    app = RaisingApp()
    middleware = FencegateMiddleware(app, store=store, store_timeout=30.0)
    with pytest.raises(RuntimeError, match="own failure"):
        await call(middleware, "POST", "/orders", headers=[("idempotency-key", "a")], body=b"{}")
    retried = await call(middleware, "POST", "/orders", headers=[("idempotency-key", "a")])
    assert (retried.status, app.calls) == (200, 2)

    monkeypatch.setattr("fencegate.gateway.engine.request_fingerprint", boom)
    failed = await call(middleware, "POST", "/orders", headers=[("idempotency-key", "b")])
    assert failed.status == 500 and failed.json()["type"].endswith("/internal-error")
    assert app.calls == 2
