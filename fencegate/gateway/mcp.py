"""An MCP route (``protocol = "mcp"``): the Model Context Protocol's streamable HTTP
transport, read at the pipeline's edges so that the decision engine sees an ordinary keyed
request and knows nothing of JSON-RPC.

- In: a ``tools/call`` of a listed tool becomes the engine's request. Its key, fence and
  entity come from ``params._meta`` (``dev.fencegate/idempotency-key``, ``/fence``,
  ``/entity``), the HTTP headers, or the route's ``key_from`` / ``entity_from``; its body, the
  one the fingerprint covers, is the tool's name and arguments as canonical JSON (never the
  JSON-RPC ``id`` nor ``_meta``, where the progress token lives). Every other message passes
  through untouched.
- Out: a replay is the stored JSON-RPC response under the new request's ``id``; the
  gateway's own refusals are JSON-RPC errors on HTTP 200 (`ERROR_CODES`, ``data`` = the
  problem body). An answer streamed as server-sent events is relayed event by event as it
  comes; the tool's final response is what the engine records, and a stream that ends
  without it is an unknown outcome.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fencegate.gateway import headers as h
from fencegate.gateway import jsonrpc
from fencegate.gateway.asgi import send_response
from fencegate.gateway.decisions import DecisionTrace
from fencegate.gateway.engine import GatewayResponse
from fencegate.gateway.mcp_tools import McpTool, argument_path
from fencegate.gateway.routes import EntityRule, RoutePolicy
from fencegate.gateway.upstream import UpstreamOutcomeUnknown, UpstreamResponse
from fencegate.problems import Problem
from fencegate.types import IncomingRequest, Send

logger = logging.getLogger("fencegate.gateway")

TOOLS_CALL = "tools/call"
META_KEY = "dev.fencegate/idempotency-key"
META_FENCE = "dev.fencegate/fence"
META_ENTITY = "dev.fencegate/entity"

# The JSON-RPC error code of each refusal (problem type), in the range JSON-RPC leaves to
# implementations, clear of the codes MCP itself uses (-32000, -32001, -32020..-32022,
# -32042). The table is documented (docs/guides/mcp.md); its codes never change meaning.
ERROR_CODES: dict[str, int] = {
    "invalid-request": -32060,
    "unauthorized": -32061,
    "in-flight": -32062,
    "response-not-stored": -32063,
    "stale-fence": -32064,
    "body-too-large": -32065,
    "key-reused": -32066,
    "outcome-unknown": -32067,
    "fence-required": -32068,
    "store-unavailable": -32069,
    "outcome-pending": -32070,
    "upstream-unreachable": -32071,
    "upstream-timeout": -32072,
    "internal-error": -32073,
}
OTHER_REFUSAL = -32079
_BY_STATUS = {400: "invalid-request", 401: "unauthorized", 403: "unauthorized"}


def error_code(problem: Problem) -> int:
    """A refusal's JSON-RPC code: by problem type, else by status (every 400 is
    ``invalid-request``, every 401 ``unauthorized``), else `OTHER_REFUSAL`."""
    code = ERROR_CODES.get(problem.kind)
    if code is None:
        code = ERROR_CODES.get(_BY_STATUS.get(problem.status, ""), OTHER_REFUSAL)
    return code


# Where the engine's words speak of HTTP requests, a tool call's say it in MCP's terms.
_MCP_DETAIL = {
    "key-reused": "this idempotency key was first used to call another tool, or with other "
    "arguments",
}


def error_message(rid: jsonrpc.RequestId | None, problem: Problem) -> bytes:
    data = problem.to_dict()
    detail = _MCP_DETAIL.get(problem.kind, problem.detail)
    if problem.kind == "stale-fence":  # the fence came in _meta or in the header
        detail = detail.replace("X-Execution-Fence ", "the fence ", 1)
    data["detail"] = detail
    return jsonrpc.error_body(rid, error_code(problem), f"{problem.title}: {detail}", data)


def tool_policy(route: RoutePolicy, tool: McpTool) -> RoutePolicy:
    """The policy the engine applies to one tool's calls: the route's, with the tool's
    settings. Only an HTTP 200 (a JSON-RPC answer) is stored unless the route says
    otherwise: another status is the transport refusing the POST, so the tool never ran."""
    return dataclasses.replace(
        route,
        key_methods=frozenset({"POST"}),
        key_required=tool.require_key,
        fence_required=tool.require_fence,
        on_unknown=tool.on_unknown or route.on_unknown,
        timeout=tool.timeout or route.timeout,
        entity=EntityRule("header"),
        stored_statuses=route.stored_statuses
        if route.stored_statuses is not None
        else frozenset({200}),
        protocol="http",
        tools=(),
        key_from=None,
        entity_from=None,
    )


class McpRoute:
    """One MCP route, its tools' policies built once."""

    def __init__(self, policy: RoutePolicy) -> None:
        self.policy = policy
        # Everything that is not a guarded tools/call: relayed, nothing checked.
        self.passthrough = dataclasses.replace(policy, key_methods=frozenset())
        self.tools = {tool.name: (tool, tool_policy(policy, tool)) for tool in policy.tools}

    def guards(self, message: object) -> str | None:
        """The listed tool a message calls, if it is such a tools/call."""
        rpc = jsonrpc.request_of(message)
        if rpc is None or rpc.method != TOOLS_CALL or rpc.params is None:
            return None
        name = rpc.params.get("name")
        return name if isinstance(name, str) and name in self.tools else None

    def names_a_guarded_tool(self, message: object) -> bool:
        """Whether a message asks for a call of a listed tool, even one that is not a
        JSON-RPC request the gateway can answer (an id of another type, no id, no
        ``"jsonrpc": "2.0"``): some servers still run it, so it never passes unguarded."""
        if not isinstance(message, dict) or message.get("method") != TOOLS_CALL:
            return False
        params = message.get("params")
        return isinstance(params, dict) and params.get("name") in self.tools


def _exact_arguments(body: bytes, parsed: object) -> object:
    """``params.arguments`` of a single-message body as Python's json reads it (integers
    exact), or ``parsed`` when the body does not read so. Read again only when ``parsed``
    holds a float: without one, every number in it is already an exact integer."""
    if not _has_float(parsed):
        return parsed
    message = jsonrpc.parse_lenient(body)
    if isinstance(message, dict):
        params = message.get("params")
        if isinstance(params, dict):
            return params.get("arguments")
    return parsed


def _has_float(value: object) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_float(item) for item in value)
    return False


def _from_arguments(arguments: object, spec: str) -> tuple[str, str] | None:
    """(field, value) of ``arguments.<field…>``, or None when it is absent or not a plain
    string or integer of 1 to 255 printable ASCII characters."""
    path = argument_path(spec)
    value = arguments
    for name in path:
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    if not 1 <= len(text) <= h.MAX_TOKEN_LENGTH or not text.isascii() or not text.isprintable():
        return None
    return path[-1], text


def _meta_value(meta: dict[str, Any], name: str, *, number: bool = False) -> list[str]:
    if name not in meta:
        return []
    value = meta[name]
    if number and isinstance(value, int) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, str):
        return [value]
    kind = "an integer" if number else "a string"
    raise Problem(
        400,
        "invalid-meta",
        "Malformed _meta field",
        f'params._meta["{name}"] must be {kind}',
        field=name,
    )


def _is_event_stream(headers: list[tuple[str, str]]) -> bool:
    content_type = next((v for k, v in headers if k.lower() == "content-type"), "")
    return content_type.lower().startswith("text/event-stream")


class McpExchange:
    """One request on an MCP route, from its body to its answer. It is also the
    `ResponseSink` the upstream streams an event-stream answer into."""

    def __init__(
        self, route: McpRoute, request: IncomingRequest, send: Send, trace: DecisionTrace
    ) -> None:
        self.route = route
        self.request = request
        self._send = send
        self.trace = trace
        message = jsonrpc.parse(request.body) if request.method == "POST" else None
        # The request an error answer answers (None: a notification, a batch, a GET…).
        self.rpc = jsonrpc.request_of(message)
        self.tool = route.guards(message)
        # A call of a listed tool that is not a request with a string or integer id.
        self._malformed_call = self.tool is None and route.names_a_guarded_tool(message)
        self._batch_guarded = isinstance(message, list) and any(
            route.names_a_guarded_tool(m) for m in message
        )
        # A call of a listed tool in a body that is not strict JSON (NaN, 1e400…): a
        # lenient server still runs it.
        self._not_strict_json = False
        if message is None and request.method == "POST" and request.body:
            lenient = jsonrpc.parse_lenient(request.body)
            batch = lenient if isinstance(lenient, list) else [lenient]
            self._not_strict_json = any(route.names_a_guarded_tool(m) for m in batch)
            self._malformed_call = self._not_strict_json
        self.started = False  # the answer's head went to the client: it is being streamed
        self._events = jsonrpc.EventStream()
        self._final: bytes | None = None  # the tool's response, streamed
        self._final_event = b""
        self._client_gone = False

    @property
    def keyed(self) -> bool:
        return self.tool is not None

    def prepare(self) -> tuple[IncomingRequest, RoutePolicy]:
        """The request and policy the engine decides on; raises `Problem` for a call that
        cannot be decided (no key where one is required, a malformed ``_meta``)."""
        if self._batch_guarded:
            raise Problem(
                400,
                "invalid-request",
                "Guarded tool call in a batch",
                "a tools/call of a guarded tool must be sent alone, not in a JSON-RPC batch",
            )
        if self._not_strict_json:
            raise Problem(
                400,
                "invalid-request",
                "Malformed tool call",
                f"a {TOOLS_CALL} of a guarded tool must be strict JSON (no NaN, Infinity, or "
                "number beyond a double's range)",
            )
        if self._malformed_call:
            raise Problem(
                400,
                "invalid-request",
                "Malformed tool call",
                f'a {TOOLS_CALL} of a guarded tool must be a JSON-RPC 2.0 request: "jsonrpc": '
                '"2.0" and an "id" that is a string or an integer',
            )
        if self.tool is None:
            return self.request, self.route.passthrough
        name = self.tool
        tool, policy = self.route.tools[name]
        assert self.rpc is not None and self.rpc.params is not None
        params = self.rpc.params
        meta = params.get("_meta")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):
            raise Problem(
                400,
                "invalid-meta",
                "Malformed _meta field",
                "params._meta must be an object",
                field="_meta",
            )
        # orjson reads an integer past 64 bits as a double, so two calls that differ only in
        # such a number would share a fingerprint (and `key_from` a key): arguments holding a
        # float are read again, exactly, from the body (a guarded call is one strict-JSON
        # message).
        arguments = _exact_arguments(self.request.body, params.get("arguments"))
        if arguments is None:
            arguments = {}
        request = self.request
        self.trace.tool = name
        span = self.trace.span
        if span is not None:
            span.update_name(f"{TOOLS_CALL} {name}")
            span.set_attributes(
                {"mcp.method.name": TOOLS_CALL, "gen_ai.tool.name": name}
                | ({"jsonrpc.request.id": str(self.rpc.id)})
            )

        keys = _meta_value(meta, META_KEY) + request.header_values(h.IDEMPOTENCY_KEY)
        key_from = tool.key_from or self.route.policy.key_from
        if not keys and key_from is not None:
            derived = _from_arguments(arguments, key_from)
            if derived is not None:
                keys = [f"{name}:{derived[1]}"]
        fences = _meta_value(meta, META_FENCE, number=True) + request.header_values(
            h.EXECUTION_FENCE
        )
        entities = _meta_value(meta, META_ENTITY) + request.header_values(h.EXECUTION_ENTITY)
        entity_from = tool.entity_from or self.route.policy.entity_from
        if not entities and entity_from is not None:
            derived = _from_arguments(arguments, entity_from)
            if derived is not None:
                entities = [f"{derived[0]}:{derived[1]}"]

        if not keys and tool.require_key:
            raise Problem(
                400,
                "key-required",
                "Idempotency key required",
                f"{TOOLS_CALL} {name} requires an idempotency key: "
                f'params._meta["{META_KEY}"] or the Idempotency-Key header'
                + (f", or {key_from}" if key_from is not None else ""),
            )
        if not fences and tool.require_fence:
            raise Problem(
                428,
                "fence-required",
                "Fence required",
                f'{TOOLS_CALL} {name} requires a fence: params._meta["{META_FENCE}"] or the '
                f"X-Execution-Fence header",
            )
        if fences and not entities:
            raise Problem(
                400,
                "entity-required",
                "Fence without an entity",
                f'a fenced call must name the entity it protects: params._meta["{META_ENTITY}"], '
                f"the X-Execution-Entity header"
                + (f", or {entity_from}" if entity_from is not None else ""),
            )
        given = (h.IDEMPOTENCY_KEY, h.EXECUTION_FENCE, h.EXECUTION_ENTITY)
        headers = [(k, v) for k, v in request.headers if k not in given]
        headers += [(h.IDEMPOTENCY_KEY, v) for v in keys]
        headers += [(h.EXECUTION_FENCE, v) for v in fences]
        headers += [(h.EXECUTION_ENTITY, v) for v in entities]
        # What the call asks for, not how it was sent: its name, its arguments, and
        # whether it asks for a task (a task's answer is not a result's).
        body = json.dumps(
            {"name": name, "arguments": arguments, "task": params.get("task") is not None},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        decided = dataclasses.replace(
            request,
            # The history and the operator's commands show the call by its tool.
            path=f"{request.path} {TOOLS_CALL} {name}",
            decoded_path=None,
            headers=tuple(headers),
            body=body,
        )
        return decided, policy

    # ResponseSink

    async def start(self, status: int, headers: list[tuple[str, str]]) -> bool:
        if not _is_event_stream(headers):
            return False
        if self.keyed and status != 200:
            return False
        relayed = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in headers
            if k.lower() not in ("content-length", "x-request-id")
        ]
        relayed.append((b"x-request-id", self.trace.request_id.encode("latin-1")))
        self.started = True
        await self._to_client({"type": "http.response.start", "status": status, "headers": relayed})
        return True

    async def chunk(self, data: bytes) -> bool:
        if not self.keyed:
            await self._body(data)
            return False
        assert self.rpc is not None
        for event in self._events.feed(data):
            if event.data is not None:
                message = event.data.encode()
                is_response, rid = jsonrpc.response_id(message)
                if is_response and rid == self.rpc.id:
                    # Held back until the engine has recorded it.
                    self._final, self._final_event = message, event.raw
                    return True
            await self._body(event.raw)
        return False

    def settle(self, answer: UpstreamResponse) -> UpstreamResponse:
        """The upstream's answer as the engine records it: a streamed tool call's final
        response as plain JSON; a stream that ended without one is an unknown outcome."""
        if not self.keyed:
            return answer
        if not self.started and answer.status == 200 and _is_event_stream(answer.headers):
            # An upstream that could not stream it: the whole stream, read at once.
            for event in self._events.feed(answer.body):
                message = event.data.encode() if event.data is not None else b""
                is_response, rid = jsonrpc.response_id(message)
                if is_response and self.rpc is not None and rid == self.rpc.id:
                    return UpstreamResponse(200, [("content-type", "application/json")], message)
            raise UpstreamOutcomeUnknown("the event stream ended before the tool's response")
        if not self.started:
            return answer
        if self._final is None:
            raise UpstreamOutcomeUnknown("the event stream ended before the tool's response")
        return UpstreamResponse(200, [("content-type", "application/json")], self._final)

    # Answers

    async def deliver(self, response: GatewayResponse) -> None:
        problem = response.problem
        request_id = self.trace.request_id
        if self.started:
            if problem is not None and self.keyed:
                assert self.rpc is not None
                last = jsonrpc.sse_event(error_message(self.rpc.id, problem))
            else:
                last = self._final_event
            await self._body(last, more=False)
            return
        if problem is not None and (self.rpc is not None or self._malformed_call):
            headers = [("content-type", "application/json")]
            headers += [(k.lower(), v) for k, v in problem.headers.items()]
            # JSON-RPC: an id that could not be read is answered as null.
            body = error_message(self.rpc.id if self.rpc is not None else None, problem)
            response = dataclasses.replace(response, status=200, headers=headers, body=body)
        elif self.keyed and response.decision == "replayed":
            assert self.rpc is not None
            replayed = jsonrpc.with_id(response.body, self.rpc.id)
            if replayed is not None:
                headers = [("content-type", "application/json"), ("idempotent-replayed", "true")]
                response = dataclasses.replace(response, headers=headers, body=replayed)
        await send_response(self._send, response, request_id=request_id)

    async def _body(self, data: bytes, *, more: bool = True) -> None:
        await self._to_client({"type": "http.response.body", "body": data, "more_body": more})

    async def _to_client(self, message: dict[str, Any]) -> None:
        # A client that went away does not stop the call: its answer is still recorded,
        # for the retry to get.
        if self._client_gone:
            return
        try:
            await self._send(message)
        except (OSError, RuntimeError) as exc:
            self._client_gone = True
            logger.info("client of request %s went away: %s", self.trace.request_id, exc)
