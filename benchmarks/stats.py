"""The one percentile every benchmark reports (nearest rank on the sorted values)."""

from __future__ import annotations


def percentile(values: list[float], fraction: float) -> float:
    """The value at ``fraction`` (0.5: the median) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]
