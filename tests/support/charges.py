"""A fake charges API that keeps, per ``Idempotency-Key``, the charge it made and the answer
it gave, and can be asked about it afterwards, as payment APIs can: what a reconciling route's
probe asks. It does not deduplicate by itself: every request that arrives is executed again.

- ``POST /v1/charges`` charges (counted per key when the request arrives, before any delay, so
  a request whose gateway died or gave up still counts) and answers the charge as JSON;
  ``X-Upstream-Delay: S`` waits S seconds before answering; ``X-Upstream-Stall: S`` waits S
  seconds and answers 503 without charging (the request never ran);
- ``GET /v1/charges/by-key/{key}`` → 200 with the very bytes the charge was first answered
  with, or 404 when no charge has that key; keys starting ``undecided-`` get a 503 (the API
  cannot tell yet);
- ``GET /_charges`` → ``{"executions": {key: n}, "answers": {key: body as text}}``.

Run it with ``python -m tests.support.charges --port N``; tests use `ChargesProcess`.
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
import urllib.request
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import orjson

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

BY_KEY = "/v1/charges/by-key/"


class ChargesApp:
    def __init__(self) -> None:
        self.executions: collections.Counter[str] = collections.Counter()
        self.answers: dict[str, bytes] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = await _read_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method: str = scope["method"]
        raw_path = bytes(scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if raw_path == "/_charges":
            answers = {k: v.decode() for k, v in self.answers.items()}
            await _send(send, 200, orjson.dumps({"executions": self.executions,
                                                 "answers": answers}))  # fmt: skip
            return
        if method == "GET" and raw_path.startswith(BY_KEY):
            asked = unquote(raw_path[len(BY_KEY) :])
            if asked.startswith("undecided-"):
                await _send(send, 503, b'{"error": "try later"}')
            elif asked in self.answers:
                await _send(send, 200, self.answers[asked])
            else:
                await _send(send, 404, b'{"error": "no such charge"}')
            return
        if method != "POST" or raw_path != "/v1/charges":
            await _send(send, 404, b'{"error": "not found"}')
            return
        key = headers.get("idempotency-key")
        if key is None:
            await _send(send, 400, b'{"error": "Idempotency-Key required"}')
            return
        stall = float(headers.get("x-upstream-stall") or 0)
        if stall > 0:
            await asyncio.sleep(stall)
            await _send(send, 503, b'{"error": "not charged"}')
            return
        self.executions[key] += 1
        try:
            amount = int(orjson.loads(body).get("amount", 0))
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            amount = 0
        charge = {
            "id": f"ch_{sum(self.executions.values())}",
            "object": "charge",
            "amount": amount,
            "key": key,
            "execution": self.executions[key],
        }
        answer = orjson.dumps(charge)
        self.answers.setdefault(key, answer)  # the first charge is the one to look up
        delay = float(headers.get("x-upstream-delay") or 0)
        if delay > 0:
            await asyncio.sleep(delay)
        await _send(send, 200, answer)


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


async def _send(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


app = ChargesApp()


class ChargesProcess:
    """The charges API in a subprocess on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="charges-", suffix=".log", delete=False)
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ChargesProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.charges", "--port", str(self.port)],
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout=20)
        except TimeoutError:
            raise RuntimeError(f"charges API did not start:\n{self.log_text()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout=10)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def state(self) -> tuple[dict[str, int], dict[str, bytes]]:
        """How many times each key was charged, and the answer each key's charge got."""
        with urllib.request.urlopen(self.url + "/_charges", timeout=10) as response:
            found = json.loads(response.read())
        answers = {k: v.encode() for k, v in found["answers"].items()}
        return {k: int(v) for k, v in found["executions"].items()}, answers

    async def astate(self) -> tuple[dict[str, int], dict[str, bytes]]:
        return await asyncio.to_thread(self.state)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="a fake charges API that keeps its answers")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                backlog=2048)  # fmt: skip


if __name__ == "__main__":
    main()
