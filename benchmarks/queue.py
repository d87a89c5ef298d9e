"""Lease queue benchmark: the fencegate `Worker`, the bare queue, PgQueuer and peers, side by side.

On one PostgreSQL server, each on a fresh database, at the same concurrency (one process each):

- the fencegate `Worker` (claim loop, heartbeat thread, events, metrics, group commit,
  claiming ahead) draining no-op jobs until idle;
- the bare queue, pipelined: claim a batch, commit it with one ``complete_many`` while the
  next claim runs (what the queue costs without a worker around it);
- the bare queue as a user first writes it: ``claim(limit=concurrency)``, then ``complete``
  each job in turn, one statement at a time;
- PgQueuer's runner (``QueueManager.run`` in drain mode, batch size = the concurrency);
- peers with their own workers at the same concurrency (leave them out with ``--no-peers``):
  saq's ``Worker`` on Redis (a queue name of its own, its keys deleted afterwards) and
  Procrastinate's worker on PostgreSQL (drain mode, ``wait=False``). A peer that is not
  installed or whose server is unreachable gets a row saying why instead of a number.

Then both shapes, at every ``--concurrency``: N `Worker`s sharing one queue in one process
against N PgQueuer managers in one process (``--shapes 1 4``). Every throughput row also
shows the CPU each job cost in this process and in the database's backends.

They alternate for several rounds and the table shows each one's median, so that a busy
machine hurts all alike. Then: Worker throughput with 1, 2 and 4 worker processes; pickup
latency (idle workers waiting on LISTEN/NOTIFY, or on Redis for saq; one job enqueued; time
until a tool holds it, or for the peers, until the task starts, from a timestamp in its payload);
and recovery after SIGKILL of a Worker process holding a job (time until another claimer
holds it; the lease's remaining time is the floor). Last, the claim's cost against the
backlog (`benchmarks/backlog.py`; alone with ``--only backlog``).

Run from the repository root (server from ``FENCEGATE_BENCH_DATABASE_URL``, default
postgresql://postgres@127.0.0.1:5432/postgres; Redis from ``FENCEGATE_BENCH_REDIS_URL``,
default redis://127.0.0.1:6379/0)::

    python -m benchmarks.queue [--jobs 5000] [--concurrency 10 50] [--shapes 1 4]
                               [--processes 1 2 4] [--rounds 3] [--samples 100] [--profile]
                               [--no-peers] [--only backlog|shapes]
                               [--compare LABEL=PYTHON ...]

``--compare LABEL=PYTHON`` (repeatable) adds Worker rows, in every shape, for the fencegate
that another interpreter has installed (an older commit in its own venv), each on a database
that version migrates, in the same interleaved rounds: "before and after" is one run.
``--only shapes`` runs only the Worker and PgQueuer in every shape (and the compared rows).

With the defaults a whole run takes about ten minutes on two shared cores.

Figures depend on the machine and on whatever else it is doing: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import io
import logging
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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from prometheus_client import CollectorRegistry

from benchmarks import backlog
from benchmarks.cpu import backends_cpu, backends_spent
from benchmarks.stats import percentile
from fencegate.lease import Lease, LeaseQueue, Worker
from fencegate.lease.events import EventLog
from fencegate.lease.metrics import WorkerMetrics
from tests.support import postgres

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
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
    # CPU per job: this process (the worker or runner, all its threads), and the database's
    # backends serving it; steadier than jobs/s on a shared machine.
    cpu_ms: float | None = None
    db_cpu_ms: float | None = None


class CpuMeter:
    """CPU spent by this process and by the backends of one database between `start` and
    `stop` (read before the pool closes: a backend that is gone cannot be read)."""

    def __init__(self, url: str) -> None:
        self.database = urlsplit(url).path.lstrip("/")
        self.process = 0.0
        self.backends: dict[int, float] = {}

    def start(self) -> None:
        self.backends = backends_cpu(self.database)
        self.process = time.process_time()

    def stop(self, row: Row, jobs: int) -> Row:
        process = time.process_time() - self.process
        database = backends_spent(self.backends, self.database)
        row.cpu_ms = process / jobs * 1000
        row.db_cpu_ms = database / jobs * 1000
        return row


# -- databases ---------------------------------------------------------------------------


# The collation and character classes of every database the run creates (``--database-locale``;
# None: the server's default), set once by `main` before anything runs.
DATABASE_LOCALE: str | None = None


@contextlib.asynccontextmanager
async def fresh_database(server: str) -> AsyncIterator[str]:
    name = "fg_bench_" + uuid.uuid4().hex[:10]
    options = "" if DATABASE_LOCALE is None else postgres.locale_clause(DATABASE_LOCALE)
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"{options}')
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


async def fencegate_pickup(server: str, *, samples: int, workers: int, limit: int = 1) -> Row:
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
                    leases = await consumer.claim(name, kinds=["ping"], limit=limit, timeout=30)
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


# -- the Worker -------------------------------------------------------------------------


def _noop_tool(job: Any) -> None:
    return None


def _quiet_worker(queue: LeaseQueue, tools: dict[str, Any], *, concurrency: int) -> Worker:
    # Events kept in memory and a registry of its own: the run measures the worker, not a
    # log file or the process-wide metrics.
    return Worker(
        queue,
        tools=tools,
        concurrency=concurrency,
        events=EventLog(keep=1000),
        metrics=WorkerMetrics(registry=CollectorRegistry()),
    )


async def _enqueue_noops(queue: LeaseQueue, jobs: int) -> float:
    started = time.perf_counter()
    for start in range(0, jobs, 500):
        await queue.enqueue_many(
            [{"kind": "noop", "payload": {"n": n}} for n in range(start, min(jobs, start + 500))],
            timeout=30,
        )
    return time.perf_counter() - started


async def worker_throughput(
    server: str, *, jobs: int, concurrency: int, profile: bool, workers: int = 1
) -> Row:
    """``workers`` `Worker`s in this one process (claim loops, heartbeat threads, events,
    metrics, group commit), sharing one queue, drain ``jobs`` no-op jobs; timed from start
    to idle."""
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(
            url, timeout=30, pool_max_size=min(workers * (concurrency + 2), 24)
        )
        try:
            await queue.migrate()
            enqueue_seconds = await _enqueue_noops(queue, jobs)
            crew = [
                _quiet_worker(queue, {"noop": _noop_tool}, concurrency=concurrency)
                for _ in range(workers)
            ]
            trips = queue.round_trips
            profiler = cProfile.Profile() if profile else None
            meter = CpuMeter(url)
            meter.start()
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            await asyncio.wait_for(
                asyncio.gather(*(worker.run_until_idle() for worker in crew)),
                PHASE_LIMIT_SECONDS,
            )
            if profiler:
                profiler.disable()
            seconds = time.perf_counter() - started
            row = meter.stop(Row("fencegate Worker"), jobs)
            trips = queue.round_trips - trips
            done = len(await queue.list_jobs(state="succeeded", limit=jobs + 1, timeout=30))
            if done != jobs:
                raise RuntimeError(f"the Worker finished {done} of {jobs} jobs")
            if profiler:
                print_profile(profiler, "fencegate Worker")
        finally:
            await queue.close()
    row.jobs_per_second = jobs / seconds
    row.enqueue_per_second = jobs / enqueue_seconds
    row.note = f"{trips / jobs * 10:.1f} statements per 10 jobs"
    return row


# A Worker crew run by another interpreter (``--compare``): the fencegate it has installed
# migrates a database of its own and queues the jobs, says "ready", drains them on a line on
# stdin and prints the seconds, its CPU seconds, the statements sent and the jobs finished,
# then keeps its pool open until the next line (its backends are read before they go).
_COMPARED_WORKER = """
import asyncio, sys, time
from prometheus_client import CollectorRegistry
from fencegate.lease import LeaseQueue, Worker
from fencegate.lease.events import EventLog
from fencegate.lease.metrics import WorkerMetrics

async def main(url: str, jobs: int, workers: int, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    queue = await LeaseQueue.connect(
        url, timeout=30, pool_max_size=min(workers * (concurrency + 2), 24))
    await queue.migrate()
    for start in range(0, jobs, 500):
        await queue.enqueue_many(
            [{"kind": "noop", "payload": {"n": n}} for n in range(start, min(jobs, start + 500))],
            timeout=30)
    crew = [Worker(queue, tools={"noop": lambda job: None}, concurrency=concurrency,
                   events=EventLog(keep=1000), metrics=WorkerMetrics(registry=CollectorRegistry()))
            for _ in range(workers)]
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    trips = queue.round_trips
    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(worker.run_until_idle() for worker in crew))
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    trips = queue.round_trips - trips
    done = len(await queue.list_jobs(state="succeeded", limit=jobs + 1, timeout=30))
    print("done", seconds, cpu, trips, done, flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await queue.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


async def compared_worker_throughput(
    server: str, python: str, label: str, *, jobs: int, concurrency: int, workers: int
) -> Row:
    """`worker_throughput` for the fencegate another interpreter has installed, on a fresh
    database that version migrates; run outside this checkout, without ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    async with fresh_database(server) as url:
        proc = await asyncio.create_subprocess_exec(
            python,
            "-c",
            _COMPARED_WORKER,
            url,
            str(jobs),
            str(workers),
            str(concurrency),
            cwd="/",
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None
        try:
            assert await _line(proc) == "ready"
            meter = CpuMeter(url)
            meter.start()
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            fields = (await asyncio.wait_for(_line(proc), PHASE_LIMIT_SECONDS)).split()
            row = meter.stop(Row(f"{label}: fencegate Worker"), jobs)
            proc.stdin.write(b"close\n")
            await proc.stdin.drain()
            await asyncio.wait_for(proc.wait(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    seconds, cpu, trips, done = float(fields[1]), float(fields[2]), int(fields[3]), int(fields[4])
    if fields[0] != "done" or done != jobs:
        raise RuntimeError(f"{label}: the Worker finished {done} of {jobs} jobs")
    row.jobs_per_second = jobs / seconds
    row.cpu_ms = cpu / jobs * 1000
    row.note = f"{trips / jobs * 10:.1f} statements per 10 jobs"
    return row


async def worker_pickup(server: str, *, samples: int, concurrency: int) -> Row:
    """An idle `Worker` (LISTEN/NOTIFY); one job enqueued; time until its tool runs."""
    async with fresh_database(server) as url:
        consumer = await LeaseQueue.connect(url, timeout=30, pool_max_size=concurrency + 2)
        producer = await LeaseQueue.connect(url, timeout=30, pool_max_size=2)
        try:
            await producer.migrate()
            got: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

            def ping(job: Any) -> None:
                got.put_nowait((job.id, time.perf_counter()))

            worker = _quiet_worker(consumer, {"ping": ping}, concurrency=concurrency)
            task = asyncio.create_task(worker.run())
            await asyncio.sleep(0.5)  # the worker is idle-waiting
            latencies: list[float] = []
            for n in range(samples):
                sent = time.perf_counter()
                job_id = await producer.enqueue("ping", {"n": n}, timeout=30)
                claimed_id, claimed = await asyncio.wait_for(got.get(), 30)
                assert claimed_id == job_id
                latencies.append((claimed - sent) * 1000)
                await asyncio.sleep(0.02)  # let it commit and settle back into waiting
            worker.stop()
            await asyncio.wait_for(task, 30)
        finally:
            await consumer.close()
            await producer.close()
    return Row(
        "fencegate Worker",
        p50_ms=percentile(latencies, 0.5),
        p99_ms=percentile(latencies, 0.99),
    )


# A Worker in its own process. "drain": wait for a line on stdin, run until idle, print the
# seconds it took. "victim": hold one job (its tool never returns) and print its token.
_WORKER_PROCESS = """
import asyncio, sys, time
from prometheus_client import CollectorRegistry
from fencegate.lease import LeaseQueue, Worker
from fencegate.lease.events import EventLog
from fencegate.lease.metrics import WorkerMetrics

async def main(url: str, mode: str, concurrency: int) -> None:
    queue = await LeaseQueue.connect(url, timeout=30, pool_max_size=concurrency + 2)

    async def hold(job):
        print("holding", job.fencing_token, flush=True)
        await asyncio.Event().wait()

    tools = {"noop": lambda job: None} if mode == "drain" else {"victim": hold}
    worker = Worker(queue, tools=tools, concurrency=concurrency, events=EventLog(keep=100),
                    metrics=WorkerMetrics(registry=CollectorRegistry()))
    if mode == "drain":
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    started = time.perf_counter()
    await worker.run_until_idle()
    print("done", time.perf_counter() - started, flush=True)
    await queue.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def _spawn_worker(url: str, mode: str, concurrency: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _WORKER_PROCESS,
        url,
        mode,
        str(concurrency),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if not line:
        raise RuntimeError(f"worker process exited early ({await proc.wait()})")
    return line.decode().strip()


async def worker_processes(server: str, *, jobs: int, processes: int, concurrency: int) -> Row:
    """``processes`` Worker processes drain ``jobs`` together; timed from the go signal
    (every process started and connected) until the last one is idle."""
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(url, timeout=30)
        procs: list[asyncio.subprocess.Process] = []
        try:
            await queue.migrate()
            await _enqueue_noops(queue, jobs)
            procs = [await _spawn_worker(url, "drain", concurrency) for _ in range(processes)]
            for proc in procs:
                assert await _line(proc) == "ready"
            started = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            for proc in procs:
                assert (await _line(proc)).startswith("done")
            seconds = time.perf_counter() - started
            # Let them close their connections before the database is dropped under them.
            await asyncio.wait_for(asyncio.gather(*(proc.wait() for proc in procs)), 30)
            done = len(await queue.list_jobs(state="succeeded", limit=jobs + 1, timeout=30))
            if done != jobs:
                raise RuntimeError(f"{processes} Worker processes finished {done} of {jobs}")
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
            await queue.close()
    return Row(f"{processes}", jobs_per_second=jobs / seconds)


async def worker_recovery(server: str, *, runs: int, lease_seconds: float) -> Row:
    """A Worker process holding a job (heartbeats running) is SIGKILLed; time until another
    claimer holds the job. The lease's remaining time is the floor."""
    recoveries: list[float] = []
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(url, timeout=30)
        try:
            await queue.migrate()
            for n in range(runs):
                job_id = await queue.enqueue(
                    "victim",
                    {"n": n},
                    lease_seconds=lease_seconds,
                    heartbeat_seconds=lease_seconds / 4,
                    jitter_seconds=lease_seconds / 2,
                )
                proc = await _spawn_worker(url, "victim", 1)
                old_token = int((await _line(proc)).split()[1])
                await asyncio.sleep(lease_seconds / 2)  # a few heartbeats have landed
                proc.send_signal(signal.SIGKILL)
                killed = time.perf_counter()
                await proc.wait()
                deadline = time.monotonic() + lease_seconds + 10
                while True:  # bounded: the lease runs out on the database clock
                    leases = await queue.claim("rescuer", kinds=["victim"], limit=1, timeout=30)
                    if leases or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.005)
                if not leases:
                    raise RuntimeError("the killed worker's job was never reclaimed")
                recovered = time.perf_counter()
                [lease] = leases
                assert lease.job_id == job_id and lease.fencing_token > old_token
                await queue.complete(lease, None)
                recoveries.append(recovered - killed)
        finally:
            await queue.close()
    return Row(
        f"recovery after SIGKILL of a Worker holding a job (lease {lease_seconds:g} s)",
        p50_ms=statistics.median(recoveries) * 1000,
        p99_ms=max(recoveries) * 1000,
        note=f"{runs} runs",
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
            meter = CpuMeter(url)
            managers: list[QueueManager] = []
            for conn in conns:
                manager = QueueManager(Queries(AsyncpgDriver(conn)))

                @manager.entrypoint("noop")
                async def noop(job: Job) -> None:
                    nonlocal done
                    done += 1

                managers.append(manager)
            meter.start()
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
            row = meter.stop(Row(f"PgQueuer    N={workers}"), jobs)
            if done != jobs:
                raise RuntimeError(f"PgQueuer finished {done} of {jobs} jobs")
        finally:
            for conn in [producer, *conns]:
                await conn.close()
    row.jobs_per_second = jobs / seconds
    row.enqueue_per_second = jobs / enqueue_seconds
    return row


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


# -- the plain loop ----------------------------------------------------------------------


async def plain_loop_throughput(server: str, *, jobs: int, batch: int) -> Row:
    """What a user writes first: claim up to ``batch`` jobs, then ``complete`` each one in
    turn, one statement at a time, until the queue is empty."""
    async with fresh_database(server) as url:
        queue = await LeaseQueue.connect(url, timeout=30, pool_max_size=4)
        try:
            await queue.migrate()
            enqueue_seconds = await _enqueue_noops(queue, jobs)
            done = 0
            deadline = time.monotonic() + PHASE_LIMIT_SECONDS
            meter = CpuMeter(url)
            meter.start()
            started = time.perf_counter()
            while time.monotonic() < deadline:
                leases = await queue.claim("plain", kinds=["noop"], limit=batch, timeout=30)
                if not leases:
                    break
                for lease in leases:
                    done += await queue.complete(lease, None, timeout=30)
            seconds = time.perf_counter() - started
            row = meter.stop(Row("fencegate claim(limit) + complete() per job"), jobs)
            if done != jobs:
                raise RuntimeError(f"the plain loop finished {done} of {jobs} jobs")
        finally:
            await queue.close()
    row.jobs_per_second = jobs / seconds
    row.enqueue_per_second = jobs / enqueue_seconds
    return row


# -- saq (Redis) -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def saq_queue(redis_url: str) -> AsyncIterator[Any]:
    """A saq queue under a name of its own on the Redis server; its keys are deleted after."""
    from redis import asyncio as aioredis
    from saq.queue.redis import RedisQueue

    # saq warns at every stop that its idle upkeep loops had to be cancelled.
    logging.getLogger("saq").setLevel(logging.ERROR)
    name = "fg_bench_" + uuid.uuid4().hex[:10]
    queue = RedisQueue(aioredis.from_url(redis_url), name=name)
    await queue.connect()
    try:
        yield queue
    finally:
        await queue.disconnect()
        cleaner = aioredis.from_url(redis_url)
        try:
            keys = [key async for key in cleaner.scan_iter(match=f"saq:*{name}*", count=1000)]
            for start in range(0, len(keys), 1000):
                await cleaner.delete(*keys[start : start + 1000])
        finally:
            await cleaner.aclose()


async def _saq_enqueue(queue: Any, function: str, kwargs: list[dict[str, Any]]) -> None:
    for start in range(0, len(kwargs), 500):
        await asyncio.gather(*(queue.enqueue(function, **kw) for kw in kwargs[start : start + 500]))


async def saq_throughput(redis_url: str, *, jobs: int, concurrency: int) -> Row:
    """saq's own `Worker` at the same concurrency drains ``jobs`` no-op jobs; timed from its
    start until every job has run and been marked complete."""
    from saq import Worker as SaqWorker

    async with saq_queue(redis_url) as queue:
        started = time.perf_counter()
        await _saq_enqueue(queue, "noop", [{"n": n} for n in range(jobs)])
        enqueue_seconds = time.perf_counter() - started
        done = 0
        all_done = asyncio.Event()

        async def noop(ctx: Any, *, n: int) -> None:
            return None

        async def finished(ctx: Any) -> None:
            # saq calls this after it has marked the job complete.
            nonlocal done
            done += 1
            if done >= jobs:
                all_done.set()

        worker = SaqWorker(
            queue,
            functions=[("noop", noop)],
            concurrency=concurrency,
            after_process=[finished],
        )
        started = time.perf_counter()
        task = asyncio.create_task(worker.start())
        try:
            await asyncio.wait_for(all_done.wait(), PHASE_LIMIT_SECONDS)
            seconds = time.perf_counter() - started
            left = await queue.count("incomplete")
        finally:
            await worker.stop()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        if done != jobs or left:
            raise RuntimeError(f"saq finished {done} of {jobs} jobs, {left} left")
    return Row(
        "saq Worker (Redis)",
        jobs_per_second=jobs / seconds,
        enqueue_per_second=jobs / enqueue_seconds,
    )


async def saq_pickup(redis_url: str, *, samples: int, concurrency: int) -> Row:
    """An idle saq `Worker`; one job enqueued with the time in its payload; the task measures
    how long after that it started."""
    from saq import Worker as SaqWorker

    async with saq_queue(redis_url) as queue:
        got: asyncio.Queue[float] = asyncio.Queue()

        async def ping(ctx: Any, *, n: int, sent: float) -> None:
            got.put_nowait(time.perf_counter() - sent)

        worker = SaqWorker(queue, functions=[("ping", ping)], concurrency=concurrency)
        task = asyncio.create_task(worker.start())
        latencies: list[float] = []
        try:
            await asyncio.sleep(0.5)  # every slot is waiting on Redis
            for n in range(samples):
                await queue.enqueue("ping", n=n, sent=time.perf_counter())
                latencies.append(await asyncio.wait_for(got.get(), 30) * 1000)
                await asyncio.sleep(0.02)
        finally:
            await worker.stop()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
    return Row(
        "saq Worker (Redis)",
        p50_ms=percentile(latencies, 0.5),
        p99_ms=percentile(latencies, 0.99),
    )


# -- Procrastinate -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def procrastinate_app(server: str, *, concurrency: int) -> AsyncIterator[tuple[Any, str]]:
    """A Procrastinate app on a fresh database with its schema applied."""
    import procrastinate

    # It warns that an app defined in __main__ cannot be found by its command-line worker;
    # this benchmark runs the worker in process.
    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    async with fresh_database(server) as url:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=url, min_size=2, max_size=concurrency + 2
            )
        )
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            yield app, url


async def procrastinate_throughput(server: str, *, jobs: int, concurrency: int) -> Row:
    """Procrastinate's own worker at the same concurrency, in drain mode (``wait=False``:
    it returns once no job is left)."""
    async with procrastinate_app(server, concurrency=concurrency) as (app, url):
        done = 0

        @app.task(name="noop")  # type: ignore[untyped-decorator]
        async def noop(n: int) -> None:
            nonlocal done
            done += 1

        started = time.perf_counter()
        for start in range(0, jobs, 500):
            await noop.batch_defer_async(*({"n": n} for n in range(start, min(jobs, start + 500))))
        enqueue_seconds = time.perf_counter() - started
        started = time.perf_counter()
        await asyncio.wait_for(
            app.run_worker_async(
                concurrency=concurrency, wait=False, install_signal_handlers=False
            ),
            PHASE_LIMIT_SECONDS,
        )
        seconds = time.perf_counter() - started
        conn = await asyncpg.connect(url, timeout=10)
        try:
            succeeded = await conn.fetchval(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            )
        finally:
            await conn.close()
        if done != jobs or succeeded != jobs:
            raise RuntimeError(f"Procrastinate ran {done} and finished {succeeded} of {jobs}")
    return Row(
        "Procrastinate worker",
        jobs_per_second=jobs / seconds,
        enqueue_per_second=jobs / enqueue_seconds,
    )


async def procrastinate_pickup(server: str, *, samples: int, concurrency: int) -> Row:
    """An idle Procrastinate worker (LISTEN/NOTIFY); one job deferred with the time in its
    payload; the task measures how long after that it started."""
    async with procrastinate_app(server, concurrency=concurrency) as (app, _url):
        got: asyncio.Queue[float] = asyncio.Queue()

        @app.task(name="ping")  # type: ignore[untyped-decorator]
        async def ping(n: int, sent: float) -> None:
            got.put_nowait(time.perf_counter() - sent)

        task = asyncio.create_task(
            app.run_worker_async(concurrency=concurrency, install_signal_handlers=False)
        )
        latencies: list[float] = []
        try:
            await asyncio.sleep(1.0)  # the worker is listening
            for n in range(samples):
                await ping.defer_async(n=n, sent=time.perf_counter())
                latencies.append(await asyncio.wait_for(got.get(), 30) * 1000)
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
    return Row(
        "Procrastinate worker",
        p50_ms=percentile(latencies, 0.5),
        p99_ms=percentile(latencies, 0.99),
    )


async def peer_unavailable(name: str, redis_url: str) -> str | None:
    """Why a peer cannot run here (not installed, server unreachable), or None."""
    try:
        if name == "saq":
            import saq  # noqa: F401
            from redis import asyncio as aioredis

            client = aioredis.from_url(redis_url, socket_connect_timeout=5)
            try:
                await client.ping()
            finally:
                await client.aclose()
        elif name == "procrastinate":
            import procrastinate  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:120].replace("|", "/")
    return None


# -- report ------------------------------------------------------------------------------


def print_profile(profiler: cProfile.Profile, title: str) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    print(f"\n-- cProfile, {title} (own time, top 18) --")
    print("\n".join(out.getvalue().splitlines()[4:]))


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def median_row(rows: list[Row]) -> Row:
    return Row(
        rows[0].name,
        jobs_per_second=statistics.median(r.jobs_per_second or 0.0 for r in rows),
        enqueue_per_second=statistics.median(r.enqueue_per_second or 0.0 for r in rows),
        note=rows[len(rows) // 2].note,
        cpu_ms=_median_of([r.cpu_ms for r in rows]),
        db_cpu_ms=_median_of([r.db_cpu_ms for r in rows]),
    )


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def cpu_text(row: Row) -> str:
    if row.cpu_ms is None:
        return "-"
    return f"{row.cpu_ms * 1000:.0f} + {(row.db_cpu_ms or 0.0) * 1000:.0f}"


PEERS = ("saq", "procrastinate")
ORDER = ("worker", "pipelined", "plain", "pgqueuer", *PEERS)


def print_shapes(
    shapes: dict[tuple[int, int], tuple[Row, Row]],
    compared: dict[tuple[int, int], list[Row]],
    args: argparse.Namespace,
) -> None:
    print()
    print(
        "Both shapes: N fencegate Workers sharing one queue in one process, against N PgQueuer "
        "managers (batch size = concurrency) in one process; CPU µs per job: this process "
        "(all threads) + the database's backends"
    )
    print()
    print(
        "| fencegate | Workers in the process | concurrency | fencegate jobs/s "
        "| PgQueuer jobs/s | x PgQueuer | fencegate CPU µs/job | PgQueuer CPU µs/job "
        "| statements per 10 jobs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (workers, concurrency), (ours, theirs) in shapes.items():
        for row in [ours, *compared.get((workers, concurrency), [])]:
            label = row.name.partition(":")[0] if row is not ours else "this checkout"
            ratio = (row.jobs_per_second or 0.0) / (theirs.jobs_per_second or 1.0)
            print(
                f"| {label} | {workers} | {concurrency} | {fmt(row.jobs_per_second, '.0f')} "
                f"| {fmt(theirs.jobs_per_second, '.0f')} | {ratio:.2f} | {cpu_text(row)} "
                f"| {cpu_text(theirs)} | {row.note.split()[0] if row.note else '-'} |"
            )


def print_table(
    throughput: dict[str, Row],
    pickup: dict[str, Row],
    scaling: list[Row],
    recovery: Row,
    args: argparse.Namespace,
) -> None:
    baseline = throughput["pgqueuer"].jobs_per_second or 0.0
    print()
    print(
        f"Lease queue: {args.jobs} no-op jobs per run, concurrency {args.concurrency[0]} "
        f"(one process each), one PostgreSQL server (saq: one Redis server), median of "
        f"{args.rounds} interleaved rounds"
    )
    print()
    print(
        "| contender | jobs/s | x PgQueuer | pickup p50 ms | pickup p99 ms "
        "| CPU µs/job: process + PostgreSQL |"
    )
    print("|---|---|---|---|---|---|")
    for key in ORDER:
        if key not in throughput:
            continue
        row, wait = throughput[key], pickup[key]
        if row.jobs_per_second is None:
            print(f"| {row.name} | not run: {row.note} | - | - | - | - |")
            continue
        ratio = row.jobs_per_second / baseline if baseline else 0.0
        print(
            f"| {row.name} | {fmt(row.jobs_per_second, '.0f')} | {ratio:.2f} "
            f"| {fmt(wait.p50_ms, '.1f')} | {fmt(wait.p99_ms, '.1f')} | {cpu_text(row)} |"
        )
    print()
    one = scaling[0].jobs_per_second or 0.0
    print("| Worker processes | jobs/s | x 1 process |")
    print("|---|---|---|")
    for row in scaling:
        ratio = (row.jobs_per_second or 0.0) / one if one else 0.0
        print(f"| {row.name} | {fmt(row.jobs_per_second, '.0f')} | {ratio:.2f} |")
    print()

    def times_pgqueuer(name: str) -> str:
        return f"{(throughput[name].jobs_per_second or 0.0) / baseline:.2f}x measured"

    print(
        f"{throughput['worker'].name}: {throughput['worker'].note}. Targets: Worker >= 1.0x "
        f"PgQueuer in every shape ({times_pgqueuer('worker')} here; the shapes below), "
        f"a plain claim + complete() loop >= 0.8x ({times_pgqueuer('plain')}), Worker "
        f"pickup p50 <= 5 ms ({pickup['worker'].p50_ms:.1f} ms measured)."
    )
    print(
        f"{recovery.name[0].upper()}{recovery.name[1:]}: median {recovery.p50_ms:.0f} ms, "
        f"worst {recovery.p99_ms:.0f} ms ({recovery.note}; the bar is lease + 1 s)"
    )


PEER_NAMES = {"saq": "saq Worker (Redis)", "procrastinate": "Procrastinate worker"}


async def backlog_table(server: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        databases = [
            await stack.enter_async_context(fresh_database(server)) for _ in backlog.BACKLOGS
        ]
        backlog.print_table(await backlog.measure(databases))


async def run(args: argparse.Namespace) -> None:
    server = os.environ.get("FENCEGATE_BENCH_DATABASE_URL", DEFAULT_SERVER)
    if args.only == "backlog":
        await backlog_table(server)
        return
    redis_url = os.environ.get("FENCEGATE_BENCH_REDIS_URL", DEFAULT_REDIS)
    concurrency = args.concurrency[0]
    runs: dict[str, Callable[[], Awaitable[Row]]] = {
        "worker": functools.partial(
            worker_throughput,
            server,
            jobs=args.jobs,
            concurrency=concurrency,
            profile=args.profile,
        ),
        # Claim a batch, commit it with complete_many while the next claim runs: the floor
        # of what the queue itself costs, without a worker around it.
        "pipelined": functools.partial(
            fencegate_throughput,
            server,
            jobs=args.jobs,
            workers=1,
            batch=concurrency,
            heartbeat=False,
            profile=False,
        ),
        "plain": functools.partial(
            plain_loop_throughput, server, jobs=args.jobs, batch=concurrency
        ),
        "pgqueuer": functools.partial(
            pgqueuer_throughput, server, jobs=args.jobs, workers=1, batch=concurrency
        ),
    }
    pickups: dict[str, Callable[[], Awaitable[Row]]] = {
        "worker": functools.partial(
            worker_pickup, server, samples=args.samples, concurrency=concurrency
        ),
        "pipelined": functools.partial(fencegate_pickup, server, samples=args.samples, workers=1),
        "plain": functools.partial(
            fencegate_pickup, server, samples=args.samples, workers=1, limit=concurrency
        ),
        "pgqueuer": functools.partial(pgqueuer_pickup, server, samples=args.samples, workers=1),
    }
    if args.only == "shapes":
        runs = {name: runs[name] for name in ("worker", "pgqueuer")}
        pickups = {}
    skipped: dict[str, str] = {}
    if args.peers and args.only != "shapes":
        peer_runs: dict[str, tuple[Callable[[], Awaitable[Row]], Callable[[], Awaitable[Row]]]]
        peer_runs = {
            "saq": (
                functools.partial(
                    saq_throughput, redis_url, jobs=args.jobs, concurrency=concurrency
                ),
                functools.partial(
                    saq_pickup, redis_url, samples=args.samples, concurrency=concurrency
                ),
            ),
            "procrastinate": (
                functools.partial(
                    procrastinate_throughput, server, jobs=args.jobs, concurrency=concurrency
                ),
                functools.partial(
                    procrastinate_pickup, server, samples=args.samples, concurrency=concurrency
                ),
            ),
        }
        for peer, (throughput_run, pickup_run) in peer_runs.items():
            reason = await peer_unavailable(peer, redis_url)
            if reason:
                skipped[peer] = reason
            else:
                runs[peer] = throughput_run
                pickups[peer] = pickup_run
    scaling_runs = {
        n: functools.partial(
            worker_processes, server, jobs=args.jobs, processes=n, concurrency=concurrency
        )
        for n in args.processes
        if args.only != "shapes"
    }
    # Both shapes at every concurrency: fencegate and PgQueuer, N of each in one process.
    for workers in args.shapes:
        for level in args.concurrency:
            for label, python in args.compare:
                runs[f"{label} {workers}x{level}"] = functools.partial(
                    compared_worker_throughput,
                    server,
                    python,
                    label,
                    jobs=args.jobs,
                    concurrency=level,
                    workers=workers,
                )
            if workers == 1 and level == concurrency:
                continue  # the first table's own rows
            runs[f"worker {workers}x{level}"] = functools.partial(
                worker_throughput,
                server,
                jobs=args.jobs,
                concurrency=level,
                profile=False,
                workers=workers,
            )
            runs[f"pgqueuer {workers}x{level}"] = functools.partial(
                pgqueuer_throughput, server, jobs=args.jobs, workers=workers, batch=level
            )
    results: dict[str, list[Row]] = {name: [] for name in runs}
    scaled: dict[int, list[Row]] = {n: [] for n in scaling_runs}
    names = list(runs)
    for round_number in range(args.rounds):
        # Rotate the order so that drift in the machine's load hits every contender.
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            if name in skipped:
                continue
            try:
                results[name].append(await runs[name]())
            except TimeoutError:
                if name not in PEERS:
                    raise
                # A peer too slow for the phase limit on this machine gets a row saying so.
                skipped[name] = f"did not drain {args.jobs} jobs within {PHASE_LIMIT_SECONDS:g} s"
        for n, measure in scaling_runs.items():
            scaled[n].append(await measure())
        print(
            f"  round {round_number + 1}: "
            + ", ".join(f"{n} {results[n][-1].jobs_per_second:.0f}" for n in names if results[n])
            + "".join(f"; processes {n}: {scaled[n][-1].jobs_per_second:.0f}" for n in scaled)
            + " jobs/s",
            file=sys.stderr,
        )
    throughput = {name: median_row(rows) for name, rows in results.items() if rows}
    shapes: dict[tuple[int, int], tuple[Row, Row]] = {}
    compared: dict[tuple[int, int], list[Row]] = {}
    for workers in args.shapes:
        for level in args.concurrency:
            compared[workers, level] = [
                throughput.pop(f"{label} {workers}x{level}") for label, _ in args.compare
            ]
            if workers == 1 and level == concurrency:
                shapes[workers, level] = (throughput["worker"], throughput["pgqueuer"])
            else:
                shapes[workers, level] = (
                    throughput.pop(f"worker {workers}x{level}"),
                    throughput.pop(f"pgqueuer {workers}x{level}"),
                )
    if args.only == "shapes":
        print_shapes(shapes, compared, args)
        return
    throughput["pipelined"].name = "fencegate claim + complete_many, pipelined"
    throughput["plain"].name = f"fencegate claim(limit={concurrency}) + complete() per job"
    throughput["pgqueuer"].name = "PgQueuer QueueManager.run"
    for peer, reason in skipped.items():
        throughput[peer] = Row(PEER_NAMES[peer], note=reason)
    pickup = {name: await measure() for name, measure in pickups.items() if name not in skipped}
    for peer in skipped:
        pickup[peer] = Row(PEER_NAMES[peer])
    recovery = await worker_recovery(server, runs=3, lease_seconds=2.0)
    print_table(throughput, pickup, [median_row(rows) for rows in scaled.values()], recovery, args)
    print_shapes(shapes, compared, args)
    await backlog_table(server)


def _comparison(text: str) -> tuple[str, str]:
    label, sep, python = text.partition("=")
    if not sep or not label or ":" in label or not Path(python).is_file():
        raise argparse.ArgumentTypeError(
            f"expected LABEL=PATH-TO-PYTHON (an interpreter with fencegate installed), got {text!r}"
        )
    return label, python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[10, 50],
        help="tool slots per Worker (PgQueuer: batch size); the first one for the main table",
    )
    parser.add_argument(
        "--shapes",
        type=int,
        nargs="+",
        default=[1, 4],
        help="Workers (PgQueuer: managers) in one process, each measured at every concurrency",
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the Worker")
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="leave out saq and Procrastinate",
    )
    parser.add_argument(
        "--only",
        choices=["backlog", "shapes"],
        help="run one table alone (backlog: claim cost against the queue's depth; shapes: "
        "the Worker against PgQueuer in every shape and concurrency, and --compare's rows)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=PYTHON",
        type=_comparison,
        help="also run the Worker of the fencegate that PYTHON has installed (an older commit "
        "in its own venv) in every shape, on its own database, in the same rounds; repeatable",
    )
    parser.add_argument(
        "--database-locale",
        default=None,
        metavar="LOCALE",
        help="create every database with this collation and character classes (e.g. "
        "en_US.UTF-8, a common server default; the server must have the locale)",
    )
    args = parser.parse_args(argv)
    global DATABASE_LOCALE
    DATABASE_LOCALE = args.database_locale
    if (
        min(args.jobs, *args.concurrency, *args.shapes, args.rounds, *args.processes) < 1
        or args.samples < 2
    ):
        parser.error(
            "--jobs, --concurrency, --processes, --rounds must be positive, --samples >= 2"
        )
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
