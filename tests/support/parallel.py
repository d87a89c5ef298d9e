"""How the suite runs on pytest-xdist workers (``-n auto --dist loadgroup``, pyproject's
addopts), see docs/reference/testing.md:

- how many workers ``-n auto`` starts: more than there are cores, because most tests wait on
  processes, sockets and timers rather than compute; none (the run stays in this process, as
  without xdist) when the command names test files or single tests rather than directories;
- which tests must share a worker: those of a module that has a module- or class-scoped fixture
  (a gateway process, an installed virtualenv: started once per worker that runs one of its
  tests), and the topology tier, whose clusters would otherwise fail over on one another's
  CPU; and the Citus tier, whose tests share one cluster and one database;
- which tests start first: the long ones, so that none of them is left to run alone at the end.

The groups reach xdist's scheduler through the run's folder, not through xdist's own
``--dist loadgroup`` (which renames test ids, and on pytest 9.2 silently does nothing:
pytest-dev/pytest-xdist#1386): each worker writes the test-to-group map it computed to
``FENCEGATE_TEST_RUN_DIR/xdist-groups.json`` when it collects, and the controlling process's
scheduler (`GroupScheduling`) reads it when it splits the collection into units of work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

TESTS = Path(__file__).resolve().parents[1]
# Workers per core for `-n auto` (measured on two cores: docs/reference/testing.md).
WORKERS_PER_CORE = 2
# Tests that take a minute or more (or a group of them), started before the rest.
STARTED_FIRST = (
    "acceptance/topology/",
    "acceptance/citus/",
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
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    relative = item.path.relative_to(TESTS).as_posix()
    if relative.startswith("acceptance/topology/"):
        return "topology"
    if relative.startswith("acceptance/citus/"):
        return "citus"  # one cluster, shared by the tier's tests
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


def _groups_file() -> Path | None:
    run_dir = os.environ.get("FENCEGATE_TEST_RUN_DIR")
    return Path(run_dir) / "xdist-groups.json" if run_dir else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if TESTS in item.path.parents]
    rest = [item for item in items if TESTS not in item.path.parents]
    items[:] = sorted(ours, key=_rank) + rest
    path = _groups_file()
    if not hasattr(config, "workerinput") or path is None:
        return
    groups = {item.nodeid: group for item in ours if (group := _group(item)) is not None}
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)  # every worker writes the same map


class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]  # xdist is untyped here
    """xdist's load-group scheduling with the groups read from the workers' map, in the
    order the tests were collected (long ones first), not largest group first."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            path = _groups_file()
            exists = path is not None and path.exists()
            self._groups = json.loads(path.read_text()) if path and exists else {}
        group = self._groups.get(nodeid)
        return group if group is not None else str(super()._split_scope(nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadgroup":
        return GroupScheduling(config, log)
    return None
