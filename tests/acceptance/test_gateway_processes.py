"""`fencegate serve` as real processes: concurrency across processes, a gateway killed with
SIGKILL mid-request, the store cut or silenced by a TCP relay, and upstream faults.

Each gateway is its own uvicorn process on loopback, the upstream is another, and the store is
real PostgreSQL (through `TcpRelay` where the network fails) or a real SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import orjson
import pytest

from fencegate.problems import PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_BASE
from fencegate.store import KeyRecord, open_gateway_store
from fencegate.store.dburl import parse_database_url
from tests.support.gateway import GatewayProcess
from tests.support.net import TcpRelay
from tests.support.processes import child_env
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(180)

BODY = orjson.dumps({"amount": 1250, "currency": "EUR", "customer": "c-1048"})
STORE_TIMEOUT = "1"  # seconds; short so that a dead store is noticed quickly


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    # Shared by the tests of this module: every test uses its own keys.
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        yield c


def new_key(label: str) -> str:
    return f"test:{label}:{uuid.uuid4().hex[:12]}"


async def post(
    client: httpx.AsyncClient,
    base: str,
    key: str | None,
    *,
    path: str = "/charges",
    fence: int | None = None,
    entity: str | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["Idempotency-Key"] = key
    if fence is not None:
        sent["X-Execution-Fence"] = str(fence)
    if entity is not None:
        sent["X-Execution-Entity"] = entity
    return await client.post(base + path, content=BODY, headers=sent)


def problem_kind(response: httpx.Response) -> str:
    """The problem type of an RFC 9457 answer (and a check that it is one)."""
    assert response.headers["content-type"].startswith(PROBLEM_CONTENT_TYPE), response.text
    body = response.json()
    assert body["status"] == response.status_code
    assert body["type"].startswith(PROBLEM_TYPE_BASE), body
    return str(body["type"][len(PROBLEM_TYPE_BASE) :])


def is_forwarded(response: httpx.Response) -> bool:
    return (
        response.status_code == 200
        and response.headers.get("x-upstream") == "fencegate-test-upstream"
        and "idempotent-replayed" not in response.headers
    )


def is_replay(response: httpx.Response) -> bool:
    return response.status_code == 200 and response.headers.get("idempotent-replayed") == "true"


def is_in_flight(response: httpx.Response) -> bool:
    return (
        response.status_code == 409
        and problem_kind(response) == "in-flight"
        and int(response.headers["retry-after"]) >= 0
    )


async def key_rows(database_url: str, key: str) -> list[dict[str, Any]]:
    """The store's rows for one key, with `live` computed by the database clock."""
    target = parse_database_url(database_url)
    if target.kind == "postgresql":
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            rows = await conn.fetch(
                "SELECT state, owner, attempt, locked_until > now() AS live"
                " FROM fencegate_idempotency_keys WHERE key = $1",
                key,
            )
        finally:
            await conn.close()
        return [dict(r) for r in rows]
    raise AssertionError("row checks are written for PostgreSQL")


async def poll_until(
    send: Any, accept: Any, *, timeout: float, interval: float = 0.25
) -> httpx.Response:
    """Send until `accept(response)` holds, or fail after `timeout` with the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        response: httpx.Response = await send()
        if accept(response):
            return response
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no acceptable answer within {timeout}s; last: "
                f"{response.status_code} {response.text[:300]}"
            )
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------------- concurrency


async def assert_one_execution(
    client: httpx.AsyncClient, upstream: UpstreamProcess, bases: list[str]
) -> None:
    """100 concurrent copies of one new key, spread over `bases`: the upstream runs once."""
    key = new_key("concurrent")
    # A slow upstream keeps the first copy in flight while the others arrive.
    slow = {"X-Upstream-Delay": "0.5"}
    answers = await asyncio.gather(
        *(
            post(
                client,
                bases[i % len(bases)],
                key,
                fence=7,
                entity="order:concurrent",
                headers=slow,
            )
            for i in range(100)
        )
    )
    assert await upstream.acount(key) == 1
    forwarded = [a for a in answers if is_forwarded(a)]
    assert len(forwarded) == 1, [(a.status_code, a.text[:120]) for a in answers]
    for answer in answers:
        assert is_forwarded(answer) or is_replay(answer) or is_in_flight(answer), answer.text
    # The upstream received the caller's key, fence and entity unchanged.
    seen = {k: v for k, v in forwarded[0].json()["headers"]}
    assert seen["idempotency-key"] == key
    assert seen["x-execution-fence"] == "7"
    assert seen["x-execution-entity"] == "order:concurrent"
    # Once it is recorded, every gateway replays it byte for byte.
    for base in bases:
        again = await post(client, base, key, fence=7, entity="order:concurrent")
        assert is_replay(again), again.text
        assert again.content == forwarded[0].content
    assert await upstream.acount(key) == 1


async def test_concurrent_copies_run_once_through_one_gateway(
    store_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    with GatewayProcess(upstream=upstream.url, database_url=store_url) as gateway:
        await assert_one_execution(client, upstream, [gateway.url])


async def test_concurrent_copies_run_once_across_two_gateways(
    pg_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    with (
        GatewayProcess(upstream=upstream.url, database_url=pg_url) as first,
        GatewayProcess(upstream=upstream.url, database_url=pg_url) as second,
    ):
        await assert_one_execution(client, upstream, [first.url, second.url])


# ---------------------------------------------------------------------------- crash


LEASE_SECONDS = 3


async def key_record(database_url: str, key: str, *, margin: float = 30.0) -> KeyRecord | None:
    """One key as `fencegate keys show` reads it, on either store."""
    store = await open_gateway_store(database_url, run_migrations=False, pool_max_size=1)
    try:
        return await store.get_key("default", key, margin=margin, timeout=30)
    finally:
        await store.close()


async def wait_for_key(
    database_url: str,
    key: str,
    accept: Callable[[KeyRecord], bool],
    *,
    timeout: float,
    margin: float = 30.0,
) -> KeyRecord:
    async def there() -> KeyRecord | None:
        record = await key_record(database_url, key, margin=margin)
        return record if record is not None and accept(record) else None

    found = await wait_until(there, timeout=timeout, what=f"key {key!r}", interval=0.1)
    assert found is not None
    return found


def retry_routes(path: Path) -> Path:
    path.write_text('[[routes]]\nprefix = "/"\non_unknown = "retry"\n', encoding="utf-8")
    return path


async def test_killed_gateway_leaves_an_unknown_outcome_that_is_never_forwarded_again(
    store_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Default settings: once the dead gateway's lease has run out, the key is an unknown
    outcome, answered 424 and never forwarded again until an operator resolves it."""
    key = new_key("crash-reject")
    with (
        GatewayProcess(
            upstream=upstream.url, database_url=store_url, inflight_lease_seconds=LEASE_SECONDS
        ) as doomed,
        GatewayProcess(
            upstream=upstream.url, database_url=store_url, inflight_lease_seconds=LEASE_SECONDS
        ) as survivor,
    ):
        in_flight = asyncio.create_task(
            post(client, doomed.url, key, headers={"X-Upstream-Delay": "60"})
        )
        assert await upstream.await_count(key, 1, timeout=30) == 1
        doomed.kill()
        with pytest.raises(httpx.TransportError):
            await in_flight

        await wait_for_key(store_url, key, lambda r: r.unknown, timeout=LEASE_SECONDS + 30)
        # While the dead gateway's registration has not run out, it might still record the
        # key itself: 503 outcome-pending ("retry"), never 424. Then 424, for an operator.
        kinds: list[str] = []

        async def settled_as_unknown() -> bool:
            answer = await post(client, survivor.url, key)
            kinds.append(problem_kind(answer))
            assert answer.status_code in (424, 503), answer.text
            return answer.status_code == 424

        await wait_until(settled_as_unknown, timeout=60, what="424 once the gateway is dead")
        assert set(kinds) <= {"outcome-pending", "outcome-unknown"}, kinds
        for _ in range(2):
            answer = await post(client, survivor.url, key)
            assert answer.status_code == 424, answer.text
            assert problem_kind(answer) == "outcome-unknown"
            assert answer.json()["reason"] == "lease_expired"
        assert await upstream.acount(key) == 1

        # The operator learns the upstream did charge, and records its answer: refused while
        # a copy of the request may still be on its way (the dead gateway's registration has
        # not run out, or its lease ended less than the release margin ago), then accepted.
        margin = 10.0
        resolve = (
            "keys", "resolve", key, "--database-url", store_url, "--completed",
            "--status", "201", "--body", '{"id": "ch_1"}', "--release-margin", str(margin),
        )  # fmt: skip
        early = await run_command(*resolve)
        assert early.returncode == 2 and f"key {key!r} not resolved: its" in early.stderr
        await wait_for_key(
            store_url, key, lambda r: r.release_blocker is None, timeout=60, margin=margin
        )
        resolved = await run_command(*resolve)
        assert resolved.returncode == 0, resolved.stderr
        replay = await post(client, survivor.url, key)
        assert replay.status_code == 201 and replay.json() == {"id": "ch_1"}
        assert replay.headers["idempotent-replayed"] == "true"
        assert await upstream.acount(key) == 1


async def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fencegate.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )


async def test_killed_gateway_leaves_key_that_another_takes_over_where_the_route_retries(
    pg_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    key = new_key("crash")
    routes = retry_routes(tmp_path / "routes.toml")
    with (
        GatewayProcess(
            upstream=upstream.url,
            database_url=pg_url,
            inflight_lease_seconds=LEASE_SECONDS,
            config=routes,
        ) as doomed,
        GatewayProcess(
            upstream=upstream.url,
            database_url=pg_url,
            inflight_lease_seconds=LEASE_SECONDS,
            config=routes,
        ) as survivor,
    ):
        # Headers are not part of the fingerprint: the same request, once slow.
        in_flight = asyncio.create_task(
            post(client, doomed.url, key, headers={"X-Upstream-Delay": "60"})
        )
        assert await upstream.await_count(key, 1, timeout=30) == 1
        [before] = await key_rows(pg_url, key)
        assert before["state"] == "in_flight" and before["live"]

        doomed.kill()
        with pytest.raises(httpx.TransportError):
            await in_flight

        # The dead gateway's lease has not run out yet: the key is not free.
        early = await post(client, survivor.url, key)
        [row] = await key_rows(pg_url, key)
        assert row["live"], "the lease ran out before the first check; machine too slow?"
        assert is_in_flight(early), early.text
        assert row["owner"] == before["owner"]
        assert await upstream.acount(key) == 1

        # Once it has, the survivor takes the key over and forwards again with the same key.
        takeover = asyncio.create_task(
            poll_until(
                lambda: post(client, survivor.url, key, headers={"X-Upstream-Delay": "5"}),
                lambda r: r.status_code != 409,
                timeout=LEASE_SECONDS + 30,
            )
        )
        assert await upstream.await_count(key, 2, timeout=LEASE_SECONDS + 30) == 2
        # While the takeover is in flight there is one owner, the survivor, and it is live.
        [during] = await key_rows(pg_url, key)
        assert during["state"] == "in_flight" and during["live"]
        assert during["owner"] != before["owner"]
        assert during["attempt"] > before["attempt"]
        meanwhile = await post(client, survivor.url, key)
        assert is_in_flight(meanwhile), meanwhile.text

        answer = await takeover
        assert is_forwarded(answer), answer.text
        assert answer.json()["key"] == key
        assert answer.json()["execution"] == 2
        [after] = await key_rows(pg_url, key)
        assert after["state"] == "completed"
        replay = await post(client, survivor.url, key)
        assert is_replay(replay) and replay.content == answer.content
        assert await upstream.acount(key) == 2


# ---------------------------------------------------------------------------- store down


def relayed(url: str, relay: TcpRelay) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    userinfo = netloc[0] + "@" if len(netloc) == 2 else ""
    return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{relay.port}"))


@pytest.fixture
def pg_relay(pg_url: str) -> Iterator[TcpRelay]:
    parts = urlsplit(pg_url)
    with TcpRelay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        yield relay


@pytest.mark.parametrize("fault", ["cut", "silence"])
async def test_postgres_unreachable_fails_closed_then_recovers(
    fault: str,
    pg_url: str,
    pg_relay: TcpRelay,
    upstream: UpstreamProcess,
    client: httpx.AsyncClient,
) -> None:
    with short_store_timeout_gateway(upstream, relayed(pg_url, pg_relay)) as gateway:
        warm = await post(client, gateway.url, new_key("warm"), fence=1, entity="order:warm")
        assert is_forwarded(warm), warm.text
        executed_before = (await upstream.astats())["requests"]

        getattr(pg_relay, fault)()
        key = new_key(f"store-{fault}")
        for fence in (None, 3):
            answer = await post(client, gateway.url, key, fence=fence, entity="order:down")
            assert answer.status_code == 503, answer.text
            assert problem_kind(answer) == "store-unavailable"
        # Fail closed: nothing reached the upstream while the store was away.
        assert (await upstream.astats())["requests"] == executed_before

        pg_relay.heal()
        resumed = await poll_until(
            lambda: post(client, gateway.url, key, fence=5, entity="order:down"),
            lambda r: r.status_code < 300,
            timeout=45,
        )
        assert is_forwarded(resumed), resumed.text
        assert await upstream.acount(key) == 1


def short_store_timeout_gateway(upstream: UpstreamProcess, database_url: str) -> GatewayProcess:
    """A gateway that notices a dead store within a second."""
    return GatewayProcess(
        upstream=upstream.url,
        database_url=database_url,
        env={"FENCEGATE_STORE_TIMEOUT": STORE_TIMEOUT},
    )


def sqlite_path(url: str) -> Path:
    path = parse_database_url(url).sqlite_path
    assert path is not None
    return path


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Another process's writer holding SQLite's lock: the store cannot be written."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_sqlite_locked_past_store_timeout_fails_closed_then_recovers(
    sqlite_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    path = sqlite_path(sqlite_url)
    with short_store_timeout_gateway(upstream, sqlite_url) as gateway:
        warm = await post(client, gateway.url, new_key("warm"))
        assert is_forwarded(warm), warm.text
        executed_before = (await upstream.astats())["requests"]
        key = new_key("sqlite-locked")
        with exclusive_lock(path):
            answer = await post(client, gateway.url, key, fence=2, entity="order:locked")
            assert answer.status_code == 503, answer.text
            assert problem_kind(answer) == "store-unavailable"
            assert (await upstream.astats())["requests"] == executed_before
        # The same key goes through well before an in-flight lease (30 s by default) could
        # run out: the refused attempt left no reservation behind.
        resumed = await poll_until(
            lambda: post(client, gateway.url, key, fence=2, entity="order:locked"),
            lambda r: r.status_code < 300,
            timeout=20,
        )
        assert is_forwarded(resumed), resumed.text
        assert await upstream.acount(key) == 1


# ---------------------------------------------------------------------------- upstream faults


def write_routes(path: Path, upstream: str, routes: list[tuple[str, str]]) -> Path:
    """A routes file: one ``[[routes]]`` table per (prefix, on_unknown), 1 s upstream timeout."""
    tables = [
        f'[[routes]]\nprefix = "{prefix}"\nupstream = "{upstream}"\ntimeout = 1\n'
        f'on_unknown = "{on_unknown}"\n'
        for prefix, on_unknown in routes
    ]
    path.write_text("\n".join(tables), encoding="utf-8")
    return path


async def test_upstream_refusing_connections_gets_502_and_the_key_is_released(
    store_url: str, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # The port is chosen, nothing listens on it yet.
    with UpstreamProcess(autostart=False) as absent:
        # A key left as outcome_unknown would be refused on this route: only a released
        # key goes through again.
        routes = write_routes(tmp_path / "routes.toml", absent.url, [("/", "reject")])
        with GatewayProcess(upstream=absent.url, database_url=store_url, config=routes) as gateway:
            key = new_key("refused")
            answer = await post(client, gateway.url, key, fence=1, entity="order:refused")
            assert answer.status_code == 502, answer.text
            problem_kind(answer)
            absent.start()
            retried = await post(client, gateway.url, key, fence=1, entity="order:refused")
            assert is_forwarded(retried), retried.text
            assert await absent.acount(key) == 1


async def test_upstream_timeout_is_504_then_retry_or_reject_per_route(
    pg_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    routes = write_routes(
        tmp_path / "routes.toml", upstream.url, [("/retry", "retry"), ("/reject", "reject")]
    )
    slow = {"X-Upstream-Delay": "5"}
    with GatewayProcess(upstream=upstream.url, database_url=pg_url, config=routes) as gateway:
        for prefix in ("/retry", "/reject"):
            key = new_key(prefix.strip("/"))
            timed_out = await post(client, gateway.url, key, path=f"{prefix}/x", headers=slow)
            assert timed_out.status_code == 504, timed_out.text
            problem_kind(timed_out)
            assert await upstream.acount(key) == 1
            [row] = await key_rows(pg_url, key)
            assert row["state"] == "outcome_unknown"

            again = await post(client, gateway.url, key, path=f"{prefix}/x")
            if prefix == "/retry":
                assert is_forwarded(again), again.text
                assert await upstream.acount(key) == 2
                assert again.json()["key"] == key
            else:
                assert again.status_code == 424, again.text
                assert problem_kind(again) == "outcome-unknown"
                assert await upstream.acount(key) == 1


async def test_upstream_5xx_is_relayed_and_released(
    pg_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    routes = write_routes(tmp_path / "routes.toml", upstream.url, [("/", "reject")])
    with GatewayProcess(upstream=upstream.url, database_url=pg_url, config=routes) as gateway:
        key = new_key("5xx")
        failed = await post(client, gateway.url, key, headers={"X-Upstream-Status": "503"})
        assert failed.status_code == 503
        assert failed.headers.get("x-upstream") == "fencegate-test-upstream"
        assert await key_rows(pg_url, key) == []
        retried = await post(client, gateway.url, key)
        assert is_forwarded(retried), retried.text
        assert await upstream.acount(key) == 2


async def test_answer_the_store_could_not_take_is_recorded_when_postgres_returns(
    pg_url: str, pg_relay: TcpRelay, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    """The upstream acted but the store was cut before the answer could be recorded: the
    caller still gets the answer, the gateway keeps trying, and once the store is back the
    retry is a replay: one execution."""
    with short_store_timeout_gateway(upstream, relayed(pg_url, pg_relay)) as gateway:
        key = new_key("store-lost-midway")
        first = asyncio.create_task(
            post(client, gateway.url, key, headers={"X-Upstream-Delay": "2"})
        )
        assert await upstream.await_count(key, 1, timeout=30) == 1
        pg_relay.cut()
        answer = await first
        # The upstream's answer still reaches the caller.
        assert is_forwarded(answer), answer.text
        [row] = await key_rows(pg_url, key)
        assert row["state"] == "in_flight", row

        pg_relay.heal()
        await wait_for_key(pg_url, key, lambda r: r.state == "completed", timeout=30)
        replay = await post(client, gateway.url, key)
        assert is_replay(replay), replay.text
        assert replay.content == answer.content
        assert await upstream.acount(key) == 1


async def test_answer_the_sqlite_store_could_not_take_is_recorded_when_the_lock_is_freed(
    sqlite_url: str, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    path = sqlite_path(sqlite_url)
    with short_store_timeout_gateway(upstream, sqlite_url) as gateway:
        key = new_key("sqlite-lost-midway")
        first = asyncio.create_task(
            post(client, gateway.url, key, headers={"X-Upstream-Delay": "2"})
        )
        assert await upstream.await_count(key, 1, timeout=30) == 1
        with exclusive_lock(path):
            answer = await first
            assert is_forwarded(answer), answer.text
        await wait_for_key(sqlite_url, key, lambda r: r.state == "completed", timeout=30)
        replay = await post(client, gateway.url, key)
        assert is_replay(replay) and replay.content == answer.content
        assert await upstream.acount(key) == 1


async def test_sigterm_records_the_answers_still_owed_within_the_grace_period(
    pg_url: str, pg_relay: TcpRelay, upstream: UpstreamProcess, client: httpx.AsyncClient
) -> None:
    gateway = GatewayProcess(
        upstream=upstream.url,
        database_url=relayed(pg_url, pg_relay),
        env={"FENCEGATE_STORE_TIMEOUT": STORE_TIMEOUT, "FENCEGATE_SHUTDOWN_GRACE_SECONDS": "60"},
    )
    with gateway:
        key = new_key("sigterm-owed")
        first = asyncio.create_task(
            post(client, gateway.url, key, headers={"X-Upstream-Delay": "2"})
        )
        assert await upstream.await_count(key, 1, timeout=30) == 1
        pg_relay.cut()
        assert is_forwarded(await first)
        gateway.signal(signal.SIGTERM)
        # The store comes back only once the gateway is shutting down and draining what it
        # owes: the answer can be recorded then, or never.
        await wait_until(
            lambda: "to record 1 answers" in gateway.log_text(),
            timeout=30,
            what="the shutdown's drain",
        )
        pg_relay.heal()
        # uvicorn ends a graceful shutdown by raising the signal it caught again.
        assert await asyncio.to_thread(gateway.wait_exit, timeout=60) in (0, -signal.SIGTERM)
        assert "recorded complete of key" in gateway.log_text()
        [row] = await key_rows(pg_url, key)
        assert row["state"] == "completed", row
