"""An in-process ASGI app that stands for the service behind the middleware: it counts
executions per Idempotency-Key and answers with what it was asked to (query parameters
``delay``, ``delay_first`` (the first execution
of a key only), ``status``, ``size``)."""

from __future__ import annotations

import asyncio
import collections
from urllib.parse import parse_qs

import orjson

from fencegate.types import Message, Receive, Scope, Send


class EchoApp:
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.seen_headers: list[dict[str, str]] = []
        self.started = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message: Message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.seen_headers.append(headers)
        key = headers.get("idempotency-key", "")
        self.calls[key] += 1
        execution = self.calls[key]
        self.started.set()
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        if "delay" in query:
            await asyncio.sleep(float(query["delay"]))
        if "delay_first" in query and execution == 1:
            await asyncio.sleep(float(query["delay_first"]))
        payload = orjson.dumps(
            {"execution": execution, "path": scope["path"], "body": body.decode("latin-1")}
        )
        payload += b" " * int(query.get("size", 0))
        await send(
            {
                "type": "http.response.start",
                "status": int(query.get("status", 200)),
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"x-custom", b"kept"),
                    (b"set-cookie", b"session=secret"),
                    (b"date", b"Wed, 02 Dec 2026 10:00:00 GMT"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
