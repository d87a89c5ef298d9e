"""The gateway in front of a legacy API, configured by a routes TOML file.

Run it (from the repository, or anywhere fencegate is installed)::

    python examples/gateway_legacy_api.py

It starts a small "legacy ticketing API" that creates a ticket for every POST it receives
(no deduplication at all), writes the routes file below, starts ``fencegate serve --config``
in front of the API, and sends the requests a retrying worker would send. The same setup by
hand::

    fencegate serve --config routes.toml          # routes.toml as in ROUTES below

Nothing is left behind: the gateway's SQLite store lives in a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROUTES = """\
[gateway]
upstream = "{upstream}"
database_url = "sqlite:///{store}"
log_level = "warning"

# Creating a ticket needs a key and a fence; the fence protects the customer named in the
# JSON body, so two jobs for one customer cannot overwrite each other out of order.
[[routes]]
prefix = "/tickets"
methods = ["POST"]
key_required = true
fence_required = true
entity = "json:customer_id"
timeout = 10
on_unknown = "reject"      # a ticket whose outcome is unknown waits for an operator

# Everything else under /: a key for writes, fences optional.
[[routes]]
prefix = "/"
"""

tickets: list[dict[str, Any]] = []


async def create_ticket(request: Request) -> JSONResponse:
    body = await request.json()
    ticket = {"ticket_id": f"T-{len(tickets) + 1}", "customer_id": body["customer_id"]}
    tickets.append(ticket)
    return JSONResponse(ticket, status_code=201)


legacy_api = Starlette(routes=[Route("/tickets", create_ticket, methods=["POST"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def run_legacy_api() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(legacy_api, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def run_gateway(config: Path) -> Iterator[str]:
    port = free_port()
    command = ["fencegate.cli", "serve", "--config", str(config), "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-m", *command],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the gateway did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Message, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, run_legacy_api() as upstream:
        config = Path(tmp) / "routes.toml"
        config.write_text(ROUTES.format(upstream=upstream, store=Path(tmp) / "gateway.db"))
        with run_gateway(config) as gateway:
            body = {"customer_id": "c-1048", "summary": "Check the invoice discrepancy"}
            key = {"Idempotency-Key": "tool-job:8f1b7c3d:create_case"}
            steps = [
                ("first attempt, token 42", {**key, "X-Execution-Fence": "42"}),
                ("the same request again (a retry)", {**key, "X-Execution-Fence": "42"}),
                ("a stale owner, token 41", {**key, "X-Execution-Fence": "41"}),
                ("no fence on a fenced route", key),
                ("no key at all", {"X-Execution-Fence": "43"}),
            ]
            for title, headers in steps:
                status, answer_headers, answer = post(f"{gateway}/tickets", body, headers)
                replayed = answer_headers.get("Idempotent-Replayed")
                summary = answer.get("ticket_id") or answer.get("type", "").rsplit("/", 1)[-1]
                print(f"{title:<36} -> {status} {summary}" + (" (replayed)" if replayed else ""))
    print(f"tickets the legacy API created: {len(tickets)}")
    return 0 if len(tickets) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
