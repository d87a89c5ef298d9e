"""Without FENCEGATE_TEST_DATABASE_URL the tests start a PostgreSQL of their own and stop it:
they do not create databases on whatever server answers at 127.0.0.1:5432."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from tests.support import postgres
from tests.support.processes import REPO_ROOT, child_env

# What a test process does: ask for the server, make a migrated database, say what it got.
SCRIPT = """
import asyncio, json, os
from tests.support import postgres
url = postgres.server_url()
database = asyncio.run(postgres.create_migrated_database(url))
run_dir = os.environ[postgres.RUN_DIR_ENV]
state = json.loads(open(run_dir + "/server.json").read())
print(json.dumps({"url": url, "database": database, "run_dir": run_dir, "state": state}))
"""


async def _answers(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


def test_without_a_url_a_private_cluster_is_started_and_stopped() -> None:
    env = child_env()
    env.pop(postgres.URL_ENV, None)
    env.pop(postgres.RUN_DIR_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    server = urlsplit(got["url"])
    assert (server.hostname, server.port) != ("127.0.0.1", 5432), got
    assert got["state"]["private"] is True
    assert got["state"]["templates"][got["url"]]  # the migrated template, made once
    assert urlsplit(got["database"]).path.startswith("/fg_test_")
    # The process that started it stopped it and removed its folder when it ended.
    assert not Path(got["run_dir"]).exists()
    assert not asyncio.run(_answers(got["url"]))


def test_the_run_s_server_is_private_unless_a_url_names_one(pg_server_url: str) -> None:
    named = os.environ.get(postgres.URL_ENV)
    if named:
        assert pg_server_url == named
    else:
        assert urlsplit(pg_server_url).port != 5432
