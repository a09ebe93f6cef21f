"""The index's operations on what is stored: a put's ``prepare``, ``commit`` (``commits``: several
at once, from a shard) and ``abort``, and ``clear`` / ``clear_partition``.

A put's schema is decided at its prepare, first writer wins: fields already decided must match, and
new ones are recorded then, pending until the put commits. An open prepare expires after
``prepare_ttl_s`` as if aborted, and an abort that overtakes its prepare makes the index refuse the
prepare when it comes. A commit checks everything before it changes anything, so a refused commit
changed nothing. Mixed into ``IndexCore`` (``server.index``); runs on the index's one thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from dataplane.codec.column_types import describe_family
from dataplane.errors import ReservationExpiredError, SchemaMismatchError, WireError
from dataplane.server.index.keytable import NOTHING as _NOTHING
from dataplane.server.index.keytable import Tag
from dataplane.server.index.records import (
    CLEARED_KEYS_KEPT,
    CLEARED_PARTITIONS_KEPT,
    FieldSchema,
    IndexRecords,
    PartMeta,
)
from dataplane.server.jobs import Job, run_job
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol

MAX_EARLY_ABORTS = 1 << 16  # aborts of puts not seen yet that the index remembers (oldest forgotten)
ON_NEW_MIN = 64  # a commit of this many new keys or more appends them to the streams at once (``on_new``)
COMMIT_SLICE = 512  # keys a commit records per step (under a millisecond), other requests between


def _remember(record: OrderedDict[str, None], name: str, bound: int) -> None:
    """Add ``name`` to a bounded record, newest last; the oldest go first."""
    record[name] = None
    record.move_to_end(name)
    while len(record) > bound:
        record.popitem(last=False)


class IndexPuts(IndexRecords):
    """The put and clear operations of ``IndexCore`` (see the module docstring)."""

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
        pid, txn = body.partition, body.txn
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
                entry = schema[name] = FieldSchema(families[name])
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

    def _families(self, pid: str, specs: dict[str, _protocol.WireSpec]) -> dict[str, list[str | int]]:
        """Each spec's family, checked against the partition's schema (``SchemaError`` on a mismatch)."""
        schema = self.schemas.get(pid, {})
        families: dict[str, list[str | int]] = {}
        for name, spec in specs.items():
            new_s = _wire.spec_from_wire(spec)
            new_s.check(name)
            families[name] = list(new_s.family())
            old = schema.get(name)
            if old is not None and old.family != families[name]:
                if not old.confirmed:
                    raise SchemaMismatchError(
                        name,
                        ":".join(map(str, old.family)),
                        f"field {name!r}: new data ({describe_family(families[name])}) does not match "
                        f"what a put in flight is creating the field as ({describe_family(old.family)}); "
                        "write it with that dtype, or use a new field name (if that put never commits, "
                        f"the field is free again within {self.prepare_ttl_s:.0f}s, reservation_timeout_s)",
                    )
                raise SchemaMismatchError(
                    name,
                    ":".join(map(str, old.family)),
                    f"field {name!r}: new data ({describe_family(families[name])}) does not match the stored "
                    f"column ({describe_family(old.family)}); write it with the stored dtype, or use a new "
                    "field name",
                )
        return families

    def _decide(self, pid: str, specs: dict[str, _protocol.WireSpec]) -> None:
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
                entry = schema[name] = FieldSchema(family, confirmed=True)
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
        return run_job(self.job_commit(body))

    def job_commit(self, body: _protocol.IndexCommit) -> Job[_protocol.CommitReply]:
        """Record that ``keys`` now hold ``fields`` (and merge ``tags``); returns fields and tags.
        Everything is checked before anything changes; then the keys are recorded ``COMMIT_SLICE`` at
        a time, a step each (the index's server answers other requests between them). Each key is
        ready for consumers as its slice lands; if the partition is cleared meanwhile, the keys not
        recorded yet go with it (as if the clear came after the whole commit)."""
        pid, keys, fields, tags = (
            body.partition,
            _protocol.unique_keys(body.keys, "commit"),
            body.fields,
            body.tags,
        )
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
        if part is None:  # (not setdefault: a PartMeta is not free to build, and commits are many)
            part = self.partitions[pid] = PartMeta()
        fieldset = frozenset(fields)
        union: set[str] = set()
        for at in range(0, len(keys), COMMIT_SLICE):
            if at:
                yield None
                if self.partitions.get(pid) is not part:  # cleared meanwhile: the rest goes with it
                    break
            chunk_tags = None if tags is None else tags[at : at + COMMIT_SLICE]
            union.update(*self._record(part, keys[at : at + COMMIT_SLICE], fieldset, chunk_tags))
            self.changed.add(pid)  # (its parked takes look again after each step)
        self.changed.add(pid)
        tag = part.keys.tag
        # (untagged: one empty dict for all, as the reply is encoded, never changed)
        out_tags = [dict(tag(k)) for k in keys] if part.keys.tagged() else [{}] * len(keys)
        order = list(self.schemas.get(pid, {}))
        ordered = [f for f in order if f in union] + sorted(union.difference(order))
        return _protocol.CommitReply(ordered, out_tags)

    @staticmethod
    def _record(
        part: PartMeta, keys: list[str], fields: frozenset[str], tags: list[Tag | None] | None
    ) -> set[frozenset[str]]:
        """``keys`` now hold ``fields`` (and their tags merged): the keys' table and the consumers'
        streams (rows that became ready, ready rows retagged); the field sets the keys hold now."""
        part.active = time.monotonic()
        grew, before, retagged, sets = part.keys.commit(keys, fields, tags)
        streams = part.streams
        if streams.by_fields:
            for key in retagged:
                streams.on_retag(key)
            if len(grew) >= ON_NEW_MIN and before.count(_NOTHING) == len(before):  # new keys: at once
                streams.on_new(grew, part.keys[grew[0]])
            else:
                held = part.keys.__getitem__
                for key, old in zip(grew, before, strict=True):
                    streams.on_commit(key, old, held(key))
        return sets

    def op_commits(self, body: _protocol.Commits) -> _protocol.CommitsReply:
        return run_job(self.job_commits(body))

    def job_commits(self, body: _protocol.Commits) -> Job[_protocol.CommitsReply]:
        """Several independent commits (a shard passing on the puts it stored since its last batch):
        each gets its own answer, ``CommitResult(ok=reply)`` or ``CommitResult(err=[class, message,
        attrs])``. A commit that is refused changed nothing (``job_commit`` checks everything first),
        so its shard can take the rows back."""
        results: list[_protocol.CommitResult] = []
        for item in body.items:
            try:
                results.append(_protocol.CommitResult(ok=(yield from self.job_commit(item))))
            except Exception as exc:  # noqa: BLE001 - one refused commit does not refuse the others
                results.append(_protocol.CommitResult(err=_wire.error_fields(exc)))
        return _protocol.CommitsReply(results)

    def op_clear(self, body: _protocol.Clear) -> _protocol.RemovedReply:
        part = self.partitions.get(body.partition)
        removed = 0
        if part is not None:
            for key in body.keys:
                if part.keys.remove(key):
                    removed += 1
                    part.streams.on_clear(key)
                    _remember(part.cleared, key, CLEARED_KEYS_KEPT)
            part.keys.settle()
        return _protocol.RemovedReply(removed)

    def op_clear_partition(self, body: _protocol.OnePartition) -> _protocol.ExistedReply:
        pid = body.partition
        part = self.partitions.pop(pid, None)
        existed = part is not None
        if part is not None:
            self.drop(part)
            _remember(self.cleared, pid, CLEARED_PARTITIONS_KEPT)
        self.schemas.pop(pid, None)
        self.changed.add(pid)
        return _protocol.ExistedReply(existed)


__all__ = ["COMMIT_SLICE", "MAX_EARLY_ABORTS", "ON_NEW_MIN", "IndexPuts"]
