"""Closed-loop HTTP load: a fixed number of connections, each sending its next request as
soon as the previous answer arrives, for a fixed time after a warm-up. Prints one JSON line.

    python -m benchmarks.loadgen --url http://127.0.0.1:9001/charges --mode new-keys

Modes (the request shape is the same in all three; only the headers differ):
- ``plain``: no idempotency headers;
- ``new-keys``: a new ``Idempotency-Key`` on every request, and a fence: each connection
  plays one worker with its own entity and a fence that never goes down;
- ``replay``: every request repeats one key, so all but the first are replays;
- ``fenced-replay``: the same, with the fence and entity the first request was accepted with
  (a worker retrying a fenced call).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import aiohttp
import orjson

from benchmarks.stats import percentile

BODY = orjson.dumps({"amount": 1250, "currency": "EUR", "customer": "c-1048"})
REPLAYS = ("replay", "fenced-replay")


def replay_headers(mode: str, run_id: str) -> dict[str, str]:
    """The one key every request of a replay run repeats (with its fence, if fenced)."""
    headers = {"Idempotency-Key": f"bench:{run_id}:{mode}"}
    if mode == "fenced-replay":
        headers |= {"X-Execution-Fence": "1", "X-Execution-Entity": f"bench:{run_id}:replay"}
    return headers


async def _worker(
    index: int,
    session: aiohttp.ClientSession,
    *,
    url: str,
    mode: str,
    run_id: str,
    stop_at: float,
    record_from: float,
    latencies: list[float],
    statuses: Counter[int],
    errors: Counter[str],
    completed: list[int],
) -> None:
    sequence = 0
    entity = f"bench:{run_id}:{index}"
    while True:
        started = time.perf_counter()
        if started >= stop_at:
            return
        sequence += 1
        headers = {"content-type": "application/json"}
        if mode == "new-keys":
            headers["Idempotency-Key"] = f"bench:{run_id}:{index}:{sequence}"
            headers["X-Execution-Fence"] = str(sequence)
            headers["X-Execution-Entity"] = entity
        elif mode in REPLAYS:
            headers.update(replay_headers(mode, run_id))
        try:
            async with session.post(url, data=BODY, headers=headers) as response:
                await response.read()
                status = response.status
            completed[0] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            if started >= record_from:
                errors[type(exc).__name__] += 1
            continue
        if started >= record_from:
            latencies.append(time.perf_counter() - started)
            statuses[status] += 1


async def run(
    *, url: str, mode: str, concurrency: int, duration: float, warmup: float
) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    completed = [0]  # every answer, warm-up included: CPU is measured over the whole run
    run_id = uuid.uuid4().hex[:10]
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if mode in REPLAYS:
            # The first request executes; everything measured afterwards is a replay.
            async with session.post(
                url, data=BODY, headers=replay_headers(mode, run_id)
            ) as response:
                await response.read()
        now = time.perf_counter()
        record_from = now + warmup
        stop_at = record_from + duration
        await asyncio.gather(
            *(
                _worker(
                    i,
                    session,
                    url=url,
                    mode=mode,
                    run_id=run_id,
                    stop_at=stop_at,
                    record_from=record_from,
                    latencies=latencies,
                    statuses=statuses,
                    errors=errors,
                    completed=completed,
                )
                for i in range(concurrency)
            )
        )
    latencies.sort()
    return {
        "url": url,
        "mode": mode,
        "concurrency": concurrency,
        "duration": duration,
        "requests": len(latencies),
        "all_requests": completed[0],
        "rps": len(latencies) / duration,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": dict(errors),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="closed-loop HTTP load generator")
    parser.add_argument("--url", required=True)
    parser.add_argument("--mode", choices=["plain", "new-keys", *REPLAYS], default="plain")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    result = runner(
        run(
            url=args.url,
            mode=args.mode,
            concurrency=args.concurrency,
            duration=args.duration,
            warmup=args.warmup,
        )
    )
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
