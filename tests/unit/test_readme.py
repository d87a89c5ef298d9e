"""The README is a front page, not the manual: at most 150 lines, what fencegate is in its first
lines, then the two commands that work on a fresh machine with only Python (the demo on the
embedded store, and the test suite, as CI runs it), and links that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO = "python3 -m venv .venv && . .venv/bin/activate && pip install . && fencegate demo"
TESTS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' "
    "&& python -m pytest -q"
)


def test_the_readme_is_at_most_150_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the manual lives in docs/"


def test_it_says_what_fencegate_is_then_gives_the_two_commands_first() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.startswith("# fencegate\n")
    assert "Idempotency keys and fencing tokens" in "\n".join(text.splitlines()[:5])
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    assert blocks, "no code block"
    kind, first = blocks[0]
    assert kind == "sh"
    assert first.splitlines() == [DEMO, TESTS]


def test_ci_runs_the_readme_s_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -e '.[test" in ci
    assert ci.rstrip().splitlines()[-1] == TESTS.split("&& ")[-1]


def test_every_link_of_the_readme_leads_to_a_file() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to the documentation"
    missing = [t for t in local if not (ROOT / t).is_file()]
    assert missing == []
