"""`fencegate demo` end to end, as a user runs it: a real subprocess, real sockets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.processes import child_env


def test_demo_tells_the_whole_story(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fencegate.cli", "demo"],
        cwd=tmp_path,  # needs no set-up and leaves nothing behind
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Verdict: 1 capture executed; W1 (token 1) fenced off with 412" in out
    lines = out.splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    # The order a person reads at 2 a.m.
    assert (
        first("W1  job_claimed")
        < first("W1 is cut off from the store;")
        < first("W1  ownership_unknown")
        < first("W1  result_rejected")
        < first("W2  job_claimed")
        < first("Idempotent-Replayed: true")
        < first("W2  result_committed")
        < first("W1  late request")
    )
    assert "extend               token=1 -> lost (no longer the owner)" in out
    assert "None" not in out
    assert "complete             token=1 -> False" in out
    assert "412 stale-fence" in out
    assert "outcome lease_expired" in out and "outcome succeeded" in out
    assert list(tmp_path.iterdir()) == []
