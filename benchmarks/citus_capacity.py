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

``--citus-setting NAME=VALUE`` (repeatable) adds a third setup in the same run: the same
Citus cluster with those settings on every node (``ALTER SYSTEM`` and a reload before each
of its rounds, reset before the others). For each Citus setup it also prints how many
backends the workers started per 1000 keys during the timed part (``pg_stat_database``'s
``sessions``): a coordinator that kept its connections to the workers starts none.

``python -m benchmarks.citus_capacity [--keys 2000] [--rounds 3] [--concurrency 32]
[--citus-setting citus.max_cached_conns_per_worker=8]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

import asyncpg

from benchmarks.cpu import backends_cpu
from benchmarks.new_keys import one_key
from fencegate.store import open_gateway_store
from fencegate.store.migrations import migrate
from tests.support.citus import CitusCluster, CitusNode, missing_citus

T = 30.0
DATABASE = "fencegate_bench"


@dataclass
class Setup:
    name: str
    url: str
    rates: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    # Coordinator settings of this setup (Citus only), and the workers it routes to.
    settings: dict[str, str] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)
    worker_sessions: list[float] = field(default_factory=list)


async def sessions(urls: list[str]) -> int:
    """Backends started so far in the benchmark's database on these nodes."""
    total = 0
    for url in urls:
        conn = await asyncpg.connect(url, timeout=T)
        try:
            total += await conn.fetchval(
                "SELECT sessions FROM pg_stat_database WHERE datname = $1", DATABASE
            )
        finally:
            await conn.close()
    return total


async def configure(nodes: list[str], names: list[str], settings: dict[str, str]) -> None:
    """On every node, ``names`` set to ``settings`` (the others reset), reloaded."""
    for node in nodes:
        await configure_node(node, names, settings)


async def configure_node(node: str, names: list[str], settings: dict[str, str]) -> None:
    conn = await asyncpg.connect(node, timeout=T)
    try:
        for name in names:
            if name in settings:
                value = settings[name].replace("'", "''")
                await conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
            else:
                await conn.execute(f"ALTER SYSTEM RESET {name}")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    # The reload is a signal: wait until a new backend sees the values.
    deadline = time.monotonic() + T
    while True:
        conn = await asyncpg.connect(node, timeout=T)
        try:
            seen = {name: await conn.fetchval("SELECT current_setting($1)", name) for name in names}
            defaults = {
                name: await conn.fetchval("SELECT reset_val FROM pg_settings WHERE name = $1", name)
                for name in names
            }
        finally:
            await conn.close()
        if all(seen[n] == settings.get(n, defaults[n]) for n in names):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"a node did not take {settings}: {seen}")
        await asyncio.sleep(0.05)


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

        sessions_before = await sessions(setup.workers)
        cpu_before = backends_cpu(DATABASE)
        client_before = time.process_time()
        began = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(args.concurrency)))
        wall = time.perf_counter() - began
        client = time.process_time() - client_before
        server = sum(backends_cpu(DATABASE).values()) - sum(cpu_before.values())
        # Less the one connection to each worker that counted the sessions before.
        started = await sessions(setup.workers) - sessions_before - len(setup.workers)
    finally:
        await store.close()
    setup.rates.append(args.keys / wall)
    setup.server_ms.append(server * 1000 / args.keys)
    setup.client_ms.append(client * 1000 / args.keys)
    setup.worker_sessions.append(started * 1000 / args.keys)


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
        url = await cluster.create_database(DATABASE)
        workers = [worker.url(DATABASE) for worker in cluster.workers]
        citus = Setup("Citus: coordinator + 2 workers", url, workers=workers)
        setups = [plain, citus]
        if args.citus_setting:
            wanted = dict(item.split("=", 1) for item in args.citus_setting)
            setups.append(
                Setup(
                    "Citus, with the settings",
                    url,
                    settings=wanted,
                    workers=workers,
                )
            )
        names = sorted({name for setup in setups for name in setup.settings})
        await migrate(plain.url)
        await migrate(citus.url)
        for n in range(args.rounds):
            # Each round in another order, so that the machine's other work falls on all.
            order = setups[n % len(setups) :] + setups[: n % len(setups)]
            for setup in order if n % 2 == 0 else order[::-1]:
                if setup is not plain and names:
                    await configure([citus.url, *workers], names, setup.settings)
                await round_on(setup, args)
    finally:
        single.stop()
        cluster.stop()
    print(
        f"{args.keys} new keys (reserve + record) per round, {args.rounds} rounds, "
        f"{args.concurrency} callers, {args.tenants} tenants"
    )
    for setup in setups:
        if setup.settings:
            print(f"{setup.name}: " + ", ".join(f"{k} = {v}" for k, v in setup.settings.items()))
    print(
        f"{'setup':<32} {'keys/s':>8} {'server CPU ms/key':>18} {'client CPU ms/key':>18} "
        f"{'worker backends/1000 keys':>26}"
    )
    for setup in setups:
        started = f"{statistics.median(setup.worker_sessions):.1f}" if setup.workers else "-"
        print(
            f"{setup.name:<32} {statistics.median(setup.rates):>8.0f} "
            f"{statistics.median(setup.server_ms):>18.2f} "
            f"{statistics.median(setup.client_ms):>18.2f} {started:>26}"
        )
    for setup in setups[1:]:
        print(
            f"{setup.name} / one PostgreSQL: keys/s x"
            f"{statistics.median(setup.rates) / statistics.median(plain.rates):.2f}, "
            f"server CPU per key x"
            f"{statistics.median(setup.server_ms) / statistics.median(plain.server_ms):.2f}"
        )
    for setup in setups:
        print(
            f"rounds, {setup.name}: keys/s {[round(r) for r in setup.rates]}, "
            f"server CPU ms/key {[round(m, 2) for m in setup.server_ms]}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument(
        "--citus-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a coordinator setting for a third setup, compared in the same run (repeatable)",
    )
    asyncio.run(main(parser.parse_args()))
