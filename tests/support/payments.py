"""A fake payments API that does NOT deduplicate by itself, on a raw asyncio socket server, so
that it can do what real upstreams do to a gateway: charge and then drop the connection
without answering, charge and answer too late, or fail once with a 500 before charging.

``POST /v1/charges`` charges (counted) and answers a Stripe-shaped charge object. The mode for
the next charges is set with ``POST /_mode?mode=ok|drop|late|fail_once`` (``late`` answers
after ``LATE_SECONDS``). ``GET /_charges`` → ``{"charges": n, "attempts": m}``.

Run it with ``python -m tests.support.payments --port N``; tests use `PaymentsProcess`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process

LATE_SECONDS = 3.0


class Payments:
    def __init__(self) -> None:
        self.mode = "ok"
        self.charges = 0
        self.attempts = 0
        self.failed_once = False

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, target, body = request
                if not await self._answer(method, target, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _answer(
        self, method: str, target: str, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection was dropped on purpose."""
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if parts.path == "/_mode" and method == "POST":
            self.mode = query.get("mode", "ok")
            self.failed_once = False
            await _send(writer, 200, {"mode": self.mode})
            return True
        if parts.path == "/_charges":
            await _send(writer, 200, {"charges": self.charges, "attempts": self.attempts})
            return True
        if parts.path != "/v1/charges" or method != "POST":
            await _send(writer, 404, {"error": {"type": "invalid_request_error"}})
            return True

        self.attempts += 1
        if self.mode == "fail_once" and not self.failed_once:
            self.failed_once = True  # nothing charged: a retry must run
            await _send(writer, 500, {"error": {"type": "api_error", "message": "try again"}})
            return True
        self.charges += 1
        charge = {"id": f"ch_{self.charges}", "object": "charge", "amount": _amount(body)}
        if self.mode == "drop":
            writer.transport.abort()  # charged, and the answer never leaves
            return False
        if self.mode == "late":
            await asyncio.sleep(LATE_SECONDS)
        await _send(writer, 200, charge)
        return True


def _amount(body: bytes) -> int:
    values = parse_qs(body.decode("latin-1"))
    try:
        return int(values.get("amount", ["0"])[-1])
    except ValueError:
        return 0


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return method, target, body


async def _send(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()


async def _main(port: int) -> None:
    payments = Payments()
    server = await asyncio.start_server(payments.serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class PaymentsProcess:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PaymentsProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.payments", "--port", str(self.port)],
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, timeout=20)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout=10)
        self._log.close()

    def _call(self, method: str, path: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, method=method, data=b"")
        with urllib.request.urlopen(request, timeout=10) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer

    def set_mode(self, mode: str) -> None:
        self._call("POST", f"/_mode?mode={mode}")

    def counts(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._call("GET", "/_charges").items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a fake payments API that does not dedupe")
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(_main(parser.parse_args().port))
