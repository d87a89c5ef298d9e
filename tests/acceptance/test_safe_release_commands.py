"""Releasing a key safely, as operators do it: `fencegate keys resolve|show` refusing a
release (or a recorded answer) while a copy of the request may still reach the upstream —
its real `fencegate serve` holds it under a live lease, its gateway heartbeats, or its lease
ended less than the release margin ago — saying why and from when, with ``--force``
audited; and going through once it is safe (after a kill -9, once the gateway's registration
ran out and the margin passed). On both stores."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from fencegate.store import DecideRequest, GatewayRow, GatewayStore, open_gateway_store
from fencegate.store.inspect import Inspector
from tests.support.gateway import GatewayProcess
from tests.support.processes import child_env
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(180)

T = 30.0
HEARTBEAT = 0.5  # seconds between a test gateway's heartbeats: alive for 1.5 s after one
GATEWAY = "gw-live:77:0000beef"


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[GatewayStore]:
    opened = await open_gateway_store(store_url, run_migrations=False, pool_max_size=2)
    try:
        yield opened
    finally:
        await opened.close()


async def fencegate(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fencegate.cli", *args],
        capture_output=True, text=True, timeout=60, env=child_env(env),
    )  # fmt: skip


async def row_of(store: GatewayStore, pid: int) -> GatewayRow | None:
    return next((g for g in await store.gateways(timeout=T) if g.pid == pid), None)


def new_key(label: str) -> str:
    return f"test:{label}:{uuid.uuid4().hex[:12]}"


async def test_a_killed_gateway_runs_out_and_its_key_becomes_releasable(
    store_url: str, store: GatewayStore, upstream: UpstreamProcess
) -> None:
    """The gateway forwards a request the upstream holds; while it runs, the key is not
    released (its lease is live). Killed with SIGKILL, its row stays until it runs out, and
    the key may be released once its lease ended longer ago than the release margin."""
    key = new_key("kill")
    margin = "2"
    with GatewayProcess(
        upstream=upstream.url,
        database_url=store_url,
        inflight_lease_seconds=2,
        extra_args=["--gateway-heartbeat", str(HEARTBEAT)],
    ) as gateway:
        pid = gateway.pid
        async with httpx.AsyncClient(timeout=60) as client:
            sent = asyncio.create_task(
                client.post(
                    gateway.url + "/charges",
                    content=b"{}",
                    headers={
                        "idempotency-key": key,
                        "x-upstream-delay": "60",
                        "content-type": "application/json",
                    },
                )
            )
            assert await upstream.await_count(key, 1, timeout=T) == 1
            resolve = ("keys", "resolve", key, "--release", "--database-url", store_url)
            live = await fencegate(*resolve, "--release-margin", margin)
            assert live.returncode == 2, live.stdout
            assert f"key {key!r} not released: its gateway " in live.stderr
            assert "holds it under a live lease" in live.stderr
            assert "may be sending it now" in live.stderr

            gateway.kill()
            with pytest.raises(httpx.TransportError):
                await sent
    row = await row_of(store, pid)
    assert row is not None  # a killed process deletes nothing

    async def ran_out() -> bool:
        found = await row_of(store, pid)
        return found is not None and not found.alive

    await wait_until(ran_out, timeout=10, what="the killed gateway's row running out")

    async def releasable() -> bool:
        record = await store.get_key("default", key, margin=float(margin), timeout=T)
        return record is not None and record.release_blocker is None

    await wait_until(releasable, timeout=T, what="the lease and the margin passing")
    show = ("keys", "show", key, "--json", "--database-url", store_url, "--release-margin", margin)
    shown = orjson.loads((await fencegate(*show)).stdout)
    assert (shown["gateway_alive"], shown["release"]) == (False, "safe now (release margin 2 s)")
    done = await fencegate(*resolve, "--release-margin", margin)
    assert done.returncode == 0, done.stderr
    assert await store.get_key("default", key, timeout=T) is None


async def reserve(store: GatewayStore, key: str, *, lease: float) -> None:
    request = DecideRequest(
        tenant="acme", key=key, fingerprint="fp", entity="inv-1", fence=None,
        owner=f"{GATEWAY}/1", lease_seconds=lease, ttl_seconds=3600.0, retry_unknown=False,
        request_id="req-1", method="POST", target="/v1/charges",
    )  # fmt: skip
    decision = await store.decide(request, timeout=T)
    assert decision.outcome == "reserved"

    async def expired() -> bool:
        record = await store.get_key("acme", key, timeout=T)
        return record is not None and record.unknown

    await wait_until(expired, timeout=T, what="the in-flight lease running out")


async def audit_rows(url: str) -> list[dict[str, Any]]:
    inspector = await Inspector.open(url)
    try:
        return await inspector.audit_log(timeout=T)
    finally:
        await inspector.close()


async def test_keys_resolve_says_why_and_when_and_force_is_audited(
    store_url: str, store: GatewayStore
) -> None:
    key = new_key("operator")
    await store.heartbeat_gateway(GATEWAY, host="gw-live", pid=77, alive_seconds=300, timeout=T)
    await reserve(store, key, lease=0.3)
    where = ("--tenant", "acme", "--database-url", store_url)

    # Its gateway is alive: it may still record the answer or release the key itself.
    for how in (["--release"], ["--completed", "--status", "201", "--body", "{}"]):
        refused = await fencegate("keys", "resolve", key, *where, *how)
        assert refused.returncode == 2, refused.stdout
        assert f"its gateway {GATEWAY} is alive (last heartbeat " in refused.stderr
        assert "it will record or release the key itself" in refused.stderr
    shown = orjson.loads((await fencegate("keys", "show", key, *where, "--json")).stdout)
    assert (shown["gateway"], shown["gateway_alive"]) == (GATEWAY, True)
    assert shown["release"].startswith(f"not yet: its gateway {GATEWAY} is alive")
    text = (await fencegate("keys", "show", key, *where)).stdout
    assert "release_safe_from" in text and "gateway_alive" in text

    # It stopped: now only the margin (env FENCEGATE_RELEASE_MARGIN, as the gateways have it).
    assert await store.deregister_gateway(GATEWAY, timeout=T)
    refused = await fencegate("keys", "resolve", key, *where, "--release",
                              FENCEGATE_RELEASE_MARGIN="600")  # fmt: skip
    assert refused.returncode == 2
    assert "its lease ended " in refused.stderr
    assert "a request sent before then may still be on its way: safe to release from " in (
        refused.stderr
    )
    assert "(release margin 600 s), or use --force" in refused.stderr
    assert await store.get_key("acme", key, timeout=T) is not None
    assert await audit_rows(store_url) == []  # a refusal changes nothing, records nothing

    forced = await fencegate(
        "keys", "resolve", key, *where, "--completed", "--status", "201", "--body",
        '{"id": "ch_1"}', "--force", "--by", "night-op", "--reason", "upstream shows ch_1",
        FENCEGATE_RELEASE_MARGIN="600",
    )  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    assert "completed (forced: the release rule was skipped)" in forced.stdout
    [row] = await audit_rows(store_url)
    assert (row["actor"], row["action"], row["reason"]) == (
        "operator:night-op", "keys.resolve_forced", "upstream shows ch_1",
    )  # fmt: skip
    after = orjson.loads((await fencegate("keys", "show", key, *where, "--json")).stdout)
    assert (after["state"], after["resolution"], after["release"]) == ("completed", "forced", None)
    assert [h["what"] for h in after["history"]] == ["reserved", "resolved_forced"]


async def test_after_the_margin_the_release_goes_through(
    store_url: str, store: GatewayStore
) -> None:
    key = new_key("margin")
    await reserve(store, key, lease=0.3)
    where = ("--tenant", "acme", "--database-url", store_url, "--release-margin", "1.5")

    async def safe() -> bool:
        record = await store.get_key("acme", key, margin=1.5, timeout=T)
        return record is not None and record.release_blocker is None

    await wait_until(safe, timeout=T, what="the release margin passing")
    done = await fencegate("keys", "resolve", key, *where, "--release", "--by", "night-op")
    assert done.returncode == 0, done.stderr
    assert await store.get_key("acme", key, timeout=T) is None
    [row] = await audit_rows(store_url)
    assert (row["action"], orjson.loads(row["before"])["gateway_alive"]) == (
        "keys.resolve_released", False,
    )  # fmt: skip


async def test_a_bad_release_margin_is_one_clear_line(store_url: str) -> None:
    done = await fencegate("keys", "resolve", "k", "--release", "--database-url", store_url,
                           "--release-margin", "-1")  # fmt: skip
    assert done.returncode == 2
    assert "the release margin is 0 or more seconds" in done.stderr
    assert "Traceback" not in done.stderr
