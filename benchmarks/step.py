"""The gateway's store step alone, on PostgreSQL: what a new key costs the database.

`benchmarks/gateway.py` measures PostgreSQL's CPU per new key under the whole gateway; this
drives the gateway store itself (no HTTP, no upstream, no gateway process) with what the
gateway does for a new key (`benchmarks/new_keys.py`): ``--batch`` concurrent callers, each
reserving a new key with a fence one higher than its last on its own entity (as in the
gateway benchmark's new-key load) and recording its answer. Their calls share the store's
steps as the gateway's requests do: the first goes at once, what queues behind it goes
together in the next step (decisions and answers alike). Each round runs
this for ``--keys`` keys with the decision history kept and without it, on fresh
databases, in interleaved rounds, and prints the PostgreSQL CPU per new key (the backends
of that database, from /proc: PostgreSQL must run on this host) and its ratio to the step
without history, and this process's CPU per new key: the store's client side without HTTP
(each step's arguments, asyncpg's encoding and decoding, the batching, the event loop, and
the callers' own tasks), on uvloop as under `fencegate serve`, against the same process's
CPU per bare ``SELECT 1`` round trip.

    python -m benchmarks.step --keys 9600 --batch 32 --rounds 3

Server from ``FENCEGATE_BENCH_DATABASE_URL`` (default postgresql://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import asyncpg
import uvloop

from benchmarks.cpu import backends_cpu, backends_spent
from benchmarks.new_keys import one_key
from benchmarks.queue import DEFAULT_SERVER, fresh_database
from fencegate.store import open_gateway_store
from fencegate.store.migrations import migrate


@dataclass
class Measured:
    seconds: float
    postgres_cpu: float
    keys: int
    client_cpu: float

    @property
    def cpu_us_per_key(self) -> float:
        return self.postgres_cpu / self.keys * 1e6

    @property
    def client_us_per_key(self) -> float:
        return self.client_cpu / self.keys * 1e6

    @property
    def keys_per_second(self) -> float:
        return self.keys / self.seconds


async def run_steps(server: str, *, keys: int, batch: int, history: bool) -> Measured:
    """``keys`` new keys, ``batch`` callers at a time, each caller's fence one higher than
    the last on its own entity."""
    async with fresh_database(server) as url:
        await migrate(url, timeout=60)
        store = await open_gateway_store(url, history=history, pool_max_size=4)
        database = urlsplit(url).path.lstrip("/")
        run = uuid.uuid4().hex[:8]
        try:
            before = backends_cpu(database)
            client_before = time.process_time()
            started = time.perf_counter()
            for fence in range(1, keys // batch + 1):
                await asyncio.gather(
                    *(
                        one_key(store, "bench", slot, entity=f"{run}:{slot}", fence=fence)
                        for slot in range(batch)
                    )
                )
            seconds = time.perf_counter() - started
            client = time.process_time() - client_before
            spent = backends_spent(before, database)
        finally:
            await store.close()
    return Measured(seconds, spent, keys // batch * batch, client)


async def round_trip_cpu(server: str, *, calls: int = 2000) -> float:
    """This process's CPU per bare ``SELECT 1`` round trip on one asyncpg connection, in
    seconds: the yardstick for the store's client side."""
    conn = await asyncpg.connect(server, timeout=30)
    try:
        await conn.fetchval("SELECT 1")
        before = time.process_time()
        for _ in range(calls):
            await conn.fetchval("SELECT 1")
        return (time.process_time() - before) / calls
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=9600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.batch < 1 or args.keys < args.batch or args.rounds < 1:
        parser.error("--batch must be at least 1, --keys at least --batch, --rounds at least 1")
    server = os.environ.get("FENCEGATE_BENCH_DATABASE_URL", DEFAULT_SERVER)
    rows: dict[str, list[Measured]] = {"history kept": [], "no history": []}
    trips: list[float] = []
    for _ in range(args.rounds):
        for name, history in (("history kept", True), ("no history", False)):
            rows[name].append(
                uvloop.run(run_steps(server, keys=args.keys, batch=args.batch, history=history))
            )
        trips.append(uvloop.run(round_trip_cpu(server)))
    trip_us = statistics.median(trips) * 1e6
    floor = statistics.median(m.cpu_us_per_key for m in rows["no history"])
    print(
        f"{args.rounds} interleaved rounds of {args.keys} new keys, {args.batch} concurrent "
        "callers (a new key and its answer each); median of the rounds\n"
    )
    header = ("step", "keys/s", "PG CPU us/key", "(min-max)", "x no history", "client us/key")
    print(
        f"{header[0]:<14} {header[1]:>8} {header[2]:>14} {header[3]:>13} {header[4]:>13} "
        f"{header[5]:>14} {'x SELECT 1':>11}"
    )
    for name, measured in rows.items():
        cpu = [m.cpu_us_per_key for m in measured]
        rate = statistics.median(m.keys_per_second for m in measured)
        spread = f"{min(cpu):.1f}-{max(cpu):.1f}"
        client = statistics.median(m.client_us_per_key for m in measured)
        print(
            f"{name:<14} {rate:>8.0f} {statistics.median(cpu):>14.1f} {spread:>13} "
            f"{statistics.median(cpu) / floor:>12.2f}x {client:>14.1f} {client / trip_us:>10.2f}x"
        )
    print(
        f"\nSELECT 1 (one round trip on one connection, this process): {trip_us:.1f} us of "
        "client CPU each. A new key takes two steps; their share of a step's fixed cost falls "
        "as --batch grows."
    )


if __name__ == "__main__":
    main()
