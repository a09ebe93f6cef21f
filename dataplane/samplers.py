"""Samplers: which of the rows ready for a consumer task a ``next_batch`` call gets.

A sampler has one method, ``sample(ready, batch_size, *, dp_rank, dp_size, finished)``, that looks
at the ready rows (keys in the order the puts made them ready, with their tags) and returns:

* ``None``: not enough yet, wait for more rows (``finished`` says no more will come: a sampler of
  your own that still returns ``None`` then gets an empty batch);
* a list of keys: this caller's batch (at most ``batch_size``);
* a dict ``{dp_rank: keys}``: one global batch split over data-parallel ranks; the caller gets its
  own part and the others are kept for the other ranks' calls with the same ``batch_index``.

The built-in samplers below run inside the index service (it receives their name and parameters,
never code). A sampler of your own (a subclass overriding ``sample``) runs in your process: the
client fetches the ready rows, calls it, and claims the keys it chose.

    >>> meta = dp.next_batch("step0", "train", 8, ["responses"], sampler=dp.GroupSampler("uid", 4))
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterator
from typing import Any

from dataplane.errors import BatchSizeError, InvalidArgumentError

Choice = list[str] | dict[int, list[str]] | None


class ReadyRows:
    """The rows ready for one consumer: keys in ready order, each with its tag dict (read-only).

    In the index service it also offers ``groups(group_tag, group_size)``: an index of its complete
    groups that the service keeps current as rows come and go (``server.index.ready``), so a grouped
    sampler costs what it takes, not what is ready.
    """

    def __init__(
        self,
        keys: Collection[str],
        tags: Callable[[str], dict[Any, Any]],
        groups: Callable[[str, int], Any] | None = None,
    ) -> None:
        self._keys = keys  # an ordered container of keys (a dict's keys, a list)
        self._tags = tags  # key -> tag dict (a callable)
        self.groups = groups  # (group_tag, group_size) -> an index with ``units(want)``, if kept

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tag(self, key: str) -> dict[Any, Any]:
        return self._tags(key)

    def first(self, n: int) -> list[str]:
        """The first ``n`` keys in ready order (fewer when fewer are ready)."""
        first = getattr(self._keys, "first", None)  # (the index's ready keys: at the cost of n)
        return first(n) if first is not None else list(itertools.islice(self._keys, n))


class Sampler:
    """Base class. Subclasses override ``sample``; the default is the sequential choice.

    Built-in samplers are also described by ``spec()`` (a name and plain parameters), which is how
    the index service learns them; a subclass of your own has no spec and runs client-side.
    """

    name: str | None = None  # set by built-in samplers the index knows

    def sample(
        self,
        ready: ReadyRows,
        batch_size: int,
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        finished: bool = False,
    ) -> Choice:
        """The keys to hand out now, ``None`` to wait for more rows (see the module docstring)."""
        if len(ready) < batch_size and not finished:
            return None
        return _first(ready, batch_size)

    def check(
        self, batch_size: int, dp_rank: int | None, dp_size: int | None, batch_index: int | None
    ) -> None:
        """Raise ``ValueError`` when a call's arguments cannot work with this sampler (``BatchSizeError``,
        a ``ValueError``, when it is the batch size)."""

    def spec(self) -> dict[str, Any] | None:
        """``{"name": ..., **params}`` for built-ins (sent to the index); ``None`` for your own."""
        if type(self).name is None or type(self).sample is not _BUILTIN_SAMPLE.get(type(self)):
            return None
        return {"name": type(self).name, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}


def _first(ready: ReadyRows, n: int) -> list[str]:
    return ready.first(n)


class SequentialSampler(Sampler):
    """The first ``batch_size`` ready rows, in the order the puts made them ready (the default)."""

    name = "sequential"


class GroupSampler(Sampler):
    """Whole groups only: rows whose ``tags[group_tag]`` is equal form a group of ``group_size`` rows
    (all responses of one prompt, for GRPO); a group is never split across batches or ranks.

    ``batch_size`` must be a multiple of ``group_size``. Groups are handed out in the order they
    became complete; once the partition is finished, the last batch may hold fewer groups, and
    groups that never completed are not handed out.
    """

    name = "group"

    def __init__(self, group_tag: str = "uid", group_size: int = 1) -> None:
        if type(group_size) is not int or group_size < 1:
            raise InvalidArgumentError(
                "group_size", f"GroupSampler: group_size must be an int >= 1, got {group_size!r}"
            )
        self.group_tag = group_tag
        self.group_size = group_size

    def _params(self) -> dict[str, Any]:
        return {"group_tag": self.group_tag, "group_size": self.group_size}

    def check(
        self, batch_size: int, dp_rank: int | None, dp_size: int | None, batch_index: int | None
    ) -> None:
        if batch_size % self.group_size:
            raise BatchSizeError(
                f"GroupSampler: batch_size {batch_size} is not a multiple of group_size {self.group_size}; "
                "a group is never split"
            )

    def sample(
        self,
        ready: ReadyRows,
        batch_size: int,
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        finished: bool = False,
    ) -> Choice:
        groups = complete_groups(ready, self.group_tag, self.group_size, batch_size // self.group_size)
        if len(groups) * self.group_size < batch_size and not finished:
            return None
        return [k for g in groups for k in g]


def group_id(tag: dict[Any, Any], group_tag: str, key: str) -> Any:
    """The group a row belongs to: its ``group_tag`` value (a row without one is a group of itself)."""
    gid = tag.get(group_tag, key)
    return repr(gid) if isinstance(gid, (list, dict)) else gid


def complete_groups(ready: ReadyRows, group_tag: str, group_size: int, want: int) -> list[list[str]]:
    """Up to ``want`` complete groups of ready rows, in the order they completed."""
    if ready.groups is not None:  # kept current by the index service: no scan
        units: list[list[str]] = ready.groups(group_tag, group_size).units(want)
        return units
    partial: dict[Any, list[str]] = {}
    done: list[list[str]] = []
    for key in ready:
        gid = group_id(ready.tag(key), group_tag, key)
        members = partial.setdefault(gid, [])
        members.append(key)
        if len(members) == group_size:
            done.append(partial.pop(gid))
            if len(done) == want:
                break
    return done


class SeqlenBalancedSampler(Sampler):
    """One global batch of ``batch_size * dp_size`` rows split over ``dp_size`` ranks so their token
    counts (``tags[length_tag]``) are balanced (Karmarkar-Karp, largest differencing), keeping
    groups of ``group_size`` whole. Every rank calls with its ``dp_rank`` and the same ``batch_index``.

    Once the partition is finished, the last global batch may be short, but only if every rank still
    gets at least one row (one group): an empty batch tells a rank that the partition is drained, so
    a split that gave some ranks rows and others none would make the ranks run different numbers of
    steps, and a data-parallel job hangs in its next collective. A remainder of fewer rows (groups)
    than ranks is therefore not handed out, like ``DistributedSampler(drop_last=True)``: every rank
    gets an empty batch at the same batch index, and those rows stay ready (``dp.consumption``).
    """

    name = "seqlen_balanced"

    def __init__(
        self, length_tag: str = "length", dp_size: int = 1, group_tag: str = "uid", group_size: int = 1
    ) -> None:
        for what, value in (("dp_size", dp_size), ("group_size", group_size)):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(
                    what, f"SeqlenBalancedSampler: {what} must be an int >= 1, got {value!r}"
                )
        self.length_tag = length_tag
        self.dp_size = dp_size
        self.group_tag = group_tag
        self.group_size = group_size

    def _params(self) -> dict[str, Any]:
        return {
            "length_tag": self.length_tag,
            "dp_size": self.dp_size,
            "group_tag": self.group_tag,
            "group_size": self.group_size,
        }

    def check(
        self, batch_size: int, dp_rank: int | None, dp_size: int | None, batch_index: int | None
    ) -> None:
        if dp_rank is None or batch_index is None:
            missing = "dp_rank" if dp_rank is None else "batch_index"
            raise InvalidArgumentError(
                missing, "SeqlenBalancedSampler: every call passes dp_rank and batch_index"
            )
        if not 0 <= dp_rank < self.dp_size or (dp_size is not None and dp_size != self.dp_size):
            raise InvalidArgumentError(
                "dp_rank",
                f"SeqlenBalancedSampler: dp_rank {dp_rank} / dp_size {dp_size} vs the sampler's dp_size "
                f"{self.dp_size}",
            )
        if batch_size % self.group_size:
            raise BatchSizeError(
                f"SeqlenBalancedSampler: batch_size {batch_size} is not a multiple of group_size "
                f"{self.group_size}"
            )

    def sample(
        self,
        ready: ReadyRows,
        batch_size: int,
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        finished: bool = False,
    ) -> Choice:
        total = batch_size * self.dp_size
        if self.group_size > 1:
            units = complete_groups(ready, self.group_tag, self.group_size, total // self.group_size)
        else:
            units = [[k] for k in _first(ready, total)]
        if len(units) * self.group_size < total and not finished:
            return None
        if len(units) < self.dp_size:  # finished, too few left to give every rank a row: none
            return {rank: [] for rank in range(self.dp_size)}
        lengths = [sum(_length(ready.tag(k), self.length_tag) for k in unit) for unit in units]
        parts = balanced_partition(lengths, self.dp_size)
        return {rank: [k for i in part for k in units[i]] for rank, part in enumerate(parts)}


def _length(tag: dict[Any, Any], length_tag: str) -> float:
    value = tag.get(length_tag)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidArgumentError(
            "sampler", f"SeqlenBalancedSampler: a row has no numeric tag {length_tag!r} (got {value!r})"
        )
    return float(value)


def balanced_partition(weights: list[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Indexes of ``weights`` split into ``k`` parts with balanced sums; with ``equal_size`` the parts
    also have (nearly) equal counts (``len(weights) // k`` or one more items).

    Karmarkar-Karp largest differencing: each item starts as a k-tuple of parts (with
    ``equal_size``, k items at a time fill one tuple; else each item fills one part of its own
    tuple); the two tuples with the largest spread are merged (largest part with smallest), until
    one remains.

    >>> balanced_partition([8, 7, 6, 5, 4, 3, 2, 1], 2)  # sums 18 and 18
    [[0, 3, 5, 6], [1, 2, 4, 7]]
    >>> balanced_partition([100, 10, 10, 10, 10], 2, equal_size=False)
    [[0], [1, 2, 3, 4]]
    """
    if k == 1:
        return [list(range(len(weights)))]
    n = len(weights)
    # equal counts: pad with zero-weight items to a multiple of k, dropped at the end
    pad = (-n) % k if equal_size else 0
    items = [*weights, *([0.0] * pad)]
    order = sorted(range(len(items)), key=lambda i: -items[i])
    step = k if equal_size else 1
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    counter = 0
    for start in range(0, len(order), step):
        chunk = order[start : start + step]
        parts = [(items[i], [i]) for i in chunk] + [(0.0, []) for _ in range(k - len(chunk))]
        parts.sort(key=lambda p: -p[0])
        spread = parts[0][0] - parts[-1][0]
        heapq.heappush(heap, (-spread, counter, parts))
        counter += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = heap[0][2] if heap else [(0.0, []) for _ in range(k)]
    return [sorted(i for i in idx if i < n) for _, idx in parts]


BUILTINS: dict[str, type[Sampler]] = {
    cls.name: cls for cls in (SequentialSampler, GroupSampler, SeqlenBalancedSampler) if cls.name
}
_BUILTIN_SAMPLE = {cls: cls.sample for cls in BUILTINS.values()}


def from_spec(spec: dict[str, Any] | None) -> Sampler:
    """The built-in sampler a spec names (the index's side: no code crosses the wire)."""
    if not spec:
        return SequentialSampler()
    params = dict(spec)
    cls = BUILTINS.get(params.pop("name", None))
    if cls is None:
        raise InvalidArgumentError(
            "sampler", f"unknown sampler {spec.get('name')!r}; built-in: {sorted(BUILTINS)}"
        )
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidArgumentError("sampler", f"sampler {spec.get('name')!r}: {exc}") from exc


__all__ = ["GroupSampler", "Sampler", "SeqlenBalancedSampler", "SequentialSampler"]
