"""Child processes of the tests: started from the repository with its packages importable,
and stopped politely first (SIGTERM), then for certain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def fencegate(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """An operator's command (``fencegate ARGS``), in its own process, with ``env`` added to
    the environment."""
    return subprocess.run(
        [sys.executable, "-m", "fencegate.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(env),
        cwd=cwd,
    )


def stop_process(proc: subprocess.Popen[Any], *, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
