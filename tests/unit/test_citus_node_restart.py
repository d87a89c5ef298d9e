"""A Citus test node killed with -9 restarts even while its postmaster is a zombie nobody has
reaped yet: the files that name it (``postmaster.pid``, the socket's lock file) are removed,
or the new postmaster finds a process of that PID and refuses to start."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.citus import CitusNode, _running
from tests.support.waits import wait_until_sync


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child killed and not reaped: it exists (``kill(pid, 0)`` succeeds) but does not run."""
    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGKILL)
    wait_until_sync(lambda: not _running(child.pid), timeout=10, what="the child to die")
    assert Path(f"/proc/{child.pid}").exists()  # still there: a zombie
    try:
        yield child.pid
    finally:
        child.wait()


def test_a_killed_nodes_files_are_cleared_while_it_is_a_zombie(tmp_path: Path, zombie: int) -> None:
    node = CitusNode.__new__(CitusNode)  # no server: only the files a killed one leaves
    node.dir, node.port = tmp_path, 5999
    left = ["postmaster.pid", ".s.PGSQL.5999.lock", ".s.PGSQL.5999"]
    for name in left:
        (tmp_path / name).write_text(f"{zombie}\n")
    node.clear_stale_pid(timeout=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
