"""The suite on pytest-xdist workers keeps the tests that share a module-scoped fixture on one
worker (the fixture, here a gateway process, is started once), spreads the others, and
starts no workers for a run that names single files (tests/support/parallel.py)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import postgres
from tests.support.processes import REPO_ROOT, child_env

GROUPED = "tests/acceptance/test_empty_query.py"  # a module-scoped `gateway` fixture
LOOSE = "tests/unit/test_errors.py"


def run_pytest(*args: str, server: str) -> str:
    env = child_env({postgres.URL_ENV: server})
    env.pop(postgres.RUN_DIR_ENV, None)  # a run of its own, with its own folder
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_module_fixture_s_tests_share_one_worker(pg_server_url: str) -> None:
    out = run_pytest("-n", "2", GROUPED, LOOSE, server=pg_server_url)
    ran = re.findall(r"^\[(gw\d+)\] .*PASSED (\S+?)::", out, re.M)
    grouped = {worker for worker, path in ran if path == GROUPED}
    assert len([path for _, path in ran if path == GROUPED]) == 3, out
    assert len(grouped) == 1, out


def test_a_run_naming_files_starts_no_workers(pg_server_url: str) -> None:
    out = run_pytest(LOOSE, server=pg_server_url)
    assert "bringing up nodes" not in out and "[gw" not in out, out
    assert re.search(r"^tests/unit/test_errors.py::\S+ PASSED", out, re.M), out
