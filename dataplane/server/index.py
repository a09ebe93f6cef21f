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
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dataplane.codec.column_types import describe_family
from dataplane.errors import (
    BatchTimeoutError,
    DataplaneError,
    PartitionNotFoundError,
    SchemaError,
    WireError,
)
from dataplane.samplers import from_spec
from dataplane.server.dispatch import Operations, OpReply
from dataplane.server.router import POLL_MS, ZmqServer
from dataplane.server.streams import PartitionStreams
from dataplane.telemetry import bounds as _bounds
from dataplane.telemetry import export
from dataplane.telemetry.recorder import Key, ServerMetrics
from dataplane.wire import auth as _auth
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol


@dataclass
class _KeyMeta:
    tag: dict[str, Any] = field(default_factory=dict)
    fields: set[str] = field(default_factory=set)


@dataclass
class _PartMeta:
    keys: dict[str, _KeyMeta] = field(default_factory=dict)
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
    (transaction ids) that rely on it, and the last of them to abort takes it back.
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


class IndexCore(Operations):
    """Metadata bookkeeping of the store. Plain class, tested without Ray.

    Its operations take the body only (the index takes no buffer frames) and return the reply
    body; a waiting one (``next``, ``ready``) returns None while its rows are not ready.
    """

    OPS = _protocol.INDEX_OPS
    SERVICE = "the index"

    def __init__(self) -> None:
        self.partitions: dict[str, _PartMeta] = {}
        self.schemas: dict[str, dict[str, _FieldSchema]] = {}  # pid -> field -> schema
        self.txns: dict[int, tuple[str, list[str]]] = {}  # open put -> (pid, fields it relies on)
        self._txn_ids = itertools.count(1)
        self.registry: dict[str, Any] = {}
        self.changed: set[str] = set()  # partitions whose rows changed since the actor last looked
        # Lease deadlines (deadline, seq, pid, task, take), stale entries dropped when they come up.
        self.lease_due: list[tuple[float, int, str, str, str]] = []
        # Takes given back by id (bounded, oldest dropped): a request carrying one that arrives after
        # its release (it travelled on another connection) takes nothing.
        self.released: OrderedDict[str, None] = OrderedDict()
        self.leases_expired = 0  # leased rows given back because their lease ran out (metrics)

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        result = self.operation(op)(body)  # no buffers: the index's server refuses any
        return ({"pending": True} if result is None else result), []  # a waiting op, run once

    def op_prepare(self, body: _protocol.Prepare) -> dict[str, Any]:
        """Decide the schema of a put's new fields at once, or refuse it: ``SchemaError``.

        Fields already decided must match; new ones are recorded now (not at commit), so of two
        puts racing to create a field with different specs exactly one passes, whichever shards
        their keys live on. Returns the put's transaction id for ``commit`` / ``abort``.
        """
        pid = body.pid
        families = self._families(pid, body.specs)
        txn = next(self._txn_ids)
        schema = self.schemas.setdefault(pid, {})
        for name in body.specs:
            entry = schema.get(name)
            if entry is None:
                entry = schema[name] = _FieldSchema(families[name])
            if not entry.confirmed:
                entry.pending.add(txn)
        self.txns[txn] = (pid, list(body.specs))
        return {"txn": txn}

    def _families(self, pid: str, specs: dict[str, Any]) -> dict[str, list]:
        """Each spec's family, checked against the partition's schema (``SchemaError`` on a mismatch)."""
        schema = self.schemas.get(pid, {})
        families = {}
        for name, spec in specs.items():
            new_s = _wire.spec_from_wire(spec)
            new_s.check(name)
            families[name] = list(new_s.family())
            old = schema.get(name)
            if old is not None and old.family != families[name]:
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

    def op_abort(self, body: _protocol.IndexAbort) -> dict[str, Any]:
        """A prepared put gave up: new fields only it relied on are undecided again."""
        pid, names = self.txns.pop(body.txn, (None, []))
        schema = self.schemas.get(pid, {}) if pid is not None else {}
        for name in names:
            entry = schema.get(name)
            if entry is not None and not entry.confirmed:
                entry.pending.discard(body.txn)
                if not entry.pending:
                    del schema[name]
        if pid is not None and not schema and pid not in self.partitions:
            self.schemas.pop(pid, None)
        return {}

    def op_commit(self, body: _protocol.IndexCommit) -> dict[str, Any]:
        """Record that ``keys`` now hold ``fields`` (and merge ``tags``); returns fields and tags."""
        pid, keys, fields, tags = body.pid, _protocol.unique_keys(body.keys, "commit"), body.fields, body.tags
        if tags is not None and len(tags) != len(keys):
            raise WireError(f"commit: {len(tags)} tags for {len(keys)} keys")
        if body.specs:  # a put that skipped prepare: its fields' schemas must agree (or are new)
            self._decide(pid, body.specs)
        if body.txn is not None:
            owner = self.txns.get(body.txn, (pid, []))[0]
            if owner != pid:  # before changing anything: a txn confirms only its own partition
                raise WireError(f"commit: put {body.txn} was prepared for partition {owner!r}, not {pid!r}")
            _, names = self.txns.pop(body.txn, (pid, []))
            for name in names:
                entry = self.schemas.get(pid, {}).get(name)
                if entry is not None:
                    entry.confirmed, entry.pending = True, set()
        part = self.partitions.get(pid)
        if part is None:  # (not setdefault: a _PartMeta is not free to build, and commits are many)
            part = self.partitions[pid] = _PartMeta()
        union: dict[str, None] = {}
        out_tags = []
        for i, key in enumerate(keys):
            meta = part.keys.get(key)
            existed = meta is not None
            if meta is None:
                meta = part.keys[key] = _KeyMeta()
            # (what the key held before matters only to consumers' streams: no copy when there are none)
            before = set(meta.fields) if fields and part.streams.by_fields else meta.fields
            meta.fields.update(fields)
            if tags is not None and tags[i]:
                meta.tag.update(tags[i])
                if existed and part.streams.by_fields:  # a ready row's group may have changed
                    part.streams.on_retag(key)
            part.streams.on_commit(key, before, meta.fields)
            out_tags.append(dict(meta.tag))
            for f in meta.fields:
                union[f] = None
        self.changed.add(pid)
        order = list(self.schemas.get(pid, {}))
        ordered = [f for f in order if f in union] + sorted(f for f in union if f not in order)
        return {"fields": ordered, "tags": out_tags}

    def op_commits(self, body: _protocol.Commits) -> dict[str, Any]:
        """Several independent commits (a shard passing on the puts it stored since its last batch):
        each gets its own answer, ``{"ok": reply}`` or ``{"err": [class, message, attrs]}``. A commit
        that is refused changed nothing (``op_commit`` checks everything first), so its shard can take
        the rows back."""
        results: list[dict[str, Any]] = []
        for item in body.items:
            try:
                results.append({"ok": self.op_commit(item)})
            except Exception as exc:  # noqa: BLE001 - one refused commit does not refuse the others
                results.append({"err": _wire.error_fields(exc)})
        return {"results": results}

    def op_clear(self, body: _protocol.Clear) -> dict[str, Any]:
        part = self.partitions.get(body.pid)
        removed = 0
        if part is not None:
            for key in body.keys:
                if part.keys.pop(key, None) is not None:
                    removed += 1
                    part.streams.on_clear(key)
        return {"removed": removed}

    def op_clear_partition(self, body: _protocol.OnePartition) -> dict[str, Any]:
        pid = body.pid
        existed = self.partitions.pop(pid, None) is not None
        self.schemas.pop(pid, None)
        self.changed.add(pid)
        return {"existed": existed}

    # ---- streaming ------------------------------------------------------------------------------
    def op_next(self, body: _protocol.Next) -> dict[str, Any] | None:
        """The next batch for a consumer task, or None while not enough rows are ready (the actor
        waits for a commit to this partition and asks again)."""
        self._check_take(body.take)
        part = self.partitions.get(body.pid)
        if part is None:
            return None
        sampler = _sampler(body)
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

    def op_ready(self, body: _protocol.Ready) -> dict[str, Any] | None:
        """Ready rows (key, tag) for a client-side sampler, once ``min_rows`` are ready or the
        partition is finished; a cached choice for this DP rank and batch index first."""
        part = self.partitions.get(body.pid)
        if part is None:
            return None
        fields = _fieldset(body.fields)
        cached = part.streams.cached(body.task, fields, body.dp_rank, body.batch_index)
        if cached is not None:
            return {**self._batch(part, body.pid, cached, body.fields), "cached": True}
        _, stream = part.streams.stream(body.task, fields)
        if len(stream.ready) < body.min_rows and not part.streams.finished:
            return None
        rows = [[k, part.keys[k].tag] for k in itertools.islice(stream.ready, body.limit)]
        return {"rows": rows, "finished": part.streams.finished, "cached": False}

    def op_claim(self, body: _protocol.Claim) -> dict[str, Any]:
        self._check_take(body.take)
        part = self.partitions.get(body.pid)
        if part is None:
            raise PartitionNotFoundError(body.pid)
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

    def _batch(
        self, part: _PartMeta, pid: str, keys: list[str], fields: list[str], lease: str | None = None
    ) -> dict[str, Any]:
        return {
            "keys": keys,
            "tags": [dict(part.keys[k].tag) for k in keys],
            "fields": fields,
            "finished": part.streams.finished,
            "lease": lease,
        }

    # ---- delivery: giving back, leases, acknowledgements ----------------------------------------------
    def _check_take(self, take: str | None) -> None:
        if take is not None and take in self.released:
            raise DataplaneError(f"take {take!r} was given back by its consumer before it arrived")

    @staticmethod
    def _lease(body: Any) -> float | None:
        """The deadline of the lease a taking request asks for, if it took rows now."""
        return None if body.lease_s is None or body.take is None else time.monotonic() + body.lease_s

    def _batch_of(self, part: _PartMeta, body: Any, got: tuple[list[str], str | None]) -> dict[str, Any]:
        """The reply to a take; a lease it made is queued for expiry."""
        keys, lease = got
        if lease is not None:
            deadline = part.streams.tasks[body.task].leases[lease].deadline
            heapq.heappush(self.lease_due, (deadline, next(self._txn_ids), body.pid, body.task, lease))
        return self._batch(part, body.pid, keys, body.fields, lease)

    def give_back(self, pid: str, task: str, take: str | None, keys: list[str]) -> None:
        """A batch's reply could not be delivered (its consumer went away): its rows are ready again."""
        part = self.partitions.get(pid)
        if part is not None:
            if take is None or part.streams.release(task, take) is None:
                part.streams.unconsume(task, keys)
            self.changed.add(pid)

    def op_release(self, body: _protocol.Release) -> dict[str, Any]:
        """Give back what a take got (its consumer gave up on the call, or lets its lease go). A take
        the index has not seen yet is refused when it comes (the release overtook it)."""
        part = self.partitions.get(body.pid)
        released = None if part is None else part.streams.release(body.task, body.take)
        self.released[body.take] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)
        if released:
            self.changed.add(body.pid)
        return {"released": released or 0, "known": released is not None}

    def op_ack(self, body: _protocol.Ack) -> dict[str, Any]:
        """Leased keys done with: taken for good. Answers the keys whose lease ran out first."""
        part = self.partitions.get(body.pid)
        if part is None:
            raise PartitionNotFoundError(body.pid)
        return {"late": part.streams.ack(body.task, body.take, _protocol.unique_keys(body.keys, "ack"))}

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
            return PartitionNotFoundError(
                body.pid, f"partition {body.pid!r} not found: no put created it within {waited:.1f}s"
            )
        fields = _fieldset(body.fields)
        counts = part.streams.counts(body.task, fields)
        want = body.batch_size if op == "next" else body.min_rows
        never = [f for f in sorted(fields) if not any(f in m.fields for m in part.keys.values())]
        hint = f"; no row holds {never} (no put wrote them yet)" if never else ""
        return BatchTimeoutError(
            body.pid,
            f"after {waited:.1f}s only {counts['ready']} row(s) of partition {body.pid!r} were ready for "
            f"task {body.task!r} (fields {sorted(fields)}), fewer than the {want} asked for; nothing "
            f"was consumed{hint}",
        )

    def op_finish(self, body: _protocol.OnePartition) -> dict[str, Any]:
        """Producers are done: consumers get what is left, then empty batches at once."""
        part = self.partitions.get(body.pid)
        if part is None:  # (a misspelt name must not create an empty, finished partition)
            raise PartitionNotFoundError(
                body.pid, f"partition {body.pid!r} not found: nothing to finish (no put created it)"
            )
        part.streams.finished = True
        self.changed.add(body.pid)
        return {}

    def op_reset(self, body: _protocol.Reset) -> dict[str, Any]:
        part = self.partitions.get(body.pid)
        if part is not None:
            part.streams.reset(body.task)
            self.changed.add(body.pid)
        return {}

    def op_consumption(self, body: _protocol.Consumption) -> dict[str, Any]:
        part = self.partitions.get(body.pid)
        if part is None:
            raise PartitionNotFoundError(body.pid)
        fields = None if body.fields is None else _fieldset(body.fields)
        return part.streams.counts(body.task, fields)

    def op_consumed(self, body: _protocol.Consumed) -> dict[str, Any]:
        """The keys ``task`` has taken from the partition (TransferQueue's per-row consumption status)."""
        part = self.partitions.get(body.pid)
        task = None if part is None else part.streams.tasks.get(body.task)
        return {"keys": [] if task is None else [k for k in part.keys if k in task.consumed]}

    def op_tasks(self, body: _protocol.Tasks) -> dict[str, Any]:
        """The consumer tasks of a partition with their counts (``PartitionStreams.overview``: taken,
        ready and not taken, leased, the fields each waits for), and the partition's rows, fields
        (in the order their schemas were decided) and whether it is finished. O(tasks)."""
        part = self.partitions.get(body.pid)
        if part is None:
            raise PartitionNotFoundError(body.pid)
        return {
            "rows": len(part.keys),
            "fields": list(self.schemas.get(body.pid, {})),
            "finished": part.streams.finished,
            "tasks": part.streams.overview(),
        }

    def op_list(self, body: _protocol.ListKeys) -> dict[str, Any]:
        pid = body.pid
        pids = [pid] if pid is not None else list(self.partitions)
        return {
            "list": {
                p: {k: dict(m.tag) for k, m in self.partitions[p].keys.items()}
                for p in pids
                if p in self.partitions
            }
        }

    def op_resolve(self, body: _protocol.Resolve) -> dict[str, Any]:
        """Which of ``keys`` the index knows, and which fields they hold (classifies a failed get)."""
        part = self.partitions.get(body.pid)
        if part is None:
            return {"partition": False, "known": {}}
        return {
            "partition": True,
            "known": {k: sorted(part.keys[k].fields) for k in body.keys if k in part.keys},
        }

    def op_stats(self, body: _protocol.Stats) -> dict[str, Any]:
        return {"partitions": {p: len(m.keys) for p, m in self.partitions.items()}}

    def op_ping(self, body: _protocol.Ping) -> dict[str, Any]:
        return {}


# Requests that may wait for rows, or that take rows (a reply that cannot be delivered gives them back).
_TAKING_OPS = _protocol.WAITING_OPS | {"claim"}
RELEASED_MEMORY = 65536  # take ids given back, remembered to refuse a request that arrives after them
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


class IndexServer(ZmqServer):
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
        if not self.deliver(w.sock, w.ident, _wire.encode_reply(w.rid, result)):
            if w.op in ("next", "claim") and result["keys"]:  # its consumer went away: ready again
                self.core.give_back(w.body.pid, w.body.task, w.body.take, result["keys"])
        elif w.op != "ready":
            self.rows_taken += len(result["keys"])
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
        return max(0, min(POLL_MS, math.ceil((due - time.monotonic()) * 1000)))

    def after_poll(self) -> None:
        now = time.monotonic()
        self.core.expire_leases(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done or self._try(w):
                continue
            self._done(w)
            err = self.core.timeout_error(w.op, w.body, now - w.start)
            self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, err))
            waiting = self._waiters.get(w.body.pid, [])
            if w in waiting:
                waiting.remove(w)
        self._recheck()

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
        metrics: bool = False,
        metrics_partitions: int = -1,
    ) -> None:
        self.core = IndexCore()
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
