"""The reconciler on a Citus coordinator: keys of two tenants whose shards are on different
workers are left with their outcome unknown (the upstream answers later than the route's
timeout), through a real `fencegate serve`, in front of a charges API its route's HTTP
``reconcile`` probe asks. The reconciler settles each without an operator: the charge that ran
is completed with the upstream's own answer (resolution ``reconciled``), the one that never
ran is released and runs, once, on the client's retry."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from fencegate.signing import HttpSigner
from tests.support.charges import ChargesProcess
from tests.support.gateway import GatewayProcess
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(300)

# Candidates, of which the test takes two whose shards are on different workers.
CANDIDATES = ("acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell")
PROBE = (
    'reconcile = { method = "GET", target = "/v1/charges/by-key/{key}", '
    "executed = [200], not_executed = [404] }"
)
NODE_OF = (
    "SELECT s.nodeport FROM citus_shards s WHERE s.shardid = "
    "get_shard_id_for_distribution_column('fencegate_idempotency_keys', $1::text)"
)


def signer(tenant: str) -> HttpSigner:
    return HttpSigner(key_id=f"{tenant}-1", secret=tenant.encode() * 8)


@pytest.fixture(scope="module")
def charges() -> Iterator[ChargesProcess]:
    with ChargesProcess() as process:
        yield process


async def tenants_on_two_workers(url: str) -> tuple[str, str]:
    conn = await asyncpg.connect(url, timeout=30)
    try:
        nodes = {t: int(await conn.fetchval(NODE_OF, t)) for t in CANDIDATES}
    finally:
        await conn.close()
    first = CANDIDATES[0]
    other = next((t for t in CANDIDATES if nodes[t] != nodes[first]), None)
    assert other is not None, f"all candidate tenants on one worker: {nodes}"
    return first, other


def write_config(directory: Path, tenants: tuple[str, ...]) -> tuple[Path, Path]:
    keys = directory / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nid = "{t}-1"\ntenant = "{t}"\nalg = "hmac-sha256"\n'
            f'secret = "{base64.b64encode(t.encode() * 8).decode()}"\n\n'
            for t in tenants
        )
    )
    routes = directory / "routes.toml"
    routes.write_text(
        "[gateway]\nrelease_margin = 0.5\nreconcile_interval = 0.2\n\n"
        f'[[routes]]\nprefix = "/v1"\ntimeout = 1\n{PROBE}\n',
        encoding="utf-8",
    )
    return keys, routes


async def charge(
    client: httpx.AsyncClient, base: str, tenant: str, key: str, **extra: str
) -> httpx.Response:
    url = f"{base}/v1/charges"
    body = b'{"amount": 1250}'
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    headers.update({k.replace("_", "-"): v for k, v in extra.items()})
    signer(tenant).sign("POST", url, headers, body)
    return await client.post(url, content=body, headers=headers)


SETTLED = """
SELECT d.tenant, d.key, d.decision, k.state::text AS state, k.resolution
FROM fencegate_decisions d
LEFT JOIN fencegate_idempotency_keys k ON k.tenant = d.tenant AND k.key = d.key
WHERE d.tenant = $1 AND d.decision IN ('reconciled_completed', 'reconciled_released')
"""


async def settled(url: str, tenants: tuple[str, str]) -> dict[tuple[str, str], asyncpg.Record]:
    conn = await asyncpg.connect(url, timeout=30)
    try:
        found = {}
        for tenant in tenants:  # one tenant per statement: each runs on its worker
            for row in await conn.fetch(SETTLED, tenant):
                found[(str(row["tenant"]), str(row["key"]))] = row
        return found
    finally:
        await conn.close()


async def test_the_reconciler_settles_unknown_outcomes_of_tenants_on_different_workers(
    pg_url: str, charges: ChargesProcess, tmp_path: Path
) -> None:
    tenants = await tenants_on_two_workers(pg_url)
    keys_file, routes = write_config(tmp_path, tenants)
    run = uuid.uuid4().hex[:8]
    ran = {t: f"ran-{t}-{run}" for t in tenants}
    never = {t: f"never-{t}-{run}" for t in tenants}
    with GatewayProcess(
        upstream=charges.url,
        database_url=pg_url,
        config=routes,
        extra_args=["--keys", str(keys_file)],
        workdir=tmp_path,
    ) as gateway:
        async with httpx.AsyncClient(timeout=30) as client:
            for tenant in tenants:
                # Later than the route's timeout: 504, the outcome unknown. The upstream
                # charges the first; the second it never runs (a 503 after the stall).
                first = await charge(client, gateway.url, tenant, ran[tenant], x_upstream_delay="3")
                assert first.status_code == 504, first.text
                second = await charge(
                    client, gateway.url, tenant, never[tenant], x_upstream_stall="3"
                )
                assert second.status_code == 504, second.text

            wanted = {(t, ran[t]) for t in tenants} | {(t, never[t]) for t in tenants}

            async def all_settled() -> dict[tuple[str, str], asyncpg.Record] | None:
                found = await settled(pg_url, tenants)
                return found if wanted <= found.keys() else None

            try:
                found = await wait_until(
                    all_settled,
                    timeout=60,
                    what="the reconciler settling all four keys",
                    interval=0.3,
                )
            except AssertionError as exc:
                pytest.fail(f"{exc}; the gateway's log ends:\n{gateway.log_text()[-3000:]}")
            assert found is not None  # for the type: wait_until returns a true value
            _, answers = await charges.astate()
            for tenant in tenants:
                done = found[(tenant, ran[tenant])]
                assert done["decision"] == "reconciled_completed"
                assert (done["state"], done["resolution"]) == ("completed", "reconciled")
                gone = found[(tenant, never[tenant])]
                assert gone["decision"] == "reconciled_released" and gone["state"] is None

                # The completed key replays the upstream's own answer, never running again.
                replay = await charge(client, gateway.url, tenant, ran[tenant])
                assert replay.status_code == 200, replay.text
                assert replay.headers["idempotent-replayed"] == "true"
                assert replay.content == answers[ran[tenant]]
                # The released key runs on the retry, once.
                retry = await charge(client, gateway.url, tenant, never[tenant])
                assert retry.status_code == 200, retry.text
                assert "idempotent-replayed" not in retry.headers

            executions, answers = await charges.astate()
            for tenant in tenants:
                assert executions[ran[tenant]] == 1
                assert executions[never[tenant]] == 1
                assert answers[never[tenant]]
        assert "could not run distributed query" not in gateway.log_text()
