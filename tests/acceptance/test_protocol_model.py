"""The protocol model in spec/: Spin verifies every property of the real model and finds a
counterexample trail for every mutation (a rule of the code removed) and for the operator
assumption taken away; two keys are a bitstate search bounded by time (docs/protocol/model.md).
The same runner as `.ci/run`, one of its runs per test (``SPEC_ONLY``), so that pytest-xdist
spreads the runs, each of which keeps a core busy for up to a few minutes, over its workers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SPEC = Path(__file__).resolve().parents[2] / "spec"
# Spin explores millions of states per run: minutes, not the suite's default two.
pytestmark = pytest.mark.timeout(1800)
MISSING = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
# The runs check.sh makes: `run NAME MODEL EXPECT ...` lines.
RUNS = re.findall(
    r"^\s*run (\S+)\s+\S+\s+(ok|trail|search)\s", (SPEC / "check.sh").read_text(), re.M
)


def test_check_sh_makes_every_run() -> None:
    """Four models verified exhaustively, two keys searched (bitstate, bounded by time), and
    seventeen mutations and assumptions caught."""
    expects = [expect for _, expect in RUNS]
    counts = (expects.count("ok"), expects.count("search"), expects.count("trail"))
    assert counts == (4, 1, 17), RUNS
    assert [name for name, expect in RUNS if expect == "search"] == ["gateway-2keys-p1-p2-p4-p6"]


@pytest.mark.skipif(
    bool(MISSING),
    reason=f"{' and '.join(MISSING)} not installed (Debian: apt-get install spin gcc)",
)
@pytest.mark.parametrize(("name", "expect"), RUNS, ids=[name for name, _ in RUNS])
def test_spin_verifies_the_model_or_catches_the_mutation(
    name: str, expect: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [str(SPEC / "check.sh"), "--keep", str(tmp_path)],
        env={**os.environ, "SPEC_ONLY": f"^{re.escape(name)}$"},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(name + " ")]
    assert len(rows) == 1, report
    # a bounded bitstate search reports its hash factor: searched(h=...)
    wanted = {"ok": "verified", "trail": "caught", "search": "searched"}[expect]
    assert rows[0][-1].split("(")[0] == wanted, report
    if expect == "trail":
        assert any((tmp_path / name).glob("*.trail")), report
