"""The examples run as documented and show what they claim: one execution per key, stale
fences refused, the httpx worker finishing every job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_example(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env,
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
    ],
)
def test_example_runs(tmp_path: Path, script: str, expected: list[str]) -> None:
    args = [str(REPO_ROOT / "examples" / script)]
    if script == "middleware_starlette.py":
        args.append("--check")
    out = run_example(tmp_path, *args)
    for text in expected:
        assert text in out
