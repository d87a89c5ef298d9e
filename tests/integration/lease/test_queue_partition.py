"""A partitioned queue answers `StoreUnavailable` within each call's timeout, and works again
once the network heals. PostgreSQL is reached through a real TCP relay that the test silences
or cuts; SQLite is held by a real second connection's write lock."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from fencegate.lease import LeaseQueue, StoreUnavailable
from fencegate.store.dburl import parse_database_url
from tests.support.net import SlowPath, TcpRelay, through_port
from tests.support.waits import wait_until

TIMEOUT = 1.0
# Generous on a shared machine; the point is "comes back", not "comes back fast".
SLACK = 4.0


@pytest.fixture
async def relay(pg_url: str) -> AsyncIterator[tuple[TcpRelay, str]]:
    with TcpRelay.to_database(pg_url) as relay:
        yield relay, relay.url_for(pg_url)


async def answers_unavailable(call: Callable[[], Awaitable[Any]], name: str) -> float:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(call(), TIMEOUT + SLACK + 5)
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT + SLACK, f"{name} took {elapsed:.1f}s with timeout={TIMEOUT}s"
    return elapsed


async def every_call_is_unavailable(queue: LeaseQueue, lease: Any, job_id: int) -> None:
    t = TIMEOUT
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "extend": lambda: queue.extend(lease, timeout=t),
        "complete": lambda: queue.complete(lease, {"ok": True}, timeout=t),
        "fail": lambda: queue.fail(lease, "boom", timeout=t),
        "release": lambda: queue.release(lease, timeout=t),
        "commit_stage": lambda: queue.commit_stage(lease, "s", 1, timeout=t),
        "stage_result": lambda: queue.stage_result(lease, "s", timeout=t),
        "claim": lambda: queue.claim("w2", limit=1, timeout=t),
        "enqueue": lambda: queue.enqueue("create_case", None, timeout=t),
        "enqueue_many": lambda: queue.enqueue_many([{"kind": "k"}], timeout=t),
        "cancel": lambda: queue.cancel(job_id, timeout=t),
        "get": lambda: queue.get(job_id, timeout=t),
        "list_jobs": lambda: queue.list_jobs(timeout=t),
        "attempts": lambda: queue.attempts(job_id, timeout=t),
        "now": lambda: queue.now(timeout=t),
    }
    for name, call in calls.items():
        await answers_unavailable(call, name)
    started = time.monotonic()
    assert await asyncio.wait_for(queue.wait_for_work(timeout=t), TIMEOUT + SLACK + 5) is False
    assert time.monotonic() - started < TIMEOUT + SLACK


async def test_silent_network_to_postgres(relay: tuple[TcpRelay, str]) -> None:
    tcp, url = relay
    queue = await LeaseQueue.connect(url, timeout=10, pool_max_size=3)
    try:
        job_id = await queue.enqueue("create_case", {"n": 1})
        [lease] = await queue.claim("w1", limit=1)
        # The first wait sets up the listener and, on a healthy network, says so at once.
        assert await queue.wait_for_work(timeout=2) is True
        tcp.silence()
        await every_call_is_unavailable(queue, lease, job_id)
        tcp.heal()
        renewed = await queue.extend(lease, timeout=10)
        assert renewed is not None and renewed.lease_until > lease.lease_until
        assert await queue.complete(renewed, {"ok": True}, timeout=10) is True
        job = await queue.get(job_id, timeout=10)
        assert (job.state, job.result) == ("succeeded", {"ok": True})
    finally:
        tcp.heal()
        await asyncio.wait_for(queue.close(), 20)


async def test_cut_connections_to_postgres(relay: tuple[TcpRelay, str]) -> None:
    tcp, url = relay
    queue = await LeaseQueue.connect(url, timeout=10, pool_max_size=3)
    try:
        job_id = await queue.enqueue("create_case", None)
        [lease] = await queue.claim("w1", limit=1)
        tcp.cut()
        await every_call_is_unavailable(queue, lease, job_id)
        tcp.heal()
        assert await queue.extend(lease, timeout=10) is not None
    finally:
        tcp.heal()
        await asyncio.wait_for(queue.close(), 20)


async def test_connect_during_a_partition(relay: tuple[TcpRelay, str]) -> None:
    tcp, url = relay
    tcp.silence()
    await answers_unavailable(lambda: LeaseQueue.connect(url, timeout=TIMEOUT), "connect")


async def test_locked_sqlite_store(sqlite_url: str) -> None:
    queue = await LeaseQueue.connect(sqlite_url, timeout=10)
    path = parse_database_url(sqlite_url).sqlite_path
    assert path is not None
    try:
        job_id = await queue.enqueue("create_case", None)
        [lease] = await queue.claim("w1", limit=1)
        other = await queue.enqueue("create_case", None)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            for name, call in {
                "extend": lambda: queue.extend(lease, timeout=TIMEOUT),
                "complete": lambda: queue.complete(lease, 1, timeout=TIMEOUT),
                "claim": lambda: queue.claim("w2", limit=1, timeout=TIMEOUT),
                "enqueue": lambda: queue.enqueue("create_case", None, timeout=TIMEOUT),
                "cancel": lambda: queue.cancel(job_id, timeout=TIMEOUT),
            }.items():
                await answers_unavailable(call, name)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        # Calls that gave up did not happen later behind the caller's back.
        waiting = await queue.get(other)
        assert (waiting.state, waiting.attempt) == ("queued", 0)
        assert (await queue.get(job_id)).state == "running"
        assert len(await queue.list_jobs()) == 2
        assert await queue.complete(lease, "done") is True
    finally:
        await queue.close()


async def test_a_wait_cancelled_while_its_listener_connects_leaves_the_connection_to_the_next(
    pg_url: str,
) -> None:
    """A Worker cancels its wait for work whenever a slot frees, often while the listening
    connection is still being set up. The set-up goes on and the next wait uses it: one
    connection made, not one per cancelled wait, and no abandoned connection attempt."""
    parts = urlsplit(pg_url)
    with SlowPath(parts.hostname or "127.0.0.1", parts.port or 5432) as path:
        url = through_port(pg_url, path.port)
        queue = await LeaseQueue.connect(url, timeout=10, pool_max_size=2)
        unhandled: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        try:
            await queue.enqueue("create_case", {"n": 1})  # the pool's connection is up
            before = path.accepted
            path.hold = 0.2  # each round trip of the set-up now takes a while
            first = asyncio.create_task(queue.wait_for_work(["create_case"], timeout=30))
            await wait_until(lambda: path.accepted > before, timeout=10, what="a connect")
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert await queue.wait_for_work(["create_case"], timeout=30) is True
            assert path.accepted == before + 1
        finally:
            path.hold = 0.0
            await asyncio.wait_for(queue.close(), 20)
            loop.set_exception_handler(None)
        assert unhandled == []
