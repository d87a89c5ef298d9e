"""Reconciliation with real `fencegate serve` processes, a real charges API that can be asked
whether it ran a key (`tests.support.charges`), and real stores (SQLite and PostgreSQL).

A key whose outcome became unknown (its gateway killed with SIGKILL, or the upstream's answer
too late) is settled by the route's ``reconcile`` without an operator: completed with the
upstream's own answer where the upstream ran it, released where it did not (the client's retry
then runs it, once), left for the operator while the upstream cannot tell.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from fencegate.store.dburl import parse_database_url
from tests.support.charges import ChargesProcess
from tests.support.gateway import GatewayProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(300)

PROBE = (
    'reconcile = { method = "GET", target = "/v1/charges/by-key/{key}", '
    "executed = [200], not_executed = [404] }"
)
FUNCTION = 'reconcile = "tests.support.reconcile_probes:charges_by_key"'


@pytest.fixture(scope="module")
def charges() -> Iterator[ChargesProcess]:
    with ChargesProcess() as process:
        yield process


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:
        yield c


def routes_file(path: Path, reconcile: str, *, timeout: float, margin: float) -> Path:
    path.write_text(
        f"[gateway]\nrelease_margin = {margin}\nreconcile_interval = 0.2\n\n"
        f'[[routes]]\nprefix = "/v1"\ntimeout = {timeout}\n{reconcile}\n',
        encoding="utf-8",
    )
    return path


async def charge(client: httpx.AsyncClient, base: str, key: str, **headers: str) -> httpx.Response:
    sent = {"Idempotency-Key": key, "content-type": "application/json"}
    sent.update({k.replace("_", "-"): v for k, v in headers.items()})
    return await client.post(f"{base}/v1/charges", content=b'{"amount": 1250}', headers=sent)


RECONCILED = (
    "SELECT key FROM fencegate_decisions"
    " WHERE decision IN ('reconciled_completed', 'reconciled_released')"
)


async def reconciled_keys(database_url: str) -> Counter[str]:
    """How many keys' history says the reconciler settled them (completed or released)."""
    target = parse_database_url(database_url)
    if target.kind == "postgresql":
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            return Counter(str(r["key"]) for r in await conn.fetch(RECONCILED))
        finally:
            await conn.close()

    def read() -> Counter[str]:
        assert target.sqlite_path is not None
        conn = sqlite3.connect(target.sqlite_path, timeout=10)
        try:
            return Counter(str(r[0]) for r in conn.execute(RECONCILED))
        finally:
            conn.close()

    return await asyncio.to_thread(read)


KEYS = 240
CONCURRENCY = 24
KILLS = 5


async def test_a_kill_storm_leaves_every_key_settled_by_asking_the_upstream(
    store_url: str, charges: ChargesProcess, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Retrying clients send keyed charges while the gateway is killed with SIGKILL and
    restarted five times (lease 1 s, release margin 1 s). Afterwards every key has run
    exactly once, and its answer, replayed, is the charge the upstream made; keys the dead
    gateways left behind were settled by the reconciler, not by an operator."""
    routes = routes_file(tmp_path / "routes.toml", PROBE, timeout=5, margin=1)
    run = uuid.uuid4().hex[:8]
    keys = [f"storm-{run}-{n:03d}" for n in range(KEYS)]
    finals: dict[str, httpx.Response] = {}
    seen: Counter[str] = Counter()  # what the clients were answered on the way
    deadline = time.monotonic() + 150

    with GatewayProcess(
        upstream=charges.url,
        database_url=store_url,
        config=routes,
        inflight_lease_seconds=1,
        workdir=tmp_path,
    ) as gateway:

        async def one_key(key: str, slots: asyncio.Semaphore) -> None:
            async with slots:
                while time.monotonic() < deadline:
                    delay = f"{random.uniform(0.0, 0.4):.3f}"
                    try:
                        answer = await charge(client, gateway.url, key, x_upstream_delay=delay)
                    except httpx.TransportError:
                        seen["transport error"] += 1
                        await asyncio.sleep(0.1)  # the client's retry pace, as a real client's
                        continue
                    seen[str(answer.status_code)] += 1
                    if answer.status_code == 200:
                        finals[key] = answer
                        return
                    # 409 in flight, 424 unknown (until reconciled), 502/503/504: retried
                    # at the client's own pace (the behaviour under test, not a wait).
                    await asyncio.sleep(0.2)

        async def storm() -> None:
            for _ in range(KILLS):
                # The storm's rhythm: a kill every second or so, each at a random moment.
                await asyncio.sleep(random.uniform(0.8, 1.6))
                await asyncio.to_thread(gateway.kill)
                await asyncio.sleep(0.3)
                await asyncio.to_thread(gateway.start)

        slots = asyncio.Semaphore(CONCURRENCY)
        clients = asyncio.gather(*(one_key(key, slots) for key in keys))
        await storm()
        await clients
        executions, answers = await charges.astate()

        unfinished = [key for key in keys if key not in finals]
        assert not unfinished, (
            f"{len(unfinished)} keys never got their charge (answers seen: {dict(seen)}); "
            f"e.g. {unfinished[:3]}"
        )
        twice = {key: executions[key] for key in keys if executions.get(key, 0) != 1}
        assert not twice, f"keys charged other than once: {twice}"
        for key in keys:
            # The client's answer, whether forwarded, replayed or reconciled, is the charge.
            assert finals[key].content == answers[key], key
        for key in random.sample(keys, 20):
            replay = await charge(client, gateway.url, key)
            assert replay.status_code == 200 and replay.content == answers[key], replay.text
            assert replay.headers["idempotent-replayed"] == "true"

    reconciled = await reconciled_keys(store_url)
    assert sum(reconciled[k] for k in keys) > 0, (
        f"no key was left to the reconciler: the storm proved nothing (answers: {dict(seen)})"
    )
    print(f"answers seen: {dict(seen)}; reconciled: {sum(reconciled[k] for k in keys)} keys")


@pytest.mark.parametrize(
    ("kind", "status"), [("probe", 200), ("function", 201)], ids=["http-probe", "function"]
)
async def test_unknown_outcomes_are_completed_released_or_left_by_what_the_upstream_says(
    store_url: str,
    charges: ChargesProcess,
    client: httpx.AsyncClient,
    tmp_path: Path,
    kind: str,
    status: int,
) -> None:
    """The upstream answers later than the route's timeout (504, outcome unknown): the key it
    ran is completed with its answer (the function answers 201, to be told apart), the key it
    never ran is released and runs on the next retry, and a key it cannot tell about stays
    unknown (424), tried again with a backoff, with a note saying why."""
    reconcile = PROBE if kind == "probe" else FUNCTION
    routes = routes_file(tmp_path / "routes.toml", reconcile, timeout=1, margin=0.5)
    run = uuid.uuid4().hex[:8]
    ran, never, undecided = f"ran-{run}", f"never-{run}", f"undecided-{run}"
    with GatewayProcess(
        upstream=charges.url,
        database_url=store_url,
        config=routes,
        env={"CHARGES_URL": charges.url},
        workdir=tmp_path,
    ) as gateway:
        for key, how in [
            (ran, "x_upstream_delay"),
            (never, "x_upstream_stall"),
            (undecided, "x_upstream_delay"),
        ]:
            first = await charge(client, gateway.url, key, **{how: "3"})
            assert first.status_code == 504, first.text

        async def settled(key: str) -> httpx.Response | None:
            answer = await charge(client, gateway.url, key)
            return answer if answer.status_code not in (409, 424, 503) else None

        done = await wait_until(lambda: settled(ran), timeout=30, what="reconciled", interval=0.2)
        assert done is not None
        executions, answers = await charges.astate()
        assert done.status_code == status and done.content == answers[ran]
        assert done.headers["idempotent-replayed"] == "true"
        if kind == "function":
            assert done.headers["x-reconciled-by"] == "function"

        again = await wait_until(lambda: settled(never), timeout=30, what="released", interval=0.2)
        assert again is not None
        executions, answers = await charges.astate()
        assert again.status_code == 200 and "idempotent-replayed" not in again.headers
        assert again.content == answers[never]  # it ran now, once
        assert (executions[ran], executions[never]) == (1, 1)

        async def tried_twice() -> bool:
            return f"key={undecided}" in gateway.log_text() and "tries=2" in gateway.log_text()

        await wait_until(tried_twice, timeout=30, what="a second try", interval=0.2)
        still = await charge(client, gateway.url, undecided)
        assert still.status_code == 424, still.text
        assert executions[undecided] == 1  # never forwarded again meanwhile

        metrics = (await client.get(f"{gateway.url}/metrics")).text
        lines = [
            line
            for line in metrics.splitlines()
            if line.startswith("fencegate_reconciliations_total{")
        ]
        assert 'fencegate_reconciliations_total{result="completed",route="/v1"} 1.0' in lines
        assert 'fencegate_reconciliations_total{result="released",route="/v1"} 1.0' in lines
        assert any('result="unknown"' in line for line in lines), lines

        log = [
            line
            for line in gateway.log_text().splitlines()
            if "reconciliation " in line and f"key={undecided}" in line
        ]
        assert log and "result=unknown" in log[-1] and "503" in log[-1], log

    counts = await reconciled_keys(store_url)
    assert (counts[ran], counts[never], counts[undecided]) == (1, 1, 0)
