"""One partition's keys, columnar: ``KeyTable``, key -> the fields it holds, with its tags and an
order that a listing can page through.

A million keys must cost little memory and nothing to the garbage collector, so no key has an
object of its own besides its name:

* ``_row``: key -> its row; ``_names`` / ``_held`` / ``_seqs``: per row its name, its field set and
  its sequence number (the order the keys came in; a key cleared and written again comes last);
* a field set is a ``frozenset`` interned per table (a million rows of the same fields share one),
  and a commit's transition from one set to a bigger one is remembered, so a commit costs a lookup;
* tags live in a dict of the keys that have one (``tag`` answers ``{}`` for the others).

None of these is a container per key, so a full collection has a handful of objects to look at,
whatever the table holds. A cleared key leaves a hole in its row; the rows are compacted when the
holes outnumber the keys (``settle``; holes at the front, the keys cleared first, are cut off
without renumbering anything), and the sequence numbers survive it, so a listing's cursor
(``page``: the next sequence number) stays valid across clears and compactions.

Plain class, no Ray (owned by ``server.index.records.PartMeta``).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from itertools import compress
from typing import Any, cast

COMPACT_MIN_HOLES = 4096  # holes tolerated before the rows are compacted (then: when they outnumber keys)

Tag = dict[str, Any]
NOTHING: frozenset[str] = frozenset()  # what a new key held before its first commit


def shrink(holder: set[str] | dict[str, Any], n: int) -> int:
    """Remove up to ``n`` items of ``holder`` (any ones); how many went."""
    take = min(n, len(holder))
    pop = holder.popitem if isinstance(holder, dict) else holder.pop
    for _ in range(take):
        pop()
    return take


class KeyTable(Mapping[str, frozenset[str]]):
    """A partition's keys in the order they came: key -> the fields it holds (a ``Mapping``), and
    its tag (``tag``)."""

    __slots__ = ("_row", "_base", "_names", "_held", "_seqs", "_next", "_tags", "_sets", "_grown")

    def __init__(self) -> None:
        self._row: dict[str, int] = {}  # key -> its row + _base (rows trimmed off the front shift _base)
        self._base = 0
        self._names: list[str | None] = []
        self._held: list[frozenset[str] | None] = []
        self._seqs = array("q")
        self._next = 0  # the next key's sequence number
        self._tags: dict[str, Tag] = {}
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self._grown: dict[tuple[frozenset[str], frozenset[str]], frozenset[str]] = {}

    # ---- Mapping ----------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> frozenset[str]:
        held = self._held[self._row[key] - self._base]
        assert held is not None  # (a live row's)
        return held

    def __contains__(self, key: object) -> bool:
        return key in self._row

    def __len__(self) -> int:
        return len(self._row)

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names if name is not None)

    def copy_names(self) -> list[str | None]:
        """The keys in order as they are now, None for a hole a cleared key left (one C-speed copy)."""
        return self._names[:]

    def copy_rows(self) -> tuple[list[str | None], list[frozenset[str] | None], dict[str, Tag]]:
        """Every row as it is now, copied at C speed (no step per key): names and field sets in
        order, None for a hole a cleared key left; and the tags by key (a key's tag is replaced,
        never changed, so these stay as they are now)."""
        return self._names[:], self._held[:], dict(self._tags)

    def having(self, fields: AbstractSet[str]) -> Iterable[str]:
        """The keys that hold every one of ``fields``, in order (a walk at C speed: one test per
        distinct field set, not per key; when every key does, the key -> row dict itself, which
        ``dict.fromkeys`` copies sized at once)."""
        ok = {held for held in self._sets if fields <= held}
        if len(ok) == len(self._sets):
            return self._row  # (its order is the rows' order: both append, and compaction keeps it)
        return compress(self._names, map(ok.__contains__, self._held))  # type: ignore[arg-type]

    @property
    def next_seq(self) -> int:
        """The sequence number the next new key gets."""
        return self._next

    def seq_of(self, key: str) -> int:
        return self._seqs[self._row[key] - self._base]

    def scan(self, fields: AbstractSet[str], start: int, end: int, limit: int) -> tuple[list[str], int]:
        """The keys of sequence numbers ``start`` <= n < ``end`` that hold every one of ``fields``,
        looking at ``limit`` rows at most, and the sequence number to go on from (``end``: done)."""
        seqs = self._seqs
        at = bisect_left(seqs, start)
        stop = bisect_left(seqs, end, at, min(len(seqs), at + limit))
        ok = {held for held in self._sets if fields <= held}
        keys = compress(self._names[at:stop], map(ok.__contains__, self._held[at:stop]))
        return cast(list[str], list(keys)), min(end, seqs[stop] if stop < len(seqs) else self._next)

    def field_sets(self) -> set[frozenset[str]]:
        """The distinct field sets the keys hold."""
        return {held for held in set(self._held) if held is not None}

    # ---- tags -------------------------------------------------------------------------------------
    def tag(self, key: str) -> Tag:
        """``key``'s tag (read-only; ``{}`` when it has none)."""
        return self._tags.get(key) or {}

    def frozen_tag(self) -> Callable[[str], Tag]:
        """``tag`` as it answers now, whatever changes later (a shallow copy: a key's tag is replaced,
        never changed)."""
        tags = dict(self._tags)
        return lambda key: tags.get(key) or {}

    def tagged(self) -> bool:
        return bool(self._tags)

    # ---- changes ----------------------------------------------------------------------------------
    def intern(self, fields: frozenset[str]) -> frozenset[str]:
        """The table's own copy of ``fields`` (one object per distinct set)."""
        return self._sets.setdefault(fields, fields)

    def _grow(self, held: frozenset[str], fields: frozenset[str]) -> frozenset[str]:
        grown = self._grown.get((held, fields))
        if grown is None:
            grown = self._grown[(held, fields)] = self.intern(held | fields)
        return grown

    def commit(
        self, keys: list[str], fields: frozenset[str], tags: list[Tag | None] | None
    ) -> tuple[list[str], list[frozenset[str]], list[str], set[frozenset[str]]]:
        """``keys`` (distinct) now hold ``fields`` too, and ``tags[i]`` merged into key i's tag: new
        keys come last. Returns the keys whose fields grew, in order, with what each held before
        (nothing, for a new key; two lists, no object per key, so a commit leaves nothing for the
        garbage collector), the keys that existed and got a tag, and the distinct field sets the keys
        hold now."""
        fields = self.intern(fields)
        row, names, held_at, seqs, base = self._row, self._names, self._held, self._seqs, self._base
        grew: list[str] = []
        before: list[frozenset[str]] = []
        sets: set[frozenset[str]] = set()
        existed: set[str] = set()  # (for ``retagged``: keys distinct, so found here means here before)
        tagging = tags is not None
        added = 0
        for key in keys:
            at = row.get(key)
            if at is None:
                row[key] = base + len(names)
                names.append(key)
                held_at.append(fields)
                seqs.append(self._next + added)
                added += 1
                if fields:
                    grew.append(key)
                    before.append(NOTHING)
                continue
            if tagging:
                existed.add(key)
            held = held_at[at - base]
            assert held is not None
            if held is not fields and not fields <= held:
                held_at[at - base] = now = self._grow(held, fields)
                grew.append(key)
                before.append(held)
                held = now
            sets.add(held)
        if added:
            self._next += added
            sets.add(fields)
        retagged: list[str] = []
        if tags is not None:
            for key, tag in zip(keys, tags, strict=True):
                if tag:
                    old = self._tags.get(key)  # (replaced, never changed: ``copy_rows`` copies shallow)
                    self._tags[key] = dict(tag) if old is None else {**old, **tag}
                    if key in existed:
                        retagged.append(key)
        return grew, before, retagged, sets

    def remove(self, key: str) -> bool:
        """Forget ``key`` (its row becomes a hole; ``settle`` after a batch of these); whether it was here."""
        at = self._row.pop(key, None)
        if at is None:
            return False
        self._names[at - self._base] = None
        self._held[at - self._base] = None
        self._tags.pop(key, None)
        return True

    def settle(self) -> None:
        """After removals: the holes at the front are cut off (the oldest keys are the ones usually
        cleared: no renumbering, one move of the rows), and the rows compacted when the holes left
        outnumber the keys."""
        names = self._names
        front = 0
        while front < len(names) and names[front] is None:
            front += 1
        if front:
            del names[:front], self._held[:front], self._seqs[:front]
            self._base += front
        holes = len(names) - len(self._row)
        if holes >= COMPACT_MIN_HOLES and holes > len(self._row):
            self._compact()

    def _compact(self) -> None:
        """Drop the holes; rows renumbered, sequence numbers kept."""
        keep = [i for i, name in enumerate(self._names) if name is not None]
        self._names = [self._names[i] for i in keep]
        self._held = [self._held[i] for i in keep]
        self._seqs = array("q", (self._seqs[i] for i in keep))
        self._row = {name: i for i, name in enumerate(self._names) if name is not None}
        self._base = 0

    def restore(self, keys: list[str], sets: list[frozenset[str]], held: list[int], tags: list[Tag]) -> None:
        """Append ``keys``, each holding ``sets[held[i]]``, with ``tags`` (empty: none), in order (a
        checkpoint's load), at C speed; ``ValueError`` when a key is already here or repeats (the
        table is then to be dropped), ``IndexError`` when a key names no set."""
        before, start = len(self._row), self._base + len(self._names)
        self._row.update(zip(keys, range(start, start + len(keys)), strict=True))
        if len(self._row) - before != len(keys):
            raise ValueError("a key repeats")
        self._names.extend(keys)
        self._held.extend(map([self.intern(fields) for fields in sets].__getitem__, held))
        self._seqs.extend(range(self._next, self._next + len(keys)))
        self._next += len(keys)
        self._tags.update(compress(zip(keys, tags, strict=True), tags))

    def drain(self, n: int) -> int:
        """Forget up to ``n`` keys, the last ones first (a dropped table freed in slices); how many went."""
        take = shrink(self._row, n)
        shrink(self._tags, n)
        cut = take if self._row else len(self._names)  # (the last slice takes the holes too)
        if cut:
            del self._names[-cut:], self._held[-cut:], self._seqs[-cut:]
        return take

    # ---- paging -----------------------------------------------------------------------------------
    def names_from(self, start: int, limit: int) -> tuple[list[str | None], int | None]:
        """The keys of ``limit`` rows from sequence number ``start`` on, in order (None for a hole a
        cleared key left), and the sequence number to go on from (None: none left)."""
        names, seqs = self._names, self._seqs
        at = bisect_left(seqs, start)
        stop = min(len(names), at + limit)
        return names[at:stop], (seqs[stop] if stop < len(names) else None)

    def page(self, start: int, limit: int) -> tuple[dict[str, Tag], int | None]:
        """Up to ``limit`` keys (with their tags) from sequence number ``start`` on, in order, and the
        sequence number to go on from (None: none left). Costs what it returns, plus the holes."""
        names, seqs, tags = self._names, self._seqs, self._tags
        at, end = bisect_left(seqs, start), len(names)
        out: dict[str, Tag] = {}
        while at < end and len(out) < limit:  # (one pass unless holes take part of a slice)
            stop = min(end, at + limit - len(out))
            chunk = [name for name in names[at:stop] if name is not None]
            if tags:
                out.update((name, dict(tags.get(name) or {})) for name in chunk)
            else:
                out.update((name, {}) for name in chunk)
            at = stop
        while at < end and names[at] is None:
            at += 1
        return out, (seqs[at] if at < end else None)


__all__ = ["COMPACT_MIN_HOLES", "NOTHING", "KeyTable", "shrink"]
