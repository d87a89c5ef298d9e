"""The serve command refuses a bad configuration at start, in one line, as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_config import write


def test_serve_refuses_a_bad_config_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[routes]]\non_unknown = "maybe"\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--config",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "routes[0].on_unknown: Input should be 'retry' or 'reject'" in lines[0]


def test_serve_needs_an_upstream(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FENCEGATE_UPSTREAM"}
    result = subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 2
    assert "no upstream" in result.stderr
