"""Lease queue benchmark: fencegate's LeaseQueue and PgQueuer side by side on one server.

No-op jobs go through enqueue (batched) -> claim (batched) -> heartbeat (one extend per job,
the batch renewed in one statement) -> complete (batched), with N worker tasks, on a fresh
PostgreSQL database per run; the same number of jobs goes through PgQueuer (its own fresh
database, its schema installed, N queue managers in drain mode, one connection each, the same
batch size). The two alternate for several rounds and the table shows each one's median, so
that a busy machine hurts both alike. Then:

- pickup latency: workers idle-wait (LISTEN/NOTIFY), one job is enqueued, time until a
  worker holds it; p50/p99 over many samples, for both queues;
- recovery after SIGKILL: a separate process claims a job with a 2 s lease and is killed;
  time until another claimer holds the job.

Run from the repository root (server from ``FENCEGATE_BENCH_DATABASE_URL``, default
postgresql://postgres@127.0.0.1:5432/postgres)::

    python -m benchmarks.queue [--jobs 5000] [--workers 4 8] [--batch 10] [--rounds 5]
                               [--samples 100] [--profile]

Figures depend on the machine and on whatever else it is doing: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import io
import os
import pstats
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from fencegate.lease import Lease, LeaseQueue

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
ROOT = Path(__file__).resolve().parents[1]
PIPELINE = 2
PHASE_LIMIT_SECONDS = 60.0


@dataclass
class Row:
    name: str
    jobs_per_second: float | None = None
    enqueue_per_second: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    note: str = ""


# -- databases ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fresh_database(server: str) -> AsyncIterator[str]:
    name = "fg_bench_" + uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urlsplit(server)
    url = urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))
    try:
        yield url
    finally:
        conn = await asyncpg.connect(server, timeout=10)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# -- fencegate ---------------------------------------------------------------------------


async def fencegate_throughput(
    server: str, *, jobs: int, workers: int, batch: int, heartbeat: bool, profile: bool
) -> Row:
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(url, timeout=30, pool_max_size=workers + 2)
        try:
            await queue.migrate()
            started = time.perf_counter()
            for start in range(0, jobs, 500):
                await queue.enqueue_many(
                    [
                        {"kind": "noop", "payload": {"n": n}}
                        for n in range(start, min(jobs, start + 500))
                    ],
                    timeout=30,
                )
            enqueue_seconds = time.perf_counter() - started
            done = 0
            deadline = time.monotonic() + PHASE_LIMIT_SECONDS

            async def finish(leases: list[Lease]) -> None:
                nonlocal done
                # One extend per job, renewed together as a worker holding a batch does.
                if heartbeat:
                    renewed = await queue.extend_many(leases, timeout=30)
                    leases = [lease for lease in renewed if lease is not None]
                answers = await queue.complete_many([(lease, None) for lease in leases], timeout=30)
                done += sum(answers)

            async def worker(name: str) -> None:
                # Like PgQueuer's buffered acknowledgements, a batch's heartbeat and commit run
                # while the worker claims its next batch; at most PIPELINE batches are open.
                pending: list[asyncio.Task[None]] = []
                while time.monotonic() < deadline:
                    leases = await queue.claim(name, kinds=["noop"], limit=batch, timeout=30)
                    if not leases:
                        break
                    pending.append(asyncio.create_task(finish(leases)))
                    if len(pending) >= PIPELINE:
                        await pending.pop(0)
                await asyncio.gather(*pending)

            profiler = cProfile.Profile() if profile else None
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            await asyncio.gather(*(worker(f"w{i}") for i in range(workers)))
            if profiler:
                profiler.disable()
            seconds = time.perf_counter() - started
            if done != jobs:
                raise RuntimeError(f"fencegate finished {done} of {jobs} jobs")
            if profiler:
                print_profile(profiler, f"fencegate, {workers} workers")
        finally:
            await queue.close()
    return Row(
        f"fencegate   N={workers}" + ("" if heartbeat else " no heartbeat"),
        jobs_per_second=jobs / seconds,
        enqueue_per_second=jobs / enqueue_seconds,
    )


async def fencegate_pickup(server: str, *, samples: int, workers: int) -> Row:
    async with fresh_database(server) as url:
        consumer = await LeaseQueue.connect(url, timeout=30, pool_max_size=workers + 2)
        producer = await LeaseQueue.connect(url, timeout=30, pool_max_size=2)
        try:
            await producer.migrate()
            got: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
            stop = asyncio.Event()

            async def worker(name: str) -> None:
                for _ in range(samples * 100):
                    if stop.is_set():
                        return
                    leases = await consumer.claim(name, kinds=["ping"], limit=1, timeout=30)
                    for lease in leases:
                        got.put_nowait((lease.job_id, time.perf_counter()))
                        await consumer.complete(lease, None, timeout=30)
                    if not leases:
                        await consumer.wait_for_work(["ping"], timeout=1.0)

            tasks = [asyncio.create_task(worker(f"w{i}")) for i in range(workers)]
            await asyncio.sleep(0.5)  # every worker is idle-waiting
            latencies: list[float] = []
            for n in range(samples):
                sent = time.perf_counter()
                job_id = await producer.enqueue("ping", {"n": n}, timeout=30)
                claimed_id, claimed = await asyncio.wait_for(got.get(), 30)
                assert claimed_id == job_id
                latencies.append((claimed - sent) * 1000)
                await asyncio.sleep(0.02)  # let the workers settle back into waiting
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        finally:
            await consumer.close()
            await producer.close()
    return Row(
        f"fencegate   N={workers}",
        p50_ms=percentile(latencies, 0.5),
        p99_ms=percentile(latencies, 0.99),
    )


_VICTIM = """
import asyncio, sys
from fencegate.lease import LeaseQueue

async def main() -> None:
    queue = await LeaseQueue.connect(sys.argv[1], timeout=30)
    [lease] = await queue.claim("doomed", kinds=["victim"], limit=1, timeout=30)
    print(lease.fencing_token, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def fencegate_recovery(server: str, *, runs: int) -> Row:
    recoveries: list[float] = []
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(url, timeout=30)
        try:
            await queue.migrate()
            for n in range(runs):
                job_id = await queue.enqueue(
                    "victim", {"n": n}, lease_seconds=2, heartbeat_seconds=0.5, jitter_seconds=1
                )
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    _VICTIM,
                    url,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdout=asyncio.subprocess.PIPE,
                )
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 30)
                old_token = int(line)
                proc.send_signal(signal.SIGKILL)
                killed = time.perf_counter()
                await proc.wait()
                for _ in range(2000):  # bounded: 2,000 polls of 5 ms is well past the lease
                    leases = await queue.claim("rescuer", kinds=["victim"], limit=1, timeout=30)
                    if leases:
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise RuntimeError("the killed worker's job was never reclaimed")
                recovered = time.perf_counter()
                [lease] = leases
                assert lease.job_id == job_id and lease.fencing_token > old_token
                await queue.complete(lease, None)
                recoveries.append(recovered - killed)
        finally:
            await queue.close()
    return Row(
        "fencegate   recovery after SIGKILL (lease 2 s)",
        p50_ms=statistics.median(recoveries) * 1000,
        p99_ms=max(recoveries) * 1000,
        note=f"{runs} runs; p99 column = worst",
    )


# -- PgQueuer ----------------------------------------------------------------------------


async def _install_pgqueuer(url: str) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(url, timeout=10)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def pgqueuer_throughput(server: str, *, jobs: int, workers: int, batch: int) -> Row:
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    async with fresh_database(server) as url:
        await _install_pgqueuer(url)
        producer = await asyncpg.connect(url, timeout=10)
        conns = [await asyncpg.connect(url, timeout=10) for _ in range(workers)]
        try:
            queries = Queries(AsyncpgDriver(producer))
            started = time.perf_counter()
            for start in range(0, jobs, 500):
                size = min(jobs, start + 500) - start
                await queries.enqueue(
                    ["noop"] * size,
                    [f'{{"n": {n}}}'.encode() for n in range(start, start + size)],
                    [0] * size,
                )
            enqueue_seconds = time.perf_counter() - started
            done = 0
            managers: list[QueueManager] = []
            for conn in conns:
                manager = QueueManager(Queries(AsyncpgDriver(conn)))

                @manager.entrypoint("noop")
                async def noop(job: Job) -> None:
                    nonlocal done
                    done += 1

                managers.append(manager)
            started = time.perf_counter()
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        m.run(
                            batch_size=batch,
                            mode=QueueExecutionMode.drain,
                            dequeue_timeout=timedelta(seconds=0.5),
                            log_aggregation_interval=timedelta(0),
                        )
                        for m in managers
                    )
                ),
                PHASE_LIMIT_SECONDS,
            )
            seconds = time.perf_counter() - started
            if done != jobs:
                raise RuntimeError(f"PgQueuer finished {done} of {jobs} jobs")
        finally:
            for conn in [producer, *conns]:
                await conn.close()
    return Row(
        f"PgQueuer    N={workers}",
        jobs_per_second=jobs / seconds,
        enqueue_per_second=jobs / enqueue_seconds,
    )


async def pgqueuer_pickup(server: str, *, samples: int, workers: int) -> Row:
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

    async with fresh_database(server) as url:
        await _install_pgqueuer(url)
        producer = await asyncpg.connect(url, timeout=10)
        conns = [await asyncpg.connect(url, timeout=10) for _ in range(workers)]
        got: asyncio.Queue[float] = asyncio.Queue()
        managers: list[QueueManager] = []
        for conn in conns:
            manager = QueueManager(Queries(AsyncpgDriver(conn)))

            @manager.entrypoint("ping")
            async def ping(job: Job) -> None:
                got.put_nowait(time.perf_counter())

            managers.append(manager)
        runs = [
            asyncio.create_task(m.run(batch_size=1, dequeue_timeout=timedelta(seconds=30)))
            for m in managers
        ]
        latencies: list[float] = []
        try:
            queries = Queries(AsyncpgDriver(producer))
            await asyncio.sleep(1.0)  # every manager is listening
            for n in range(samples):
                sent = time.perf_counter()
                await queries.enqueue("ping", f'{{"n": {n}}}'.encode())
                claimed = await asyncio.wait_for(got.get(), 30)
                latencies.append((claimed - sent) * 1000)
                await asyncio.sleep(0.02)
        finally:
            for m in managers:
                m.shutdown.set()
            await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)
            for conn in [producer, *conns]:
                await conn.close()
    return Row(
        f"PgQueuer    N={workers}",
        p50_ms=percentile(latencies, 0.5),
        p99_ms=percentile(latencies, 0.99),
    )


# -- report ------------------------------------------------------------------------------


def print_profile(profiler: cProfile.Profile, title: str) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    print(f"\n-- cProfile, {title} (own time, top 18) --")
    print("\n".join(out.getvalue().splitlines()[4:]))


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(
    throughput: list[list[Row]], pickup: tuple[Row, Row], recovery: Row, args: argparse.Namespace
) -> None:
    print()
    print(
        f"Lease queue benchmark: {args.jobs} no-op jobs per run, batch {args.batch}, "
        f"one PostgreSQL server; throughput is the median of {args.rounds} interleaved rounds"
    )
    print()
    header = f"{'throughput':<32}{'jobs/s':>10}{'enqueue/s':>12}{'vs PgQueuer':>14}"
    print(header)
    print("-" * len(header))
    for rows in throughput:
        baseline = rows[-1].jobs_per_second
        for row in rows:
            ratio = (
                row.jobs_per_second / baseline
                if row is not rows[-1] and row.jobs_per_second and baseline
                else None
            )
            print(
                f"{row.name:<32}{fmt(row.jobs_per_second, '10.0f')}"
                f"{fmt(row.enqueue_per_second, '12.0f')}"
                + ("" if ratio is None else f"{ratio:13.2f}x")
            )
    print()
    header = f"{'pickup latency (idle workers)':<32}{'p50 ms':>10}{'p99 ms':>12}"
    print(header)
    print("-" * len(header))
    for row in pickup:
        print(f"{row.name:<32}{fmt(row.p50_ms, '10.1f')}{fmt(row.p99_ms, '12.1f')}")
    print()
    print(
        f"{recovery.name}: median {recovery.p50_ms:.0f} ms, worst {recovery.p99_ms:.0f} ms "
        f"({recovery.note}; the lease's remaining time is the floor)"
    )


def median_row(rows: list[Row]) -> Row:
    return Row(
        rows[0].name,
        jobs_per_second=statistics.median(r.jobs_per_second or 0.0 for r in rows),
        enqueue_per_second=statistics.median(r.enqueue_per_second or 0.0 for r in rows),
    )


async def run(args: argparse.Namespace) -> None:
    server = os.environ.get("FENCEGATE_BENCH_DATABASE_URL", DEFAULT_SERVER)
    throughput: list[list[Row]] = []
    for workers in args.workers:
        runs: dict[str, Callable[[], Awaitable[Row]]] = {
            "fencegate": functools.partial(
                fencegate_throughput,
                server,
                jobs=args.jobs,
                workers=workers,
                batch=args.batch,
                heartbeat=True,
                profile=args.profile,
            ),
            # The same without the durable heartbeat: what the extend costs.
            "no heartbeat": functools.partial(
                fencegate_throughput,
                server,
                jobs=args.jobs,
                workers=workers,
                batch=args.batch,
                heartbeat=False,
                profile=False,
            ),
            "pgqueuer": functools.partial(
                pgqueuer_throughput, server, jobs=args.jobs, workers=workers, batch=args.batch
            ),
        }
        results: dict[str, list[Row]] = {name: [] for name in runs}
        names = list(runs)
        for round_number in range(args.rounds):
            # Rotate the order so that drift in the machine's load hits every contender.
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(await runs[name]())
            print(
                f"  N={workers} round {round_number + 1}: "
                + ", ".join(f"{n} {results[n][-1].jobs_per_second:.0f}" for n in names)
                + " jobs/s",
                file=sys.stderr,
            )
        throughput.append([median_row(results[name]) for name in names])
    pickup_workers = args.workers[0]
    pickup = (
        await fencegate_pickup(server, samples=args.samples, workers=pickup_workers),
        await pgqueuer_pickup(server, samples=args.samples, workers=pickup_workers),
    )
    recovery = await fencegate_recovery(server, runs=3)
    print_table(throughput, pickup, recovery, args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the fencegate workers")
    args = parser.parse_args(argv)
    if min(args.jobs, args.batch, args.rounds, *args.workers) < 1 or args.samples < 2:
        parser.error("--jobs, --batch, --workers, --rounds must be positive, --samples >= 2")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
