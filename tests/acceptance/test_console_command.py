"""The console command refuses to start without tokens, in one line."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from fencegate.console import TokenConfigError, load_tokens
from tests.support.processes import child_env


def test_no_tokens_is_refused_with_one_line(tmp_path: Any) -> None:
    with pytest.raises(TokenConfigError, match="no console tokens"):
        load_tokens(None, {})
    env = {k: v for k, v in child_env().items() if not k.startswith("FENCEGATE_CONSOLE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            "console",
            "--database-url",
            f"sqlite:///{tmp_path / 'x.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no console tokens" in done.stderr
