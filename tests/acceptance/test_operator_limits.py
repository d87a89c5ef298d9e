"""The operator sees the scheduling limits: `fencegate jobs list` and the console's jobs page show
each limit, how many jobs run under it and how many ready jobs it holds back."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from fencegate.console.app import create_console_app
from fencegate.lease import LeaseQueue, RateLimit, WorkClass
from tests.integration.test_console import ORIGIN, TOKENS, sign_in
from tests.support.processes import fencegate

pytestmark = pytest.mark.timeout(120)


async def limited_queue(url: str) -> None:
    """browse: 2 of at most 2 running, 3 held back; case: customer a full (1 running, 2 held
    back), customer b free; charge: the bucket's 2 tokens spent, 4 charges held back."""
    async with await LeaseQueue.connect(url) as queue:
        queue.declare(WorkClass(kind="browse", max_running=2))
        queue.declare(WorkClass(kind="case", max_running_per_key=1))
        queue.declare(WorkClass(kind="charge", provider="stripe"))
        queue.declare_rate_limit(RateLimit("stripe", 2, per_seconds=3600.0))
        for n in range(5):
            await queue.enqueue("browse", n)
        for n in range(3):
            await queue.enqueue("case", n, concurrency_key="customer:a")
        await queue.enqueue("case", "b", concurrency_key="customer:b")
        for n in range(6):
            await queue.enqueue("charge", n)
        await queue.claim("w1", kinds=["browse", "charge"], limit=20)
        await queue.claim("w1", kinds=["case"], limit=1)  # customer a's first job


EXPECTED = [
    ("max_running", "browse", "2", 2, 3, None),
    ("max_running_per_key", "case", "1 per key", 1, 2, None),
    ("rate", "stripe", "2 per 3600s", 2, 4, "0 tokens"),
]


def rows(limits: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keys = ("rule", "subject", "limit", "running", "waiting", "detail")
    return [tuple(row[k] for k in keys) for row in limits]


async def test_jobs_list_shows_each_limit(store_url: str) -> None:
    await limited_queue(store_url)
    done = fencegate("jobs", "list", "--database-url", store_url, "--json")
    assert done.returncode == 0, done.stderr
    assert rows(orjson.loads(done.stdout)["limits"]) == EXPECTED
    text = fencegate("jobs", "list", "--database-url", store_url)
    assert text.returncode == 0, text.stderr
    assert "limits (running under each, ready jobs held back by it):" in text.stdout
    assert "2 per 3600s" in text.stdout and "customer:a" in text.stdout


async def test_the_console_jobs_page_shows_each_limit(sqlite_url: str) -> None:
    await limited_queue(sqlite_url)
    app = create_console_app(sqlite_url, tokens=TOKENS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=ORIGIN) as client:
        await sign_in(client, "watcher")
        page = await client.get("/jobs", headers={"accept": "text/html"})
    assert page.status_code == 200, page.text
    table = page.text[page.text.index('<table id="limits">') : page.text.index('<table id="jobs">')]
    for rule, subject, limit, running, waiting, _ in EXPECTED:
        cells = (rule, subject, limit, running, waiting)
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in cells) in table, table
