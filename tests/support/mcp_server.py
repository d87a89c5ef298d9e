"""A real MCP server for gateway tests, made with the ``mcp`` SDK and run by uvicorn in its
own process: a ``charge`` tool that counts its executions per order, over the streamable
HTTP transport, answering with plain JSON (``--json``) or an event stream.

``charge(order, amount, delay=0, fail=False)``: counts the execution (before any delay, so
a call whose answer never arrives still counts), reports progress, waits ``delay`` seconds,
reports progress again, and answers ``charged <order> <amount> #<n>``; ``fail`` answers a
tool error (``isError: true``). ``GET /_count?order=O`` → ``{"order": O, "count": n}``.

Long-running tools (MCP tasks), as a small extension (the SDK has no task store of its
own): a ``tools/call`` with ``params.task`` counts the execution, answers a new task at
once (``CreateTaskResult``) and completes it ``delay`` seconds later; ``tasks/get`` and
``tasks/result`` read it.

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
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mcp.server.context import CallNext, HandlerResult
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolRequestParams, GetTaskPayloadRequestParams, GetTaskRequestParams
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process
from tests.support.waits import wait_until


class Tasks(Extension):
    """Task-augmented tools/call: the call becomes a task that completes in the background."""

    identifier = "dev.fencegate.test/tasks"

    def __init__(self, counts: collections.Counter[str]) -> None:
        self.counts = counts
        self.tasks: dict[str, dict[str, Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self._running: set[asyncio.Task[None]] = set()

    def methods(self) -> list[MethodBinding]:
        return [
            MethodBinding("tasks/get", GetTaskRequestParams, self._get),
            MethodBinding("tasks/result", GetTaskPayloadRequestParams, self._result),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: Any, call_next: CallNext
    ) -> HandlerResult:
        if params.task is None:
            return await call_next(ctx)
        arguments = params.arguments or {}
        order = str(arguments.get("order"))
        self.counts[order] += 1
        execution = self.counts[order]
        task_id = uuid.uuid4().hex
        now = datetime.now(UTC).isoformat()
        task: dict[str, Any] = {"taskId": task_id, "status": "working", "ttl": 60_000}
        task |= {"createdAt": now, "lastUpdatedAt": now}
        self.tasks[task_id] = task
        text = f"charged {order} {arguments.get('amount')} #{execution}"
        job = asyncio.create_task(self._finish(task_id, float(arguments.get("delay", 0)), text))
        self._running.add(job)
        job.add_done_callback(self._running.discard)
        # An extension's own result type: the 2026-07-28 runner does not sieve it.
        return {"resultType": "task", "task": task}

    async def _finish(self, task_id: str, delay: float, text: str) -> None:
        await asyncio.sleep(delay)
        self.results[task_id] = {"content": [{"type": "text", "text": text}], "isError": False}
        self.tasks[task_id] |= {
            "status": "completed",
            "lastUpdatedAt": datetime.now(UTC).isoformat(),
        }

    async def _get(self, ctx: Any, params: GetTaskRequestParams) -> HandlerResult:
        return dict(self.tasks[params.task_id])

    async def _result(self, ctx: Any, params: GetTaskPayloadRequestParams) -> HandlerResult:
        return self.results[params.task_id]


def build_app(*, json_response: bool) -> Starlette:
    counts: collections.Counter[str] = collections.Counter()
    server = MCPServer("charges", extensions=[Tasks(counts)])

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

    def __init__(
        self, *, json_response: bool, port: int | None = None, middleware: str | None = None
    ) -> None:
        self.json_response = json_response
        # A database URL: the app is wrapped in FencegateMiddleware with an MCP route.
        self.middleware = middleware
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/mcp"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="mcp-server-", suffix=".log", delete=False)

    def __enter__(self) -> McpServerProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.mcp_server", "--port", str(self.port)]
            + (["--json"] if self.json_response else [])
            + (["--middleware", self.middleware] if self.middleware else []),
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
        """Wait until ``charge`` ran at least ``expected`` times for this order; the count."""

        if expected <= 0:
            return await self.acount(order)

        async def reached() -> int:
            seen = await self.acount(order)
            return seen if seen >= expected else 0

        return int(
            await wait_until(
                reached, timeout=timeout, what=f"{expected} charges of {order}", interval=0.05
            )
        )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="test MCP server for fencegate")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--json", action="store_true", help="answer plain JSON, not SSE")
    parser.add_argument(
        "--middleware", metavar="DATABASE_URL", help="wrap the app in FencegateMiddleware"
    )
    args = parser.parse_args(argv)
    app: Any = build_app(json_response=args.json)
    if args.middleware:
        from fencegate import FencegateMiddleware
        from fencegate.gateway.mcp_tools import McpTool
        from fencegate.gateway.routes import RoutePolicy

        route = RoutePolicy(prefix="/mcp", protocol="mcp", tools=(McpTool(name="charge"),))
        app = FencegateMiddleware(app, database_url=args.middleware, routes=[route])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
