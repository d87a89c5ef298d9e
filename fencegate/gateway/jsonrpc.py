"""JSON-RPC 2.0 as an MCP route reads and answers it: the one request a body holds, an error
answer, a stored response under another request's id, and the events of a
``text/event-stream`` answer.

Nothing here decides anything: `fencegate.gateway.mcp` does, at the pipeline's edges.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

RequestId = str | int


@dataclass(frozen=True, slots=True)
class RpcRequest:
    """A JSON-RPC request (it has an ``id``): ``params`` is its object of parameters, or
    None when it has none or they are not an object."""

    id: RequestId
    method: str
    params: dict[str, Any] | None


def parse(body: bytes) -> object:
    """The body as JSON, or None when it is not JSON (the upstream answers that itself)."""
    try:
        return orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None


def parse_lenient(body: bytes) -> object:
    """The body as a lenient parser reads it (Python's json: NaN, Infinity, numbers out of a
    double's range), or None. For telling what a body `parse` refused would mean to a
    server that reads it so."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def request_of(message: object) -> RpcRequest | None:
    """The request a parsed message is, or None: a notification, a response, a batch, or
    not JSON-RPC at all."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return None
    method = message.get("method")
    rid = message.get("id")
    if not isinstance(method, str) or isinstance(rid, bool) or not isinstance(rid, str | int):
        return None
    params = message.get("params")
    return RpcRequest(rid, method, params if isinstance(params, dict) else None)


def error_body(rid: RequestId | None, code: int, message: str, data: object = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "error": error})


def response_id(body: bytes) -> tuple[bool, object]:
    """Whether the body is one JSON-RPC response (a ``result`` or an ``error``), and its id."""
    message = parse(body)
    if (
        isinstance(message, dict)
        and message.get("jsonrpc") == "2.0"
        and "method" not in message
        and ("result" in message or "error" in message)
    ):
        return True, message.get("id")
    return False, None


def with_id(body: bytes, rid: RequestId) -> bytes | None:
    """A stored JSON-RPC response as the answer to request ``rid``: the same message, only
    its ``id`` replaced. None when the stored body is not one JSON-RPC response."""
    message = parse(body)
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return None
    if "result" not in message and "error" not in message:
        return None
    message["id"] = rid
    return orjson.dumps(message)


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its bytes as received (blank line included), and its data."""

    raw: bytes
    data: str | None


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
_LINE = re.compile(r"\r\n|\n|\r")


class EventStream:
    """Splits a ``text/event-stream`` body into events as its bytes arrive (the WHATWG
    event-stream format: events end with a blank line; lines with CRLF, LF or CR)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        # Where the search for an event's end resumes: the bytes before it hold none, and
        # an end is at most 4 bytes long. (Searching the whole of a large event again at
        # each chunk took time quadratic in its size, on the event loop.)
        self._scanned = 0

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer
        buffer += chunk
        events = []
        start = 0
        while (end := _EVENT_END.search(buffer, max(start, self._scanned))) is not None:
            raw = bytes(buffer[start : end.end()])
            events.append(Event(raw, _data_of(raw[: end.start() - start])))
            start = end.end()
        del buffer[:start]
        self._scanned = max(len(buffer) - 3, 0)
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not finished yet."""
        return bytes(self._buffer)


def _data_of(block: bytes) -> str | None:
    lines = []
    for line in _LINE.split(block.decode("utf-8", "replace")):
        if line == "data" or line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(lines) if lines else None


def sse_event(message: bytes) -> bytes:
    """One message as an event of its own, as MCP servers send them."""
    return b"event: message\r\ndata: " + message + b"\r\n\r\n"
