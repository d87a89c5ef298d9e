"""The test run's folder, shared by every process of one run (the controlling pytest and its
pytest-xdist workers, which inherit ``FENCEGATE_TEST_RUN_DIR``): the private PostgreSQL
cluster's data, its ``server.json`` and the lock around it (tests/support/postgres.py).

The controlling process makes the folder when pytest starts and, when it ends, stops the
cluster and removes the folder; a run killed before that is cleaned up by the next one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import postgres

_OWNED = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(postgres.RUN_DIR_ENV):
        return  # an xdist worker (or a nested run): the controlling process owns the folder
    postgres.sweep_abandoned_runs()
    run_dir = postgres.new_run_dir()
    os.environ[postgres.RUN_DIR_ENV] = str(run_dir)
    config.stash[_OWNED] = run_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    run_dir = config.stash.get(_OWNED, None)
    if run_dir is None:
        return
    postgres.end_run(run_dir)
    os.environ.pop(postgres.RUN_DIR_ENV, None)
