"""Gateway throughput and latency, side by side in one run, then a profile of the gateway.

    .venv/bin/python -m benchmarks.gateway [--concurrency 16,64] [--rounds 2] [--duration 3]
        [--only TEXT ...] [--compare LABEL=PYTHON ...]

Every server is its own uvicorn process (one worker) on loopback, and the load comes from
another process (`benchmarks.loadgen`). For each concurrency, two tables, each measured in
interleaved rounds:

The gateway (ratios to the bare proxy of the same round): the upstream alone; a bare
passthrough proxy on the same stack, with no store (`benchmarks.bare_proxy`); fencegate on
SQLite and on PostgreSQL with a new key and a fence on every request, on PostgreSQL also with
the decision history switched off, and with both the history and the decision log off (what
they cost); and the replay path (one key repeated).
The bars: PostgreSQL new keys (history on) >= 0.6x, replay >= 1.5x.

``--compare LABEL=PYTHON`` adds rows for another fencegate, the one installed for that
interpreter (an earlier release in its own venv: ``pip install fencegate==X`` or a checkout
of an older commit), on PostgreSQL with its own migrations, measured in the same rounds:
whether a change made the gateway slower is read off one table.

The middleware (ratios to the app alone): one Starlette app (`benchmarks.peers`) behind
`FencegateMiddleware` (SQLite, PostgreSQL with and without history) and behind the
Idempotency-Key middlewares a user might pick instead, new keys and replays. Before the
rounds each one is checked on the app's own execution count (the same key twice runs once;
eight concurrent copies of one key run once), and the verdict is printed on its rows: a
fast middleware that runs a request twice is no comparison.

The tables show medians over the rounds; a ratio is taken within each round, so a machine
that is busy with something else for a while slows both sides of it. Then, unless
``--no-profile``, py-spy samples the PostgreSQL gateway under load and prints where the time
goes (by package, and the functions with the most samples of their own); the bare proxy too,
sampled the same way, for what the two share (the HTTP server and client, the event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from benchmarks.cpu import backend_pids, cpu_seconds
from benchmarks.loadgen import BODY
from fencegate.store.migrations import migrate
from tests.support import postgres
from tests.support.gateway import GatewayProcess, installed_env
from tests.support.net import free_port, wait_for_port
from tests.support.upstream import UpstreamProcess

REPO_ROOT = Path(__file__).resolve().parents[1]
BARE = "bare proxy (no store)"


@dataclass
class Scenario:
    name: str
    url: str
    mode: str
    pid: int
    bar: float | None = None
    # Processes that work for this server and whose CPU counts toward each request.
    helper_pids: tuple[int, ...] = ()
    database: str | None = None  # PostgreSQL backends serving this database count too
    note: str = ""  # printed as the last column (the middleware table: is it correct)


@dataclass
class Result:
    scenario: Scenario
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_percent: float
    cost_ms: float
    cost_parts_ms: tuple[float, float, float]  # server, upstream, database backends
    statuses: dict[str, int]
    errors: dict[str, int]


def cpu_snapshot(scenario: Scenario) -> dict[int, float]:
    pids = [scenario.pid, *scenario.helper_pids]
    if scenario.database:
        pids += backend_pids(scenario.database)
    return {pid: cpu_seconds(pid) for pid in pids}


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
    all_before = cpu_snapshot(scenario)
    load = run_load(
        scenario.url + "/charges",
        mode=scenario.mode,
        concurrency=concurrency,
        duration=duration,
        warmup=warmup,
    )
    cpu = (cpu_seconds(scenario.pid) - cpu_before) / (time.monotonic() - wall_before)
    all_after = cpu_snapshot(scenario)
    # A backend that connected during the run counts from zero.
    spent = {
        pid: after - all_before.get(pid, 0.0)
        for pid, after in all_after.items()
        if after == after  # not NaN: the process may have exited
    }
    answered = max(int(load["all_requests"]), 1)
    server = spent.get(scenario.pid, 0.0)
    helpers = sum(spent.get(pid, 0.0) for pid in scenario.helper_pids)
    return Result(
        cost_ms=1000 * sum(spent.values()) / answered,
        cost_parts_ms=(
            1000 * server / answered,
            1000 * helpers / answered,
            1000 * (sum(spent.values()) - server - helpers) / answered,
        ),
        scenario=scenario,
        rps=float(load["rps"]),
        p50_ms=float(load["p50_ms"]),
        p99_ms=float(load["p99_ms"]),
        cpu_percent=cpu * 100,
        statuses=dict(load["statuses"]),
        errors=dict(load["errors"]),
    )


@dataclass
class Summary:
    """One scenario over all rounds: medians, and the ratio to the bare proxy taken within
    each round (so that a noisy neighbour slows both sides of a ratio alike)."""

    scenario: Scenario
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_percent: float
    cost_ms: float
    cost_parts_ms: tuple[float, float, float]
    cost_ratio: float
    ratio: float
    ratio_low: float
    ratio_high: float
    statuses: dict[str, int]
    errors: dict[str, int]


def summarize(rounds: Sequence[Sequence[Result]], *, baseline_index: int) -> list[Summary]:
    summaries = []
    for i, scenario_results in enumerate(zip(*rounds, strict=True)):
        ratios = [
            r.rps / round_results[baseline_index].rps
            for r, round_results in zip(scenario_results, rounds, strict=True)
        ]
        statuses: collections.Counter[str] = collections.Counter()
        errors: collections.Counter[str] = collections.Counter()
        for r in scenario_results:
            statuses.update(r.statuses)
            errors.update(r.errors)
        summaries.append(
            Summary(
                scenario=scenario_results[0].scenario,
                rps=statistics.median(r.rps for r in scenario_results),
                p50_ms=statistics.median(r.p50_ms for r in scenario_results),
                p99_ms=statistics.median(r.p99_ms for r in scenario_results),
                cpu_percent=statistics.median(r.cpu_percent for r in scenario_results),
                cost_ms=statistics.median(r.cost_ms for r in scenario_results),
                cost_parts_ms=(
                    statistics.median(r.cost_parts_ms[0] for r in scenario_results),
                    statistics.median(r.cost_parts_ms[1] for r in scenario_results),
                    statistics.median(r.cost_parts_ms[2] for r in scenario_results),
                ),
                cost_ratio=statistics.median(
                    r.cost_ms / round_results[baseline_index].cost_ms
                    for r, round_results in zip(scenario_results, rounds, strict=True)
                ),
                ratio=statistics.median(ratios) if i != baseline_index else 1.0,
                ratio_low=min(ratios),
                ratio_high=max(ratios),
                statuses=dict(sorted(statuses.items())),
                errors=dict(errors),
            )
        )
    return summaries


def print_table(summaries: Sequence[Summary]) -> None:
    header = (
        f"{'scenario':<40} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'x bare':>7} "
        f"{'(min-max)':>11} {'CPU %':>6} {'CPU ms/req':>10} {'x bare':>6} "
        f"{'server':>7} {'upstr.':>7} {'pg':>7}  statuses"
    )
    print(header)
    print("-" * len(header))
    for r in summaries:
        statuses = " ".join(f"{k}:{v}" for k, v in r.statuses.items())
        if r.errors:
            statuses += " errors:" + ",".join(f"{k}={v}" for k, v in r.errors.items())
        spread = f"{r.ratio_low:.2f}-{r.ratio_high:.2f}"
        note = f"  [{r.scenario.note}]" if r.scenario.note else ""
        # Beside each ratio, the CPU each process spent per request (ms): the server, the
        # upstream, the PostgreSQL backends ("-" where not measured).
        server, upstream, database = r.cost_parts_ms
        parts = (
            f"{server:>7.3f} "
            + (f"{upstream:>7.3f} " if r.scenario.helper_pids else f"{'-':>7} ")
            + (f"{database:>7.3f}" if r.scenario.database else f"{'-':>7}")
        )
        print(
            f"{r.scenario.name:<40} {r.rps:>7.0f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} "
            f"{r.ratio:>6.2f}x {spread:>11} {r.cpu_percent:>6.0f} {r.cost_ms:>10.3f} "
            f"{r.cost_ratio:>5.2f}x {parts}  {statuses}{note}"
        )
    print()
    for r in summaries:
        if r.scenario.bar is not None and r.scenario.bar > 0:
            verdict = "met" if r.ratio >= r.scenario.bar else "MISSED"
            print(f"bar {r.scenario.bar:.1f}x for {r.scenario.name}: {r.ratio:.2f}x, {verdict}")
    print("\nCPU ms per request, by process:")
    print(f"  {'scenario':<40} {'server':>7} {'upstream':>9} {'postgres':>9}")
    for r in summaries:
        server, upstream, database = r.cost_parts_ms
        if r.scenario.helper_pids:
            db = f"{database:>9.3f}" if r.scenario.database else f"{'-':>9}"
            print(f"  {r.scenario.name:<40} {server:>7.3f} {upstream:>9.3f} {db}")
    print(
        "\nCPU %: the server process alone. CPU ms/req: the server, the upstream and this "
        "run's\nPostgreSQL backends together, per answered request (warm-up included); less "
        "sensitive\nthan req/s to other work on the machine. The load generator is not counted."
    )


# ---------------------------------------------------------------------------- profiling


def classify(frame: str) -> str | None:
    """The package a py-spy frame ``function (path:line)`` belongs to, or None for frames
    that only pass control along (asyncio's own machinery is counted as the event loop)."""
    # py-spy prints paths relative to sys.path ("asyncpg/connection.py:2066"), or absolute.
    path = "/" + frame.rsplit("(", 1)[-1].lstrip("/")
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


# Native leaf frames (py-spy --native) that say what the process was doing, not where.
_NATIVE_ACTIVITY = (
    (("write (", "writev (", "sendto (", "sendmsg (", "send ("), "socket writes (kernel)"),
    (("read (", "recvfrom (", "recvmsg (", "recv ("), "socket reads (kernel)"),
    (("epoll_wait (", "epoll_pwait ("), "waiting in epoll"),
)


def activity(frames: Sequence[str]) -> str | None:
    leaf = frames[-1]
    for prefixes, name in _NATIVE_ACTIVITY:
        if leaf.startswith(prefixes):
            return name
    if any(f.startswith("gc_collect") for f in frames):
        return "garbage collection"
    return None


def summarize_profile(raw_path: Path, *, top: int = 15) -> str:
    by_package: collections.Counter[str] = collections.Counter()
    writes_by_caller: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if "(" in f]  # drop the thread name
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        package = next((p for p in map(classify, reversed(frames)) if p is not None), "other")
        kind = activity(frames)
        by_package[kind or package] += count
        if kind == "socket writes (kernel)":
            writes_by_caller[package] += count
        for frame in set(frames):
            if (classify(frame) or "").startswith(("fencegate/", "asyncpg", "aiohttp")):
                inclusive[frame] += count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples of a busy thread"]
    lines.append("  by activity, else by the innermost known package of each sample:")
    for package, count in by_package.most_common(top):
        lines.append(f"    {100 * count / total:5.1f}%  {package}")
    if writes_by_caller:
        lines.append("  socket writes, by the package that wrote:")
        for package, count in writes_by_caller.most_common(top):
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
    native: bool,
) -> tuple[Path, dict[str, Any]]:
    slug = "bare" if scenario.name == BARE else scenario.mode
    raw = out_dir / f"profile-{slug}.txt"
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
            *(
                # Native frames show syscalls and the garbage collector, but need the target
                # stopped for each sample, and stops land at syscalls more often than time
                # spent there would say: read those shares as upper bounds.
                ["--native"] if native else ["--nonblocking"]
            ),
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=False,
    )
    driver.join(timeout=duration + 120)
    return raw, load


def scrape_latency(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of the gateway's latency histograms, by series."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(text):
        if family.name not in (
            "fencegate_store_latency_seconds",
            "fencegate_upstream_latency_seconds",
        ):
            continue
        for sample in family.samples:
            label = sample.labels.get("operation", "upstream")
            if sample.name.endswith("_sum"):
                totals[label][0] += sample.value
            elif sample.name.endswith("_count"):
                totals[label][1] += sample.value
    return {k: (v[0], v[1]) for k, v in totals.items()}


def latency_breakdown(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> str:
    """Mean wall time per request step between two scrapes: where a request waits."""
    lines = ["  wall time per call, from the gateway's own /metrics (mean over the run):"]
    for name in sorted(after):
        total = after[name][0] - before.get(name, (0.0, 0.0))[0]
        count = after[name][1] - before.get(name, (0.0, 0.0))[1]
        if count:
            lines.append(f"    {name:<14} {1000 * total / count:7.2f} ms  x {count:.0f} calls")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def _comparison(text: str) -> tuple[str, str]:
    label, sep, python = text.partition("=")
    if not sep or not label or not Path(python).is_file():
        raise argparse.ArgumentTypeError(
            f"expected LABEL=PATH-TO-PYTHON (an interpreter with fencegate installed), got {text!r}"
        )
    return label, python


async def _new_postgres_database(
    server: str, *, migrated: bool = True, locale: str | None = None
) -> str:
    url = await postgres.create_database(server, locale=locale)
    if migrated:
        await migrate(url)
    return url


@contextlib.contextmanager
def peer_app(middleware: str, *extra: str) -> Iterator[tuple[str, int]]:
    """`benchmarks.peers`: the same Starlette app behind one Idempotency-Key middleware."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.peers",
            "--middleware",
            middleware,
            *extra,
            "--port",
            str(port),
        ],
        cwd=REPO_ROOT,
    )
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _correctness(url: str) -> str:
    """The two things an Idempotency-Key middleware is for, checked on the app's own count:
    the same key sent twice runs once (and the second answer is a replay), and eight
    concurrent copies of one key run once."""
    import aiohttp

    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def post(key: str, query: str = "") -> tuple[int, bool]:
            async with session.post(
                f"{url}/charges{query}", data=BODY, headers={**headers, "Idempotency-Key": key}
            ) as response:
                await response.read()
                replayed = any(
                    response.headers.get(h) == "true"
                    for h in ("Idempotent-Replayed", "Idempotency-Replayed")
                )
                return response.status, replayed

        async def executed(key: str) -> int:
            async with session.get(f"{url}/_count", params={"key": key}) as response:
                return int((await response.json())["count"])

        run = os.urandom(6).hex()
        await post(f"check:{run}:twice")
        second = await post(f"check:{run}:twice")
        twice = await executed(f"check:{run}:twice")
        copies = await asyncio.gather(
            *(post(f"check:{run}:copies", "?delay=0.3") for _ in range(8))
        )
        concurrent = await executed(f"check:{run}:copies")
    verdict = "ok" if twice == 1 and concurrent == 1 else "WRONG"
    statuses = collections.Counter(status for status, _ in copies)
    return (
        f"{verdict}: twice ran {twice}x, 2nd {second[0]}{' replayed' if second[1] else ''}; "
        f"8 concurrent ran {concurrent}x "
        f"({' '.join(f'{k}:{v}' for k, v in sorted(statuses.items()))})"
    )


def run_rounds(
    scenarios: Sequence[Scenario],
    *,
    concurrency: int,
    rounds: int,
    duration: float,
    warmup: float,
) -> list[list[Result]]:
    return [
        [measure(s, concurrency=concurrency, duration=duration, warmup=warmup) for s in scenarios]
        for _ in range(rounds)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fencegate gateway benchmark")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[16, 64],
        help="comma-separated connection counts, one table each (16,64)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="skip the middleware table")
    parser.add_argument("--profile-seconds", type=float, default=6.0)
    parser.add_argument(
        "--native", action="store_true", help="sample native frames too (syscalls, GC)"
    )
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=PYTHON",
        type=_comparison,
        help="also measure the fencegate that PYTHON has installed (another release, in its "
        "own venv) on PostgreSQL, in the same rounds; may be repeated",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        # Row names contain commas ("fencegate PG, replay"), so each text is taken whole.
        help="measure only the gateway rows whose name contains TEXT; may be repeated (the "
        "upstream and the bare proxy are always measured)",
    )
    parser.add_argument(
        "--database-locale",
        default=None,
        metavar="LOCALE",
        help="create the PostgreSQL databases with this collation and character classes "
        "(e.g. en_US.UTF-8, a common server default; the server must have the locale) "
        "instead of the server's default",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fencegate-bench-")))
        # A real server (fsync on), not the tests' private cluster, which runs without fsync.
        server = os.environ.get(postgres.URL_ENV, "postgresql://postgres@127.0.0.1:5432/postgres")

        def new_database(*, migrated: bool = True) -> tuple[str, str]:
            url = asyncio.run(
                _new_postgres_database(server, migrated=migrated, locale=args.database_locale)
            )
            stack.callback(lambda: asyncio.run(postgres.drop_database(server, url)))
            return url, urlsplit(url).path.lstrip("/")

        pg_url, pg_database = new_database()
        nohist_url, nohist_database = new_database()
        sqlite_url = f"sqlite:///{tmp / 'fencegate.db'}"
        asyncio.run(migrate(sqlite_url))

        upstream = stack.enter_context(UpstreamProcess())
        bare_url, bare_pid = stack.enter_context(bare_proxy(upstream.url))
        gw_sqlite = stack.enter_context(
            GatewayProcess(upstream=upstream.url, database_url=sqlite_url)
        )
        gw_pg = stack.enter_context(GatewayProcess(upstream=upstream.url, database_url=pg_url))
        gw_nohist = stack.enter_context(
            GatewayProcess(
                upstream=upstream.url,
                database_url=nohist_url,
                extra_args=["--no-decision-history"],
            )
        )
        quiet_url, quiet_database = new_database()
        gw_quiet = stack.enter_context(
            GatewayProcess(
                upstream=upstream.url,
                database_url=quiet_url,
                extra_args=["--no-decision-history", "--no-decision-log"],
            )
        )
        nocopy_url, nocopy_database = new_database()
        gw_nocopy = stack.enter_context(
            GatewayProcess(
                upstream=upstream.url, database_url=nocopy_url, extra_args=["--answer-cache", "0"]
            )
        )
        up = (upstream.pid,)
        gateway = [
            Scenario("upstream alone", upstream.url, "new-keys", upstream.pid),
            Scenario(BARE, bare_url, "new-keys", bare_pid, None, up),
            Scenario(
                "fencegate SQLite, new key + fence",
                gw_sqlite.url,
                "new-keys",
                gw_sqlite.pid,
                None,
                up,
            ),
            Scenario(
                "fencegate PG, new key + fence",
                gw_pg.url,
                "new-keys",
                gw_pg.pid,
                0.6,
                up,
                pg_database,
            ),
            Scenario(
                "fencegate PG, new key, no history",
                gw_nohist.url,
                "new-keys",
                gw_nohist.pid,
                None,
                up,
                nohist_database,
            ),
            Scenario(
                "fencegate PG, new key, no history, no log",
                gw_quiet.url,
                "new-keys",
                gw_quiet.pid,
                None,
                up,
                quiet_database,
            ),
            Scenario("fencegate PG, replay", gw_pg.url, "replay", gw_pg.pid, 1.5, up, pg_database),
            # A worker's retry carries its fence: never answered from the copy (the fence is
            # checked in the store), but its fence, already accepted, is read, not written.
            Scenario(
                "fencegate PG, replay + fence",
                gw_pg.url,
                "fenced-replay",
                gw_pg.pid,
                None,
                up,
                pg_database,
            ),
            # A replay is answered from the gateway's copy of the answer; its history row is
            # written in a batch every 0.2 s. Without the copy it is a decision in the store
            # (a read and its history row, one commit per batch): what the copy saves.
            Scenario(
                "fencegate PG, replay, no answer cache",
                gw_nocopy.url,
                "replay",
                gw_nocopy.pid,
                None,
                up,
                nocopy_database,
            ),
            # The history row is written in the background batch: these rows show its cost.
            Scenario(
                "fencegate PG, replay, no history",
                gw_nohist.url,
                "replay",
                gw_nohist.pid,
                None,
                up,
                nohist_database,
            ),
            # Without the decision log either: what the two switches leave.
            Scenario(
                "fencegate PG, replay, no history, no log",
                gw_quiet.url,
                "replay",
                gw_quiet.pid,
                None,
                up,
                quiet_database,
            ),
        ]
        for label, python in args.compare:
            # Its own migrations: another release has another schema.
            other_url, other_database = new_database(migrated=False)
            subprocess.run(
                [python, "-m", "fencegate.cli", "migrate", "--database-url", other_url],
                check=True,
                cwd=tmp,
                capture_output=True,
                env=installed_env(),
            )
            other = stack.enter_context(
                GatewayProcess(upstream=upstream.url, database_url=other_url, python=python)
            )
            gateway += [
                Scenario(
                    f"{label}: PG, new key + fence",
                    other.url,
                    "new-keys",
                    other.pid,
                    None,
                    up,
                    other_database,
                ),
                Scenario(
                    f"{label}: PG, replay", other.url, "replay", other.pid, None, up, other_database
                ),
                Scenario(
                    f"{label}: PG, replay + fence",
                    other.url,
                    "fenced-replay",
                    other.pid,
                    None,
                    up,
                    other_database,
                ),
            ]

        if args.only:
            gateway = gateway[:2] + [
                s for s in gateway[2:] if any(part in s.name for part in args.only)
            ]

        peers: list[Scenario] = []
        if not args.no_peers:
            mw_pg_url, mw_pg_database = new_database()
            mw_nohist_url, mw_nohist_database = new_database()
            tortoise_url, tortoise_database = new_database(migrated=False)
            peer_specs: list[tuple[str, str, tuple[str, ...], str | None]] = [
                ("app alone (no middleware)", "none", (), None),
                (
                    "fencegate mw SQLite",
                    "fencegate",
                    ("--database-url", f"sqlite:///{tmp / 'middleware.db'}"),
                    None,
                ),
                ("fencegate mw PG", "fencegate", ("--database-url", mw_pg_url), mw_pg_database),
                (
                    "fencegate mw PG, no history",
                    "fencegate",
                    ("--database-url", mw_nohist_url, "--no-decision-history"),
                    mw_nohist_database,
                ),
                ("fastapi-idempotency-key (Redis)", "fastapi-idempotency-key", (), None),
                ("asgi-idempotency-header (Redis)", "asgi-idempotency-header", (), None),
                (
                    "fastapi-idempotency (PG, Tortoise)",
                    "fastapi-idempotency",
                    ("--database-url", tortoise_url),
                    tortoise_database,
                ),
            ]
            for name, middleware, extra, database in peer_specs:
                try:
                    url, pid = stack.enter_context(peer_app(middleware, *extra))
                except Exception as exc:
                    print(f"{name}: could not be started ({exc}); left out")
                    continue
                note = "" if middleware == "none" else asyncio.run(_correctness(url))
                for mode in ("new-keys", "replay"):
                    if middleware == "none" and mode == "replay":
                        continue
                    label = name if middleware == "none" else f"{name}, {mode}"
                    peers.append(Scenario(label, url, mode, pid, None, (), database, note))

        print(
            f"{args.rounds} interleaved rounds of {args.warmup:g} s warm-up + "
            f"{args.duration:g} s measured per scenario; {os.cpu_count()} CPUs; one POST of "
            f"{len(BODY)} bytes per request; new keys: a new Idempotency-Key and a fence on "
            f"every request; replay: one key repeated"
        )
        if args.database_locale:
            print(f"PostgreSQL databases created with the locale {args.database_locale}")
        for concurrency in args.concurrency:
            print(f"\n=== gateway, concurrency {concurrency} (x bare: to the bare proxy) ===")
            rounds = run_rounds(
                gateway,
                concurrency=concurrency,
                rounds=args.rounds,
                duration=args.duration,
                warmup=args.warmup,
            )
            print_table(summarize(rounds, baseline_index=1))
            if peers:
                print(
                    f"\n=== middleware in one Starlette app, concurrency {concurrency} "
                    f"(x bare: to the app alone) ==="
                )
                rounds = run_rounds(
                    peers,
                    concurrency=concurrency,
                    rounds=args.rounds,
                    duration=args.duration,
                    warmup=args.warmup,
                )
                print_table(summarize(rounds, baseline_index=0))

        if args.no_profile:
            print(f"\ntotal {time.monotonic() - started:.0f} s")
            return 0
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(py_spy).exists():
            print("\npy-spy not installed (pip install py-spy): no profile")
            return 0
        out_dir = args.profile_dir or tmp
        out_dir.mkdir(parents=True, exist_ok=True)
        profiled = (BARE, "fencegate PG, new key + fence", "fencegate PG, replay")
        for scenario in [s for s in gateway if s.name in profiled]:
            # The bare proxy has no /metrics of its own (it would forward the scrape).
            scraped = scrape_latency(scenario.url) if scenario.name != BARE else None
            raw, load = profile(
                scenario,
                py_spy=py_spy,
                out_dir=out_dir,
                concurrency=max(args.concurrency),
                duration=args.profile_seconds,
                native=args.native,
                warmup=args.warmup,
            )
            print(
                f"\nprofile of {scenario.name} (pid {scenario.pid}, "
                f"{load.get('rps', float('nan')):.0f} req/s while sampled):"
            )
            if scraped is not None:
                print(latency_breakdown(scraped, scrape_latency(scenario.url)))
            print(summarize_profile(raw) if raw.exists() else "  (py-spy produced nothing)")
            if args.profile_dir:
                print(f"  raw stacks: {raw}")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
