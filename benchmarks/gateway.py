"""Gateway throughput and latency, side by side in one run, then a profile of the gateway.

    .venv/bin/python -m benchmarks.gateway [--concurrency 48] [--duration 5] [--warmup 1]

Every server is its own uvicorn process (one worker) on loopback, and the load comes from
another process (`benchmarks.loadgen`). Measured, in this order:

1. the upstream alone;
2. a bare passthrough proxy on the same stack, with no store (`benchmarks.bare_proxy`);
3. fencegate on SQLite, a new key and a fence on every request;
4. fencegate on PostgreSQL, a new key and a fence on every request;
5. fencegate on PostgreSQL, one key repeated (the replay path).

Ratios are to the bare proxy. The bars: (4) >= 0.6x, (5) >= 1.0x. Then, unless
``--no-profile``, py-spy samples the PostgreSQL gateway under each load and prints where the
time goes (by package, and the functions with the most samples of their own).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from benchmarks.loadgen import BODY
from fencegate.migrations import migrate
from tests.support import postgres
from tests.support.gateway import GatewayProcess
from tests.support.net import free_port, wait_for_port
from tests.support.upstream import UpstreamProcess

REPO_ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Scenario:
    name: str
    url: str
    mode: str
    pid: int
    bar: float | None = None


@dataclass
class Result:
    scenario: Scenario
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_percent: float
    statuses: dict[str, int]
    errors: dict[str, int]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@contextlib.contextmanager
def bare_proxy(upstream: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.bare_proxy",
            "--upstream",
            upstream,
            "--port",
            str(port),
        ],
        cwd=REPO_ROOT,
    )
    try:
        wait_for_port(port, timeout=20)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run_load(
    url: str, *, mode: str, concurrency: int, duration: float, warmup: float
) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.loadgen",
        "--url",
        url,
        "--mode",
        mode,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration),
        "--warmup",
        str(warmup),
    ]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=warmup + duration + 60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr}")
    return dict(orjson.loads(done.stdout.strip().splitlines()[-1]))


def measure(scenario: Scenario, *, concurrency: int, duration: float, warmup: float) -> Result:
    # The load generator reports only the measured window; CPU is sampled over the whole run
    # (warm-up included) and scaled, which is close enough for "is this process saturated".
    cpu_before, wall_before = cpu_seconds(scenario.pid), time.monotonic()
    load = run_load(
        scenario.url + "/charges",
        mode=scenario.mode,
        concurrency=concurrency,
        duration=duration,
        warmup=warmup,
    )
    cpu = (cpu_seconds(scenario.pid) - cpu_before) / (time.monotonic() - wall_before)
    return Result(
        scenario=scenario,
        rps=float(load["rps"]),
        p50_ms=float(load["p50_ms"]),
        p99_ms=float(load["p99_ms"]),
        cpu_percent=cpu * 100,
        statuses=dict(load["statuses"]),
        errors=dict(load["errors"]),
    )


def print_table(results: Sequence[Result], *, baseline: float) -> None:
    header = (
        f"{'scenario':<44} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'x bare':>7} "
        f"{'CPU %':>6}  statuses"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r.rps / baseline if baseline else float("nan")
        statuses = " ".join(f"{k}:{v}" for k, v in r.statuses.items())
        if r.errors:
            statuses += " errors:" + ",".join(f"{k}={v}" for k, v in r.errors.items())
        print(
            f"{r.scenario.name:<44} {r.rps:>8.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
            f"{ratio:>6.2f}x {r.cpu_percent:>6.0f}  {statuses}"
        )
    print()
    for r in results:
        if r.scenario.bar is None:
            continue
        ratio = r.rps / baseline if baseline else float("nan")
        verdict = "met" if ratio >= r.scenario.bar else "MISSED"
        print(f"bar {r.scenario.bar:.1f}x for {r.scenario.name}: {ratio:.2f}x, {verdict}")


# ---------------------------------------------------------------------------- profiling


def classify(frame: str) -> str | None:
    """The package a py-spy frame ``function (path:line)`` belongs to, or None for frames
    that only pass control along (asyncio's own machinery is counted as the event loop)."""
    path = frame.rsplit("(", 1)[-1]
    if "/fencegate/" in path:
        module = path.split("/fencegate/", 1)[1].split(":", 1)[0]
        return "fencegate/" + module
    for package in (
        "asyncpg",
        "aiohttp",
        "uvicorn",
        "httptools",
        "uvloop",
        "orjson",
        "starlette",
        "prometheus_client",
        "multidict",
        "yarl",
        "pydantic",
        "sqlite3",
    ):
        if f"/{package}/" in path:
            return package
    if "/asyncio/" in path:
        return "asyncio"
    if "/logging/" in path:
        return "logging"
    if "/hashlib" in path or "/hmac" in path:
        return "hashlib"
    return None


def summarize_profile(raw_path: Path, *, top: int = 15) -> str:
    by_package: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        # py-spy puts the thread name first; the leaf frame is last.
        frames = [f for f in frames if "(" in f]
        if not frames:
            continue
        own[frames[-1]] += count
        package = next(
            (p for p in map(classify, reversed(frames)) if p is not None), "other (stdlib)"
        )
        by_package[package] += count
        for frame in set(frames):
            if "/fencegate/" in frame or "/asyncpg/" in frame or "/aiohttp/" in frame:
                inclusive[frame] += count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples of a busy thread"]
    lines.append("  by package (innermost known package of each sample):")
    for package, count in by_package.most_common(top):
        lines.append(f"    {100 * count / total:5.1f}%  {package}")
    lines.append("  functions with the most samples of their own:")
    for frame, count in own.most_common(top):
        lines.append(f"    {100 * count / total:5.1f}%  {_short(frame)}")
    lines.append("  fencegate / asyncpg / aiohttp functions, inclusive of what they call:")
    for frame, count in inclusive.most_common(top):
        lines.append(f"    {100 * count / total:5.1f}%  {_short(frame)}")
    return "\n".join(lines)


def _short(frame: str) -> str:
    for marker in ("/site-packages/", "/fencegate/", "/lib/python3"):
        if marker in frame:
            head, tail = frame.split(marker, 1)
            name = head.split("(", 1)[0].strip()
            prefix = "fencegate/" if marker == "/fencegate/" else ""
            return f"{name} ({prefix}{tail}"
    return frame


def profile(
    scenario: Scenario,
    *,
    py_spy: str,
    out_dir: Path,
    concurrency: int,
    duration: float,
    warmup: float,
) -> tuple[Path, dict[str, Any]]:
    raw = out_dir / f"profile-{scenario.mode}.txt"
    load: dict[str, Any] = {}

    def drive() -> None:
        load.update(
            run_load(
                scenario.url + "/charges",
                mode=scenario.mode,
                concurrency=concurrency,
                duration=duration,
                warmup=warmup,
            )
        )

    driver = threading.Thread(target=drive)
    driver.start()
    time.sleep(warmup + 0.5)  # sample the steady state, not start-up
    subprocess.run(
        [
            py_spy,
            "record",
            "--pid",
            str(scenario.pid),
            "--duration",
            str(max(1, int(duration - 1))),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=False,
    )
    driver.join(timeout=duration + 120)
    return raw, load


# ---------------------------------------------------------------------------- main


async def _new_postgres_database() -> tuple[str, str]:
    server = postgres.server_url()
    url = await postgres.create_database(server)
    await migrate(url)
    return server, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fencegate gateway benchmark")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fencegate-bench-")))
        server, pg_url = asyncio.run(_new_postgres_database())
        stack.callback(lambda: asyncio.run(postgres.drop_database(server, pg_url)))
        sqlite_url = f"sqlite:///{tmp / 'fencegate.db'}"
        asyncio.run(migrate(sqlite_url))

        upstream = stack.enter_context(UpstreamProcess())
        bare_url, bare_pid = stack.enter_context(bare_proxy(upstream.url))
        gw_sqlite = stack.enter_context(
            GatewayProcess(upstream=upstream.url, database_url=sqlite_url)
        )
        gw_pg = stack.enter_context(GatewayProcess(upstream=upstream.url, database_url=pg_url))

        scenarios = [
            Scenario("upstream alone", upstream.url, "new-keys", upstream.pid),
            Scenario("bare proxy (no store)", bare_url, "new-keys", bare_pid),
            Scenario("fencegate SQLite, new key + fence", gw_sqlite.url, "new-keys", gw_sqlite.pid),
            Scenario(
                "fencegate PostgreSQL, new key + fence", gw_pg.url, "new-keys", gw_pg.pid, 0.6
            ),
            Scenario("fencegate PostgreSQL, replay", gw_pg.url, "replay", gw_pg.pid, 1.0),
        ]
        print(
            f"concurrency {args.concurrency}, {args.warmup:g} s warm-up + {args.duration:g} s "
            f"measured per row, {os.cpu_count()} CPUs; one POST of {len(BODY)} bytes per request\n"
        )
        results = [
            measure(s, concurrency=args.concurrency, duration=args.duration, warmup=args.warmup)
            for s in scenarios
        ]
        baseline = results[1].rps
        print_table(results, baseline=baseline)

        if args.no_profile:
            return 0
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(py_spy).exists():
            print("\npy-spy not installed (pip install py-spy): no profile")
            return 0
        out_dir = args.profile_dir or tmp
        out_dir.mkdir(parents=True, exist_ok=True)
        for scenario in scenarios[3:]:
            raw, load = profile(
                scenario,
                py_spy=py_spy,
                out_dir=out_dir,
                concurrency=args.concurrency,
                duration=args.duration,
                warmup=args.warmup,
            )
            print(
                f"\nprofile of {scenario.name} (pid {scenario.pid}, "
                f"{load.get('rps', float('nan')):.0f} req/s while sampled):"
            )
            print(summarize_profile(raw) if raw.exists() else "  (py-spy produced nothing)")
            if args.profile_dir:
                print(f"  raw stacks: {raw}")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
