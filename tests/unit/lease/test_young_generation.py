"""The collector's youngest generation while Workers run: raised to hold their leases'
objects, never lowered, put back when the last one stops unless changed meanwhile."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fencegate.lease import young_generation
from fencegate.lease.young_generation import OBJECTS_PER_LEASE


@pytest.fixture(autouse=True)
def threshold() -> Iterator[tuple[int, int, int]]:
    found = gc.get_threshold()
    gc.set_threshold(700, *found[1:])
    try:
        yield gc.get_threshold()
    finally:
        for owner in list(young_generation._shares):
            young_generation._shares.pop(owner)
        young_generation._found = young_generation._set = None
        gc.set_threshold(*found)


def test_raised_for_the_workers_running_and_put_back_after_the_last() -> None:
    one, two = object(), object()
    young_generation.enter(one, leases=200)
    assert gc.get_threshold()[0] == 200 * OBJECTS_PER_LEASE
    young_generation.enter(two, leases=200)
    assert gc.get_threshold()[0] == 400 * OBJECTS_PER_LEASE
    young_generation.leave(one)
    assert gc.get_threshold()[0] == 200 * OBJECTS_PER_LEASE
    young_generation.leave(two)
    assert gc.get_threshold()[0] == 700


def test_never_lowered_and_the_older_generations_kept() -> None:
    gc.set_threshold(50_000, 7, 3)
    owner = object()
    young_generation.enter(owner, leases=16)
    assert gc.get_threshold() == (50_000, 7, 3)
    young_generation.leave(owner)
    assert gc.get_threshold() == (50_000, 7, 3)


def test_a_threshold_changed_meanwhile_is_left_as_it_was_set() -> None:
    owner = object()
    young_generation.enter(owner, leases=200)
    gc.set_threshold(1_000)
    young_generation.leave(owner)
    assert gc.get_threshold()[0] == 1_000


def test_leaving_without_entering_changes_nothing() -> None:
    young_generation.leave(object())
    assert gc.get_threshold()[0] == 700
