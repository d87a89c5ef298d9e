"""An MCP route's edges, without processes: its configuration, the JSON-RPC it reads, the
request the engine decides on (what the fingerprint covers), the error code table, and the
event-stream reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fencegate.gateway import jsonrpc
from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.decisions import DecisionTrace
from fencegate.gateway.mcp import (
    ERROR_CODES,
    META_ENTITY,
    META_FENCE,
    META_KEY,
    OTHER_REFUSAL,
    McpExchange,
    McpRoute,
    error_code,
    error_message,
)
from fencegate.gateway.routes import RoutePolicy
from fencegate.problems import Problem
from fencegate.types import IncomingRequest, Message

GOOD = """
[[routes]]
prefix = "/mcp"
protocol = "mcp"
entity_from = "arguments.order"

[[routes.tools]]
name = "charge"
require_fence = true
on_unknown = "retry"
timeout = 120

[[routes.tools]]
name = "refund"
require_key = false
key_from = "arguments.refund_id"
"""


def load(tmp_path: Path, text: str) -> list[RoutePolicy]:
    path = tmp_path / "mcp.toml"
    path.write_text(text)
    return load_config({"config": path, "upstream": "http://127.0.0.1:9000"}).policies()


def test_tools_tables_build_each_tool_s_policy(tmp_path: Path) -> None:
    [route] = load(tmp_path, GOOD)
    assert route.protocol == "mcp" and [t.name for t in route.tools] == ["charge", "refund"]
    mcp = McpRoute(route)
    charge = mcp.tools["charge"][1]
    assert (charge.fence_required, charge.on_unknown, charge.timeout) == (True, "retry", 120)
    assert charge.stored_statuses == frozenset({200}) and charge.protocol == "http"
    refund = mcp.tools["refund"][1]
    assert (refund.key_required, refund.on_unknown, refund.timeout) == (False, "reject", 30)
    assert mcp.passthrough.key_methods == frozenset()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[routes]]\nprefix = "/x"\n[[routes.tools]]\nname = "a"', 'need protocol = "mcp"'),
        ('[[routes]]\nprotocol = "grpc"', "routes[0].protocol: Input should be 'http' or 'mcp'"),
        (
            '[[routes]]\nprotocol = "mcp"\nkey_from = "order"',
            'routes[0].key_from: must name a field of the arguments, e.g. "arguments.order_id"',
        ),
        (
            '[[routes]]\nprotocol = "mcp"\n[[routes.tools]]\nname = "a"\nrequire_keys = true',
            "routes[0].tools[0].require_keys: Extra inputs are not permitted",
        ),
        (
            '[[routes]]\nprotocol = "mcp"\n[[routes.tools]]\nname = "a"\n'
            '[[routes.tools]]\nname = "a"',
            "lists each tool once",
        ),
        (
            '[[routes]]\nprotocol = "mcp"\nerror_format = "stripe"',
            "an mcp route answers JSON-RPC errors",
        ),
    ],
)
def test_bad_mcp_routes_are_refused_naming_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert message in str(caught.value)


def exchange(
    body: object, headers: tuple[tuple[str, str], ...] = (), route: RoutePolicy | None = None
) -> McpExchange:
    policy = route or RoutePolicy(
        prefix="/mcp",
        protocol="mcp",
        tools=({"name": "charge"}, {"name": "refund", "key_from": "arguments.id"}),  # type: ignore[arg-type]
        entity_from="arguments.order",
    )
    request = IncomingRequest(
        method="POST",
        scheme="http",
        authority="gw",
        path="/mcp",
        query_string="",
        headers=headers,
        body=body if isinstance(body, bytes) else orjson.dumps(body),
        request_id="r-1",
    )

    async def send(message: Message) -> None:
        raise AssertionError("nothing is sent here")

    return McpExchange(McpRoute(policy), request, send, DecisionTrace("r-1", "POST", "/mcp"))


def call(
    rid: object = 1, name: str = "charge", meta: dict[str, Any] | None = None, **arguments: Any
) -> dict[str, Any]:
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    if meta is not None:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def test_the_fingerprinted_body_is_the_tool_and_its_arguments_only() -> None:
    first, first_policy = exchange(
        call(1, meta={META_KEY: "k", "progressToken": 1}, order="o", amount=5)
    ).prepare()
    second, _ = exchange(
        call("x", meta={META_KEY: "k", "progressToken": "p"}, amount=5, order="o")
    ).prepare()
    assert (
        first.body
        == second.body
        == b'{"arguments":{"amount":5,"order":"o"},"name":"charge","task":false}'
    )
    assert first.path == "/mcp tools/call charge"
    assert first.header_values("idempotency-key") == ["k"]
    assert first.header_values("x-execution-entity") == ["order:o"]  # entity_from
    assert first_policy.key_methods == frozenset({"POST"})
    other, _ = exchange(call(1, meta={META_KEY: "k"}, order="o", amount=6)).prepare()
    assert other.body != first.body


def test_integers_past_64_bits_are_fingerprinted_and_keyed_exactly() -> None:
    # Two amounts a double cannot tell apart: each its own fingerprint, and its own key.
    def raw(amount: str) -> bytes:
        return (
            b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"refund",'
            b'"arguments":{"id":' + amount.encode() + b',"order":"o"}}}'
        )

    first, _ = exchange(raw("123456789012345678901234567890")).prepare()
    second, _ = exchange(raw("123456789012345678901234567891")).prepare()
    assert first.body == (
        b'{"arguments":{"id":123456789012345678901234567890,"order":"o"},'
        b'"name":"refund","task":false}'
    )
    assert first.body != second.body
    assert first.header_values("idempotency-key") == ["refund:123456789012345678901234567890"]
    assert second.header_values("idempotency-key") == ["refund:123456789012345678901234567891"]


def test_key_fence_and_entity_come_from_meta_headers_or_the_arguments() -> None:
    meta = {META_KEY: "k-1", META_FENCE: 7, META_ENTITY: "order:o-1"}
    decided, _ = exchange(call(meta=meta, order="o")).prepare()
    assert decided.header_values("x-execution-fence") == ["7"]
    assert decided.header_values("x-execution-entity") == ["order:o-1"]
    headers = (("idempotency-key", "k-2"), ("x-execution-fence", "9"))
    decided, _ = exchange(call(order="o"), headers).prepare()
    assert decided.header_values("idempotency-key") == ["k-2"]
    assert decided.header_values("x-execution-fence") == ["9"]
    # Both given and different: the engine sees a repeated header and refuses it (400).
    decided, _ = exchange(call(meta={META_KEY: "k-1"}, order="o"), headers).prepare()
    assert decided.header_values("idempotency-key") == ["k-1", "k-2"]
    decided, _ = exchange(call(name="refund", id="r-9")).prepare()
    assert decided.header_values("idempotency-key") == ["refund:r-9"]  # key_from


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (call(order="o"), "key-required"),
        (call(meta={META_KEY: 5}, order="o"), "invalid-meta"),
        (call(meta={META_KEY: "k", META_FENCE: True}, order="o"), "invalid-meta"),
        (call(meta={META_KEY: "k", META_FENCE: 1}), "entity-required"),
        # _meta itself of the wrong type: not read as "no key, no fence".
        (call(meta=[{META_KEY: "k"}], order="o"), "invalid-meta"),  # type: ignore[arg-type]
        (call(meta="k", order="o"), "invalid-meta"),  # type: ignore[arg-type]
        ([call(meta={META_KEY: "k"}, order="o")], "invalid-request"),
        # A call of a guarded tool that is not a request with a string or integer id.
        (call(1.0, meta={META_KEY: "k"}, order="o"), "invalid-request"),
        (call(None, meta={META_KEY: "k"}, order="o"), "invalid-request"),
        (call(False, meta={META_KEY: "k"}, order="o"), "invalid-request"),
        ({**call(meta={META_KEY: "k"}, order="o"), "id": None} | {"id": {}}, "invalid-request"),
        ({k: v for k, v in call(meta={META_KEY: "k"}).items() if k != "id"}, "invalid-request"),
        (
            {k: v for k, v in call(meta={META_KEY: "k"}).items() if k != "jsonrpc"},
            "invalid-request",
        ),
        (
            [{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "charge"}}],
            "invalid-request",
        ),
    ],
)
def test_calls_that_cannot_be_decided_are_refused(body: object, kind: str) -> None:
    with pytest.raises(Problem) as refused:
        exchange(body).prepare()
    assert refused.value.kind == kind


@pytest.mark.parametrize(
    "body",
    [
        {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        call(name="search", q="x"),  # a tool not listed
        [{"jsonrpc": "2.0", "id": 1, "method": "ping"}, call(name="search")],
        "not an object",
    ],
)
def test_everything_else_passes_through_as_it_came(body: object) -> None:
    given = exchange(body)
    decided, policy = given.prepare()
    assert decided is given.request
    assert not policy.guards("POST") and not given.keyed


def test_every_refusal_has_its_code() -> None:
    def code(status: int, kind: str) -> int:
        return error_code(Problem(status, kind, "t", "d"))

    assert code(412, "stale-fence") == ERROR_CODES["stale-fence"] == -32064
    assert code(401, "signature-invalid") == ERROR_CODES["unauthorized"]
    assert code(400, "invalid-header") == ERROR_CODES["invalid-request"]
    assert code(418, "teapot") == OTHER_REFUSAL
    codes = list(ERROR_CODES.values())
    assert len(set(codes)) == len(codes)
    assert all(-32099 <= c <= -32000 for c in [*codes, OTHER_REFUSAL])
    # Clear of the codes MCP itself uses.
    assert not {-32000, -32001, -32020, -32021, -32022, -32042} & {*codes, OTHER_REFUSAL}


def test_refusals_speak_of_tool_calls() -> None:
    stale = Problem(412, "stale-fence", "Stale fencing token", "X-Execution-Fence 2 is lower")
    error = orjson.loads(error_message(7, stale))
    assert error["id"] == 7 and error["error"]["code"] == ERROR_CODES["stale-fence"]
    assert error["error"]["data"]["detail"] == "the fence 2 is lower"
    assert error["error"]["message"] == "Stale fencing token: the fence 2 is lower"
    reused = orjson.loads(error_message("a", Problem(422, "key-reused", "Reused", "method")))
    assert "another tool, or with other arguments" in reused["error"]["data"]["detail"]


def test_a_stored_response_answers_another_id() -> None:
    stored = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":false}}'
    assert orjson.loads(jsonrpc.with_id(stored, "abc") or b"") == {
        "jsonrpc": "2.0",
        "id": "abc",
        "result": {"content": [], "isError": False},
    }
    assert jsonrpc.with_id(b'{"jsonrpc":"2.0","method":"x"}', 2) is None
    assert jsonrpc.with_id(b"<html>", 2) is None


def test_event_streams_are_split_as_they_arrive() -> None:
    stream = jsonrpc.EventStream()
    assert stream.feed(b'event: message\r\ndata: {"a"') == []
    [first] = stream.feed(b":1}\r\n\r\nevent: message\n")
    assert first.data == '{"a":1}' and first.raw == b'event: message\r\ndata: {"a":1}\r\n\r\n'
    second, third = stream.feed(b"data: 2\ndata: 3\n\n: comment\n\n")
    assert second.data == "2\n3" and third.data is None
    assert stream.pending == b""


def test_event_ends_split_anywhere_across_chunks_are_found() -> None:
    # Every line ending, every event end, cut at every byte (and fed one byte at a time):
    # the same events as the stream read whole.
    stream = (
        b'event: message\r\nid: 1\r\ndata: {"a":1}\r\n\r\n'
        b": comment\n\n"
        b"retry: 10\rdata: 2\r\r"
        b"data: 3\r\n\n"
        b"data: 4\n\r\n"
        b"data: 5\n\n"
    )
    whole = jsonrpc.EventStream().feed(stream)
    assert [e.data for e in whole] == ['{"a":1}', None, "2", "3", "4", "5"]
    assert b"".join(e.raw for e in whole) == stream
    for cut in range(len(stream) + 1):
        split = jsonrpc.EventStream()
        assert split.feed(stream[:cut]) + split.feed(stream[cut:]) == whole, cut
        assert split.pending == b""
    one = jsonrpc.EventStream()
    assert [e for i in range(len(stream)) for e in one.feed(stream[i : i + 1])] == whole
