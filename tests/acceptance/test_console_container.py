"""The Docker image runs the console reachable from outside the container: its environment
(read from the Dockerfile) makes `fencegate console` listen on every interface, not only
127.0.0.1. Checked with a real console process and a connection to another loopback address
(127.0.0.2), which a server bound to 127.0.0.1 alone does not accept."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process
from tests.support.stories import two_workers_one_fenced_off

pytestmark = pytest.mark.timeout(120)

TOKENS = '[[tokens]]\nname = "op"\ntoken = "operator-secret-0123456789"\nrole = "operator"\n'


def dockerfile_env() -> dict[str, str]:
    """The ``ENV`` pairs of the Dockerfile (continuation lines joined)."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def test_the_image_runs_the_console_on_every_interface(sqlite_url: str, tmp_path: Path) -> None:
    env = dockerfile_env()
    assert env.get("FENCEGATE_CONSOLE_HOST") == "0.0.0.0"
    asyncio.run(two_workers_one_fenced_off(sqlite_url))
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            "console",
            "--database-url",
            sqlite_url,
            "--tokens",
            str(tokens),
        ],
        env=child_env({**env, "FENCEGATE_CONSOLE_PORT": str(port)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_port(port, timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/login", timeout=10) as answer:
            assert answer.status == 200
    finally:
        stop_process(proc, timeout=10)
