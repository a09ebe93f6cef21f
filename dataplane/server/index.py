"""The index service: partitions, keys, per-key field production status, tags, and the shard registry.

``IndexCore`` is the plain bookkeeping class; ``IndexServer`` serves it on zmq ROUTER sockets from
one thread (no locks needed) and parks requests that wait for rows; ``IndexActor`` is the Ray actor
around them, answering a few Ray calls used only at attach time (``info``).

Design rule, enforced in ``IndexServer``: the index receives metadata only. A request that
carries any buffer frame is refused with an error, so tensor bytes can never reach it.

Placement of keys is a stable hash (``client.sharding``), so the index is not asked where a key lives;
it is on the path only where metadata changes (put, clear) or must be resolved (``kv_list``,
classifying a missing key).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dataplane.codec.column_types import describe_family
from dataplane.errors import (
    BatchTimeoutError,
    DataplaneError,
    PartitionNotFoundError,
    ReservationExpiredError,
    SchemaError,
    WireError,
    did_you_mean,
)
from dataplane.samplers import from_spec
from dataplane.server.dispatch import Operations, OpReply
from dataplane.server.index_checkpoint import IndexCheckpoints
from dataplane.server.router import POLL_MS, RequestServer
from dataplane.server.streams import PartitionStreams
from dataplane.telemetry import bounds as _bounds
from dataplane.telemetry import export
from dataplane.telemetry.recorder import Key, ServerMetrics
from dataplane.wire import auth as _auth
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol

logger = logging.getLogger(__name__)


@dataclass
class _KeyMeta:
    tag: dict[str, Any] = field(default_factory=dict)
    fields: set[str] = field(default_factory=set)


@dataclass
class _PartMeta:
    keys: dict[str, _KeyMeta] = field(default_factory=dict)
    # The last CLEARED_KEYS_KEPT keys cleared from it, oldest first: a get of one says "cleared".
    cleared: OrderedDict[str, None] = field(default_factory=OrderedDict)
    streams: PartitionStreams = field(init=False)
    # Which partition of this name it is: a consumer waiting on one never gets rows of a successor.
    incarnation: int = field(default_factory=itertools.count(1).__next__)

    def __post_init__(self) -> None:
        self.streams = PartitionStreams(self.keys)


@dataclass
class _FieldSchema:
    """A field's family (kind group, dtype, dims per row; ``ColumnSpec.family``), decided by the first
    ``prepare`` that named it (first writer wins); each row's shape is free.

    ``confirmed`` once a put that relies on it commits; until then ``pending`` holds the puts
    (transaction ids) that rely on it, and the last of them to abort or expire takes it back.
    """

    family: list[Any]
    confirmed: bool = False
    pending: set[int] = field(default_factory=set)
    wire: Any = None  # the wire spec a put without prepare last declared, found of this family


def _fieldset(fields: list[str]) -> frozenset[str]:
    if not fields:
        raise WireError("a consumer names at least one field to wait for")
    return frozenset(fields)


def _sampler(body: Any) -> Any:
    if body.dp_rank is not None and body.dp_size is not None and body.dp_rank >= body.dp_size:
        raise WireError(f"dp_rank must be below dp_size: got dp_rank={body.dp_rank}, dp_size={body.dp_size}")
    try:
        sampler = from_spec(body.sampler)
        sampler.check(body.batch_size, body.dp_rank, body.dp_size, body.batch_index)
    except ValueError as exc:
        raise WireError(str(exc)) from exc
    return sampler


MAX_EARLY_ABORTS = 1 << 16  # aborts of puts not seen yet that the index remembers (oldest forgotten)


class IndexCore(IndexCheckpoints, Operations):
    """Metadata bookkeeping of the store. Plain class, tested without Ray.

    Its operations take the body only (the index takes no buffer frames) and return the reply
    body; a waiting one (``next``, ``ready``) returns None while its rows are not ready. The
    checkpoint operations are in ``server.index_checkpoint``.

    A put's prepare (``op_prepare``) stays open for ``prepare_ttl_s`` (the store's
    ``reservation_timeout_s``, as long as the shards keep the put's reservations), then expires as
    if aborted; ``clock`` is the monotonic clock those deadlines are read on (a test moves its own).
    """

    OPS = _protocol.INDEX_OPS
    REPLIES = _protocol.INDEX_REPLIES
    SERVICE = "the index"
    PART, KEY, SCHEMA = _PartMeta, _KeyMeta, _FieldSchema  # for the checkpoint operations

    def __init__(self, prepare_ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.partitions: dict[str, _PartMeta] = {}
        self.schemas: dict[str, dict[str, _FieldSchema]] = {}  # pid -> field -> schema
        self.txns: dict[int, tuple[str, list[str]]] = {}  # open put -> (pid, fields it relies on)
        self.prepare_ttl_s = prepare_ttl_s
        self._clock = clock
        # When each open put expires, and the same in deadline order (one ttl for all: arrival order)
        # so that expiring costs nothing while no deadline has passed.
        self._open_until: dict[int, float] = {}
        self._deadlines: deque[tuple[float, int]] = deque()
        # Puts aborted before their prepare arrived (txn -> until when it is refused), same order.
        self._early_aborts: dict[int, float] = {}
        self._early_order: deque[tuple[float, int]] = deque()
        self.put_counts = {"aborted": 0, "expired": 0, "refused": 0}
        self.registry: dict[str, Any] = {}
        self.changed: set[str] = set()  # partitions whose rows changed since the actor last looked
        # Lease deadlines (deadline, seq, pid, task, take), stale entries dropped when they come up.
        self.lease_due: list[tuple[float, int, str, str, str]] = []
        self._lease_seq = itertools.count()
        # Takes given back by id (bounded, oldest dropped): a request carrying one that arrives after
        # its release (it travelled on another connection) takes nothing.
        self.released: OrderedDict[str, None] = OrderedDict()
        # The last CLEARED_PARTITIONS_KEPT partitions cleared, oldest first (for the error naming one).
        self.cleared: OrderedDict[str, None] = OrderedDict()
        self.leases_expired = 0  # leased rows given back because their lease ran out (metrics)

    def missing(self, pid: str, message: str | None = None) -> PartitionNotFoundError:
        """The error for a partition that is not there: cleared (if remembered), or never written, with
        the names it might be a typo of."""
        text = message or f"partition {pid!r} not found"
        if pid in self.cleared:
            text += " (it was cleared: clear_partition; a put creates it anew)"
        elif message is None:
            text += f" (never written, nor among the last {CLEARED_PARTITIONS_KEPT} partitions cleared)"
        return PartitionNotFoundError(pid, text + did_you_mean(pid, self.partitions))

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        result = self.operation(op)(body)  # no buffers: the index's server refuses any
        return (_protocol.Pending() if result is None else result), []  # a waiting op, run once

    def op_prepare(self, body: _protocol.Prepare) -> _protocol.PrepareReply:
        """Decide the schema of a put's new fields at once, or refuse it: ``SchemaError``.

        Fields already decided must match; new ones are recorded now (not at commit), so of two
        puts racing to create a field with different specs exactly one passes, whichever shards
        their keys live on. The put's id (``body.txn``) is its client's choice, so the client can
        abort a prepare whose answer it never saw: a prepare whose abort came first is refused
        (``ReservationExpiredError``) and decides nothing. An open prepare expires after
        ``prepare_ttl_s`` (``expire``). Answers ``PrepareReply(body.txn)``.
        """
        now = self._clock()
        self.expire(now)
        pid, txn = body.pid, body.txn
        if txn in self._early_aborts:  # its client gave up before this arrived (a stalled index)
            self.put_counts["refused"] += 1
            raise ReservationExpiredError(
                f"put {txn} was aborted by its writer before its prepare reached the index; nothing was "
                "recorded"
            )
        if txn in self.txns:
            raise WireError(f"prepare: put {txn} is already open; a put id is used once (chosen at random)")
        families = self._families(pid, body.specs)
        schema = self.schemas.setdefault(pid, {})
        for name in body.specs:
            entry = schema.get(name)
            if entry is None:
                entry = schema[name] = _FieldSchema(families[name])
            if not entry.confirmed:
                entry.pending.add(txn)
        self.txns[txn] = (pid, list(body.specs))
        until = now + self.prepare_ttl_s
        self._open_until[txn] = until
        self._deadlines.append((until, txn))
        return _protocol.PrepareReply(txn)

    def expire(self, now: float | None = None) -> None:
        """Undo the prepares open longer than ``prepare_ttl_s`` (their writers died or gave up, and
        the shards have fenced their reservations): new fields only they relied on are undecided
        again, and a commit that comes later is refused. Forget early aborts as old."""
        now = self._clock() if now is None else now
        while self._deadlines and self._deadlines[0][0] <= now:
            until, txn = self._deadlines.popleft()
            if self._open_until.get(txn) == until:  # (else committed or aborted already)
                self._release(txn)
                self.put_counts["expired"] += 1
        while self._early_order and self._early_order[0][0] <= now:
            until, txn = self._early_order.popleft()
            if self._early_aborts.get(txn) == until:
                del self._early_aborts[txn]

    def _families(self, pid: str, specs: dict[str, Any]) -> dict[str, list[Any]]:
        """Each spec's family, checked against the partition's schema (``SchemaError`` on a mismatch)."""
        schema = self.schemas.get(pid, {})
        families = {}
        for name, spec in specs.items():
            new_s = _wire.spec_from_wire(spec)
            new_s.check(name)
            families[name] = list(new_s.family())
            old = schema.get(name)
            if old is not None and old.family != families[name]:
                if not old.confirmed:
                    raise SchemaError(
                        name,
                        f"field {name!r}: new data ({describe_family(families[name])}) does not match "
                        f"what a put in flight is creating the field as ({describe_family(old.family)}); "
                        "write it with that dtype, or use a new field name (if that put never commits, "
                        f"the field is free again within {self.prepare_ttl_s:.0f}s, reservation_timeout_s)",
                    )
                raise SchemaError(
                    name,
                    f"field {name!r}: new data ({describe_family(families[name])}) does not match the stored "
                    f"column ({describe_family(old.family)}); write it with the stored dtype, or use a new "
                    "field name",
                )
        return families

    def _decide(self, pid: str, specs: dict[str, Any]) -> None:
        """Check ``specs`` against the partition's schema and record new fields as confirmed; all
        checked before anything is recorded."""
        schema = self.schemas.get(pid)
        if schema is not None and all(
            (entry := schema.get(name)) is not None and entry.wire == spec for name, spec in specs.items()
        ):  # the specs of the last such put to these fields (small puts repeat them): checked already
            return
        families = self._families(pid, specs)
        schema = self.schemas.setdefault(pid, {})
        for name, family in families.items():
            entry = schema.get(name)
            if entry is None:
                entry = schema[name] = _FieldSchema(family, confirmed=True)
            elif not entry.confirmed:  # a prepared put's new field, which this commit now relies on too
                entry.confirmed, entry.pending = True, set()
            entry.wire = specs[name]

    def op_abort(self, body: _protocol.IndexAbort) -> _protocol.Done:
        """A put gave up: new fields only it relied on are undecided again. Its prepare may not have
        arrived yet (the writer never saw an answer): then it is refused when it does."""
        now = self._clock()
        self.expire(now)
        txn = body.txn
        if txn in self.txns:
            self._release(txn)
            self.put_counts["aborted"] += 1
        elif txn not in self._early_aborts:
            if len(self._early_aborts) >= MAX_EARLY_ABORTS:  # the oldest is the least likely to matter
                _, oldest = self._early_order.popleft()
                self._early_aborts.pop(oldest, None)
            until = now + self.prepare_ttl_s
            self._early_aborts[txn] = until
            self._early_order.append((until, txn))
        return _protocol.Done()

    def _release(self, txn: int) -> None:
        """Close the open put ``txn`` without committing it (aborted or expired)."""
        pid, names = self.txns.pop(txn)
        del self._open_until[txn]
        schema = self.schemas.get(pid, {})
        for name in names:
            entry = schema.get(name)
            if entry is not None and not entry.confirmed:
                entry.pending.discard(txn)
                if not entry.pending:
                    del schema[name]
        if not schema and pid not in self.partitions:
            self.schemas.pop(pid, None)

    def op_commit(self, body: _protocol.IndexCommit) -> _protocol.CommitReply:
        """Record that ``keys`` now hold ``fields`` (and merge ``tags``); returns fields and tags."""
        pid, keys, fields, tags = body.pid, _protocol.unique_keys(body.keys, "commit"), body.fields, body.tags
        if tags is not None and len(tags) != len(keys):
            raise WireError(f"commit: {len(tags)} tags for {len(keys)} keys")
        self.expire()  # (a pending field of an expired put must not decide this commit's schema)
        if body.txn is not None:  # checked before anything changes
            opened = self.txns.get(body.txn)
            if opened is None:  # as a shard refuses the commit of a reservation it fenced
                raise ReservationExpiredError(
                    f"commit: put {body.txn} is not open at the index: its prepare expired after "
                    f"reservation_timeout_s ({self.prepare_ttl_s:.0f}s), was aborted, or never arrived; "
                    "nothing was recorded"
                )
            if opened[0] != pid:  # a txn confirms only its own partition
                raise WireError(
                    f"commit: put {body.txn} was prepared for partition {opened[0]!r}, not {pid!r}"
                )
        if body.specs:  # a put that skipped prepare: its fields' schemas must agree (or are new)
            self._decide(pid, body.specs)
        if body.txn is not None:
            _, names = self.txns.pop(body.txn)
            del self._open_until[body.txn]
            for name in names:
                entry = self.schemas.get(pid, {}).get(name)
                if entry is not None:
                    entry.confirmed, entry.pending = True, set()
        part = self.partitions.get(pid)
        if part is None:  # (not setdefault: a _PartMeta is not free to build, and commits are many)
            part = self.partitions[pid] = _PartMeta()
        union: dict[str, None] = {}
        out_tags: list[dict[str, Any]] = []
        for i, key in enumerate(keys):
            meta = part.keys.get(key)
            existed = meta is not None
            if meta is None:
                meta = part.keys[key] = _KeyMeta()
            # (what the key held before matters only to consumers' streams: no copy when there are none)
            before = set(meta.fields) if fields and part.streams.by_fields else meta.fields
            meta.fields.update(fields)
            tag = tags[i] if tags is not None else None
            if tag:
                meta.tag.update(tag)
                if existed and part.streams.by_fields:  # a ready row's group may have changed
                    part.streams.on_retag(key)
            part.streams.on_commit(key, before, meta.fields)
            out_tags.append(dict(meta.tag))
            for f in meta.fields:
                union[f] = None
        self.changed.add(pid)
        order = list(self.schemas.get(pid, {}))
        ordered = [f for f in order if f in union] + sorted(f for f in union if f not in order)
        return _protocol.CommitReply(ordered, out_tags)

    def op_commits(self, body: _protocol.Commits) -> _protocol.CommitsReply:
        """Several independent commits (a shard passing on the puts it stored since its last batch):
        each gets its own answer, ``CommitResult(ok=reply)`` or ``CommitResult(err=[class, message,
        attrs])``. A commit that is refused changed nothing (``op_commit`` checks everything first), so
        its shard can take the rows back."""
        results: list[_protocol.CommitResult] = []
        for item in body.items:
            try:
                results.append(_protocol.CommitResult(ok=self.op_commit(item)))
            except Exception as exc:  # noqa: BLE001 - one refused commit does not refuse the others
                results.append(_protocol.CommitResult(err=_wire.error_fields(exc)))
        return _protocol.CommitsReply(results)

    def op_clear(self, body: _protocol.Clear) -> _protocol.RemovedReply:
        part = self.partitions.get(body.pid)
        removed = 0
        if part is not None:
            for key in body.keys:
                if part.keys.pop(key, None) is not None:
                    removed += 1
                    part.streams.on_clear(key)
                    _remember(part.cleared, key, CLEARED_KEYS_KEPT)
        return _protocol.RemovedReply(removed)

    def op_clear_partition(self, body: _protocol.OnePartition) -> _protocol.ExistedReply:
        pid = body.pid
        existed = self.partitions.pop(pid, None) is not None
        if existed:
            _remember(self.cleared, pid, CLEARED_PARTITIONS_KEPT)
        self.schemas.pop(pid, None)
        self.changed.add(pid)
        return _protocol.ExistedReply(existed)

    # ---- streaming ------------------------------------------------------------------------------
    def op_next(self, body: _protocol.Next) -> _protocol.BatchReply | None:
        """The next batch for a consumer task, or None while not enough rows are ready (the actor
        waits for a commit to this partition and asks again)."""
        self._check_take(body.take)
        sampler = _sampler(body)  # (bad arguments are refused at once, not once rows exist)
        part = self.partitions.get(body.pid)
        if part is None:
            return None
        got = part.streams.take(
            body.task,
            _fieldset(body.fields),
            sampler,
            body.batch_size,
            body.dp_rank,
            body.dp_size,
            body.batch_index,
            body.take,
            self._lease(body),
        )
        if got is None:
            return None
        return self._batch_of(part, body, got)

    def op_ready(self, body: _protocol.Ready) -> _protocol.ReadyReply | None:
        """Ready rows (key, tag) for a client-side sampler, once ``min_rows`` are ready or the
        partition is finished; a cached choice for this DP rank and batch index first."""
        part = self.partitions.get(body.pid)
        if part is None:
            return None
        fields = _fieldset(body.fields)
        cached = part.streams.cached(body.task, fields, body.dp_rank, body.batch_index)
        if cached is not None:
            got = self._batch(part, cached, body.fields)
            return _protocol.ReadyReply(
                cached=True, finished=got.finished, keys=got.keys, tags=got.tags, fields=got.fields
            )
        _, stream = part.streams.stream(body.task, fields)
        if len(stream.ready) < body.min_rows and not part.streams.finished:
            return None
        rows = [(k, part.keys[k].tag) for k in itertools.islice(stream.ready, body.limit)]
        return _protocol.ReadyReply(rows=rows, finished=part.streams.finished)

    def op_claim(self, body: _protocol.Claim) -> _protocol.BatchReply:
        self._check_take(body.take)
        part = self.partitions.get(body.pid)
        if part is None:
            raise self.missing(body.pid)
        got = part.streams.claim(
            body.task,
            _fieldset(body.fields),
            _protocol.unique_keys(body.keys, "claim"),
            body.dp_rank,
            body.batch_index,
            body.take,
            self._lease(body),
        )
        return self._batch_of(part, body, got)

    @staticmethod
    def _batch(
        part: _PartMeta, keys: list[str], fields: list[str], lease: str | None = None
    ) -> _protocol.BatchReply:
        tags = [dict(part.keys[k].tag) for k in keys]
        return _protocol.BatchReply(keys, tags, fields, part.streams.finished, lease)

    # ---- delivery: giving back, leases, acknowledgements ----------------------------------------------
    def _check_take(self, take: str | None) -> None:
        if take is not None and take in self.released:
            raise DataplaneError(f"take {take!r} was given back by its consumer before it arrived")

    @staticmethod
    def _lease(body: Any) -> float | None:
        """The deadline of the lease a taking request asks for, if it took rows now."""
        return None if body.lease_s is None or body.take is None else time.monotonic() + body.lease_s

    def _batch_of(
        self, part: _PartMeta, body: Any, got: tuple[list[str], str | None]
    ) -> _protocol.BatchReply:
        """The reply to a take; a lease it made is queued for expiry."""
        keys, lease = got
        if lease is not None:
            self.queue_lease(part.streams.tasks[body.task].leases[lease].deadline, body.pid, body.task, lease)
        return self._batch(part, keys, body.fields, lease)

    def queue_lease(self, deadline: float, pid: str, task: str, take: str) -> None:
        """Give the lease's unacknowledged rows back at ``deadline`` (``expire_leases``)."""
        heapq.heappush(self.lease_due, (deadline, next(self._lease_seq), pid, task, take))

    def give_back(self, pid: str, task: str, take: str | None, keys: list[str]) -> None:
        """A batch's reply could not be delivered (its consumer went away): its rows are ready again."""
        part = self.partitions.get(pid)
        if part is not None:
            if take is None or part.streams.release(task, take) is None:
                part.streams.unconsume(task, keys)
            self.changed.add(pid)

    def op_release(self, body: _protocol.Release) -> _protocol.ReleaseReply:
        """Give back what a take got (its consumer gave up on the call, or lets its lease go). A take
        the index has not seen yet is refused when it comes (the release overtook it)."""
        part = self.partitions.get(body.pid)
        released = None if part is None else part.streams.release(body.task, body.take)
        self.released[body.take] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)
        if released:
            self.changed.add(body.pid)
        return _protocol.ReleaseReply(released or 0, released is not None)

    def op_ack(self, body: _protocol.Ack) -> _protocol.AckReply:
        """Leased keys done with: taken for good. Answers the keys whose lease ran out first."""
        part = self.partitions.get(body.pid)
        if part is None:
            raise self.missing(body.pid)
        return _protocol.AckReply(
            part.streams.ack(body.task, body.take, _protocol.unique_keys(body.keys, "ack"))
        )

    def next_lease_due(self) -> float:
        return self.lease_due[0][0] if self.lease_due else math.inf

    def expire_leases(self, now: float) -> None:
        """Give back the unacknowledged keys of every lease that is due (its consumer took too long,
        or died)."""
        while self.lease_due and self.lease_due[0][0] <= now:
            _, _, pid, task, take = heapq.heappop(self.lease_due)
            part = self.partitions.get(pid)
            back = 0 if part is None else part.streams.expire(task, take, now)
            if back:
                self.leases_expired += back
                self.changed.add(pid)
        if len(self.lease_due) > LEASE_HEAP_COMPACT:  # mostly acknowledged leases: keep the live ones
            live = {
                (p, name, take)
                for p, part in self.partitions.items()
                for name, t in part.streams.tasks.items()
                for take in t.leases
            }
            self.lease_due = [e for e in self.lease_due if e[2:] in live]
            heapq.heapify(self.lease_due)

    def timeout_error(self, op: str, body: Any, waited: float) -> Exception:
        """What a waiting call that timed out raises: which partition, how many rows were ready."""
        part = self.partitions.get(body.pid)
        if part is None:
            return self.missing(
                body.pid, f"partition {body.pid!r} not found: no put created it within {waited:.1f}s"
            )
        fields = _fieldset(body.fields)
        counts = part.streams.counts(body.task, fields)
        want = body.batch_size if op == "next" else body.min_rows
        never = [f for f in sorted(fields) if not any(f in m.fields for m in part.keys.values())]
        written = {f for m in part.keys.values() for f in m.fields}
        hint = f"; no row holds {never} (no put wrote them yet)" if never else ""
        hint += "".join(did_you_mean(f, written) for f in never)
        return BatchTimeoutError(
            body.pid,
            f"after {waited:.1f}s only {counts.ready} row(s) of partition {body.pid!r} were ready for "
            f"task {body.task!r} (fields {sorted(fields)}), fewer than the {want} asked for; nothing "
            f"was consumed{hint}",
        )

    def op_finish(self, body: _protocol.OnePartition) -> _protocol.Done:
        """Producers are done: consumers get what is left, then empty batches at once."""
        part = self.partitions.get(body.pid)
        if part is None:  # (a misspelt name must not create an empty, finished partition)
            raise self.missing(
                body.pid, f"partition {body.pid!r} not found: nothing to finish (no put created it)"
            )
        part.streams.finished = True
        self.changed.add(body.pid)
        return _protocol.Done()

    def op_reset(self, body: _protocol.Reset) -> _protocol.Done:
        part = self.partitions.get(body.pid)
        if part is not None:
            part.streams.reset(body.task)
            self.changed.add(body.pid)
        return _protocol.Done()

    def op_consumption(self, body: _protocol.Consumption) -> _protocol.ConsumptionReply:
        part = self.partitions.get(body.pid)
        if part is None:
            raise self.missing(body.pid)
        fields = None if body.fields is None else _fieldset(body.fields)
        return part.streams.counts(body.task, fields)

    def op_consumed(self, body: _protocol.Consumed) -> _protocol.ConsumedReply:
        """The keys ``task`` has taken from the partition (TransferQueue's per-row consumption status)."""
        part = self.partitions.get(body.pid)
        task = None if part is None else part.streams.tasks.get(body.task)
        if part is None or task is None:
            return _protocol.ConsumedReply([])
        return _protocol.ConsumedReply([k for k in part.keys if k in task.consumed])

    def op_tasks(self, body: _protocol.Tasks) -> _protocol.TasksReply:
        """The consumer tasks of a partition with their counts (``PartitionStreams.overview``: taken,
        ready and not taken, leased, the fields each waits for), and the partition's rows, fields
        (in the order their schemas were decided) and whether it is finished. O(tasks)."""
        part = self.partitions.get(body.pid)
        if part is None:
            raise PartitionNotFoundError(body.pid)
        return _protocol.TasksReply(
            rows=len(part.keys),
            fields=list(self.schemas.get(body.pid, {})),
            finished=part.streams.finished,
            tasks=part.streams.overview(),
        )

    def op_list(self, body: _protocol.ListKeys) -> _protocol.ListReply:
        pid = body.pid
        pids = [pid] if pid is not None else list(self.partitions)
        return _protocol.ListReply(
            {
                p: {k: dict(m.tag) for k, m in self.partitions[p].keys.items()}
                for p in pids
                if p in self.partitions
            }
        )

    def op_resolve(self, body: _protocol.Resolve) -> _protocol.ResolveReply:
        """Which of ``keys`` the index knows, and which fields they hold (classifies a failed get)."""
        part = self.partitions.get(body.pid)
        if part is None:
            return _protocol.ResolveReply(partition=False, known={}, error=str(self.missing(body.pid)))
        return _protocol.ResolveReply(
            partition=True,
            known={k: sorted(part.keys[k].fields) for k in body.keys if k in part.keys},
            cleared=[k for k in body.keys if k not in part.keys and k in part.cleared],
            cleared_kept=CLEARED_KEYS_KEPT,
        )

    def op_stats(self, body: _protocol.Stats) -> _protocol.IndexStatsReply:
        """Keys per partition, and the prepared puts: open now, and how many were aborted, expired,
        or refused (their abort had come first)."""
        self.expire()
        return _protocol.IndexStatsReply(
            partitions={p: len(m.keys) for p, m in self.partitions.items()},
            puts={"open": len(self.txns), **self.put_counts},
        )

    def op_ping(self, body: _protocol.Ping) -> _protocol.Done:
        return _protocol.Done()


# Requests that may wait for rows, or that take rows (a reply that cannot be delivered gives them back).
_TAKING_OPS = _protocol.WAITING_OPS | {"claim"}
RELEASED_MEMORY = 65536  # take ids given back, remembered to refuse a request that arrives after them
CLEARED_KEYS_KEPT = 4096  # cleared keys remembered per partition, so a get of one says "cleared"
CLEARED_PARTITIONS_KEPT = 1024  # cleared partitions remembered, for the same reason


def _remember(record: OrderedDict[str, None], name: str, bound: int) -> None:
    """Add ``name`` to a bounded record, newest last; the oldest go first."""
    record[name] = None
    record.move_to_end(name)
    while len(record) > bound:
        record.popitem(last=False)


LEASE_HEAP_COMPACT = 65536  # lease deadlines queued before the acknowledged ones are swept out


@dataclass(eq=False)
class _Waiter:
    """A ``next`` / ``ready`` request parked until rows are ready for it (or its deadline passes)."""

    sock: Any
    ident: Any
    rid: int
    op: str
    body: Any
    start: float
    deadline: float
    done: bool = False
    incarnation: int | None = None  # of the partition it waits on, if that existed when it came


class IndexServer(RequestServer):
    """The index's request loop: one thread, so ``IndexCore`` needs no lock.

    Requests that may wait (``next``, ``ready``) are answered at once when rows are ready; otherwise
    they are parked per partition and re-tried, in arrival order, after every request that changed
    that partition (a commit, a delete, a finish, ...): woken by the change, never by polling. A
    parked request past its ``timeout_s`` is answered with ``BatchTimeoutError``. Replies use
    mandatory routing, so a batch whose consumer has gone away cannot be delivered and is given back
    to the task (``IndexCore.give_back``).
    """

    core: IndexCore

    def __init__(self, core: IndexCore, host_ip: str, name: str, creds: _auth.Credentials, **kw: Any) -> None:
        self._waiters: dict[str, list[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._by_take: dict[str, _Waiter] = {}  # parked takes, to unpark one its consumer gives up on
        self._seq = itertools.count()
        self.rows_taken = 0  # rows handed out to consumers (metrics)
        self.partition_series = -1  # partitions with series of their own (StoreConfig.metrics_partitions)
        kw.update(max_frames=0, mandatory=True)  # metadata only: no buffer frames
        super().__init__(core, host_ip, name, creds, **kw)

    def _serve_one(self, sock: Any, msg: list[Any]) -> None:
        super()._serve_one(sock, msg)
        self._recheck()  # the request may have changed partitions that parked requests wait on

    def serve(
        self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]
    ) -> OpReply | None:
        if op not in _TAKING_OPS:
            if op == "release":  # a parked take its consumer gave up on waits no more
                self._unpark(self._by_take.get(body.take))
            return super().serve(sock, ident, rid, op, body, bufs)
        # Answered now if it can be, else parked until its partition changes.
        now = time.monotonic()
        waiter = _Waiter(sock, ident, rid, op, body, now, math.inf)
        if self._try(waiter):
            return None
        if body.timeout_s is not None:
            waiter.deadline = now + body.timeout_s
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))
        part = self.core.partitions.get(body.pid)
        waiter.incarnation = None if part is None else part.incarnation
        self._waiters.setdefault(body.pid, []).append(waiter)
        take = getattr(body, "take", None)
        if take is not None:
            self._by_take[take] = waiter
        return None

    def _unpark(self, w: _Waiter | None) -> None:
        """Answer a parked request whose consumer gave it up, taking nothing; its socket may be gone."""
        if w is None or w.done:
            return
        self._done(w)
        waiting = self._waiters.get(w.body.pid, [])
        if w in waiting:
            waiting.remove(w)
        err = DataplaneError(f"the consumer gave up on this {w.op!r} call; nothing was taken")
        self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, err))

    def _done(self, w: _Waiter) -> None:
        w.done = True
        take = getattr(w.body, "take", None)
        if take is not None and self._by_take.get(take) is w:
            del self._by_take[take]

    def _try(self, w: _Waiter) -> bool:
        """Answer ``w`` if it can be answered now (its rows are ready, or it failed)."""
        try:
            if w.incarnation is not None:
                part = self.core.partitions.get(w.body.pid)
                if part is None or part.incarnation != w.incarnation:
                    raise PartitionNotFoundError(
                        w.body.pid,
                        f"partition {w.body.pid!r} was cleared while this {w.op!r} call waited on it "
                        "(clear_partition); nothing was taken",
                    )
            result = self.core.operation(w.op)(w.body)
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the loop goes on
            self._done(w)
            self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, exc))
            return True
        if result is None:
            return False
        self._done(w)
        if self.metrics is not None:
            self.metrics.waited(w.op, time.monotonic() - w.start)
        taken = result.keys if type(result) is _protocol.BatchReply else []  # (a ready takes nothing)
        if not self.deliver(w.sock, w.ident, _wire.encode_reply(w.rid, result)):
            if taken:  # its consumer went away: ready again
                self.core.give_back(w.body.pid, w.body.task, w.body.take, taken)
        else:
            self.rows_taken += len(taken)
        return True

    def _recheck(self) -> None:
        """Re-try the parked requests of every partition that changed, oldest first."""
        while self.core.changed:
            pid = self.core.changed.pop()
            waiting = self._waiters.get(pid)
            if not waiting:
                continue
            self._waiters[pid] = [w for w in waiting if not w.done and not self._try(w)]
            if not self._waiters[pid]:
                del self._waiters[pid]

    def poll_timeout_ms(self) -> int:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        due = min(self._deadlines[0][0] if self._deadlines else math.inf, self.core.next_lease_due())
        if due == math.inf:
            return POLL_MS
        left = due - time.monotonic()
        if left <= 0:
            return 0
        if not left < POLL_MS / 1000:  # (a deadline the protocol's bounds let through is finite; and
            return POLL_MS  # should one not be, inf or nan ends here, never in an integer conversion)
        return math.ceil(left * 1000)

    def after_poll(self) -> None:
        """Answer the parked requests whose deadline passed; a request whose expiry fails is answered
        with that failure (``_fail``), and the others are still served."""
        now = time.monotonic()
        self.core.expire_leases(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                continue
            try:
                self._expire(w, now)
            except Exception as exc:  # noqa: BLE001 - this request gets the error, the loop goes on
                logger.exception("%s: timing out a %r request failed", self.name, w.op)
                why = f"{type(exc).__name__}: {exc}"
                self._fail(w, DataplaneError(f"the index failed at this {w.op!r} request's deadline ({why})"))
        self._recheck()

    def _expire(self, w: _Waiter, now: float) -> None:
        """``w``'s deadline passed: its rows if they are ready now, else ``BatchTimeoutError``."""
        if self._try(w):
            return
        err = self.core.timeout_error(w.op, w.body, now - w.start)
        self._fail(w, err)

    def _fail(self, w: _Waiter, exc: BaseException) -> None:
        """Answer a parked request with ``exc`` (unless it was answered already) and forget it."""
        waiting = self._waiters.get(w.body.pid, [])
        if w in waiting:
            waiting.remove(w)
        if w.done:
            return
        self._done(w)
        self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, exc))

    def metrics_snapshot(self, labels: tuple[str, ...]) -> tuple[dict[Key, float], dict[Key, float]]:
        counters, gauges = super().metrics_snapshot(labels)
        core = self.core
        counters[("dataplane_index_rows_taken", *labels)] = self.rows_taken
        counters[("dataplane_index_leases_expired", *labels)] = core.leases_expired
        # One pass over the partitions and their tasks (this runs on the loop: it must stay cheap).
        rows: dict[str, int] = {}
        lag: dict[tuple[str, str], int] = {}
        counts: dict[tuple[str, str], tuple[int, int]] = {}  # (taken, leased)
        finished = 0
        for pid, part in core.partitions.items():
            rows[pid] = len(part.keys)
            finished += part.streams.finished
            for task, taken, ready, leased, _ in part.streams.progress():
                lag[(pid, task)] = ready
                counts[(pid, task)] = (taken, leased)
        gauges[("dataplane_index_partitions", *labels, "open")] = len(rows) - finished
        gauges[("dataplane_index_partitions", *labels, "finished")] = finished
        gauges[("dataplane_index_waiting", *labels)] = sum(
            1 for waiting in self._waiters.values() for w in waiting if not w.done
        )
        for pid, n in _bounds.fold(rows, _bounds.chosen(rows, self.partition_series), _bounds.OTHER).items():
            gauges[("dataplane_index_partition_rows", *labels, pid)] = n
        # Consumer tasks: the (partition, task) pairs furthest behind get series of their own.
        keep = _bounds.chosen(lag, self.partition_series)
        other = (_bounds.OTHER, _bounds.OTHER)
        for (pid, task), n in _bounds.fold(lag, keep, other).items():
            gauges[("dataplane_consumer_ready_rows", *labels, pid, task)] = n
        for i, name in ((0, "dataplane_consumer_taken_rows"), (1, "dataplane_consumer_leased_rows")):
            values = {pair: c[i] for pair, c in counts.items()}
            for (pid, task), n in _bounds.fold(values, keep, other).items():
                gauges[(name, *labels, pid, task)] = n
        return counters, gauges


class IndexActor:
    """The index as a Ray actor (wrapped with ``ray.remote`` by ``service.launch``): its Ray methods only
    start and describe it; every KV and streaming request reaches ``IndexServer`` over zmq, on
    sockets that admit only the store's own peers (``wire.auth``)."""

    def __init__(
        self,
        name: str,
        creds: dict[str, str] | None = None,
        max_message_bytes: int = -1,
        reservation_timeout_s: float = 120.0,
        metrics: bool = False,
        metrics_partitions: int = -1,
    ) -> None:
        self.core = IndexCore(prepare_ttl_s=reservation_timeout_s)
        self._name = name
        self._metrics = metrics
        self._metrics_partitions = metrics_partitions
        self._creds = _auth.Credentials.from_dict(creds or {})
        self._max_message_bytes = max_message_bytes
        self.server: IndexServer | None = None

    def start(self) -> dict[str, Any]:
        import os

        import ray

        from dataplane.wire.liveness import process_start
        from dataplane.wire.shm import boot_id

        if not self._creds.secret:
            raise ValueError("the index needs the store's credentials")
        host_ip = ray.util.get_node_ip_address()
        self.core.node = f"{host_ip} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"
        gc.freeze()  # as the shards do (``ShardActor``): full collections scan only what came since
        self.server = IndexServer(
            self.core, host_ip, f"{self._name}-index", self._creds, max_message_bytes=self._max_message_bytes
        )
        if self._metrics and export.start():  # before the loop starts: it reads these
            self.server.partition_series = self._metrics_partitions
            # ("commits" relays puts the shards time as put_ready: timing it too would double the cost)
            self.server.metrics = ServerMetrics(
                "dataplane_index", (self._name,), IndexCore.OPS, untimed={"commits"}
            )
        self.server.start()
        pid = os.getpid()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "tcp": self.server.tcp,
            "ipc": self.server.ipc,
            "unix": self.server.unix,
            "max_message_bytes": self._max_message_bytes,  # clients refuse a bigger frame themselves
            "boot_id": boot_id(),
            "pid": pid,
            "pid_start": process_start(pid),
        }

    def register(self, registry: dict[str, Any]) -> None:
        self.core.registry = registry

    def info(self) -> dict[str, Any]:
        """The registry and the client credentials: the one way a process obtains them (a Ray call)."""
        return {**self.core.registry, "credentials": self._creds.for_clients().to_dict()}

    def ping(self) -> bool:
        return True


__all__ = ["IndexActor", "IndexCore"]
