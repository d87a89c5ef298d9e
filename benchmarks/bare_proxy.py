"""The yardstick for the gateway benchmark: a passthrough reverse proxy on the same stack as
`fencegate serve` (pure ASGI, one pooled aiohttp ClientSession, uvicorn with uvloop and
httptools, one worker) that does nothing else: no store, no headers checked.

    python -m benchmarks.bare_proxy --upstream http://127.0.0.1:9000 --port 9001
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)


class BareProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        url = self.upstream + scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k not in HOP_BY_HOP
        ]
        assert self.session is not None
        try:
            async with self.session.request(
                scope["method"], url, headers=headers, data=body, allow_redirects=False
            ) as response:
                payload = await response.read()
                out = [(k, v) for k, v in response.raw_headers if k.lower() not in HOP_BY_HOP]
                status = response.status
        except aiohttp.ClientError:
            status, payload, out = 502, b"bad gateway", []
        out.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": payload})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=256),
                    timeout=aiohttp.ClientTimeout(total=30),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bare passthrough proxy (benchmark baseline)")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(
        BareProxy(args.upstream),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=2048,
    )


if __name__ == "__main__":
    main()
