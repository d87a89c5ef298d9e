"""New keys per second on one PostgreSQL and on a Citus coordinator with two workers, on
the same machine, side by side in one run (docs/operations/citus.md).

Both run privately on loopback (tests/support/citus.py; the single server is a node of the
same kind, with Citus not loaded), both with fsync off. The load is the gateway's common
case through its store: a new key reserved with a fence, then its answer recorded, for many
tenants at once (``--concurrency`` callers over ``--tenants`` tenants). Rounds alternate
between the two, so that what else the machine does falls on both; per setup it prints new
keys per second (median of the rounds) and, steadier on a shared machine, the CPU each key
costs the database processes (every backend of the benchmark's database, on every node) and
the client.

``python -m benchmarks.citus_capacity [--keys 2000] [--rounds 3] [--concurrency 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field

import asyncpg

from benchmarks.cpu import backends_cpu
from fencegate.store import DecideRequest, Reservation, StoredResponse, open_gateway_store
from fencegate.store.base import GatewayStore
from fencegate.store.migrations import migrate
from tests.support.citus import CitusCluster, CitusNode, missing_citus

T = 30.0
DATABASE = "fencegate_bench"
ANSWER = StoredResponse(
    status=201, headers=[("content-type", "application/json")], body=b"{}", sha256=""
)


@dataclass
class Setup:
    name: str
    url: str
    rates: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)


async def one_key(store: GatewayStore, tenant: str, n: int) -> None:
    request = DecideRequest(
        tenant=tenant,
        key=f"k-{uuid.uuid4().hex}",
        fingerprint="f" * 64,
        entity=f"invoice-{n}",
        fence=1,
        owner=f"bench/{n}",
        lease_seconds=30,
        ttl_seconds=3600,
        retry_unknown=False,
        request_id=str(n),
        method="POST",
        target="/v1/charges",
    )
    decision = await store.decide(request, timeout=T)
    assert decision.attempt is not None and request.key is not None
    holder = Reservation(tenant, request.key, request.owner, decision.attempt, str(n))
    assert await store.complete(holder, ANSWER, timeout=T)


async def round_on(setup: Setup, args: argparse.Namespace) -> None:
    store = await open_gateway_store(setup.url, pool_max_size=args.concurrency)
    try:
        await asyncio.gather(*(one_key(store, f"t{i}", i) for i in range(args.concurrency)))
        queue = asyncio.Queue[int]()
        for n in range(args.keys):
            queue.put_nowait(n)

        async def caller() -> None:
            while not queue.empty():
                n = queue.get_nowait()
                await one_key(store, f"tenant-{n % args.tenants}", n)

        server_before = sum(backends_cpu(DATABASE).values())
        client_before = time.process_time()
        began = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(args.concurrency)))
        wall = time.perf_counter() - began
        client = time.process_time() - client_before
        server = sum(backends_cpu(DATABASE).values()) - server_before
    finally:
        await store.close()
    setup.rates.append(args.keys / wall)
    setup.server_ms.append(server * 1000 / args.keys)
    setup.client_ms.append(client * 1000 / args.keys)


async def main(args: argparse.Namespace) -> None:
    reason = missing_citus()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    cluster = CitusCluster(workers=2)
    single = CitusNode(cluster.root, "single")
    try:
        cluster.start()
        single.init()
        # One PostgreSQL as fencegate runs on it: no Citus loaded.
        with (single.dir / "postgresql.auto.conf").open("a") as conf:
            conf.write("shared_preload_libraries = ''\n")
        single.start()
        conn = await asyncpg.connect(single.url())
        await conn.execute(f'CREATE DATABASE "{DATABASE}"')
        await conn.close()
        plain = Setup("one PostgreSQL", single.url(DATABASE))
        citus = Setup("Citus: coordinator + 2 workers", await cluster.create_database(DATABASE))
        for setup in (plain, citus):
            await migrate(setup.url)
        for n in range(args.rounds):
            for setup in (plain, citus) if n % 2 == 0 else (citus, plain):
                await round_on(setup, args)
    finally:
        single.stop()
        cluster.stop()
    print(
        f"{args.keys} new keys (reserve + record) per round, {args.rounds} rounds, "
        f"{args.concurrency} callers, {args.tenants} tenants"
    )
    print(f"{'setup':<32} {'keys/s':>8} {'server CPU ms/key':>18} {'client CPU ms/key':>18}")
    for setup in (plain, citus):
        print(
            f"{setup.name:<32} {statistics.median(setup.rates):>8.0f} "
            f"{statistics.median(setup.server_ms):>18.2f} "
            f"{statistics.median(setup.client_ms):>18.2f}"
        )
    print(
        f"Citus / one PostgreSQL: keys/s x"
        f"{statistics.median(citus.rates) / statistics.median(plain.rates):.2f}, "
        f"server CPU per key x"
        f"{statistics.median(citus.server_ms) / statistics.median(plain.server_ms):.2f}"
    )
    print(
        f"rounds, keys/s: one PostgreSQL {[round(r) for r in plain.rates]}, "
        f"Citus {[round(r) for r in citus.rates]}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
