"""The garbage collector's youngest generation, sized to the Workers running in this process.

CPython collects its youngest generation whenever the objects it tracks grow by the first
threshold (700 by default) since the last collection. A Worker's claim of ``2 * concurrency``
leases creates some 25 such objects per lease at once (its task and coroutines, the
execution, the job context, futures), all alive until the job ends; at concurrency 50 every
claim set off collections that found only live objects, moved them to the older generations
and so led to full collections of the whole process: 9-14 µs of collector time per job with
one Worker, 17-18 with four (of 65-85 µs of the process's CPU per job), reclaiming next to
nothing (the Worker's objects are freed by reference counting).

While Workers run, the first threshold is raised to cover the objects of the leases they may
hold at once (`OBJECTS_PER_LEASE` per lease, ``4 * concurrency`` leases each), never lowered,
and put back when the last one stops, unless someone else has changed it meanwhile. Only the
youngest generation's threshold moves: cyclic garbage is still collected, after at most that
many more objects; the older generations keep their thresholds (counted in young
collections, so they come as much less often) and `gc.collect` is untouched.
"""

from __future__ import annotations

import gc
import threading

# Objects the collector tracks per lease a Worker holds (measured: 23-27 in flight).
OBJECTS_PER_LEASE = 25

_lock = threading.Lock()
# Each running Worker's share (by id), the threshold found before the first one, and the
# one set for them (None while no Worker runs).
_shares: dict[int, int] = {}
_found: int | None = None
_set: int | None = None


def _apply() -> None:
    """With the lock held: the threshold the running Workers need, or the one found."""
    global _found, _set
    current, *older = gc.get_threshold()
    if _set is not None and current != _set:
        _found = current  # changed by someone else meanwhile: theirs is the floor now
    if not _shares:
        if _set is not None and _found is not None and current == _set:
            gc.set_threshold(_found, *older)
        _found = _set = None
        return
    if _found is None:
        _found = current
    wanted = max(_found, sum(_shares.values()))
    if wanted != current:
        gc.set_threshold(wanted, *older)
    _set = wanted


def enter(owner: object, *, leases: int) -> None:
    """``owner`` (a Worker) runs, holding up to ``leases`` leases at once."""
    with _lock:
        _shares[id(owner)] = leases * OBJECTS_PER_LEASE
        _apply()


def leave(owner: object) -> None:
    """``owner`` stopped (a call for an owner that never entered does nothing)."""
    with _lock:
        if _shares.pop(id(owner), None) is not None:
            _apply()
