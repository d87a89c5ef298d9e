"""`fencegate serve` as a real process in front of a real upstream process, on loopback."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess

PROBLEM = "application/problem+json"


@pytest.fixture
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def keyed(key: str, **extra: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **{k.replace("_", "-"): v for k, v in extra.items()}}


def test_forward_and_replay(upstream: UpstreamProcess, store_url: str) -> None:
    with GatewayProcess(upstream=upstream.url, database_url=store_url) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            headers = keyed("order-1", X_Execution_Fence="3", X_Execution_Entity="order:1")
            first = client.post(
                "/orders", params={"b": "2", "a": "1"}, content=b"x" * 5000, headers=headers
            )
            again = client.post(
                "/orders", params={"a": "1", "b": "2"}, content=b"x" * 5000, headers=headers
            )
    assert first.status_code == 200
    seen = first.json()
    assert seen["path"] == "/orders" and seen["query"] == "b=2&a=1"
    assert seen["body_length"] == 5000
    seen_headers = dict(seen["headers"])
    assert seen_headers["host"] == upstream.url.removeprefix("http://")
    assert seen_headers["idempotency-key"] == "order-1"
    assert seen_headers["x-execution-fence"] == "3"
    assert seen_headers["x-execution-entity"] == "order:1"
    assert first.headers["x-upstream"] == "fencegate-test-upstream"
    assert "idempotent-replayed" not in first.headers
    assert again.status_code == 200
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-upstream"] == "fencegate-test-upstream"
    assert upstream.count("order-1") == 1


def test_healthz_and_metrics(upstream: UpstreamProcess, tmp_path: Path) -> None:
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            health = client.get("/healthz")
            for _ in range(2):
                client.post("/x", headers=keyed("m-1"))
            client.post("/x", headers=keyed("m-2", X_Execution_Fence="1"))
            metrics = client.get("/metrics")
    assert (tmp_path / "fencegate.db").exists()  # the embedded default store
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    requests = "fencegate_gateway_requests_total"
    assert f'{requests}{{decision="forwarded",problem=""}} 1.0' in text
    assert f'{requests}{{decision="replayed",problem=""}} 1.0' in text
    assert f'{requests}{{decision="invalid_request",problem="entity-required"}} 1.0' in text
    # The replay came from the gateway's copy of the answer: no decision in the store.
    assert 'fencegate_store_latency_seconds_count{operation="decide"} 1.0' in text
    assert "fencegate_answer_cache_hits_total 1.0" in text
    assert "fencegate_upstream_latency_seconds_count 1.0" in text


def test_refused_upstream_is_502_and_a_retry_runs(tmp_path: Path) -> None:
    upstream = UpstreamProcess(autostart=False)
    with upstream, GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            refused = client.post("/pay", headers=keyed("p-1"), content=b"{}")
            assert refused.status_code == 502
            assert refused.headers["content-type"] == PROBLEM
            assert refused.json()["type"].endswith("/upstream-unreachable")
            upstream.start()
            retried = client.post("/pay", headers=keyed("p-1"), content=b"{}")
            assert retried.status_code == 200
            assert "idempotent-replayed" not in retried.headers
            assert upstream.count("p-1") == 1


ROUTES = """
[[routes]]
prefix = "/slow"
timeout = 0.5
on_unknown = "reject"

[[routes]]
prefix = "/big"
max_stored_body_bytes = 1000
"""


def test_timeout_is_504_then_rejected_and_big_answers_replay_as_problem(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    config = tmp_path / "routes.toml"
    config.write_text(ROUTES)
    with GatewayProcess(upstream=upstream.url, config=config, workdir=tmp_path) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            slow = client.post("/slow", params={"delay": "3"}, headers=keyed("s-1"))
            again = client.post("/slow", params={"delay": "3"}, headers=keyed("s-1"))
            big = client.post("/big", params={"size": "5000"}, headers=keyed("b-1"))
            big_again = client.post("/big", params={"size": "5000"}, headers=keyed("b-1"))
    assert slow.status_code == 504 and slow.json()["type"].endswith("/upstream-timeout")
    assert again.status_code == 424 and again.json()["type"].endswith("/outcome-unknown")
    assert again.json()["reason"] == "upstream_timeout" and again.json()["since"]
    assert upstream.count("s-1") == 1
    assert big.status_code == 200 and len(big.content) > 5000
    assert big_again.status_code == 410
    assert big_again.json()["original_status"] == 200
    assert upstream.count("b-1") == 1


def test_per_hop_headers_stay_behind_and_head_keeps_its_length(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            got = client.get(
                "/doc", headers={"Connection": "x-secret-hop", "X-Secret-Hop": "1", "X-Kept": "yes"}
            )
            head = client.head("/doc")
    seen = dict(got.json()["headers"])
    assert seen["x-kept"] == "yes"
    assert "x-secret-hop" not in seen and "connection" not in seen
    assert seen["x-forwarded-host"] == gateway.url.removeprefix("http://")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0


def test_expired_keys_are_purged_in_the_background(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    args = ["--key-ttl-seconds", "0.5", "--purge-interval-seconds", "0.5"]
    with GatewayProcess(upstream=upstream.url, workdir=tmp_path, extra_args=args) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            assert client.post("/x", headers=keyed("short-lived")).status_code == 200
        db = sqlite3.connect(tmp_path / "fencegate.db")
        try:
            deadline = time.monotonic() + 20
            remaining = 1
            while remaining and time.monotonic() < deadline:
                time.sleep(0.2)
                count = "SELECT count(*) FROM fencegate_idempotency_keys"
                remaining = db.execute(count).fetchone()[0]
        finally:
            db.close()
    assert remaining == 0
