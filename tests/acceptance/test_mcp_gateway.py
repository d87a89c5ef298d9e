"""An MCP route of `fencegate serve` (a real process) in front of a real MCP server (the
``mcp`` SDK under uvicorn, answering plain JSON or event streams), called by the SDK's own
client over streamable HTTP, on both stores."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from mcp.client.client import Client
from mcp.shared.exceptions import MCPError
from mcp_types import RequestParamsMeta

from fencegate.gateway.mcp import ERROR_CODES, META_ENTITY, META_FENCE, META_KEY
from tests.acceptance.test_operator_commands import ok_json
from tests.acceptance.test_traces import OtlpReceiver
from tests.support.gateway import GatewayProcess
from tests.support.mcp_server import McpServerProcess
from tests.support.net import TcpRelay
from tests.support.waits import wait_until

CONFIG = """
[[routes]]
prefix = "/mcp"
protocol = "mcp"

[[routes.tools]]
name = "charge"
"""

ACCEPT = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


@pytest.fixture(params=["json", "sse"])
def server(request: pytest.FixtureRequest) -> Iterator[McpServerProcess]:
    with McpServerProcess(json_response=request.param == "json") as process:
        yield process


def gateway_for(upstream: str, store_url: str, tmp_path: Path) -> GatewayProcess:
    config = tmp_path / "mcp.toml"
    config.write_text(CONFIG)
    return GatewayProcess(upstream=upstream, database_url=store_url, config=config)


@pytest.fixture
def gateway(server: McpServerProcess, store_url: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    with gateway_for(server.base, store_url, tmp_path) as process:
        yield process


@asynccontextmanager
async def client(gateway: GatewayProcess) -> AsyncIterator[Client]:
    async with Client(f"{gateway.url}/mcp") as session:
        yield session


def meta(key: str | None = None, **more: object) -> RequestParamsMeta:
    given: dict[str, Any] = {META_KEY: key} if key is not None else {}
    names = {"fence": META_FENCE, "entity": META_ENTITY}
    given.update({names[k]: v for k, v in more.items()})
    return cast(RequestParamsMeta, given)


def text(result: Any) -> str:
    return str(result.content[0].text)


class Progress:
    """A progress callback: the SDK asks for progress, so an SSE server streams it."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.first = asyncio.Event()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append(progress)
        self.first.set()


def rpc(rid: int | str, name: str, arguments: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments, "_meta": {META_KEY: key}},
    }


async def test_a_retry_runs_once_and_gets_the_first_result_under_its_own_id(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    arguments = {"order": "o-1", "amount": 5, "delay": 0.3}
    async with client(gateway) as session:
        first = await session.call_tool(
            "charge", arguments, meta=meta("charge:o-1"), progress_callback=Progress()
        )
        retried = await session.call_tool(
            "charge", arguments, meta=meta("charge:o-1"), progress_callback=Progress()
        )
    assert text(first) == text(retried) == "charged o-1 5 #1"
    assert not first.is_error
    assert await server.acount("o-1") == 1

    # The same call by hand under another JSON-RPC id (and another progress token): the
    # stored result, answered as plain JSON with this request's id.
    async with httpx.AsyncClient(timeout=30) as http:
        body = rpc(4242, "charge", arguments, "charge:o-1")
        body["params"]["_meta"]["progressToken"] = "tok-9"
        answer = await http.post(f"{gateway.url}/mcp", json=body, headers=ACCEPT)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["idempotent-replayed"] == "true"
    replayed = answer.json()
    assert replayed["id"] == 4242
    assert replayed["result"]["content"][0]["text"] == "charged o-1 5 #1"
    assert await server.acount("o-1") == 1


async def test_concurrent_copies_run_once_and_the_other_reads_in_flight(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    arguments = {"order": "o-2", "amount": 7, "delay": 1.5}
    async with client(gateway) as one, client(gateway) as two:
        calling = one.call_tool(
            "charge", arguments, meta=meta("charge:o-2"), progress_callback=Progress()
        )
        first = asyncio.create_task(calling)
        assert await server.await_count("o-2", 1) == 1
        with pytest.raises(MCPError) as refused:
            await two.call_tool("charge", arguments, meta=meta("charge:o-2"))
        result = await first
    assert text(result) == "charged o-2 7 #1"
    error = refused.value.error
    assert error.code == ERROR_CODES["in-flight"]
    assert error.data["status"] == 409
    assert error.data["type"].endswith("/in-flight")
    assert error.data["retry_after"] >= 1
    assert await server.acount("o-2") == 1


async def test_other_arguments_under_the_same_key_are_key_reused(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    async with client(gateway) as session:
        await session.call_tool("charge", {"order": "o-3", "amount": 1}, meta=meta("k-3"))
        with pytest.raises(MCPError) as refused:
            await session.call_tool("charge", {"order": "o-3", "amount": 2}, meta=meta("k-3"))
    assert refused.value.error.code == ERROR_CODES["key-reused"]
    assert refused.value.error.data["status"] == 422
    assert await server.acount("o-3") == 1


async def test_a_stale_fence_is_refused_before_the_tool_runs(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    async with client(gateway) as session:
        newer = meta("k-4b", fence=8, entity="order:o-4")
        await session.call_tool("charge", {"order": "o-4", "amount": 1}, meta=newer)
        stale = meta("k-4a", fence=7, entity="order:o-4")
        with pytest.raises(MCPError) as refused:
            await session.call_tool("charge", {"order": "o-4", "amount": 1}, meta=stale)
    error = refused.value.error
    assert error.code == ERROR_CODES["stale-fence"]
    assert error.data["status"] == 412
    assert error.data["last_accepted_fence"] == 8
    assert await server.acount("o-4") == 1


async def test_a_tool_error_is_stored_and_replayed(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    arguments = {"order": "o-5", "amount": 1, "fail": True}
    async with client(gateway) as session:
        first = await session.call_tool("charge", arguments, meta=meta("k-5"))
        again = await session.call_tool("charge", arguments, meta=meta("k-5"))
    assert first.is_error and again.is_error
    assert "card declined for o-5" in text(first) == text(again)
    assert await server.acount("o-5") == 1


async def test_a_guarded_tool_without_a_key_is_refused_and_does_not_run(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    async with client(gateway) as session:
        with pytest.raises(MCPError) as refused:
            await session.call_tool("charge", {"order": "o-6", "amount": 1})
    assert refused.value.error.code == ERROR_CODES["invalid-request"]
    assert refused.value.error.data["type"].endswith("/key-required")
    assert await server.acount("o-6") == 0


@pytest.mark.parametrize(
    "shape",
    [
        {"id": 1.0},  # a JSON number that is not an integer token
        {"id": None},
        {"id": True},
        {"id": [1]},
        {},  # a notification
        {"jsonrpc": None, "id": 1},  # not "jsonrpc": "2.0"
    ],
)
async def test_a_guarded_call_that_is_not_a_request_with_a_plain_id_is_refused(
    server: McpServerProcess, gateway: GatewayProcess, shape: dict[str, Any]
) -> None:
    # A tools/call of a guarded tool the gateway cannot read as one request never reaches
    # the tool unguarded: a stale fence, a missing key, a retry would not be caught.
    order = f"o-id-{abs(hash(repr(shape)))}"
    body: dict[str, Any] = {
        "jsonrpc": "2.0",
        "method": "tools/call",
        "params": {
            "name": "charge",
            "arguments": {"order": order, "amount": 1},
            "_meta": {META_KEY: f"k-{order}"},
        },
    }
    body.update(shape)
    if body["jsonrpc"] is None:
        del body["jsonrpc"]
    version = {"mcp-protocol-version": "2025-11-25"}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(2):
            answer = await http.post(f"{gateway.url}/mcp", json=body, headers=ACCEPT | version)
            assert answer.status_code == 200, answer.text
            error = answer.json()
            assert error["jsonrpc"] == "2.0" and error["id"] is None
            assert error["error"]["code"] == ERROR_CODES["invalid-request"]
            assert error["error"]["data"]["status"] == 400
    assert await server.acount(order) == 0


@pytest.mark.parametrize("value", [b"NaN", b"1e400", b"-Infinity"])
async def test_a_guarded_call_the_gateway_cannot_parse_strictly_is_refused(
    server: McpServerProcess, gateway: GatewayProcess, value: bytes
) -> None:
    # Not strict JSON, but the server reads it (Python's json does) and would run the tool:
    # it must not pass through unguarded, once per retry.
    order = f"o-nan-{value.decode()}"
    body = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "charge", '
        b'"arguments": {"order": "' + order.encode() + b'", "amount": 1, "x": ' + value + b"}, "
        b'"_meta": {"' + META_KEY.encode() + b'": "k-' + order.encode() + b'"}}}'
    )
    version = {"mcp-protocol-version": "2025-11-25"}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(2):
            answer = await http.post(f"{gateway.url}/mcp", content=body, headers=ACCEPT | version)
            assert answer.status_code == 200, answer.text
            error = answer.json()
            assert error["id"] is None
            assert error["error"]["code"] == ERROR_CODES["invalid-request"]
    assert await server.acount(order) == 0


async def test_a_meta_that_is_not_an_object_is_a_clear_error_and_nothing_is_stored(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    body = rpc(1, "charge", {"order": "o-meta", "amount": 1}, "unused")
    body["params"]["_meta"] = "k-meta"
    headers = ACCEPT | {"mcp-protocol-version": "2025-11-25", "idempotency-key": "k-meta"}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(2):
            answer = await http.post(f"{gateway.url}/mcp", json=body, headers=headers)
            error = answer.json()
            assert answer.status_code == 200 and error["id"] == 1
            assert error["error"]["code"] == ERROR_CODES["invalid-request"]
            assert error["error"]["data"]["type"].endswith("/invalid-meta")
            assert "params._meta must be an object" in error["error"]["message"]
    assert await server.acount("o-meta") == 0


async def test_other_messages_pass_through_byte_for_byte(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    messages: list[Any] = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
        # A batch without tools/call, and a body that is not JSON.
        [{"jsonrpc": "2.0", "id": 4, "method": "ping"}],
    ]
    version = {"mcp-protocol-version": "2025-11-25"}
    async with httpx.AsyncClient(timeout=30) as http:
        for message in messages:
            direct = await http.post(server.url, json=message, headers=ACCEPT | version)
            through = await http.post(f"{gateway.url}/mcp", json=message, headers=ACCEPT | version)
            assert through.status_code == direct.status_code, message
            assert through.content == direct.content, message
            assert through.headers.get("content-type") == direct.headers.get("content-type")
            assert "idempotent-replayed" not in through.headers
        garbage = b'{"jsonrpc": "2.0", "id": 5, "method": '
        direct = await http.post(server.url, content=garbage, headers=ACCEPT | version)
        through = await http.post(f"{gateway.url}/mcp", content=garbage, headers=ACCEPT | version)
    assert (through.status_code, through.content) == (direct.status_code, direct.content)


async def test_decision_log_and_metrics_name_the_tool(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    async with client(gateway) as session:
        for _ in range(2):
            await session.call_tool("charge", {"order": "o-7", "amount": 1}, meta=meta("k-7"))
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(f"{gateway.url}/metrics")).text
    calls = "fencegate_mcp_tool_calls_total"
    assert f'{calls}{{decision="forwarded",problem="",tool="charge"}} 1.0' in metrics
    assert f'{calls}{{decision="replayed",problem="",tool="charge"}} 1.0' in metrics
    log = gateway.log_text()
    assert "decision=replayed" in log and "tool=charge" in log and "key=k-7" in log


@pytest.fixture
def sse_server() -> Iterator[McpServerProcess]:
    with McpServerProcess(json_response=False) as process:
        yield process


async def test_progress_passes_live_and_a_cut_stream_is_an_unknown_outcome(
    sse_server: McpServerProcess, store_url: str, tmp_path: Path
) -> None:
    """The stream is cut (a real TCP reset between gateway and server) after the tool
    started and its first progress came through: the caller hears the outcome is unknown,
    and a retry with the same key never runs the tool again."""
    arguments = {"order": "o-8", "amount": 3, "delay": 3.0}
    with (
        TcpRelay("127.0.0.1", sse_server.port) as relay,
        gateway_for(f"http://127.0.0.1:{relay.port}", store_url, tmp_path) as gateway,
    ):
        async with client(gateway) as session:
            progress = Progress()
            call = asyncio.create_task(
                session.call_tool("charge", arguments, meta=meta("k-8"), progress_callback=progress)
            )
            # The first progress reached the client while the tool still runs: live.
            await asyncio.wait_for(progress.first.wait(), timeout=20)
            assert not call.done()
            relay.cut()
            with pytest.raises(MCPError) as cut:
                await call
            relay.heal()
            with pytest.raises(MCPError) as retried:
                await session.call_tool("charge", arguments, meta=meta("k-8"))
        assert progress.seen == [1]
        assert cut.value.error.code == ERROR_CODES["upstream-timeout"]
        assert cut.value.error.data["status"] == 504
        assert retried.value.error.code == ERROR_CODES["outcome-unknown"]
        assert retried.value.error.data["status"] == 424
        assert retried.value.error.data["key"] == "k-8"
    assert await sse_server.acount("o-8") == 1


MODERN = "2026-07-28"
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientInfo": {"name": "agent", "version": "1"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


async def post_rpc(
    http: httpx.AsyncClient, url: str, rid: int, method: str, params: dict[str, Any]
) -> httpx.Response:
    headers = ACCEPT | {"mcp-protocol-version": MODERN, "mcp-method": method}
    if "name" in params:
        headers["mcp-name"] = params["name"]
    body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}
    return await http.post(url, json=body, headers=headers)


async def test_a_task_creating_call_is_deduplicated_and_tasks_pass_through(
    server: McpServerProcess, gateway: GatewayProcess
) -> None:
    """A long-running tool answers with a task at once: a retry gets the same task id,
    not a second task; tasks/get and tasks/result reach the server untouched."""
    url = f"{gateway.url}/mcp"
    call = {
        "name": "charge",
        "arguments": {"order": "o-9", "amount": 2, "delay": 0.5},
        "task": {"ttl": 60000},
        "_meta": MODERN_META | {META_KEY: "k-9"},
    }
    async with httpx.AsyncClient(timeout=30) as http:
        first = await post_rpc(http, url, 1, "tools/call", call)
        retried = await post_rpc(http, url, 2, "tools/call", call)
        task_id = first.json()["result"]["task"]["taskId"]
        assert retried.json()["id"] == 2
        assert retried.json()["result"]["task"]["taskId"] == task_id
        assert retried.headers["idempotent-replayed"] == "true"
        # The same key without the task: another operation, refused.
        plain = dict(call)
        del plain["task"]
        reused = await post_rpc(http, url, 3, "tools/call", plain)
        assert reused.json()["error"]["code"] == ERROR_CODES["key-reused"]

        polls = itertools.count(10)

        async def completed() -> bool:
            got = await post_rpc(
                http, url, next(polls), "tasks/get", {"taskId": task_id, "_meta": MODERN_META}
            )
            return bool(got.json()["result"]["status"] == "completed")

        await wait_until(completed, timeout=15, what="the task completed", interval=0.05)
        result = await post_rpc(
            http, url, 300, "tasks/result", {"taskId": task_id, "_meta": MODERN_META}
        )
        direct = await post_rpc(
            http, server.url, 300, "tasks/result", {"taskId": task_id, "_meta": MODERN_META}
        )
    assert result.content == direct.content
    assert result.json()["result"]["content"][0]["text"] == "charged o-9 2 #1"
    assert await server.acount("o-9") == 1


async def test_operator_commands_and_traces_show_the_call_by_its_tool(
    sse_server: McpServerProcess, store_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "mcp.toml"
    config.write_text(CONFIG)
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "mcp-gateway",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with OtlpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
        gateway = GatewayProcess(
            upstream=sse_server.base, database_url=store_url, config=config, env=env
        )
        with gateway:
            async with client(gateway) as session:
                arguments = {"order": "o-10", "amount": 1}
                fenced = meta("k-10", fence=4, entity="order:o-10")
                await session.call_tool("charge", arguments, meta=fenced)
                await session.call_tool("charge", arguments, meta=fenced)
            log = gateway.log_text()
            await wait_until(
                lambda: sum(s["name"] == "tools/call charge" for s in receiver.spans) >= 2,
                what="the tool calls' spans",
                timeout=20,
            )
    assert "protocol=mcp tools=charge" in log  # the start line
    shown = ok_json("keys", "show", "k-10", "--database-url", store_url)
    assert (shown["method"], shown["target"]) == ("POST", "/mcp tools/call charge")
    trace = ok_json("trace", "order:o-10", "--database-url", store_url)
    targets = {e["target"] for e in trace["events"] if e.get("target")}
    assert targets == {"/mcp tools/call charge"}
    spans = [s for s in receiver.spans if s["name"] == "tools/call charge"]
    decisions = sorted(s["attributes"]["fencegate.decision"] for s in spans)
    assert decisions == ["forwarded", "replayed"]
    for span in spans:
        assert span["attributes"]["gen_ai.tool.name"] == "charge"
        assert span["attributes"]["mcp.method.name"] == "tools/call"
        assert span["attributes"]["fencegate.idempotency_key"] == "k-10"


@pytest.mark.parametrize("mode", ["json", "sse"])
async def test_the_middleware_guards_an_mcp_app_in_process(mode: str, store_url: str) -> None:
    """The same pipeline as FencegateMiddleware around the MCP server's own ASGI app: one
    execution per key, the retry replayed under its own id, progress streamed live."""
    arguments = {"order": "o-11", "amount": 3, "delay": 0.3}
    with McpServerProcess(json_response=mode == "json", middleware=store_url) as app:
        async with Client(app.url) as session:
            progress = Progress()
            first = await session.call_tool(
                "charge", arguments, meta=meta("k-11"), progress_callback=progress
            )
            again = await session.call_tool("charge", arguments, meta=meta("k-11"))
            with pytest.raises(MCPError) as refused:
                await session.call_tool("charge", {**arguments, "amount": 4}, meta=meta("k-11"))
            tools = await session.list_tools()
        assert text(first) == text(again) == "charged o-11 3 #1"
        assert refused.value.error.code == ERROR_CODES["key-reused"]
        assert [tool.name for tool in tools.tools] == ["charge"]
        assert progress.seen == ([] if mode == "json" else [1, 2])
        assert await app.acount("o-11") == 1
