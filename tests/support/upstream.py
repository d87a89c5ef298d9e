"""A real upstream HTTP service for gateway tests and benchmarks, run by uvicorn in its own
process on a loopback port.

It counts executions per ``Idempotency-Key`` (counted when the request arrives, before any
delay, so a request the gateway gave up on still counts) and answers JSON describing what it
received. Behaviour is chosen per request, by query parameter or header:

- ``?delay=SECONDS`` / ``X-Upstream-Delay``: wait before answering;
- ``?status=NNN`` / ``X-Upstream-Status``: answer with that status;
- ``?size=BYTES`` / ``X-Upstream-Size``: pad the answer to at least that many bytes.

Control endpoints (never counted): ``GET /_count?key=K`` → ``{"key": K, "count": n}``,
``GET /_stats`` → every key's count and the total number of requests, ``POST /_reset``.
Started with ``--keep-answers`` it also keeps its execution log, the answer it gave for each
execution of a key: ``GET /_answers?key=K`` → ``{"key": K, "count": n, "answers": [{"status":
s, "body": "..."}]}`` (what an operator reads before resolving a key by hand).

Run it with ``python -m tests.support.upstream --port N``; tests use `UpstreamProcess`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import orjson

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class UpstreamApp:
    """Pure ASGI so that, in benchmarks, the upstream costs as little as possible."""

    def __init__(self, *, keep_answers: bool = False) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests = 0
        # Off by default: benchmarks send millions of keys.
        self.keep_answers = keep_answers
        self.answers: dict[str, list[dict[str, Any]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        path: str = scope["path"]
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode("latin-1")).items()}
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        if path == "/_count":
            key = query.get("key", "")
            await _answer(send, 200, {"key": key, "count": self.counts[key]})
            return
        if path == "/_stats":
            await _answer(send, 200, {"requests": self.requests, "counts": dict(self.counts)})
            return
        if path == "/_answers":
            key = query.get("key", "")
            log = self.answers.get(key, [])
            await _answer(send, 200, {"key": key, "count": self.counts[key], "answers": log})
            return
        if path == "/_reset" and scope["method"] == "POST":
            self.counts.clear()
            self.answers.clear()
            self.requests = 0
            await _answer(send, 200, {"reset": True})
            return

        self.requests += 1
        options = {k.lower(): v for k, v in headers}
        key = options.get("idempotency-key")
        if key is not None:
            self.counts[key] += 1
        delay = float(query.get("delay") or options.get("x-upstream-delay") or 0)
        status = int(query.get("status") or options.get("x-upstream-status") or 200)
        size = int(query.get("size") or options.get("x-upstream-size") or 0)
        if delay > 0:
            await asyncio.sleep(delay)
        answer: dict[str, Any] = {
            "method": scope["method"],
            "path": path,
            "raw_path": bytes(scope.get("raw_path") or b"").decode("latin-1"),
            "query": scope["query_string"].decode("latin-1"),
            "headers": headers,
            "body_length": len(body),
            "key": key,
            "execution": self.counts[key] if key is not None else None,
        }
        if size:
            answer["padding"] = "x" * size
        sent = await _answer(send, status, answer)
        if key is not None and self.keep_answers:
            self.answers.setdefault(key, []).append({"status": status, "body": sent.decode()})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
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


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> bytes:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-upstream", b"fencegate-test-upstream"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return body


app = UpstreamApp()


class UpstreamProcess:
    """Start the upstream in a subprocess on a free (or given) loopback port.

    ``stop()`` then ``start()`` reuses the same port, so a gateway configured with this
    upstream sees "connection refused" while it is stopped. Counts restart at zero with
    each new process.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        autostart: bool = True,
        startup_timeout: float = 20.0,
        keep_answers: bool = False,
    ) -> None:
        self.autostart = autostart
        self.keep_answers = keep_answers
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="upstream-", suffix=".log", delete=False)

    def __enter__(self) -> UpstreamProcess:
        if self.autostart:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def start(self) -> None:
        if self.running:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.upstream", "--port", str(self.port)]
            + (["--keep-answers"] if self.keep_answers else []),
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout=self.startup_timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"upstream did not start:\n{self.log_text()}") from None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "upstream not started"
        return self._proc.pid

    def stop(self, *, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, timeout=timeout)

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def _get(self, path: str, *, timeout: float) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return dict(json.loads(response.read()))

    def count(self, key: str, *, timeout: float = 10.0) -> int:
        """How many times a request with this Idempotency-Key reached the upstream."""
        return int(self._get(f"/_count?key={quote(key, safe='')}", timeout=timeout)["count"])

    def stats(self, *, timeout: float = 10.0) -> dict[str, Any]:
        return self._get("/_stats", timeout=timeout)

    def answers(self, key: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The execution log of a key (needs ``keep_answers``): one ``{"status", "body"}``
        per execution that was answered, oldest first."""
        log = self._get(f"/_answers?key={quote(key, safe='')}", timeout=timeout)["answers"]
        return list(log)

    def total_requests(self, *, timeout: float = 10.0) -> int:
        return int(self.stats(timeout=timeout)["requests"])

    def wait_for_count(
        self, key: str, expected: int, *, timeout: float = 15.0, interval: float = 0.05
    ) -> int:
        """Poll until the key was seen `expected` times (or the timeout); returns the count."""
        deadline = time.monotonic() + timeout
        seen = self.count(key)
        while seen < expected and time.monotonic() < deadline:
            time.sleep(interval)
            seen = self.count(key)
        return seen

    # Async tests must not block their event loop (their own requests may be in flight).
    async def acount(self, key: str, *, timeout: float = 10.0) -> int:
        return await asyncio.to_thread(self.count, key, timeout=timeout)

    async def astats(self, *, timeout: float = 10.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.stats, timeout=timeout)

    async def aanswers(self, key: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.answers, key, timeout=timeout)

    async def await_count(
        self, key: str, expected: int, *, timeout: float = 15.0, interval: float = 0.05
    ) -> int:
        return await asyncio.to_thread(
            self.wait_for_count, key, expected, timeout=timeout, interval=interval
        )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="test upstream for fencegate")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--keep-answers", action="store_true", help="serve GET /_answers")
    args = parser.parse_args(argv)
    app.keep_answers = args.keep_answers
    uvicorn.run(
        app,
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
