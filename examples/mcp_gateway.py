"""An MCP server behind `fencegate serve`, and an agent loop that retries its tool calls.

Run it (the ``mcp`` SDK comes with the ``mcp`` extra: ``pip install 'fencegate[mcp]'``)::

    python examples/mcp_gateway.py

It starts an MCP server made with the ``mcp`` SDK (streamable HTTP, answers streamed as
server-sent events) whose ``charge`` tool counts its executions and charges nothing twice
only if nobody calls it twice; writes the routes file below; starts ``fencegate serve
--config`` in front of the server; and runs an agent loop that calls ``charge`` the way an
agent does: it retries when it lost an answer, when the gateway says the first call is
still running, and sends its fencing token. The same setup by hand::

    fencegate serve --config routes.toml          # routes.toml as in ROUTES below

Nothing is left behind: the gateway's SQLite store lives in a temporary directory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    from mcp.client.client import Client
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.shared.exceptions import MCPError
except ModuleNotFoundError:  # the SDK comes with the extra
    sys.exit("This example needs the mcp SDK: pip install 'fencegate[mcp]' (or pip install mcp).")

import uvicorn

ROUTES = """\
[gateway]
upstream = "{upstream}"
database_url = "sqlite:///{store}"
log_level = "warning"

# JSON-RPC over streamable HTTP: tools/call of a listed tool is the keyed operation;
# initialize, tools/list, notifications and unlisted tools pass through untouched.
[[routes]]
prefix = "/mcp"
protocol = "mcp"
entity_from = "arguments.order"   # the fence protects the order being charged

[[routes.tools]]
name = "charge"
require_key = true
timeout = 30
on_unknown = "reject"             # a charge whose outcome is unknown waits for an operator
"""

# fencegate's JSON-RPC error codes (docs/guides/mcp.md): retry later, or not.
IN_FLIGHT, OUTCOME_PENDING, STORE_UNAVAILABLE = -32062, -32070, -32069
RETRY_LATER = {IN_FLIGHT, OUTCOME_PENDING, STORE_UNAVAILABLE}
KEY_META = "dev.fencegate/idempotency-key"
FENCE_META = "dev.fencegate/fence"

executions: collections.Counter[str] = collections.Counter()
started: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
server = MCPServer("payments", log_level="WARNING")


@server.tool()
async def charge(order: str, amount: int, ctx: Context, seconds: float = 0.0) -> str:
    """Charge an order (no deduplication of its own)."""
    executions[order] += 1
    started[order].set()
    await ctx.report_progress(1, 2, "authorising")
    await asyncio.sleep(seconds)
    await ctx.report_progress(2, 2, "captured")
    return f"charged {order} {amount} (execution #{executions[order]})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def run_mcp_server() -> Iterator[str]:
    port = free_port()
    app = server.streamable_http_app(stateless_http=True)
    uv = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
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


def call_meta(key: str, fence: int | None = None) -> Any:
    """A tool call's ``_meta``: its idempotency key, and its fencing token if any (typed
    Any: the SDK's type for ``_meta`` does not name fencegate's fields)."""
    return {KEY_META: key} if fence is None else {KEY_META: key, FENCE_META: fence}


async def call_with_retries(
    session: Client, arguments: dict[str, Any], *, key: str, fence: int, attempts: int = 20
) -> str:
    """What an agent's tool runner does: the same key on every attempt, and a wait where
    the gateway says the first attempt is still running."""
    meta = call_meta(key, fence)
    for _ in range(attempts):
        try:
            result = await session.call_tool("charge", arguments, meta=meta)
            return str(result.content[0].text)  # type: ignore[union-attr]
        except MCPError as error:
            if error.error.code not in RETRY_LATER:
                raise
            await asyncio.sleep(min(float(error.error.data.get("retry_after", 1)), 1.0))
    raise RuntimeError("gave up")


def refusal(error: MCPError) -> str:
    data = error.error.data or {}
    return f"JSON-RPC error {error.error.code} ({str(data.get('type', '')).rsplit('/', 1)[-1]})"


async def agent(url: str) -> None:
    async with Client(f"{url}/mcp") as session, Client(f"{url}/mcp") as other:
        tools = await session.list_tools()
        print(f"tools/list (passed through)          -> {[t.name for t in tools.tools]}")
        first = {"order": "o-1", "amount": 4200}
        answer = await call_with_retries(session, first, key="run-7:charge:o-1", fence=3)
        print(f"charge o-1, token 3                  -> {answer}")
        answer = await call_with_retries(session, first, key="run-7:charge:o-1", fence=3)
        print(f"the answer was lost: the same call   -> {answer}")

        # A slow charge, and a second copy of it while it runs (a retry after a timeout).
        slow = {"order": "o-2", "amount": 990, "seconds": 1.5}
        running = asyncio.create_task(
            call_with_retries(session, slow, key="run-7:charge:o-2", fence=3)
        )
        await asyncio.to_thread(started["o-2"].wait, 10)  # the server has started it
        try:
            await other.call_tool("charge", slow, meta=call_meta("run-7:charge:o-2"))
        except MCPError as error:
            print(f"a copy while o-2 still runs          -> {refusal(error)}")
        copy = await call_with_retries(other, slow, key="run-7:charge:o-2", fence=3)
        print(f"the copy, retried until it ended     -> {copy}")
        print(f"the first call of o-2                -> {await running}")

        try:
            await session.call_tool(
                "charge", {"order": "o-1", "amount": 1}, meta=call_meta("run-7:charge:o-1")
            )
        except MCPError as error:
            print(f"the same key, another amount         -> {refusal(error)}")
        try:
            stale = call_meta("run-6:charge:o-1", 2)
            await session.call_tool("charge", first, meta=stale)
        except MCPError as error:
            print(f"a replaced agent run, token 2        -> {refusal(error)}")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, run_mcp_server() as upstream:
        config = Path(tmp) / "routes.toml"
        config.write_text(ROUTES.format(upstream=upstream, store=Path(tmp) / "gateway.db"))
        with run_gateway(config) as gateway:
            asyncio.run(agent(gateway))
    print(f"charges the MCP server executed: {dict(executions)}")
    return 0 if executions == {"o-1": 1, "o-2": 1} else 1


if __name__ == "__main__":
    sys.exit(main())
