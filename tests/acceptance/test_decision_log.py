"""The decision log: one structured line per gateway answer, from a real `fencegate serve`
(JSON and text formats), and the request id echoed on every answer. Nothing but the named
fields reaches the log: no bodies, no other header values, no database password."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson
import pytest

from fencegate.gateway.engine import Engine
from fencegate.gateway.pipeline import Pipeline
from fencegate.gateway.routes import RoutePolicy, RouteTable
from fencegate.store import GatewayStore
from fencegate.store.schema import schema_version
from tests.support.asgi import call
from tests.support.gateway import GatewayProcess
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until_sync

SECRETS = ("card-4242-secret-body", "Bearer tok-secret-header", "pw-not-for-logs")


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    netloc = f"{user or 'postgres'}:{password}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def wait_for(predicate: Callable[[], Any], *, timeout: float = 10.0) -> Any:
    """The first truthy value of ``predicate()`` within ``timeout`` seconds."""
    return wait_until_sync(predicate, timeout=timeout, what="log lines", interval=0.05)


def json_lines(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gateway.log_text().splitlines() if line.strip()]


def decisions(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [r for r in json_lines(gateway) if r.get("logger") == "fencegate.decisions"]


def test_json_log_has_one_object_per_decision(
    upstream: UpstreamProcess, pg_url: str, tmp_path: Path
) -> None:
    database_url = with_password(pg_url, SECRETS[2])
    gateway = GatewayProcess(
        upstream=upstream.url,
        database_url=database_url,
        workdir=tmp_path,
        extra_args=["--log-format", "json"],
    )
    fenced = {"X-Execution-Fence": "5", "X-Execution-Entity": "order:1"}
    with gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        headers = {
            "Idempotency-Key": "order-1",
            "Authorization": SECRETS[1],
            "X-Request-Id": "req-1",
            **fenced,
        }
        body = b'{"card": "' + SECRETS[0].encode() + b'"}'
        first = client.post("/orders", params={"x": "1"}, content=body, headers=headers)
        again = client.post(
            "/orders", params={"x": "1"}, content=body, headers={**headers, "X-Request-Id": "r2"}
        )
        stale = client.post(
            "/orders",
            headers={"Idempotency-Key": "order-2", **fenced, "X-Execution-Fence": "4"},
        )
        records = wait_for(lambda: len(decisions(gateway)) >= 3 and decisions(gateway))
        lines = json_lines(gateway)  # every line, uvicorn's too, is one JSON object
        text = gateway.log_text()

    assert (first.status_code, again.status_code, stale.status_code) == (200, 200, 412)
    assert first.headers["x-request-id"] == "req-1"
    assert again.headers["x-request-id"] == "r2"
    generated = stale.headers["x-request-id"]
    assert generated

    assert len(records) == 3
    forwarded, replayed, refused = records
    owner = forwarded["owner"]
    assert owner and owner.split(":")[1].isdigit()  # host:pid:instance
    assert forwarded["level"] == "info" and forwarded["time"].endswith("+00:00")
    assert {k: v for k, v in forwarded.items() if k not in ("time", "upstream_ms")} == {
        "level": "info",
        "logger": "fencegate.decisions",
        "event": "decision",
        "decision": "forwarded",
        "problem": None,
        "status": 200,
        "tenant": "default",
        "key": "order-1",
        "method": "POST",
        "target": "/orders?x=1",
        "entity": "order:1",
        "fence": 5,
        "upstream_status": 200,
        "request_id": "req-1",
        "owner": owner,
    }
    assert forwarded["upstream_ms"] > 0
    assert replayed["decision"] == "replayed" and replayed["request_id"] == "r2"
    assert replayed["upstream_status"] is None and replayed["upstream_ms"] is None
    assert refused["decision"] == "stale_fence" and refused["problem"] == "stale-fence"
    assert (refused["status"], refused["fence"], refused["key"]) == (412, 4, "order-2")
    assert refused["request_id"] == generated

    [started] = [r for r in lines if r.get("event") == "gateway_starting"]
    assert started["store"] == with_password(pg_url, "***")
    assert started["schema_version"] == schema_version("postgresql")
    assert started["signatures"] == "off"
    assert started["upstreams"] == [upstream.url]
    assert started["routes"] == [
        {
            "prefix": "/",
            "upstream": upstream.url,
            "methods": ["DELETE", "PATCH", "POST", "PUT"],
            "on_unknown": "reject",
            "timeout": 30.0,
            "error_format": "problem",
            "reconcile": None,  # an operator settles its unknown outcomes
        }
    ]
    assert any(r.get("logger", "").startswith("uvicorn") for r in lines)
    for secret in SECRETS:
        assert secret not in text


def test_text_is_the_default_and_the_environment_chooses_json(
    upstream: UpstreamProcess, tmp_path: Path
) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "j").mkdir()
    with (
        GatewayProcess(upstream=upstream.url, workdir=tmp_path / "t") as text_gw,
        httpx.Client(base_url=text_gw.url, timeout=30) as client,
    ):
        client.post("/pay", headers={"Idempotency-Key": "text key", "X-Request-Id": "abc"})
        line = wait_for(
            lambda: [x for x in text_gw.log_text().splitlines() if "fencegate.decisions" in x]
        )
    assert len(line) == 1
    assert 'decision=forwarded status=200 tenant=default key="text key" method=POST' in line[0]
    assert "request_id=abc" in line[0] and "upstream_status=200" in line[0]
    assert "fence=" not in line[0]  # absent fields are left out

    with (
        GatewayProcess(
            upstream=upstream.url,
            workdir=tmp_path / "j",
            env={"FENCEGATE_LOG_FORMAT": "JSON"},
        ) as json_gw,
        httpx.Client(base_url=json_gw.url, timeout=30) as client,
    ):
        client.post("/pay", headers={"Idempotency-Key": "json-key"})
        records = wait_for(lambda: decisions(json_gw))
    assert [r["key"] for r in records] == ["json-key"]


@pytest.mark.parametrize(
    ("args", "env"), [(["--no-decision-log"], {}), ([], {"FENCEGATE_DECISION_LOG": "false"})]
)
def test_the_decision_log_can_be_switched_off_alone(
    upstream: UpstreamProcess, tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    gateway = GatewayProcess(upstream=upstream.url, workdir=tmp_path, extra_args=args, env=env)
    with gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        answer = client.post("/pay", headers={"Idempotency-Key": "quiet"})
        # The line of a decision is written before its answer is sent.
        text = gateway.log_text()
    assert answer.status_code == 200 and answer.headers["x-request-id"]
    assert "gateway starting" in text  # the rest of the log is still there
    assert "fencegate.decisions" not in text and "key=quiet" not in text


def test_unknown_log_format_is_refused(upstream: UpstreamProcess, tmp_path: Path) -> None:
    gateway = GatewayProcess(
        upstream=upstream.url, workdir=tmp_path, extra_args=["--log-format", "yaml"]
    )
    with pytest.raises(RuntimeError, match="log_format"):
        gateway.start()
    gateway.terminate()


class Refusing:
    async def send(self, *args: object, timeout: float) -> object:
        raise AssertionError("nothing reaches the upstream in these cases")


async def test_every_answer_carries_the_request_id_and_is_logged_once(
    store: GatewayStore, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(store, store_timeout=30)
    routes = RouteTable([], default=RoutePolicy(max_body_bytes=10))
    pipeline = Pipeline(engine=engine, routes=routes, upstream=Refusing())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="fencegate.decisions"):
        unroutable = await call(pipeline, "POST", "/h/../x", headers=[("x-request-id", "id-1")])
        too_large = await call(pipeline, "POST", "/x", body=b"x" * 11)
        no_key = await call(pipeline, "POST", "/x", headers=[("x-request-id", "bad id!")])
    assert unroutable.header("x-request-id") == "id-1"
    assert (unroutable.status, too_large.status, no_key.status) == (400, 413, 400)
    made_up = [too_large.header("x-request-id"), no_key.header("x-request-id")]
    assert all(made_up) and made_up[0] != made_up[1]  # an unfit id is replaced, not echoed
    fields = [r.fields for r in caplog.records if r.name == "fencegate.decisions"]  # type: ignore[attr-defined]
    assert [(f["decision"], f["problem"], f["request_id"]) for f in fields] == [
        ("invalid_request", "invalid-target", "id-1"),
        ("body_too_large", "body-too-large", made_up[0]),
        ("invalid_request", "key-required", made_up[1]),
    ]
    assert fields[0]["target"] == "/h/../x"

    caplog.clear()
    logging.getLogger("fencegate.decisions").setLevel(logging.WARNING)
    try:
        await call(pipeline, "POST", "/x")
    finally:
        logging.getLogger("fencegate.decisions").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "fencegate.decisions"]
