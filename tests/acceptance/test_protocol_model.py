"""The protocol model in spec/: Spin verifies every property of the real model and finds a
counterexample trail for every mutation (a rule of the code removed) and for the operator
assumption taken away; two keys are a bitstate search bounded by time (docs/protocol/model.md).
The same runner as `.ci/run`; it takes a few minutes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SPEC = Path(__file__).resolve().parents[2] / "spec"
# Spin explores millions of states per run: minutes, not the suite's default two.
pytestmark = pytest.mark.timeout(1800)
MISSING = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


@pytest.mark.skipif(
    bool(MISSING),
    reason=f"{' and '.join(MISSING)} not installed (Debian: apt-get install spin gcc)",
)
def test_spin_verifies_the_model_and_catches_every_mutation(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SPEC / "check.sh"), "--keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    rows = [
        line.split()
        for line in done.stdout.splitlines()
        if line.startswith(("lease", "gateway", "mutation", "assumption"))
    ]
    results = {row[0]: (row[1], row[-1]) for row in rows}
    assert len(results) == 23, report
    wanted = {"ok": "verified", "trail": "caught", "search": "searched"}
    for name, (expect, result) in results.items():
        # a bounded bitstate search reports its hash factor: searched(h=...)
        assert result.split("(")[0] == wanted[expect], (name, report)
        if expect == "trail":
            assert any((tmp_path / name).glob("*.trail")), name
    assert [name for name, (expect, _) in results.items() if expect == "search"] == [
        "gateway-2keys-p1-p2-p4-p6"
    ], report
