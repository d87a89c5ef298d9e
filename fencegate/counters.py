"""A Prometheus counter whose label children are looked up once per label set.

`Counter.labels()` validates its arguments and takes a lock on every call; on a path that
counts every request or job, that costs more than the increment. The children are kept here,
by their label values in the counter's label order.
"""

from __future__ import annotations

from prometheus_client import Counter


class CachedCounter:
    __slots__ = ("_children", "counter")

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._children: dict[tuple[str, ...], Counter] = {}

    def inc(self, *labels: str) -> None:
        """Add one to the child of these label values (in the counter's label order)."""
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.counter.labels(*labels)
        child.inc()
