"""The keys ready for one stream, in ready order, with the group indexes its samplers asked for.

A ``GroupSampler`` (or a grouped ``SeqlenBalancedSampler``) wants whole groups: rows whose
``tags[group_tag]`` are equal, ``group_size`` of them. Scanning every ready row for complete groups
costs the number of ready rows, and a parked consumer is asked again after every commit to its
partition, so 50,000 rows stuck in incomplete groups made every 1-row put scan 50,000 rows per
waiting consumer. Instead, the first time a sampler asks a stream for groups of ``(tag, size)``,
one scan builds a ``GroupIndex``; from then on every change to the ready keys (a commit appends, a
take or a clear removes, a give-back puts first) updates it in O(1) per key, and a sampler reads
complete groups in O(groups it takes).

Plain classes, no Ray, no sockets (owned by ``server.index.streams``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dataplane.samplers import group_id
from dataplane.server.index.keytable import shrink

Tag = Callable[[str], dict[Any, Any]]


GROUP_SLICE = 4096  # ready keys filed per step while a big stream's group index is gathered
TRIM_MIN = 4096  # keys taken off the front of a stream's order before the list is cut (then: half of it)


class StillGathering(Exception):  # noqa: N818 - a signal, not an error
    """A sampler asked for groups whose index is being gathered in slices: its call waits."""


class GroupIndex:
    """Ready keys by group, and the groups holding at least ``size`` of them, in the order they
    became complete (a group given back is first in line again).

    Over many ready keys it is gathered a slice at a time (``gather_some``): the keys ready when it
    was asked for (``todo``, in ready order) are filed first, then the changes made meanwhile, in the
    order they came (queued): the same index as one built at once when asked for and kept current
    since. The first keys are filed by their tags as they were then (``todo_tag``, a copy)."""

    def __init__(
        self, group_tag: str, size: int, tag: Tag, todo: list[str] | None = None, todo_tag: Tag | None = None
    ) -> None:
        self.group_tag = group_tag
        self.size = size
        self._tag = tag
        self._todo_tag = todo_tag or tag
        self.members: dict[Any, dict[str, None]] = {}  # gid -> its ready keys, in ready order
        self.gid: dict[str, Any] = {}  # key -> gid (as filed: a later tag change re-files it)
        self.complete: dict[Any, None] = {}  # gids with >= size ready keys, in completion order
        self._todo = todo  # (None: gathered)
        self._at = 0
        self._queued: list[tuple[Callable[[Any], None], Any]] = []  # changes made while gathering

    @property
    def gathering(self) -> bool:
        return self._todo is not None

    def gather_some(self, n: int = GROUP_SLICE) -> bool:
        """File up to ``n`` more keys, then the queued changes; whether any work is left."""
        todo = self._todo
        if todo is None:
            return False
        if self._at < len(todo):
            for key in todo[self._at : self._at + n]:
                self._add(key, self._todo_tag)
            self._at += n
            return True
        queued, self._queued = self._queued[:n], self._queued[n:]
        for change, arg in queued:
            change(arg)
        if self._queued:
            return True
        self._todo = None
        return False

    def add(self, key: str) -> None:
        self._change(self._add, key)

    def discard(self, key: str) -> None:
        self._change(self._discard, key)

    def put_first(self, keys: list[str]) -> None:
        """``keys`` are ready again, first in line: in their groups, and their groups among the complete."""
        self._change(self._put_first, keys)

    def _change(self, change: Callable[[Any], None], arg: Any) -> None:
        """Apply a change now, or queue it while the index is being gathered."""
        if self._todo is not None:
            self._queued.append((change, arg))
        else:
            change(arg)

    def _add(self, key: str, tag: Tag | None = None) -> None:
        gid = self.gid[key] = group_id((tag or self._tag)(key), self.group_tag, key)
        members = self.members.get(gid)
        if members is None:
            members = self.members[gid] = {}
        members[key] = None
        if len(members) == self.size:
            self.complete[gid] = None

    def _discard(self, key: str) -> None:
        gid = self.gid.pop(key, None)
        if gid is None:
            return
        members = self.members[gid]
        del members[key]
        if len(members) < self.size:
            self.complete.pop(gid, None)
            if not members:
                del self.members[gid]

    def _put_first(self, keys: list[str]) -> None:
        back: dict[Any, None] = {}
        for key in keys:
            gid = self.gid[key] = group_id(self._tag(key), self.group_tag, key)
            members = self.members.get(gid, {})
            self.members[gid] = {key: None, **members}
            back[gid] = None
        first = {gid: None for gid in back if len(self.members[gid]) >= self.size}
        if first:
            self.complete = {**first, **{g: None for g in self.complete if g not in first}}

    def units(self, want: int) -> list[list[str]]:
        """Up to ``want`` complete groups (``size`` keys each), oldest complete first."""
        out: list[list[str]] = []
        for gid in self.complete:
            members = iter(self.members[gid])
            for _ in range(len(self.members[gid]) // self.size):
                out.append([next(members) for _ in range(self.size)])
                if len(out) == want:
                    return out
        return out


class ReadyKeys:
    """The keys ready for one stream: ordered, with O(1) add / discard / membership, the first ``n``
    in O(n) however many were taken before them, and the group indexes samplers asked for kept
    current.

    Keys given back (``put_first``) wait in ``front``, the others in ``keys``, both dicts in ready
    order, never sharing a key. A dict's order alone would not do: taking from its front leaves
    deleted slots that every later walk from the front steps over again (a consumer taking a
    million keys 1,000 at a time walked half a million of them per take on average), and putting
    keys first means building a new dict. So ``keys``' order is also kept in a list, ``_order``,
    whose head moves past what is taken: ``_order[_head:]`` holds each key of ``keys`` once, as its
    last occurrence (keys are only ever appended there), and ``_stale[k]`` earlier occurrences of
    ``k`` that are no longer ready (discarded where they stood), which a walk steps over once.

        >>> ready = ReadyKeys(lambda key: {}, ["a", "b", "c"])
        >>> ready.discard_all(ready.first(2)); ready.add("d"); ready.put_first(["a"])
        >>> list(ready), ready.first(2)
        (['a', 'c', 'd'], ['a', 'c'])
    """

    def __init__(
        self, tag: Tag, keys: Iterable[str] = (), frozen_tag: Callable[[], Tag] | None = None
    ) -> None:
        self._tag = tag
        self._frozen_tag = frozen_tag  # the tags as they are now, kept as they are (a copy)
        self.front: dict[str, None] = {}
        self.keys: dict[str, None] = {}
        self._order: list[str] = []
        self._head = 0
        self._stale: dict[str, int] = {}
        self._stale_n = 0  # the stale occurrences in ``_order[_head:]``
        self.indexes: dict[tuple[str, int], GroupIndex] = {}
        self._append(keys)

    def __iter__(self) -> Iterator[str]:
        return itertools.chain(self.front, self.keys) if self.front else iter(self.keys)

    def __len__(self) -> int:
        return len(self.front) + len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys or key in self.front

    def contains_all(self, keys: Iterable[str]) -> bool:
        """Whether every one of ``keys`` is ready (C-speed passes)."""
        rest = list(itertools.filterfalse(self.keys.__contains__, keys))
        return not rest or self.front.keys() >= set(rest)

    def first(self, n: int) -> list[str]:
        """The first ``n`` ready keys (fewer when fewer are ready), at the cost of ``n``."""
        got = list(itertools.islice(self.front, n)) if self.front else []
        want = n - len(got)
        if want <= 0:
            return got
        order, stale = self._order, self._stale
        while stale and self._head < len(order) and order[self._head] in stale:  # stale ones in front
            self._step_over(order[self._head])
            self._head += 1
        run = order[self._head : self._head + want]
        if not stale or stale.keys().isdisjoint(run):  # (each a live key: the usual case)
            return got + run
        skip = dict(stale)
        for key in itertools.islice(order, self._head, None):
            if skip.get(key):  # (an earlier occurrence of a key that is ready further on, or not at all)
                skip[key] -= 1
                continue
            got.append(key)
            if len(got) == n:
                break
        return got

    def _step_over(self, key: str) -> None:
        self._stale_n -= 1
        left = self._stale[key] - 1
        if left:
            self._stale[key] = left
        else:
            del self._stale[key]

    def _append(self, keys: Iterable[str]) -> None:
        """``keys`` ready, at the end (none of them in ``front``; those in ``keys`` keep their place)."""
        added = dict.fromkeys(keys)
        before = len(self.keys)
        self.keys.update(added)
        grew = len(self.keys) - before
        if grew == len(added):  # (all new: the usual case, no lookup per key to find out)
            self._order.extend(added)
        elif grew:  # the new ones: the dict's last entries
            self._order.extend(reversed(list(itertools.islice(reversed(self.keys), grew))))

    def add(self, key: str) -> None:
        if key not in self.keys and key not in self.front:
            self.keys[key] = None
            self._order.append(key)
            for index in self.indexes.values():
                index.add(key)

    def discard(self, key: str) -> None:
        if self._remove(key):
            for index in self.indexes.values():
                index.discard(key)

    def _remove(self, key: str) -> bool:
        if self.keys.pop(key, 0) is None:
            self._stale[key] = self._stale.get(key, 0) + 1  # (its place in ``_order`` stays, stale)
            self._stale_n += 1
            if self._stale_n > TRIM_MIN and 4 * self._stale_n > len(self._order) - self._head:
                self._reorder()  # (a walk would step over too many: a big clear of ready keys)
            return True
        return self.front.pop(key, 0) is None

    def _reorder(self) -> None:
        """``_order`` made again from ``keys`` (one C-speed pass), with no stale occurrence."""
        self._order, self._head, self._stale, self._stale_n = list(self.keys), 0, {}, 0

    def extend(self, keys: Iterable[str]) -> None:
        """``add`` of each of ``keys``, in order (keys here already keep their place)."""
        if self.indexes or self.front:
            for key in keys:
                self.add(key)
            return
        self._append(keys)

    def discard_all(self, keys: list[str]) -> None:
        """``discard`` of each of ``keys`` (a take: when they are the first in ``_order``, its head
        moves past them; no call per key while no group index is kept)."""
        if self.indexes:
            for key in keys:
                self.discard(key)
            return
        head, n = self._head, len(keys)
        if (
            not self.front
            and self._order[head : head + n] == keys
            and (not self._stale or self._stale.keys().isdisjoint(keys))
        ):  # a take of the first keys (none of them a stale occurrence)
            self._head = head + n
            collections.deque(map(self.keys.pop, keys), 0)
            if self._head > TRIM_MIN and 2 * self._head > len(self._order):  # (one memmove, amortised)
                del self._order[: self._head]
                self._head = 0
            return
        for key in keys:
            self._remove(key)

    def put_first(self, keys: list[str]) -> None:
        back = [k for k in dict.fromkeys(keys) if k not in self]
        if back:
            self.front = {**dict.fromkeys(back), **self.front}  # (the front is small: given-back keys)
            for index in self.indexes.values():
                index.put_first(back)

    def replace(self, keys: Iterable[str]) -> None:
        """A new set of ready keys (a reset); group indexes are rebuilt when next asked for."""
        self.front, self.keys = {}, {}
        self._reorder()
        self._append(keys)
        self.indexes.clear()

    def drain(self, n: int) -> int:
        """Forget up to ``n`` keys (a dropped partition, freed in slices); how many went."""
        gone = shrink(self.front, n)
        gone += shrink(self.keys, n - gone)
        cut = min(n - gone, len(self._order))
        if cut:
            del self._order[len(self._order) - cut :]
        if not self._order:
            self._reorder()
        return gone + cut

    def retag(self, key: str) -> None:
        """``key``'s tags changed: file it under its group again."""
        if key in self:
            for index in self.indexes.values():
                index.discard(key)
                index.add(key)

    def groups(self, group_tag: str, size: int) -> GroupIndex:
        """The index of complete groups of ``(group_tag, size)``, built by one scan the first time;
        over more than ``GROUP_SLICE`` ready keys gathered in slices (``gather_some``), and until it
        is whole, ``StillGathering``."""
        index = self.indexes.get((group_tag, size))
        if index is None:
            big = len(self) > GROUP_SLICE
            if big:
                todo_tag = self._frozen_tag() if self._frozen_tag is not None else self._tag
                index = GroupIndex(group_tag, size, self._tag, list(self), todo_tag)
            else:
                index = GroupIndex(group_tag, size, self._tag)
            self.indexes[(group_tag, size)] = index
            if not big:
                for key in self:
                    index.add(key)
        if index.gathering:
            raise StillGathering
        return index

    def gathering(self) -> bool:
        """Whether a group index of these keys is being gathered."""
        return any(index.gathering for index in self.indexes.values())

    def gather_some(self) -> bool:
        """One slice of the group indexes being gathered; whether any work is left."""
        return any(index.gather_some() for index in self.indexes.values() if index.gathering)


__all__ = ["GROUP_SLICE", "GroupIndex", "ReadyKeys", "StillGathering"]
