"""Readiness and consumption of one partition's rows, per consumer task (the index's streaming state).

A *stream* is one consumer task reading one set of fields. Its ``ready`` dict holds the keys that
hold every one of those fields and that the task has not consumed, in the order the puts made them
ready. The commit that completes a row appends it to every stream waiting for those fields
(``on_commit``: no extra round trip from the writer, and no scan); a stream is filled by one scan of
the partition only when a task first asks for a new set of fields. So a ``next`` call costs what
its sampler looks at (for the built-ins, about the batch size), however many rows the partition or
any other partition holds.

Plain class, no Ray, no sockets: ``IndexCore`` owns one per partition and the index actor does the
waiting (``server.index.actor``).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from dataplane.errors import WireError
from dataplane.samplers import ReadyRows, Sampler, SequentialSampler
from dataplane.server.index.keytable import KeyTable, shrink
from dataplane.server.index.ready import ReadyKeys, StillGathering
from dataplane.wire.protocol import ConsumptionReply, TaskProgress

RANK_CACHE = 256  # rank-aware results kept per task (batch_index entries), oldest dropped first
TAKE_MEMORY = 4096  # takes remembered per task (take id -> keys), oldest dropped first
BUILD_SLICE = 8192  # a new stream over more keys is gathered this many rows at a time, between requests
# (one over fewer at once: a few milliseconds, and its first take answered in the same call)


@dataclass
class Build:
    """A new stream's ready keys gathered from a big partition a slice at a time, between requests
    (``PartitionStreams.build_some``): the walk is at ``cursor`` (a sequence number of the partition's
    keys); keys from ``end`` on came after the stream was asked for. A key that becomes ready where
    the walk will not look (behind it, or past ``end``) waits in ``late``, to come after the walk's."""

    cursor: int
    end: int
    late: dict[str, None] = field(default_factory=dict)


@dataclass
class Stream:
    fields: frozenset[str]
    ready: ReadyKeys
    build: Build | None = None  # while its ready keys are being gathered (sequential takes only)


@dataclass
class Lease:
    """A leased take: its keys not yet acknowledged, and when they go back to the task."""

    keys: dict[str, None]
    deadline: float  # time.monotonic()


Tag = Callable[[str], dict[Any, Any]]  # a key's tag (read-only)


def _no_tag(key: str) -> dict[Any, Any]:
    return {}


Slot = tuple[frozenset[str], int | None, int | None]  # a rank-aware call's (fields, dp_rank, batch_index)


@dataclass
class Task:
    consumed: set[str] = field(default_factory=set)
    streams: dict[frozenset[str], Stream] = field(default_factory=dict)
    cache: OrderedDict[Slot, list[str]] = field(default_factory=OrderedDict)
    # The last TAKE_MEMORY takes (id -> keys): a call its consumer gave up on is given back by id, and
    # a retry of a take gets the same keys. Tuples: the collector stops tracking a tuple of strings at
    # its first look, where a list would be walked by each collection until the heap is frozen (a
    # second of takes of 1,000 held half a million keys in lists). Leases (id -> Lease) are kept until
    # acknowledged or due; ``leased`` maps each key under a lease to its take.
    takes: OrderedDict[str, tuple[str, ...]] = field(default_factory=OrderedDict)
    leases: dict[str, Lease] = field(default_factory=dict)
    leased: dict[str, str] = field(default_factory=dict)
    # When it last took or acknowledged rows here, or first asked for some (time.monotonic()).
    active: float = field(default_factory=time.monotonic)
    # Snapshots of ``consumed`` being read (checkpoint saves): told of each change before it is made.
    frozen: list[ConsumedAt] = field(default_factory=list)

    def changing(self, keys: Iterable[str]) -> None:
        """``keys``' membership in ``consumed`` is about to change (call only when ``frozen``)."""
        for at in self.frozen:
            at.note(keys)

    def replace_consumed(self) -> None:
        """``consumed`` emptied at once: a new set when a snapshot is reading the old one."""
        if self.frozen:
            for at in self.frozen:
                at.detach()
            self.consumed = set()
        else:
            self.consumed.clear()


class ConsumedAt:
    """A task's consumed keys as they were at one instant, read a slice at a time while the task goes
    on (a checkpoint's snapshot: copying a set of a million keys took 35 ms on an idle machine, 190
    under load, in one step of the index). Until ``close``, the task tells it each key whose
    membership is about to change (``note``), and it keeps the membership that key had; once the
    task's set is replaced whole (``detach``: a reset, a dropped partition), it keeps the old set,
    which no longer changes, and needs no more notes.

        >>> task = Task(consumed={"a", "b"})
        >>> at = ConsumedAt(task)
        >>> task.changing(["b", "c"]); task.consumed.discard("b"); task.consumed.add("c")
        >>> at.read(["a", "b", "c", None])
        ['a', 'b']
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.was: dict[str, bool] = {}
        self.base: set[str] | None = None
        task.frozen.append(self)

    def note(self, keys: Iterable[str]) -> None:
        if self.base is None:
            consumed, was = self.task.consumed, self.was
            for key in keys:
                if key not in was:
                    was[key] = key in consumed

    def detach(self) -> None:
        if self.base is None:
            self.base = self.task.consumed

    def read(self, names: list[str | None]) -> list[str]:
        """Which of ``names`` (keys of the partition at the instant; None: a hole) were consumed then
        (C-speed passes over the slice, no step per key)."""
        live = self.task.consumed if self.base is None else self.base
        was = self.was
        now = itertools.compress(names, map(live.__contains__, names))
        got: list[Any] = list(itertools.filterfalse(was.__contains__, now))
        if was:
            got.extend(filter(was.get, names))
        return got

    def close(self) -> None:
        """Stop being told of changes (idempotent)."""
        if self in self.task.frozen:
            self.task.frozen.remove(self)


class PartitionStreams:
    """The streaming state of one partition; ``keys`` is the index's key -> fields mapping (a
    ``KeyTable``), ``tag`` answers a key's tag."""

    def __init__(self, keys: Mapping[str, AbstractSet[str]], tag: Tag | None = None) -> None:
        self.keys = keys
        self._table = keys if isinstance(keys, KeyTable) else None
        self._tag_of: Tag = tag or _no_tag
        # The keys holding every one of some fields, in order (a KeyTable's walk runs at C speed).
        self._having: Callable[[AbstractSet[str]], Iterable[str]] = (
            self._scan if self._table is None else self._table.having
        )
        self.tasks: dict[str, Task] = {}
        self.by_fields: dict[frozenset[str], list[tuple[Task, Stream]]] = {}
        self.building: list[tuple[Task, Stream]] = []  # streams being gathered (``build_some``), oldest first
        self.finished = False

    # ---- updates from writers -------------------------------------------------------------------
    def on_commit(self, key: str, before: AbstractSet[str], now: AbstractSet[str]) -> None:
        """``key`` now holds ``now`` (it held ``before``): append it to streams it just became ready for."""
        if not self.by_fields or len(now) == len(before):
            return
        for fields, streams in self.by_fields.items():
            if fields <= now and not fields <= before:
                for task, stream in streams:
                    if key in task.consumed:
                        continue
                    build = stream.build
                    if build is None:
                        stream.ready.add(key)
                    elif self._table is not None and not build.cursor <= self._table.seq_of(key) < build.end:
                        build.late[key] = None  # (else: the walk will find it)

    def on_new(self, keys: list[str], now: frozenset[str]) -> None:
        """``keys``, new, hold ``now``: ``on_commit`` of each, at once (no call per key)."""
        for fields, streams in self.by_fields.items():
            if fields <= now:
                for task, stream in streams:
                    fresh = itertools.filterfalse(task.consumed.__contains__, keys) if task.consumed else keys
                    if stream.build is None:
                        stream.ready.extend(fresh)
                    else:  # (new keys come after the walk's end)
                        stream.build.late.update(dict.fromkeys(fresh))

    def on_clear(self, key: str) -> None:
        for task in self.tasks.values():
            if task.frozen:
                task.changing((key,))
            task.consumed.discard(key)
            for stream in task.streams.values():
                stream.ready.discard(key)
                if stream.build is not None:
                    stream.build.late.pop(key, None)
            take = task.leased.pop(key, None)
            if take is not None:
                lease = task.leases[take]
                del lease.keys[key]
                if not lease.keys:
                    del task.leases[take]

    # ---- consumers -----------------------------------------------------------------------------
    def stream(self, task_name: str, fields: frozenset[str]) -> tuple[Task, Stream]:
        task = self.tasks.get(task_name)
        if task is None:
            task = self.tasks[task_name] = Task()
        stream = task.streams.get(fields)
        if stream is None:  # first ask for these fields: one scan, then commits keep it current
            if self._table is not None and len(self._table) > BUILD_SLICE:  # a slice at a time
                stream = Stream(
                    fields, ReadyKeys(self._tag, (), self._frozen_tag), Build(0, self._table.next_seq)
                )
                self.building.append((task, stream))
            else:
                ready = self._having(fields)
                if task.consumed:
                    ready = itertools.filterfalse(task.consumed.__contains__, ready)
                stream = Stream(fields, ReadyKeys(self._tag, ready, self._frozen_tag))
            task.streams[fields] = stream
            self.by_fields.setdefault(fields, []).append((task, stream))
        return task, stream

    def build_some(self, n: int = BUILD_SLICE) -> tuple[bool, bool]:
        """Gather the ready keys of the oldest stream being built from up to ``n`` more rows; whether
        there was one, and whether it is complete now (its waiting consumers may take)."""
        while self.building:
            task, stream = self.building[0]
            build = stream.build
            if task.streams.get(stream.fields) is not stream or (
                build is None and not stream.ready.gathering()
            ):
                self.building.pop(0)  # (reset, or restored from a checkpoint, meanwhile)
                continue
            if build is None:  # a group index of its ready keys (``ReadyKeys.groups``)
                if stream.ready.gather_some():
                    return True, False
            else:
                assert self._table is not None  # (only a KeyTable's streams are gathered in slices)
                keys, build.cursor = self._table.scan(stream.fields, build.cursor, build.end, n)
                stream.ready.extend(itertools.filterfalse(task.consumed.__contains__, keys))
                if build.cursor < build.end:
                    return True, False
                stream.ready.extend(build.late)
                stream.build = None
            self.building.pop(0)
            return True, True
        return False, False

    def build_all(self) -> None:
        """Complete every stream being built (a checkpoint's snapshot, a claim: they need them whole)."""
        while self.building:
            self.build_some(1 << 62)

    def _scan(self, fields: AbstractSet[str]) -> Iterator[str]:
        return (k for k, held in self.keys.items() if fields <= held)

    def _tag(self, key: str) -> dict[Any, Any]:
        return self._tag_of(key)

    def _frozen_tag(self) -> Tag:
        """The tags as they are now, kept as they are (a group index gathered in slices files its
        first keys by them)."""
        return self._table.frozen_tag() if self._table is not None else self._tag

    def on_retag(self, key: str) -> None:
        """``key``'s tags changed: streams that index ready rows by group file it again."""
        for task in self.tasks.values():
            for stream in task.streams.values():
                if stream.ready.indexes:
                    stream.ready.retag(key)

    def rows(self, stream: Stream) -> ReadyRows:
        return ReadyRows(stream.ready, self._tag, stream.ready.groups)

    def take(
        self,
        task_name: str,
        fields: frozenset[str],
        sampler: Sampler,
        batch_size: int,
        dp_rank: int | None,
        dp_size: int | None,
        batch_index: int | None,
        take: str | None = None,
        lease_deadline: float | None = None,
    ) -> tuple[list[str], str | None] | None:
        """The keys this call gets (marked consumed) and the take they are held under (leased ones
        until ``lease_deadline``), or None to wait for more rows."""
        task, stream = self.stream(task_name, fields)
        if take is not None and take in task.takes:
            return list(task.takes[take]), take if take in task.leases else None  # a retry: the same keys
        slot = (fields, dp_rank, batch_index)
        if dp_rank is not None and batch_index is not None and slot in task.cache:
            keys = task.cache[slot]  # a peer of this DP rank (TP/PP) asked first: the same keys
            return keys, next((t for t in map(task.leased.get, keys[:1]) if t is not None), None)
        if stream.build is not None and not (
            type(sampler) is SequentialSampler and len(stream.ready) >= batch_size
        ):  # its ready keys are still being gathered: wait, unless the walk has found enough
            return None  # (the walk goes in ready order, so its first rows are the whole stream's)
        final = stream.build is None and self.drained(task, fields)  # (a short batch: once whole)
        try:
            choice = sampler.sample(
                self.rows(stream), batch_size, dp_rank=dp_rank, dp_size=dp_size, finished=final
            )
        except StillGathering:  # its group index is gathered in slices (``build_some``): wait
            if (task, stream) not in self.building:
                self.building.append((task, stream))
            return None
        if choice is None or (not choice and not final):
            return None
        parts: dict[Any, list[str]] = choice if isinstance(choice, dict) else {dp_rank: list(choice)}
        chosen = next(iter(parts.values())) if len(parts) == 1 else [k for p in parts.values() for k in p]
        if type(sampler) is not SequentialSampler:  # (its rows are the ready dict's first: no check)
            self._check_ready(stream, chosen, type(sampler).__name__)
        mine = parts.get(dp_rank, [])
        if len(mine) > batch_size:
            raise WireError(
                f"sampler {type(sampler).__name__} returned {len(mine)} keys for a batch of {batch_size}"
            )
        self.consume(task, chosen)
        if batch_index is not None:
            for rank, keys in parts.items():
                if rank is not None:
                    self._remember(task, (fields, rank, batch_index), keys)
        return mine, self._record(task, take, mine, lease_deadline)

    def claim(
        self,
        task_name: str,
        fields: frozenset[str],
        keys: list[str],
        dp_rank: int | None,
        batch_index: int | None,
        take: str | None = None,
        lease_deadline: float | None = None,
    ) -> tuple[list[str], str | None]:
        """Mark ``keys`` (chosen by a client-side sampler) consumed; all must be ready for the task."""
        task, stream = self.stream(task_name, fields)
        if take is not None and take in task.takes:
            return list(task.takes[take]), take if take in task.leases else None  # a retry of the same claim
        if stream.build is not None:
            self.build_all()
        self._check_ready(stream, keys, "the sampler")
        self.consume(task, keys)
        if dp_rank is not None and batch_index is not None:
            self._remember(task, (fields, dp_rank, batch_index), keys)
        return keys, self._record(task, take, keys, lease_deadline)

    @staticmethod
    def _record(task: Task, take: str | None, keys: list[str], lease_deadline: float | None) -> str | None:
        """Remember what ``take`` got, and lease it until ``lease_deadline``; returns the take id when
        the keys are leased (None otherwise)."""
        if take is None:
            return None
        task.takes[take] = tuple(keys)
        while len(task.takes) > TAKE_MEMORY:
            old, _ = task.takes.popitem(last=False)
            lease = task.leases.get(old)
            if lease is not None and not lease.keys:
                del task.leases[old]
        if lease_deadline is None or not keys:
            return None
        task.leases[take] = Lease(dict.fromkeys(keys), lease_deadline)
        for key in keys:
            task.leased[key] = take
        return take

    def drained(self, task: Task, fields: frozenset[str]) -> bool:
        """No more rows will come for ``task`` reading ``fields``: the partition is finished and no row
        that would be ready for them is leased (a lease that runs out gives its rows back)."""
        if not self.finished:
            return False
        return not any(fields <= self.keys[k] for k in task.leased if k in self.keys)

    # ---- giving back and acknowledging ------------------------------------------------------------
    def release(self, task_name: str, take: str) -> int | None:
        """Give back what ``take`` got and has not acknowledged: its consumer gave up on the call, or
        lets the lease go. A leased take gives back only the keys still leased under it: acknowledged
        ones stay taken, and ones whose lease ran out went back already (and may be another take's
        now). Returns how many keys went back (those a rank-aware slot holds stay with it), or None
        when the task holds no such take."""
        task = self.tasks.get(task_name)
        if task is None:
            return None
        keys: Sequence[str] | None = task.takes.pop(take, None)
        lease = task.leases.pop(take, None)
        if lease is not None:
            keys = list(lease.keys)
            for key in keys:
                del task.leased[key]
        if keys is None:
            return None
        return self.unconsume(task_name, keys)

    def ack(self, task_name: str, take: str, keys: list[str]) -> list[str]:
        """``keys`` of leased ``take`` are done with: taken for good. Returns the keys whose lease had
        run out before this (given back to the task, maybe delivered again since)."""
        task = self.tasks.get(task_name)
        if task is None:
            return list(keys)
        lease = task.leases.get(take)
        got = task.takes.get(take, ())
        late = []
        for key in keys:
            if task.leased.get(key) == take:
                del task.leased[key]
                del lease.keys[key]  # type: ignore[union-attr]
            elif key not in got or key not in task.consumed or key in task.leased:
                late.append(key)  # (else: this take acknowledged it before)
        # A lease acknowledged in full stays filed (empty) until it is released, runs out or its take is
        # forgotten: a release after the ack then finds it and gives back nothing.
        return late

    def expire(self, task_name: str, take: str, now: float) -> int:
        """Give back the unacknowledged keys of ``take`` if its lease is due; how many went back. A
        rank-aware slot holding them lets them go too: its consumer is gone."""
        task = self.tasks.get(task_name)
        lease = None if task is None else task.leases.get(take)
        if task is None or lease is None or lease.deadline > now:
            return 0
        if not lease.keys:  # acknowledged in full: nothing goes back, and the take stays filed
            del task.leases[take]
            return 0
        keys = set(lease.keys)
        for slot in [s for s, held in task.cache.items() if keys.intersection(held)]:
            del task.cache[slot]
        return self.release(task_name, take) or 0

    def cached(
        self, task_name: str, fields: frozenset[str], dp_rank: int | None, batch_index: int | None
    ) -> list[str] | None:
        task = self.tasks.get(task_name)
        if task is None or dp_rank is None or batch_index is None:
            return None
        return task.cache.get((fields, dp_rank, batch_index))

    @staticmethod
    def _check_ready(stream: Stream, keys: list[str], who: str) -> None:
        chosen = set(keys)
        if len(chosen) != len(keys):
            raise WireError(f"{who} chose a key twice")
        ready = stream.ready
        if not ready.contains_all(chosen):  # (C-level passes; the list below only on a refusal)
            bad = [k for k in keys if k not in ready]
            raise WireError(
                f"{who} chose {len(bad)} key(s) that are not ready for this task (not all of "
                f"{sorted(stream.fields)} written, already consumed, or unknown): {bad[:5]}"
            )

    @staticmethod
    def _remember(task: Task, slot: Slot, keys: list[str]) -> None:
        task.cache[slot] = keys
        while len(task.cache) > RANK_CACHE:
            task.cache.popitem(last=False)

    def consume(self, task: Task, keys: list[str]) -> None:
        if task.frozen:
            task.changing(keys)
        task.consumed.update(keys)
        for stream in task.streams.values():
            stream.ready.discard_all(keys)
            if stream.build is not None and stream.build.late:
                for key in keys:
                    stream.build.late.pop(key, None)

    def unconsume(self, task_name: str, keys: Iterable[str]) -> int:
        """Give back keys whose batch never reached its consumer's code; how many went back.

        Keys a rank-aware call took stay with their ``(dp_rank, batch_index)`` slot instead: a TP/PP
        peer of that slot may already hold them, and a peer (or a replacement) asking that slot again
        gets them again; given back, another rank could take them too.
        """
        task = self.tasks.get(task_name)
        if task is None:
            return 0
        held = {k for slot_keys in task.cache.values() for k in slot_keys} if task.cache else set()
        keys = [k for k in keys if k not in held and k in task.consumed and k not in task.leased]
        if not keys:
            return 0
        if task.frozen:
            task.changing(keys)
        task.consumed.difference_update(keys)
        for stream in task.streams.values():
            back = [k for k in keys if k in self.keys and stream.fields <= self.keys[k]]
            if back:  # first in line again
                stream.ready.put_first(back)
        return len(keys)

    def reset(self, task_name: str | None) -> None:
        """Every row readable again for ``task_name`` (all tasks when None); a big partition's streams
        are gathered again in slices (``build_some``), as a new stream's are."""
        names = list(self.tasks) if task_name is None else [task_name]
        for name in names:
            task = self.tasks.get(name)
            if task is None:
                continue
            task.replace_consumed()
            task.cache.clear()
            task.takes.clear()
            task.leases.clear()
            task.leased.clear()
            for stream in task.streams.values():
                if self._table is not None and len(self._table) > BUILD_SLICE:  # gathered again in slices
                    stream.ready.replace(())
                    stream.build = Build(0, self._table.next_seq)
                    self.building.append((task, stream))
                else:
                    stream.ready.replace(self._having(stream.fields))
                    stream.build = None

    # ---- a dropped partition, freed in slices (``IndexRecords.free_some``) -------------------------
    def drain(self, n: int) -> int:
        """Forget up to about ``n`` keys of the streaming state; how many went (0: it is empty)."""
        gone = 0
        for task in self.tasks.values():
            if task.frozen:  # (a snapshot reads the set: it is left whole, to go when the snapshot does)
                task.replace_consumed()
            holders: list[Any] = [task.consumed, task.leased]
            for stream in task.streams.values():
                holders.append(stream.ready)
                holders.extend(index.gid for index in stream.ready.indexes.values())
            for holder in holders:
                gone += holder.drain(n - gone) if isinstance(holder, ReadyKeys) else shrink(holder, n - gone)
                if gone >= n:
                    return gone
        self.tasks.clear()  # (what is left holds no more than the takes and caches it remembers)
        self.by_fields.clear()
        return gone

    # ---- checkpoints (server.index.checkpoint) --------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        """This partition's streaming state as plain values (msgpack, no pickle): per task the keys
        it took (a ``ConsumedAt``, to be read against the partition's keys as they are now, and
        closed), each stream's ready keys in ready order, the rank-aware cache, the takes it
        remembers and its leases (unacknowledged keys, seconds left at ``now``); and ``finished``.
        ``restore`` of it answers ``take``, ``cached``, ``ack`` and ``counts`` exactly as this one does."""
        self.build_all()
        return {
            "finished": self.finished,
            "tasks": [
                {
                    "name": name,
                    "consumed": ConsumedAt(task),
                    "streams": [
                        {"fields": sorted(s.fields), "ready": list(s.ready)} for s in task.streams.values()
                    ],
                    "cache": [[sorted(slot[0]), slot[1], slot[2], keys] for slot, keys in task.cache.items()],
                    "takes": [[take, keys] for take, keys in task.takes.items()],
                    "leases": [
                        [take, list(lease.keys), max(0.0, lease.deadline - now)]
                        for take, lease in task.leases.items()
                    ],
                }
                for name, task in self.tasks.items()
            ],
        }

    def restore(self, state: dict[str, Any], now: float) -> None:
        """Replace the streaming state with a ``snapshot()`` taken of these keys; leases run out the
        seconds they had left, from ``now``. ``ValueError`` (or ``KeyError`` / ``TypeError`` for a
        malformed one) when a stream or a lease names a key that is not here."""
        tasks: dict[str, Task] = {}
        by_fields: dict[frozenset[str], list[tuple[Task, Stream]]] = {}
        for t in state["tasks"]:
            task = tasks[str(t["name"])] = Task(consumed=set(t["consumed"]))
            for s in t["streams"]:
                fields = frozenset(s["fields"])
                unknown = [k for k in s["ready"] if k not in self.keys]
                if unknown:
                    raise ValueError(
                        f"task {t['name']!r} has {len(unknown)} unknown ready key(s): {unknown[:3]}"
                    )
                stream = task.streams[fields] = Stream(
                    fields, ReadyKeys(self._tag, s["ready"], self._frozen_tag)
                )
                by_fields.setdefault(fields, []).append((task, stream))
            for fields, rank, index, keys in t["cache"]:
                task.cache[(frozenset(fields), rank, index)] = list(keys)
            for take, keys in t.get("takes", ()):
                task.takes[str(take)] = tuple(keys)
            for take, keys, left in t.get("leases", ()):
                bad = [k for k in keys if k not in task.consumed]
                if bad:
                    raise ValueError(f"task {t['name']!r} leases key(s) it has not taken: {bad[:3]}")
                task.leases[str(take)] = Lease(dict.fromkeys(keys), now + float(left))
                task.leased.update(dict.fromkeys(keys, str(take)))
        self.tasks, self.by_fields, self.finished = tasks, by_fields, bool(state["finished"])
        self.building = []

    def progress(self) -> Iterator[tuple[str, int, int, int, Stream | None]]:
        """Each consumer task's progress, in O(1) per task: its name, rows taken (leased ones
        included), rows ready for the fields it asked for last and not taken (its lag), rows leased
        and not acknowledged, and the stream of those fields."""
        for name, task in self.tasks.items():
            stream = next(reversed(task.streams.values()), None)
            ready = 0 if stream is None else len(stream.ready)
            yield name, len(task.consumed), ready, len(task.leased), stream

    def overview(self, now: float) -> dict[str, TaskProgress]:
        """``progress`` by task, with the fields each waits for and how long before ``now`` it last took
        or acknowledged rows (or first asked), the ``tasks`` reply's."""
        return {
            name: TaskProgress(
                taken,
                ready,
                leased,
                [] if stream is None else sorted(stream.fields),
                max(0.0, now - self.tasks[name].active),
            )
            for name, taken, ready, leased, stream in self.progress()
        }

    def drained_by_all(self) -> bool:
        """Finished, consumed by at least one task, and every task has taken every row it reads with
        none still leased: nothing more will happen here (``rlplane store status --watch``)."""
        return (
            self.finished
            and bool(self.tasks)
            and all(
                not task.leased and not any(s.ready or s.build for s in task.streams.values())
                for task in self.tasks.values()
            )
        )

    def counts(self, task_name: str, fields: frozenset[str] | None) -> ConsumptionReply:
        """``task_name``'s progress on this partition for ``fields`` (the ``consumption`` reply)."""
        task = self.tasks.get(task_name)
        consumed = task.consumed if task is not None else set()
        if fields is None:  # the fields the task asked for last; every key when it never asked
            fields = (
                next(reversed(task.streams), frozenset())
                if task is not None and task.streams
                else frozenset()
            )
        stream = task.streams.get(fields) if task is not None else None
        if (
            task is not None and stream is not None and len(task.streams) == 1 and stream.build is None
        ):  # every consumed key came through it: O(1)
            produced, done = len(stream.ready) + len(consumed), len(consumed)
        else:
            having = self._having(fields)
            produced = len(having) if isinstance(having, Mapping) else sum(1 for _ in having)
            done = sum(1 for k in consumed if k in self.keys and fields <= self.keys[k])
        ready = produced - done
        return ConsumptionReply(
            total=len(self.keys),
            produced=produced,
            consumed=len(consumed),
            ready=ready,
            leased=0 if task is None else len(task.leased),
            finished=self.finished,
            fields=sorted(fields),
            drained=self.finished and not ready and (task is None or self.drained(task, fields)),
        )


__all__ = ["BUILD_SLICE", "Build", "Lease", "PartitionStreams", "Stream", "Task"]
