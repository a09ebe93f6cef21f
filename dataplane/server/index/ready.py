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

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dataplane.samplers import group_id

Tag = Callable[[str], dict[Any, Any]]


class GroupIndex:
    """Ready keys by group, and the groups holding at least ``size`` of them, in the order they
    became complete (a group given back is first in line again)."""

    def __init__(self, group_tag: str, size: int, tag: Tag) -> None:
        self.group_tag = group_tag
        self.size = size
        self._tag = tag
        self.members: dict[Any, dict[str, None]] = {}  # gid -> its ready keys, in ready order
        self.gid: dict[str, Any] = {}  # key -> gid (as filed: a later tag change re-files it)
        self.complete: dict[Any, None] = {}  # gids with >= size ready keys, in completion order

    def add(self, key: str) -> None:
        gid = self.gid[key] = group_id(self._tag(key), self.group_tag, key)
        members = self.members.get(gid)
        if members is None:
            members = self.members[gid] = {}
        members[key] = None
        if len(members) == self.size:
            self.complete[gid] = None

    def discard(self, key: str) -> None:
        gid = self.gid.pop(key, None)
        if gid is None:
            return
        members = self.members[gid]
        del members[key]
        if len(members) < self.size:
            self.complete.pop(gid, None)
            if not members:
                del self.members[gid]

    def put_first(self, keys: list[str]) -> None:
        """``keys`` are ready again, first in line: in their groups, and their groups among the complete."""
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
    """The keys ready for one stream: ordered, with O(1) add / discard / membership, and the group
    indexes samplers asked for kept current."""

    def __init__(self, tag: Tag, keys: Iterable[str] = ()) -> None:
        self._tag = tag
        self.keys: dict[str, None] = dict.fromkeys(keys)
        self.indexes: dict[tuple[str, int], GroupIndex] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def add(self, key: str) -> None:
        if key not in self.keys:
            self.keys[key] = None
            for index in self.indexes.values():
                index.add(key)

    def discard(self, key: str) -> None:
        if self.keys.pop(key, 0) is None:
            for index in self.indexes.values():
                index.discard(key)

    def extend(self, keys: Iterable[str]) -> None:
        """``add`` of each of ``keys``, in order (keys here already keep their place)."""
        if self.indexes:
            for key in keys:
                self.add(key)
            return
        self.keys.update(dict.fromkeys(keys))

    def discard_all(self, keys: list[str]) -> None:
        """``discard`` of each of ``keys`` (a take: no call per key while no group index is kept)."""
        if self.indexes:
            for key in keys:
                self.discard(key)
            return
        pop = self.keys.pop
        for key in keys:
            pop(key, None)

    def put_first(self, keys: list[str]) -> None:
        back = [k for k in dict.fromkeys(keys) if k not in self.keys]
        if back:
            self.keys = {**dict.fromkeys(back), **self.keys}
            for index in self.indexes.values():
                index.put_first(back)

    def replace(self, keys: Iterable[str]) -> None:
        """A new set of ready keys (a reset); group indexes are rebuilt when next asked for."""
        self.keys = dict.fromkeys(keys)
        self.indexes.clear()

    def retag(self, key: str) -> None:
        """``key``'s tags changed: file it under its group again."""
        if key in self.keys:
            for index in self.indexes.values():
                index.discard(key)
                index.add(key)

    def groups(self, group_tag: str, size: int) -> GroupIndex:
        """The index of complete groups of ``(group_tag, size)``, built by one scan the first time."""
        index = self.indexes.get((group_tag, size))
        if index is None:
            index = self.indexes[(group_tag, size)] = GroupIndex(group_tag, size, self._tag)
            for key in self.keys:
                index.add(key)
        return index


__all__ = ["GroupIndex", "ReadyKeys"]
