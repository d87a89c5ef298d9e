"""The signing command through the installed command line, as its own processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.test_signatures_command import URL


def test_through_the_installed_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("FENCEGATE_SIGNING_KEY_ID", None)
    cli = [sys.executable, "-m", "fencegate.cli", "sign"]
    key = tmp_path / "worker.key"
    created = subprocess.run(
        [
            *cli,
            "--new-key",
            "ed25519",
            "--key-id",
            "w1",
            "--tenant",
            "acme",
            "--secret-file",
            str(key),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("[[keys]]\n")
    signed = subprocess.run(
        [*cli, "--key-id", "w1", "--alg", "ed25519", "--secret-file", str(key), URL],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert signed.returncode == 0, signed.stderr
    assert 'keyid="w1";alg="ed25519"' in signed.stdout
    refused = subprocess.run(
        [*cli, "--secret-file", str(key), URL], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "fencegate sign: error: --key-id (or FENCEGATE_SIGNING_KEY_ID) is required"
    ]
