"""How the suite runs on pytest-xdist workers (``-n auto --dist loadgroup``, pyproject's
addopts), see docs/reference/testing.md:

- how many workers ``-n auto`` starts: more than there are cores, because most tests wait on
  processes, sockets and timers rather than compute; none (the run stays in this process, as
  without xdist) when the command names test files or single tests rather than directories;
- which tests must share a worker: those of a module that has a module- or class-scoped fixture
  (a gateway process, an installed virtualenv: started once per worker that runs one of its
  tests), and the topology tier, whose clusters would otherwise fail over on one another's
  CPU;
- which tests start first: the long ones, so that none of them is left to run alone at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# Workers per core for `-n auto` (measured on two cores: docs/reference/testing.md).
WORKERS_PER_CORE = 2
# Tests that take a minute or more (or a group of them), started before the rest.
STARTED_FIRST = (
    "acceptance/topology/",
    "acceptance/test_protocol_model.py",
    "acceptance/test_examples_installed.py",
    "integration/test_protocol_conformance.py",
    "integration/test_gateway_differential.py",
    "acceptance/test_docs_site.py",
)
SHARED_SCOPES = ("module", "class", "package")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own rule reads it
    named = [arg for arg in config.args if not Path(arg.split("::")[0]).is_dir()]
    if config.args and len(named) == len(config.args):
        return 0  # a few files or tests: no workers to start
    return WORKERS_PER_CORE * (len(os.sched_getaffinity(0)) or 1)


def _group(item: pytest.Item) -> str | None:
    relative = item.path.relative_to(TESTS).as_posix()
    if relative.startswith("acceptance/topology/"):
        return "topology"
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        definitions = info.name2fixturedefs.get(name, ())
        if definitions and definitions[-1].scope in SHARED_SCOPES:
            return relative
    return None


def _rank(item: pytest.Item) -> int:
    relative = item.path.relative_to(TESTS).as_posix()
    for rank, prefix in enumerate(STARTED_FIRST):
        if relative.startswith(prefix):
            return rank
    return len(STARTED_FIRST)


# Before xdist's own hook, which reads the xdist_group marks into the test ids.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if TESTS not in item.path.parents:
            continue
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _rank(item) if TESTS in item.path.parents else len(STARTED_FIRST))
