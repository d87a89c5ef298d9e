"""The purge command, run as its own process against each store."""

from __future__ import annotations

import subprocess
import sys


def test_purge_command(store_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "purge", "--database-url", store_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "purged 0 keys, 0 fences, 0 nonces, 0 decision history rows"


def test_purge_command_names_a_bad_url() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "purge", "--database-url", "mysql://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unsupported database URL" in result.stderr
