"""The examples run as documented and show what they claim: one execution per key, stale
fences refused, the httpx worker finishing every job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT, child_env


def run_example(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("gateway_legacy_api.py", ["-> 201 T-1 (replayed)", "412 stale-fence", "created: 1"]),
        ("middleware_starlette.py", ["(replayed)", "-> 412", "captures executed: 1"]),
        ("worker_httpx.py", ["jobs: ['succeeded', 'succeeded', 'succeeded']"]),
        (
            "worker_scheduling.py",
            [
                "browse: at most 2 at once",
                "first to run: the user's request",
                "create_case: at most 1 per customer at once, 2 at once in all",
                "charge: 15 charges over",
                "jobs: ['succeeded']",
            ],
        ),
    ],
)
def test_example_runs(tmp_path: Path, script: str, expected: list[str]) -> None:
    args = [str(REPO_ROOT / "examples" / script)]
    if script == "middleware_starlette.py":
        args.append("--check")
    out = run_example(tmp_path, *args)
    for text in expected:
        assert text in out
