"""Call an ASGI app in-process with exact header bytes, as a server would."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from fencegate.types import ASGIApp, Message


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None

    def json(self) -> Any:
        return orjson.loads(self.body)


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    *,
    headers: list[tuple[str, str]] | list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    body: bytes = b"",
    query: str = "",
    chunk_size: int | None = None,
) -> Answer:
    raw_headers = [
        (
            k if isinstance(k, bytes) else k.lower().encode("latin-1"),
            v if isinstance(v, bytes) else v.encode("latin-1"),
        )
        for k, v in headers
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"testserver"), *raw_headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    size = chunk_size or max(len(body), 1)
    chunks = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    received = 0

    async def receive() -> Message:
        nonlocal received
        if received < len(messages):
            received += 1
            return messages[received - 1]
        # A server's receive() blocks until the client goes away.
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    status = 0
    out_headers: list[tuple[str, str]] = []
    out_body: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers.extend(
                (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in message["headers"]
            )
        elif message["type"] == "http.response.body":
            out_body.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, out_headers, b"".join(out_body))
