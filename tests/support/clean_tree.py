"""The test run leaves the working tree as it found it: no tracked file rewritten, no
untracked file left behind (screenshots for the README, say, are made on purpose with
``FENCEGATE_SCREENSHOTS``, not by every run). Checked with ``git status`` at the start and
at the end of the session (by the controlling process under pytest-xdist); a change fails the
run and names the paths."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
_BEFORE = pytest.StashKey[set[str] | None]()


def tree_status() -> set[str] | None:
    """``git status --porcelain`` lines, or None outside a git checkout."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "status", "--porcelain=v1", "--untracked-files=all", "--ignore-submodules"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    return set(done.stdout.splitlines()) if done.returncode == 0 else None


def changed_by_run(before: set[str] | None, after: set[str] | None) -> list[str]:
    """Lines new since the start, except under the screenshots folder asked for."""
    if before is None or after is None:
        return []
    asked = os.environ.get("FENCEGATE_SCREENSHOTS", "").strip("/")
    return sorted(line for line in after - before if not (asked and asked in line))


def _is_xdist_worker(config: pytest.Config) -> bool:
    # The controlling process looks before the first worker starts and after the last ends; a
    # worker looking at the end would see another worker's test in the middle of its work.
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_xdist_worker(session.config):
        session.config.stash[_BEFORE] = tree_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_xdist_worker(session.config):
        return
    changed = changed_by_run(session.config.stash.get(_BEFORE, None), tree_status())
    if not changed:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["the test run changed the working tree:", *(f"  {line}" for line in changed)]
    if reporter is not None:
        reporter.write_sep("=", "working tree changed", red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
