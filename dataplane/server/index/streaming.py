"""The index's streaming operations: what consumer tasks take, hold and give back.

* taking: ``next`` (a batch chosen by a sampler on the index; may wait), ``ready`` (ready rows for a
  sampler on the client; may wait), ``claim`` (the rows such a sampler chose);
* delivery: ``release`` (a take given back), ``ack`` (leased rows done with), and the lease deadlines
  that give a dead consumer's rows back (``queue_lease``, ``expire_leases``);
* the partition's course: ``finish``, ``reset``;
* progress: ``consumption``, ``consumed``, ``tasks``.

Per-partition consumption lives in ``PartitionStreams`` (``server.index.streams``); a call that waits is
parked by the index's server (``server.index.actor``) and asked again when its partition changes.
Mixed into ``IndexCore`` (``server.index``); runs on the index's one thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Any

from dataplane.errors import (
    BatchTimeoutError,
    DataplaneError,
    PartitionNotFoundError,
    WireError,
    did_you_mean,
)
from dataplane.samplers import from_spec
from dataplane.server.index.records import IndexRecords, PartMeta
from dataplane.wire import protocol as _protocol

RELEASED_MEMORY = 65536  # take ids given back, remembered to refuse a request that arrives after them
LEASE_HEAP_COMPACT = 65536  # lease deadlines queued before the acknowledged ones are swept out


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


class IndexStreaming(IndexRecords):
    """The streaming operations of ``IndexCore`` (see the module docstring)."""

    def op_next(self, body: _protocol.Next) -> _protocol.BatchReply | None:
        """The next batch for a consumer task, or None while not enough rows are ready (the actor
        waits for a commit to this partition and asks again)."""
        self._check_take(body.take)
        sampler = _sampler(body)  # (bad arguments are refused at once, not once rows exist)
        part = self.partitions.get(body.partition)
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
            self._watch_build(body.partition, part)
            return None
        return self._batch_of(part, body, got)

    def op_ready(self, body: _protocol.Ready) -> _protocol.ReadyReply | None:
        """Ready rows (key, tag) for a client-side sampler, once ``min_rows`` are ready or the
        partition is finished; a cached choice for this DP rank and batch index first."""
        part = self.partitions.get(body.partition)
        if part is None:
            return None
        fields = _fieldset(body.fields)
        cached = part.streams.cached(body.task, fields, body.dp_rank, body.batch_index)
        if cached is not None:
            got = self._batch(part, cached, body.fields)
            return _protocol.ReadyReply(
                cached=True, finished=got.finished, keys=got.keys, tags=got.tags, fields=got.fields
            )
        task, stream = part.streams.stream(body.task, fields)
        if stream.build is not None:
            self._watch_build(body.partition, part)
            return None
        drained = part.streams.drained(task, fields)
        if len(stream.ready) < body.min_rows and not drained:
            return None
        tag = part.keys.tag
        rows = [(k, tag(k)) for k in itertools.islice(stream.ready, body.limit)]
        return _protocol.ReadyReply(rows=rows, finished=drained)

    def op_claim(self, body: _protocol.Claim) -> _protocol.BatchReply:
        self._check_take(body.take)
        part = self.partitions.get(body.partition)
        if part is None:
            raise self.missing(body.partition)
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

    def _watch_build(self, pid: str, part: PartMeta) -> None:
        """A stream of ``part`` is being gathered: the loop goes on with it between requests."""
        if part.streams.building:
            self.building[pid] = part

    @staticmethod
    def _batch(
        part: PartMeta, keys: list[str], fields: list[str], lease: str | None = None
    ) -> _protocol.BatchReply:
        tag = part.keys.tag
        # (untagged rows share one empty dict: the reply is encoded and dropped, never changed)
        tags = [dict(tag(k)) for k in keys] if part.keys.tagged() else [{}] * len(keys)
        return _protocol.BatchReply(keys, tags, fields, part.streams.finished, lease)

    # ---- delivery: giving back, leases, acknowledgements ----------------------------------------------
    def _check_take(self, take: str | None) -> None:
        if take is not None and take in self.released:
            raise DataplaneError(f"take {take!r} was given back by its consumer before it arrived")

    @staticmethod
    def _lease(body: Any) -> float | None:
        """The deadline of the lease a taking request asks for, if it took rows now."""
        return None if body.lease_s is None or body.take is None else time.monotonic() + body.lease_s

    def _batch_of(self, part: PartMeta, body: Any, got: tuple[list[str], str | None]) -> _protocol.BatchReply:
        """The reply to a take; a lease it made is queued for expiry."""
        keys, lease = got
        task = part.streams.tasks[body.task]
        if keys:
            part.active = task.active = time.monotonic()
        if lease is not None:
            self.queue_lease(task.leases[lease].deadline, body.partition, body.task, lease)
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
        part = self.partitions.get(body.partition)
        released = None if part is None else part.streams.release(body.task, body.take)
        self.released[body.take] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)
        if released:
            self.changed.add(body.partition)
        return _protocol.ReleaseReply(released or 0, released is not None)

    def op_ack(self, body: _protocol.Ack) -> _protocol.AckReply:
        """Leased keys done with: taken for good. Answers the keys whose lease ran out first."""
        part = self.partitions.get(body.partition)
        if part is None:
            raise self.missing(body.partition)
        late = part.streams.ack(body.task, body.take, _protocol.unique_keys(body.keys, "ack"))
        task = part.streams.tasks.get(body.task)
        if task is not None:
            part.active = task.active = time.monotonic()
        if part.streams.finished:  # a consumer draining the partition may wait for these rows only
            self.changed.add(body.partition)
        return _protocol.AckReply(late)

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
                for take, lease in t.leases.items()
                if lease.keys  # (one acknowledged in full has nothing left to give back)
            }
            self.lease_due = [e for e in self.lease_due if e[2:] in live]
            heapq.heapify(self.lease_due)

    def timeout_error(self, op: str, body: Any, waited: float) -> Exception:
        """What a waiting call that timed out raises: which partition, how many rows were ready."""
        part = self.partitions.get(body.partition)
        if part is None:
            return self.missing(
                body.partition,
                f"partition {body.partition!r} not found: no put created it within {waited:.1f}s",
            )
        fields = _fieldset(body.fields)
        counts = part.streams.counts(body.task, fields)
        want = body.batch_size if op == "next" else body.min_rows
        written = frozenset().union(*part.keys.field_sets())
        never = [f for f in sorted(fields) if f not in written]
        hint = f"; no row holds {never} (no put wrote them yet)" if never else ""
        if part.streams.finished and counts.leased:
            hint += (
                f"; the partition is finished but {counts.leased} row(s) are leased by other takes of "
                "this task: they come back here if their lease runs out unacknowledged"
            )
        hint += "".join(did_you_mean(f, written) for f in never)
        return BatchTimeoutError(
            body.partition,
            f"after {waited:.1f}s only {counts.ready} row(s) of partition {body.partition!r} were ready for "
            f"task {body.task!r} (fields {sorted(fields)}), fewer than the {want} asked for; nothing "
            f"was consumed{hint}",
        )

    def op_finish(self, body: _protocol.OnePartition) -> _protocol.Done:
        """Producers are done: consumers get what is left, then empty batches at once (a task whose
        rows are leased waits for their ack or their lease to run out, ``PartitionStreams.drained``)."""
        part = self.partitions.get(body.partition)
        if part is None:  # (a misspelt name must not create an empty, finished partition)
            raise self.missing(
                body.partition,
                f"partition {body.partition!r} not found: nothing to finish (no put created it)",
            )
        part.streams.finished = True
        self.changed.add(body.partition)
        return _protocol.Done()

    def op_reset(self, body: _protocol.Reset) -> _protocol.Done:
        part = self.partitions.get(body.partition)
        if part is not None:
            part.streams.reset(body.task)
            self._watch_build(body.partition, part)
            self.changed.add(body.partition)
        return _protocol.Done()

    def op_consumption(self, body: _protocol.Consumption) -> _protocol.ConsumptionReply:
        part = self.partitions.get(body.partition)
        if part is None:
            raise self.missing(body.partition)
        fields = None if body.fields is None else _fieldset(body.fields)
        return part.streams.counts(body.task, fields)

    def op_consumed(self, body: _protocol.Consumed) -> _protocol.ConsumedReply:
        """The keys ``task`` has taken among a page of the partition's keys, in key order, and the
        next page's cursor (TransferQueue's per-row consumption status, asked for page by page: a
        page costs ``limit`` lookups, however big the partition)."""
        part, start = self.page_start(body.partition, body.cursor, "walk of consumed keys")
        if part is None:
            return _protocol.ConsumedReply([])
        names, nxt = part.keys.names_from(start, body.limit)
        task = part.streams.tasks.get(body.task)
        keys = [] if task is None else list(filter(task.consumed.__contains__, names))
        return _protocol.ConsumedReply(keys, None if nxt is None else f"{part.incarnation}.{nxt}")  # type: ignore[arg-type]

    def op_tasks(self, body: _protocol.Tasks) -> _protocol.TasksReply:
        """The consumer tasks of a partition with their counts (``PartitionStreams.overview``: taken,
        ready and not taken, leased, the fields each waits for), and the partition's rows, fields
        (in the order their schemas were decided) and whether it is finished. O(tasks)."""
        part = self.partitions.get(body.partition)
        if part is None:
            raise PartitionNotFoundError(body.partition)
        return _protocol.TasksReply(
            rows=len(part.keys),
            fields=list(self.schemas.get(body.partition, {})),
            finished=part.streams.finished,
            tasks=part.streams.overview(time.monotonic()),
        )


__all__ = ["LEASE_HEAP_COMPACT", "RELEASED_MEMORY", "IndexStreaming"]
