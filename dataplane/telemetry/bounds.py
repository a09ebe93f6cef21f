"""Keep label sets small: the largest few partitions get series of their own, the rest one "other".

A run may make thousands of partitions (one per step) and consumer tasks; a series per partition
would grow every metric that has a ``partition`` label without bound. ``chosen`` picks the ``k``
largest (by whatever the caller measures: bytes, rows, lag), ``fold`` sums everything else under
``OTHER``. So such a metric has at most ``k + 1`` series per process and label set, whatever the
number of partitions (``k = -1``, asked for explicitly, gives each its own).

    >>> rows = {"step1": 5, "step2": 9, "step3": 1}
    >>> keep = chosen(rows, 2)
    >>> sorted(fold(rows, keep, OTHER).items())
    [('other', 1), ('step1', 5), ('step2', 9)]
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping
from typing import TypeVar

# The name everything else folds into, for the callers of fold (its home is the catalog).
from dataplane.telemetry.catalog import OTHER as OTHER

K = TypeVar("K", bound=Hashable)


def chosen(sizes: Mapping[K, float], k: int) -> set[K] | None:
    """The keys of ``sizes`` that get series of their own: the ``k`` largest (ties broken by key, so
    the choice is stable); None when all of them do (``k`` is -1, or there are no more than ``k``)."""
    if k < 0 or len(sizes) <= k:
        return None
    if k == 0:
        return set()
    return set(heapq.nlargest(k, sizes, key=lambda key: (sizes[key], str(key))))


def fold(values: Mapping[K, float], keep: set[K] | None, other: K) -> dict[K, float]:
    """``values`` with every key not in ``keep`` summed under ``other`` (all kept when ``keep`` is
    None; no ``other`` entry when nothing was folded)."""
    if keep is None:
        return dict(values)
    out: dict[K, float] = {}
    rest: float = 0
    folded = False
    for key, value in values.items():
        if key in keep:
            out[key] = value
        else:
            rest += value
            folded = True
    if folded:
        out[other] = out.get(other, 0) + rest
    return out


__all__ = ["chosen", "fold"]
