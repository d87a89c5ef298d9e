"""`fencegate serve` on a Citus coordinator, signed requests of several tenants through it,
a real upstream that counts what it runs; the operator's commands and the console's reads on
the distributed tables; the lease queue on the coordinator."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from fencegate.lease import LeaseQueue
from fencegate.signing import HttpSigner
from fencegate.store.inspect import Inspector
from tests.support.gateway import GatewayProcess
from tests.support.processes import fencegate
from tests.support.upstream import UpstreamProcess

TENANTS = ("acme", "globex", "initech", "umbrella")
SIGNERS = {t: HttpSigner(key_id=f"{t}-1", secret=t.encode() * 8) for t in TENANTS}
PATH = "/v1/cases"


def write_keys(directory: Path) -> Path:
    keys = directory / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nid = "{t}-1"\ntenant = "{t}"\nalg = "hmac-sha256"\n'
            f'secret = "{base64.b64encode(t.encode() * 8).decode()}"\n\n'
            for t in TENANTS
        )
    )
    return keys


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


@pytest.fixture(scope="module")
def gateway(
    upstream: UpstreamProcess, citus_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("citus-gateway")
    with GatewayProcess(
        upstream=upstream.url,
        database_url=citus_database,
        extra_args=["--keys", str(write_keys(directory))],
    ) as process:
        yield process


def signed(
    client: httpx.Client, tenant: str, key: str, *, fence: int, entity: str, body: bytes = b"{}"
) -> httpx.Response:
    headers = {
        "Idempotency-Key": key,
        "X-Execution-Fence": str(fence),
        "X-Execution-Entity": entity,
        "Content-Type": "application/json",
    }
    SIGNERS[tenant].sign("POST", str(client.base_url) + PATH, headers, body)
    return client.post(PATH, headers=headers, content=body)


def test_signed_tenants_get_the_http_contract_each_on_its_own_rows(
    gateway: GatewayProcess, upstream: UpstreamProcess
) -> None:
    key = f"case-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for n, tenant in enumerate(TENANTS, start=1):
            first = signed(client, tenant, key, fence=5, entity="invoice:1")
            assert first.status_code == 200, first.text
            # The same key and entity, another tenant: runs for that tenant too.
            assert upstream.count(key) == n
            replay = signed(client, tenant, key, fence=5, entity="invoice:1")
            assert replay.status_code == 200
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.json() == first.json()
        assert upstream.count(key) == len(TENANTS)
        # A newer fence for one tenant leaves the others' fences alone.
        newer = signed(client, "acme", key + "-2", fence=9, entity="invoice:1")
        assert newer.status_code == 200
        stale = signed(client, "acme", key + "-3", fence=6, entity="invoice:1")
        assert stale.status_code == 412
        assert stale.json()["last_accepted_fence"] == 9
        assert signed(client, "globex", key + "-3", fence=6, entity="invoice:1").status_code == 200
        # A key reused with another body; a signature replayed; no signature at all.
        reused = signed(client, "initech", key, fence=5, entity="invoice:1", body=b'{"x":1}')
        assert reused.status_code == 422
        headers = {"Idempotency-Key": key + "-4", "Content-Type": "application/json"}
        SIGNERS["umbrella"].sign("POST", str(client.base_url) + PATH, headers, b"{}")
        assert client.post(PATH, headers=headers, content=b"{}").status_code == 200
        replayed = client.post(PATH, headers=headers, content=b"{}")
        assert replayed.status_code == 401
        assert client.post(PATH, headers={"Idempotency-Key": key}).status_code == 401


def test_the_operator_commands_and_the_console_read_the_distributed_tables(
    gateway: GatewayProcess, citus_database: str, upstream: UpstreamProcess
) -> None:
    key = f"op-{uuid.uuid4().hex[:8]}"
    entity = f"invoice:{key}"
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert signed(client, "acme", key, fence=3, entity=entity).status_code == 200
    url = citus_database
    shown = fencegate("keys", "show", key, "--tenant", "acme", "--json", "--database-url", url)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "completed"
    fences = fencegate("fences", "show", entity, "--tenant", "acme", "--database-url", url)
    assert fences.returncode == 0, fences.stderr
    assert "3" in fences.stdout
    trace = fencegate("trace", key, "--tenant", "acme", "--json", "--database-url", url)
    assert trace.returncode == 0, trace.stderr
    assert "reserved" in trace.stdout and "completed" in trace.stdout
    # Nothing to resolve: the key is completed (the statement ran on its worker).
    resolve = fencegate(
        "keys", "resolve", key, "--tenant", "acme", "--release", "--database-url", url
    )
    assert resolve.returncode != 0 and "completed" in resolve.stderr + resolve.stdout
    purge = fencegate("purge", "--database-url", url)
    assert purge.returncode == 0, purge.stderr

    async def console_reads() -> None:
        inspector = await Inspector.open(url)
        try:
            keys = await inspector.keys(tenant="acme", timeout=20)
            assert key in {row["key"] for row in keys.rows}
            overview = await inspector.overview(tenant="acme", timeout=20)
            assert overview
            fence = await inspector.fence(entity, tenant="acme", timeout=20)
            assert fence.fence is not None and fence.fence["last_accepted"] == 3
            assert fence.events
        finally:
            await inspector.close()

    asyncio.run(console_reads())


async def test_the_lease_queue_stays_on_the_coordinator(citus_database: str) -> None:
    conn = await asyncpg.connect(citus_database)
    try:
        distributed = {
            str(r[0]) for r in await conn.fetch("SELECT logicalrelid::text FROM pg_dist_partition")
        }
    finally:
        await conn.close()
    assert distributed == {
        "fencegate_idempotency_keys",
        "fencegate_fences",
        "fencegate_decisions",
        "fencegate_signature_nonces",
        "fencegate_gateways",
    }
    queue = await LeaseQueue.connect(citus_database, timeout=20)
    try:
        kind = f"citus-{uuid.uuid4().hex[:6]}"
        job = await queue.enqueue(kind, {"n": 1}, idempotency_key=f"{kind}:1", timeout=20)
        [lease] = await queue.claim("worker-a", kinds=[kind], timeout=20)
        assert lease.job_id == job
        assert await queue.claim("worker-b", kinds=[kind], timeout=20) == []
        assert await queue.complete(lease, {"ok": True}, timeout=20)
    finally:
        await queue.close()
