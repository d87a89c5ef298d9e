"""Metrics an operator can trust: with `fencegate serve --workers 2`, `/metrics` counts every
request exactly once whichever worker process answers the scrape, and never goes down; the
`decision` label is a word, the problem type its own label."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from fencegate.gateway.engine import Engine
from fencegate.gateway.metrics import GatewayMetrics
from fencegate.gateway.pipeline import Pipeline
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.store import GatewayStore
from tests.support.asgi import call
from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess

FORWARDED = re.compile(
    r'^fencegate_gateway_requests_total\{decision="forwarded",problem=""\} (\S+)$', re.M
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def fresh_client(base_url: str) -> httpx.Client:
    """No kept-alive connections: each request is accepted anew, by either worker."""
    return httpx.Client(
        base_url=base_url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
    )


def forwarded_count(client: httpx.Client) -> float:
    answer = client.get("/metrics")
    assert answer.status_code == 200
    match = FORWARDED.search(answer.text)
    return float(match.group(1)) if match else 0.0


def answering_pids(gateway: GatewayProcess) -> set[str]:
    """The worker processes that answered, from the decision log's owner (host:pid:…)."""
    pids = set()
    for line in gateway.log_text().splitlines():
        if '"fencegate.decisions"' in line:
            pids.add(orjson.loads(line)["owner"].split(":")[1])
    return pids


def worker_metrics_dirs(gateway: GatewayProcess) -> set[str]:
    """The multiprocess directory each worker process was started with."""
    found = set()
    children = Path(f"/proc/{gateway.pid}/task/{gateway.pid}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        for entry in environ:
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                found.add(entry.split(b"=", 1)[1].decode())
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads worker pids from /proc")
def test_two_workers_count_every_request_once_whichever_answers(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    gateway = GatewayProcess(
        upstream=upstream.url,
        workdir=tmp_path,
        extra_args=["--workers", "2", "--log-format", "json"],
    )
    with gateway, fresh_client(gateway.url) as client:
        dirs = worker_metrics_dirs(gateway)
        sent = 0
        seen: list[float] = []
        deadline = time.monotonic() + 60
        # Until both workers have answered requests (and at least 20), each request then a
        # scrape: the count is exactly the requests sent so far, never less, never more.
        while sent < 20 or len(answering_pids(gateway)) < 2:
            assert time.monotonic() < deadline, "one worker answered every request"
            answer = client.post("/pay", headers={"Idempotency-Key": f"k-{sent}"})
            assert answer.status_code == 200
            sent += 1
            seen.append(forwarded_count(client))
        scrapes = [forwarded_count(client) for _ in range(20)]
        assert len(dirs) == 1  # one directory, shared by both workers
        [metrics_dir] = dirs
        assert Path(metrics_dir).is_dir() and os.listdir(metrics_dir)
    assert seen == [float(n) for n in range(1, sent + 1)]
    assert scrapes == [float(sent)] * 20
    assert not Path(metrics_dir).exists()  # removed when the gateway stopped


class Answering:
    async def send(self, *args: object, timeout: float) -> object:
        from fencegate.gateway.upstream import UpstreamResponse

        return UpstreamResponse(201, [], b"ok")


async def test_decision_label_is_a_word_and_the_problem_its_own_label(
    store: GatewayStore,
) -> None:
    metrics = GatewayMetrics()
    engine = Engine(store, store_timeout=30, metrics=metrics)
    routes = RouteTable(
        [RoutePolicy(prefix="/fenced", fence_required=True)],
        default=RoutePolicy(max_body_bytes=100),
    )
    pipeline = Pipeline(engine=engine, routes=routes, upstream=Answering())  # type: ignore[arg-type]
    fence = [("x-execution-fence", "2"), ("x-execution-entity", "e")]
    await call(pipeline, "POST", "/p", headers=[("idempotency-key", "a")], body=b"1")
    await call(pipeline, "POST", "/p", headers=[("idempotency-key", "a")], body=b"2")
    await call(pipeline, "POST", "/p", headers=[("idempotency-key", "b"), *fence])
    await call(pipeline, "POST", "/p", headers=[("idempotency-key", "c"), fence[0]])
    stale = [("idempotency-key", "d"), ("x-execution-fence", "1"), fence[1]]
    await call(pipeline, "POST", "/p", headers=stale)
    await call(pipeline, "POST", "/p", body=b"x" * 101)
    await call(pipeline, "POST", "/fenced/1", headers=[("idempotency-key", "e")])
    await call(pipeline, "GET", "/p")
    text = metrics.render().decode()
    counted = re.findall(
        r'^fencegate_gateway_requests_total\{decision="(\w*)",problem="([\w-]*)"\} (\S+)$',
        text,
        re.M,
    )
    assert {(d, p): float(v) for d, p, v in counted} == {
        ("forwarded", ""): 2.0,
        ("key_reused", "key-reused"): 1.0,
        ("invalid_request", "entity-required"): 1.0,
        ("stale_fence", "stale-fence"): 1.0,
        ("body_too_large", "body-too-large"): 1.0,
        ("fence_required", "fence-required"): 1.0,
        ("passthrough", ""): 1.0,
    }
