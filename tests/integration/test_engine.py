"""The decision engine on its own: an `IncomingRequest`, a policy, a store, and a forward
callable standing for the upstream (here: one that answers, refuses or never answers)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from urllib.parse import urlsplit

import orjson
import pytest

from fencegate.gateway.engine import Engine, GatewayResponse
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import Pipeline
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.gateway.upstream import UpstreamOutcomeUnknown, UpstreamRefused, UpstreamResponse
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.types import IncomingRequest
from tests.support.asgi import call
from tests.support.net import TcpRelay
from tests.support.waits import wait_until


def request(key: str = "k", *, fence: int | None = None, body: bytes = b"{}") -> IncomingRequest:
    headers = [("idempotency-key", key)]
    if fence is not None:
        headers += [("x-execution-fence", str(fence)), ("x-execution-entity", "job:1")]
    return IncomingRequest("POST", "http", "gw", "/pay", "", tuple(headers), body)


class Upstream:
    """Counts calls; each call does what the next entry of ``script`` says."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.calls = 0

    async def forward(self, timeout: float) -> UpstreamResponse:
        self.calls += 1
        action = self.script.pop(0) if self.script else "ok"
        if action == "refused":
            raise UpstreamRefused("connection refused")
        if action == "lost":
            raise UpstreamOutcomeUnknown("connection lost after sending")
        return UpstreamResponse(200, [("content-type", "text/plain")], b"done %d" % self.calls)


def problem(response: GatewayResponse) -> dict[str, object]:
    assert ("content-type", "application/problem+json") in response.headers
    return dict(orjson.loads(response.body))


async def test_refused_upstream_is_502_and_releases_the_key(store: GatewayStore) -> None:
    engine = Engine(store, store_timeout=30)
    upstream = Upstream("refused")
    policy = RoutePolicy()
    refused = await engine.handle(request(), policy, "default", upstream.forward)
    assert refused.status == 502 and refused.decision == "upstream_unreachable"
    assert str(problem(refused)["type"]).endswith("/upstream-unreachable")
    retried = await engine.handle(request(), policy, "default", upstream.forward)
    assert (retried.status, retried.body) == (200, b"done 2")
    replay = await engine.handle(request(), policy, "default", upstream.forward)
    assert replay.decision == "replayed" and replay.body == b"done 2"
    assert upstream.calls == 2


@pytest.mark.parametrize(("on_unknown", "status"), [("reject", 424), ("retry", 200)])
async def test_lost_connection_is_504_outcome_unknown(
    store: GatewayStore, on_unknown: str, status: int
) -> None:
    engine = Engine(store, store_timeout=30)
    upstream = Upstream("lost")
    policy = RoutePolicy(on_unknown=on_unknown)  # type: ignore[arg-type]
    lost = await engine.handle(request(), policy, "default", upstream.forward)
    assert lost.status == 504 and str(problem(lost)["type"]).endswith("/upstream-timeout")
    again = await engine.handle(request(), policy, "default", upstream.forward)
    assert again.status == status
    assert upstream.calls == (1 if on_unknown == "reject" else 2)


class PipelineUpstream:
    """The pipeline's view of an upstream: the same scripted `Upstream` behind it."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def send(self, *args: object, timeout: float) -> UpstreamResponse:
        return await self.upstream.forward(timeout)


async def test_each_decision_is_counted_once_by_the_pipeline(store: GatewayStore) -> None:
    metrics = GatewayMetrics()
    engine = Engine(store, store_timeout=30, metrics=metrics)
    pipeline = Pipeline(
        engine=engine,
        routes=RouteTable([], default=RoutePolicy()),
        upstream=PipelineUpstream(Upstream()),
    )
    for _ in range(3):
        await call(pipeline, "POST", "/pay", headers=[("idempotency-key", "k")], body=b"{}")
    await call(pipeline, "POST", "/h/../pay", headers=[("idempotency-key", "k")], body=b"{}")
    text = metrics.render().decode()
    requests = "fencegate_gateway_requests_total"
    assert f'{requests}{{decision="forwarded",problem=""}} 1.0' in text
    assert f'{requests}{{decision="replayed",problem=""}} 2.0' in text
    assert f'{requests}{{decision="invalid_request",problem="invalid-target"}} 1.0' in text
    assert 'fencegate_store_latency_seconds_count{operation="decide"} 3.0' in text
    assert "fencegate_upstream_latency_seconds_count 1.0" in text


async def test_unreachable_sqlite_store_is_503_and_nothing_is_forwarded(sqlite_url: str) -> None:
    store = await open_gateway_store(sqlite_url, run_migrations=False)
    path = urlsplit(sqlite_url).path[1:]
    blocker = sqlite3.connect(path, timeout=1, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # another process holds the file
        engine = Engine(store, store_timeout=0.5)
        upstream = Upstream()
        answer = await engine.handle(request(fence=3), RoutePolicy(), "default", upstream.forward)
        assert answer.status == 503
        assert str(problem(answer)["type"]).endswith("/store-unavailable")
        assert upstream.calls == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        await asyncio.sleep(0)
    try:
        await engine.close()  # the release kept trying for the refused decision stops
        engine = Engine(store, store_timeout=30)
        answer = await engine.handle(request(fence=3), RoutePolicy(), "default", upstream.forward)
        assert answer.status == 200
    finally:
        await engine.close()
        await store.close()


async def refused_with_a_release_kept_trying(sqlite_url: str) -> tuple[GatewayStore, Engine]:
    """A store another process locks: the decision is refused (503) and the release of
    whatever it may have reserved is kept trying in the background."""
    store = await open_gateway_store(sqlite_url, run_migrations=False)
    engine = Engine(store, store_timeout=0.5)
    blocker = sqlite3.connect(urlsplit(sqlite_url).path[1:], timeout=1, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        answer = await engine.handle(request(), RoutePolicy(), "default", Upstream().forward)
        assert answer.status == 503
        assert len(engine.pending) == 1
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    return store, engine


async def test_closing_the_engine_stops_its_background_writes(sqlite_url: str) -> None:
    store, engine = await refused_with_a_release_kept_trying(sqlite_url)
    tasks = list(getattr(engine.pending, "_tasks"))  # noqa: B009
    try:
        await engine.close()
        assert tasks and all(task.done() for task in tasks)
        assert len(engine.pending) == 0
    finally:
        await store.close()


async def test_a_closed_store_stops_the_writes_kept_trying_for_it(sqlite_url: str) -> None:
    # Without the engine closed first: the release stops at its next try, rather than
    # retry against the closed store until the lease it watches runs out (30 s).
    store, engine = await refused_with_a_release_kept_trying(sqlite_url)
    await store.close()
    await wait_until(lambda: len(engine.pending) == 0, timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["silence", "cut"])
async def test_unreachable_postgres_store_is_503_and_nothing_is_forwarded(
    pg_url: str, fault: str
) -> None:
    with TcpRelay.to_database(pg_url) as relay:
        via_relay = relay.url_for(pg_url)
        store = await open_gateway_store(via_relay, run_migrations=False)
        try:
            engine = Engine(store, store_timeout=1.0)
            upstream = Upstream()
            ok = await engine.handle(request("a"), RoutePolicy(), "default", upstream.forward)
            assert ok.status == 200
            getattr(relay, fault)()
            for key in ("b", "c"):
                answer = await engine.handle(
                    request(key), RoutePolicy(), "default", upstream.forward
                )
                assert answer.status == 503
                assert str(problem(answer)["type"]).endswith("/store-unavailable")
            assert upstream.calls == 1
        finally:
            relay.heal()
            await store.close()


@pytest.mark.timeout(120)
async def test_a_reservation_that_commits_after_the_503_is_released_so_the_retry_runs(
    pg_url: str,
) -> None:
    """The decision reaches PostgreSQL and commits, but its answer never comes back: the
    client gets 503 (nothing forwarded), and the reservation it left under its own owner is
    released in the background once the store answers again, so the retry runs normally."""
    with TcpRelay.to_database(pg_url) as relay:
        via_relay = relay.url_for(pg_url)
        # One connection, its decision statement already prepared: once deafened, the next
        # decision goes out whole (bind, execute, sync) and commits on the server. A new
        # connection opened while the answers are dropped hangs until its connect timeout:
        # a short one, so the release is not held up long after the relay heals.
        store = await open_gateway_store(
            via_relay, run_migrations=False, pool_max_size=1, timeout=2
        )
        direct = await open_gateway_store(pg_url, run_migrations=False)
        try:
            engine = Engine(store, store_timeout=1.0)
            upstream = Upstream()
            ok = await engine.handle(request("a"), RoutePolicy(), "default", upstream.forward)
            assert ok.status == 200
            relay.deafen()
            refused = await engine.handle(request("b"), RoutePolicy(), "default", upstream.forward)
            assert refused.status == 503
            left = await direct.get_key("default", "b", timeout=30)
            assert left is not None and left.state == "in_flight"  # committed behind its back
            relay.heal()

            async def released() -> bool:
                return await direct.get_key("default", "b", timeout=30) is None

            await wait_until(released, timeout=30, what="the abandoned reservation released")
            retry = await engine.handle(request("b"), RoutePolicy(), "default", upstream.forward)
            assert retry.status == 200
            assert upstream.calls == 2  # "a", then the retry of "b"
        finally:
            relay.heal()
            await store.close()
            await direct.close()


@pytest.mark.timeout(120)
async def test_an_answer_recorded_with_only_its_reply_lost_is_not_reported_as_lost(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store commits the answer but its reply never arrives: the write is tried again,
    finds nothing to change, and the log says the answer had landed, not that the key is no
    longer held."""
    caplog.set_level(logging.INFO, logger="fencegate.gateway")
    with TcpRelay.to_database(pg_url) as relay:
        via_relay = relay.url_for(pg_url)
        store = await open_gateway_store(
            via_relay, run_migrations=False, pool_max_size=1, timeout=2
        )
        try:
            engine = Engine(store, store_timeout=1.0)
            warm = await engine.handle(request("a"), RoutePolicy(), "default", Upstream().forward)
            assert warm.status == 200

            async def answer_then_lose_the_store_replies(timeout: float) -> UpstreamResponse:
                relay.deafen()
                return UpstreamResponse(201, [], b"charged")

            answered = await engine.handle(
                request("b"), RoutePolicy(), "default", answer_then_lose_the_store_replies
            )
            assert answered.status == 201
            await wait_until(lambda: len(engine.pending) == 1, timeout=30, what="a write owed")
            relay.heal()
            await wait_until(lambda: len(engine.pending) == 0, timeout=30, what="the write done")
            record = await store.get_key("default", "b", timeout=30)
            assert record is not None and record.state == "completed"
        finally:
            relay.heal()
            await store.close()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "no longer held" in m], messages
    assert [m for m in messages if "complete of key 'b'" in m and "already landed" in m]
