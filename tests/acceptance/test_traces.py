"""Traces across processes: a caller's W3C ``traceparent`` continued by a real gateway
process, exported with OTLP/HTTP (the SDK's exporter, configured by the standard ``OTEL_*``
variables) to a receiver in this test that decodes the protobuf, and passed on to a raw
upstream, which sees the gateway's client span as its parent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp

from fencegate.lease import LeaseQueue
from tests.support.gateway import GatewayProcess
from tests.support.processes import child_env
from tests.support.raw_upstream import RawUpstream
from tests.support.waits import wait_until_sync

pytestmark = pytest.mark.timeout(120)

DECISION = "fencegate.decision"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class OtlpReceiver:
    """POST /v1/traces on loopback: every span received, decoded, as a dict."""

    def __init__(self) -> None:
        spans: list[dict[str, Any]] = []
        self.spans = spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = otlp.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    service = {a.key: a.value.string_value for a in resource.resource.attributes}
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            spans.append(
                                {
                                    "service": service.get("service.name"),
                                    "name": span.name,
                                    "kind": span.kind,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                                }
                            )
                answer = otlp.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, name: str, timeout: float = 20.0) -> dict[str, Any]:
        found = wait_until_sync(
            lambda: [s for s in self.spans if s["name"] == name],
            timeout=timeout,
            what=f"a span {name!r}",
        )
        return found[0]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
def traced_gateway(tmp_path: Path) -> Iterator[tuple[GatewayProcess, OtlpReceiver]]:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "billing-gateway",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with OtlpReceiver() as receiver, RawUpstream(status="201 Created") as upstream:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
        with GatewayProcess(
            upstream=upstream.url, workdir=tmp_path, env=env, extra_args=["--log-format", "json"]
        ) as gateway:
            yield gateway, receiver


def post(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=b'{"amount": 5}', headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=20) as answer:
        return answer.status, json.loads(answer.read())


def test_the_gateway_continues_the_callers_trace_to_the_upstream(
    traced_gateway: tuple[GatewayProcess, OtlpReceiver],
) -> None:
    gateway, receiver = traced_gateway
    status, seen = post(
        f"{gateway.url}/v1/charges",
        {
            "Content-Type": "application/json",
            "Idempotency-Key": "charge:inv-7",
            "X-Execution-Fence": "12",
            "X-Execution-Entity": "invoice:inv-7",
            "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
        },
    )
    assert status == 201
    server = receiver.wait_for("POST /")
    client = receiver.wait_for("POST / upstream")
    assert server["service"] == "billing-gateway"
    assert (server["trace_id"], server["parent"]) == (TRACE_ID, CALLER_SPAN)
    assert server["kind"] == 2 and client["kind"] == 3  # SERVER, CLIENT
    assert (client["trace_id"], client["parent"]) == (TRACE_ID, server["span_id"])
    attributes = server["attributes"]
    assert attributes["fencegate.decision"] == "forwarded"
    assert attributes["fencegate.tenant"] == "default"
    assert attributes["fencegate.entity"] == "invoice:inv-7"
    assert attributes["fencegate.fence"] == 12
    assert attributes["http.response.status_code"] == 201
    assert "5" not in json.dumps({k: v for k, v in attributes.items() if "amount" in str(v)})
    # The upstream's parent is the gateway's client span, in the same trace.
    assert seen["headers"]["traceparent"] == f"00-{TRACE_ID}-{client['span_id']}-01"
    # The decision log line names the trace.
    lines = [json.loads(line) for line in gateway.log_text().splitlines() if '"decision"' in line]
    [decision] = [line for line in lines if line.get("key") == "charge:inv-7"]
    assert decision["trace_id"] == TRACE_ID


def test_a_replay_and_a_stale_fence_are_spans_with_their_decision(
    traced_gateway: tuple[GatewayProcess, OtlpReceiver],
) -> None:
    gateway, receiver = traced_gateway
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": "charge:inv-8",
        "X-Execution-Fence": "20",
        "X-Execution-Entity": "invoice:inv-8",
    }
    post(f"{gateway.url}/v1/charges", headers)
    post(f"{gateway.url}/v1/charges", headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(
            f"{gateway.url}/v1/charges",
            {**headers, "X-Execution-Fence": "19", "Idempotency-Key": "charge:inv-8b"},
        )
    assert refused.value.code == 412

    def decisions() -> set[Any]:
        return {s["attributes"].get("fencegate.decision") for s in receiver.spans}

    wait_until_sync(
        lambda: {"forwarded", "replayed", "stale_fence"} <= decisions(),
        timeout=20,
        what="spans for the forwarded, replayed and stale-fence decisions",
    )
    [stale] = [s for s in receiver.spans if s["attributes"].get(DECISION) == "stale_fence"]
    assert stale["attributes"]["fencegate.problem"] == "stale-fence"
    children = [s["name"] for s in receiver.spans if s["parent"] == stale["span_id"]]
    assert children == []  # nothing forwarded, so no upstream call


@pytest.mark.parametrize("tool", ["post", "post_httpx"], ids=["aiohttp", "httpx"])
def test_one_trace_from_the_worker_through_the_gateway_to_the_upstream(
    traced_gateway: tuple[GatewayProcess, OtlpReceiver], tmp_path: Path, tool: str
) -> None:
    gateway, receiver = traced_gateway
    queue_url = f"sqlite:///{tmp_path / 'queue.db'}"

    async def enqueue() -> int:
        queue = await LeaseQueue.connect(queue_url)
        try:
            await queue.migrate()
            return await queue.enqueue(
                "charge",
                {"url": f"{gateway.url}/v1/charges", "n": 1},
                idempotency_key="charge:inv-9",
                lease_seconds=5,
                heartbeat_seconds=1,
                jitter_seconds=1,
            )
        finally:
            await queue.close()

    job = asyncio.run(enqueue())
    events = tmp_path / "events.jsonl"
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_SERVICE_NAME": "billing-worker",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.worker_process",
            "--url",
            queue_url,
            "--events",
            str(events),
            "--kind",
            "charge",
            "--tool",
            tool,
            "--until-idle",
            "--lease-seconds",
            "5",
            "--heartbeat-seconds",
            "1",
            "--jitter-seconds",
            "1",
        ],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    attempt = receiver.wait_for("process charge")
    assert attempt["service"] == "billing-worker" and attempt["kind"] == 5  # CONSUMER
    assert attempt["attributes"]["messaging.operation.type"] == "process"
    assert attempt["attributes"]["messaging.message.id"] == str(job)
    assert attempt["attributes"]["fencegate.attempt"] == 1
    assert attempt["attributes"]["fencegate.outcome"] == "succeeded"
    trace_id = attempt["trace_id"]

    def gateway_spans() -> list[dict[str, Any]]:
        return [s for s in receiver.spans if s["name"] == "POST /" and s["trace_id"] == trace_id]

    server = wait_until_sync(gateway_spans, timeout=20, what="the gateway's span in the trace")[0]
    assert server["parent"] == attempt["span_id"]
    token = attempt["attributes"]["fencegate.fencing_token"]
    assert server["attributes"]["fencegate.fence"] == token
    assert server["attributes"]["fencegate.entity"] == f"job:{job}"
    [client] = [s for s in receiver.spans if s["parent"] == server["span_id"]]
    assert client["trace_id"] == trace_id
    # The worker's events carry the trace id too.
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    claimed = [e for e in lines if e["event"] == "job_claimed" and e.get("job") == str(job)]
    assert claimed and claimed[0]["trace_id"] == trace_id


def test_the_console_exporter_prints_the_gateways_spans(tmp_path: Path) -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with (
        RawUpstream(status="201 Created") as upstream,
        GatewayProcess(upstream=upstream.url, workdir=tmp_path, env=env) as gateway,
    ):
        caller = {
            "Idempotency-Key": "charge:inv-10",
            "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
        }
        post(f"{gateway.url}/v1/charges", caller)
        wait_until_sync(
            lambda: '"fencegate.decision": "forwarded"' in gateway.log_text(),
            timeout=20,
            what="the forwarded decision's span in the console exporter's output",
        )
        text = gateway.log_text()
    assert f'"trace_id": "0x{TRACE_ID}"' in text and '"name": "POST /"' in text


def test_traces_are_off_and_import_nothing_unless_asked() -> None:
    code = (
        "import sys, asyncio\n"
        "from fencegate import tracing\n"
        "import fencegate.gateway.app, fencegate.lease.worker, fencegate.lease.client\n"
        "assert tracing.configure(service_name='x') is False\n"
        "assert tracing.TRACER is None\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    env = {k: v for k, v in child_env().items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
