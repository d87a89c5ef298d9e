"""A real MCP server for gateway tests, made with the ``mcp`` SDK and run by uvicorn in its
own process: a ``charge`` tool that counts its executions per order, over the streamable
HTTP transport, answering with plain JSON (``--json``) or an event stream.

``charge(order, amount, delay=0, fail=False)``: counts the execution (before any delay, so
a call whose answer never arrives still counts), reports progress, waits ``delay`` seconds,
reports progress again, and answers ``charged <order> <amount> #<n>``; ``fail`` answers a
tool error (``isError: true``). ``GET /_count?order=O`` → ``{"order": O, "count": n}``.

Run it with ``python -m tests.support.mcp_server --port N [--json]``; tests use
`McpServerProcess`.
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
import urllib.request
from pathlib import Path
from urllib.parse import quote

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process


def build_app(*, json_response: bool) -> Starlette:
    server = MCPServer("charges")
    counts: collections.Counter[str] = collections.Counter()

    @server.tool()
    async def charge(
        order: str, amount: int, ctx: Context, delay: float = 0.0, fail: bool = False
    ) -> str:
        """Charge an order (counts each execution)."""
        counts[order] += 1
        execution = counts[order]
        await ctx.report_progress(1, 2, "charging")
        if delay > 0:
            await asyncio.sleep(delay)
        await ctx.report_progress(2, 2, "charged")
        if fail:
            raise ToolError(f"card declined for {order}")
        return f"charged {order} {amount} #{execution}"

    @server.custom_route("/_count", methods=["GET"])  # type: ignore[untyped-decorator]
    async def count(request: Request) -> JSONResponse:
        order = request.query_params.get("order", "")
        return JSONResponse({"order": order, "count": counts[order]})

    return server.streamable_http_app(json_response=json_response, stateless_http=True)


class McpServerProcess:
    """The MCP server in a subprocess on a free loopback port; its endpoint is ``url``
    (``…/mcp``)."""

    def __init__(self, *, json_response: bool, port: int | None = None) -> None:
        self.json_response = json_response
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/mcp"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="mcp-server-", suffix=".log", delete=False)

    def __enter__(self) -> McpServerProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.mcp_server", "--port", str(self.port)]
            + (["--json"] if self.json_response else []),
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout=30)
        except TimeoutError:
            self.__exit__()
            raise RuntimeError(f"MCP server did not start:\n{self.log_text()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, timeout=10)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def log_text(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def count(self, order: str) -> int:
        """How many times ``charge`` ran for this order."""
        url = f"{self.base}/_count?order={quote(order, safe='')}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(json.loads(response.read())["count"])

    async def acount(self, order: str) -> int:
        return await asyncio.to_thread(self.count, order)

    async def await_count(self, order: str, expected: int, *, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        seen = await self.acount(order)
        while seen < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            seen = await self.acount(order)
        return seen


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="test MCP server for fencegate")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--json", action="store_true", help="answer plain JSON, not SSE")
    args = parser.parse_args(argv)
    app = build_app(json_response=args.json)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
