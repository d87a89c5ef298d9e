"""A Starlette service with `FencegateMiddleware` under a real uvicorn process, in front of a
PostgreSQL database nobody migrated: the server does not start, and its log says once what
to run. (The in-process lifespan cases are in tests/integration/test_middleware_schema.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

pytestmark = pytest.mark.timeout(120)

SERVICE = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from fencegate import FencegateMiddleware

async def charge(request):
    return PlainTextResponse("charged", status_code=201)

app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
app.add_middleware(FencegateMiddleware, database_url=sys.argv[1])
uvicorn.run(app, host="127.0.0.1", port=0, lifespan="on", log_level="info")
"""


def test_uvicorn_refuses_to_start_on_an_unmigrated_database(
    empty_pg_url: str, tmp_path: Path
) -> None:
    refused = subprocess.run(
        [sys.executable, "-c", SERVICE, empty_pg_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=child_env(),
    )
    assert refused.returncode != 0, refused.stderr
    lines = [ln for ln in refused.stderr.splitlines() if "no fencegate schema" in ln]
    assert len(lines) == 1, refused.stderr
    assert f"fencegate migrate --database-url {empty_pg_url}" in lines[0]
    assert "Uvicorn running on" not in refused.stderr
