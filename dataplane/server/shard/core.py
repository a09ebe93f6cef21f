"""A storage shard's core: column segments in memory, rows addressed as (segment, row), byte accounting.

``ShardCore`` is a plain class (no Ray, no sockets); ``shard.actor`` wraps it in a Ray actor and a
zmq loop. Every operation takes a request body plus its buffer frames and returns its reply struct
plus buffer frames (``dispatch.Operations``; the structs are ``wire.protocol``'s, the frames
``dataplane.wire.frames``).

A put is two steps so that a failure anywhere writes nothing:
1. ``reserve``: check the schema and the byte capacity, then either keep the inline column frames
   (zmq path, small columns) or hand out shared-memory files the client copies into (same host);
2. ``commit``: attach the rows to their keys (replacing older values of the same fields), or
   ``abort``. A reservation whose client vanished is undone after ``reservation_timeout_s``.
A put of B rows makes one segment per field; a get answers with shared-memory references (the
client gathers straight from the segments) or with one gathered frame per field in request order.
The shard never unpickles anything: object columns are opaque bytes here.

Invariants (``docs/reliability.md`` has the tests that back each):

* Every peer-declared value is checked before anything changes: bodies are typed
  (``wire.protocol``), specs are ones the codec can write, declared byte counts equal the frames
  sent and fit the capacity (or, unbounded, the host's memory: what a put allocates must fit the
  host's available memory, shared with the store's other shards there, ``server.shard.host_memory``),
  offsets rise from 0 to the data length. A malformed request gets a typed error reply and changes nothing.
* A row's bytes never change while it is live: writers write only into segments they reserved,
  before the commit that makes them readable.
* Memory is reused only when no reader can be misled (see ``server.shard.segments``): a freed segment moves
  to its next generation before reuse, and readers that copied from it check the generation and
  retry; a segment handed out as a view is never reused; a reservation that expires is *fenced*
  (its files are closed, never recycled), because its writer may still be writing into them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane._units import exact_bytes
from dataplane.codec.column_types import Column, ColumnSpec, check_offsets, check_shapes
from dataplane.codec.rows import assemble_any, contiguous_view
from dataplane.errors import (
    DataplaneError,
    FieldNotFoundError,
    KeyNotFoundError,
    PartitionNotFoundError,
    ReservationExpiredError,
    SchemaError,
    StoreFullError,
    WireError,
)
from dataplane.server.dispatch import Operations, OpReply
from dataplane.server.jobs import Job, run_job
from dataplane.server.shard.host_memory import HostMemory
from dataplane.server.shard.segments import ShmFile, ShmPool
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol

logger = logging.getLogger(__name__)

ROW_BITS = 32  # a row code is (segment id << ROW_BITS) | row: a put writes fewer than 2**32 rows
ROW_MASK = (1 << ROW_BITS) - 1
DROP_SLICE = 16384  # rows of a cleared partition freed at a time, between requests (``free_some``)
ATTACH_SLICE = 1024  # rows a put attaches per step (about a millisecond), requests answered between
_segment_ids = itertools.count(1)


@dataclass(eq=False)
class Segment:
    """One field of the rows one put wrote to this shard: a contiguous buffer (+ offsets)."""

    spec: ColumnSpec
    num_rows: int
    nbytes: int
    data: memoryview | None  # heap bytes (a received frame) when not in shared memory
    offsets: np.ndarray | None
    file: ShmFile | None
    shapes: np.ndarray | None = None  # ragged rows' shapes
    live: int = 0  # rows pointing at it, and the checkpoint saves that pinned it (``pins``)
    owner: _Partition | None = None  # whose bytes it counts in (``_Partition.nbytes``); set once attached
    sid: int = field(default_factory=_segment_ids.__next__)  # its name in its partition's row codes
    pins: int = 0  # checkpoint saves writing it (``ShardCheckpoints``): its bytes outlive its rows till then

    @property
    def accounted(self) -> int:
        aux = (0 if self.offsets is None else self.offsets.nbytes) + (
            0 if self.shapes is None else self.shapes.nbytes
        )
        return self.nbytes + aux

    @property
    def heap_bytes(self) -> int:
        """Bytes held in the shard's own heap (not shared memory): inline data, offsets, shapes."""
        return self.accounted - (self.nbytes if self.file is not None else 0)

    def column(self) -> Column:
        data = self.file.view()[: self.nbytes] if self.file is not None else self.data
        assert data is not None, "a freed segment was read"  # (a live row's segment holds its bytes)
        return Column(self.spec, self.num_rows, data, self.offsets, self.shapes)


def row_code(seg: Segment, i: int) -> int:
    """Where a row's value of a field is: row ``i`` of ``seg``, as one int (``_Partition.loc``)."""
    return seg.sid << ROW_BITS | i


@dataclass
class _Partition:
    """A partition's rows: key -> field -> a row code (``row_code``: a plain int, so a row is a dict of
    ints that the garbage collector never tracks, however many keys the shard holds), and the
    segments the codes name."""

    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    specs: dict[str, ColumnSpec] = field(default_factory=dict)
    nbytes: int = 0  # bytes of its live segments (``Segment.accounted``)
    segs: dict[int, Segment] = field(default_factory=dict)  # sid -> its segments holding rows

    def seg(self, code: int) -> Segment:
        """The segment a row code names."""
        return self.segs[code >> ROW_BITS]

    def loc(self, code: int) -> tuple[Segment, int]:
        """The segment and row a row code names."""
        return self.seg(code), code & ROW_MASK


@dataclass
class PutUndo:
    """What takes back the rows of one ``put_ready`` (``ShardCore.undo_put``)."""

    pid: str
    keys: list[str]
    segs: dict[str, Segment]  # field -> the segment the put made


@dataclass
class _Field:
    """One field of a put, checked: its spec and bytes, and where its rows are (an inline column,
    or once reserved a shared-memory file; neither while being checked)."""

    spec: ColumnSpec
    nbytes: int
    col: Column | None = None
    file: ShmFile | None = None


@dataclass
class _Reservation:
    pid: str
    keys: list[str]
    fields: dict[str, _Field]
    nbytes: int
    deadline: float


def host_memory_bytes() -> int:
    """Physical memory of this host: the most an unbounded shard accepts in one put."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ShardCore(Operations):
    """The shard's storage logic. Not thread-safe: the server serialises calls."""

    OPS = _protocol.SHARD_OPS
    REPLIES = _protocol.SHARD_REPLIES
    SERVER_OPS = frozenset({"put_ready"})  # its reply waits for the index: ``ShardServer`` answers it
    JOBS = {"commit": "job_commit"}  # (attached in steps: ``_attach_steps``)
    SERVICE = "the shard"

    def __init__(
        self,
        shard_id: int,
        capacity_bytes: int | None = None,
        warm_idle_s: float = 2.0,
        warm_retain_bytes: int = 1 << 30,
        reservation_timeout_s: float = 120.0,
        name: str = "dataplane",
        host: HostMemory | None = None,
    ) -> None:
        self.shard_id = shard_id
        self.capacity = capacity_bytes
        # An unbounded shard admits shared memory against its host's (shared with the store's other
        # shards there when ``host`` is theirs too, ``HostMemory.for_store``).
        self.host = host if host is not None else HostMemory.private()
        self.pool = ShmPool(warm_idle_s, warm_retain_bytes, prefix=f"{name}-shard-{shard_id}")
        self.reservation_timeout_s = reservation_timeout_s
        self.partitions: dict[str, _Partition] = {}
        self.dropped: deque[dict[str, dict[str, int]]] = deque()  # rows of dropped partitions (``free_some``)
        self.used = 0
        self.pending = 0
        self.heap_bytes = 0
        self._resv: dict[int, _Reservation] = {}
        self._resv_ids = itertools.count(1)
        self.expired = 0
        self.host_memory = host_memory_bytes()
        self.ready_puts = 0  # put_ready requests stored and passed on to the index (by ShardServer)
        self.ready_batches = 0  # the index requests that carried them
        self.tick_hooks: list[Callable[[float], None]] = []  # more housekeeping (checkpoint expiry)
        # Lending (``op_get``): a remote reader's rows sent from shared memory by a transfer engine
        # that says when it is done with them, instead of a copy. The server sets the smallest column
        # worth lending for the request at hand (0: none); the segments lent are pinned until their
        # engine is done (``take_lent``'s callback queues them on ``returned``, any thread) and given
        # back on this core's thread before the next op runs, or at the tick.
        self.lend_min_bytes = 0
        self._lent: list[Segment] = []
        self.returned: deque[list[Segment]] = deque()
        # Cumulative, for metrics (``ShardServer.metrics_snapshot``): rows stored, served and freed,
        # and bytes stored and freed (``Segment.accounted``: what ``used`` counts).
        self.rows_put = self.rows_got = self.rows_cleared = 0
        self.bytes_put = self.bytes_cleared = 0

    # ---- put --------------------------------------------------------------------------------
    def op_reserve(
        self, body: _protocol.Reserve, bufs: list[memoryview]
    ) -> tuple[_protocol.ReserveReply, list[Any]]:
        pid, keys = body.partition, _protocol.unique_keys(body.keys, "reserve")
        fields, need = self._checked_fields(pid, keys, body.fields, bufs)
        files: dict[str, list[int]] = {}
        admit = self._admit(pid)
        try:
            for name, entry in fields.items():
                if entry.col is None:
                    entry.file = self.pool.acquire(max(1, entry.nbytes), admit)
                    files[name] = entry.file.ref()
        except OSError as exc:
            for entry in fields.values():
                if entry.file is not None:
                    self.pool.release(entry.file)
            if isinstance(exc, DataplaneError):  # out of file descriptors: already typed
                raise
            raise StoreFullError(
                f"shard {self.shard_id} could not allocate {exact_bytes(need)} of shared memory for "
                f"partition {pid!r} ({exc}); nothing was written"
            ) from exc
        rid = next(self._resv_ids)
        self._resv[rid] = _Reservation(
            pid, list(keys), fields, need, time.monotonic() + self.reservation_timeout_s
        )
        self.pending += need
        version = self.pool.version
        live = self.pool.live_ids() if body.version != version else None
        return _protocol.ReserveReply(rid, files, version, live), []

    def _checked_fields(
        self,
        pid: str,
        keys: list[str],
        wire_fields: dict[str, _protocol.ReserveField],
        bufs: list[memoryview],
    ) -> tuple[dict[str, _Field], int]:
        """A put's fields checked against what the request declares, the frames it carries, the
        partition's schema and the byte capacity (nothing changes here): ``{name: _Field}`` (with
        ``col``, the inline Column, where the request carries one), and the bytes the put needs."""
        if not keys or not wire_fields:  # a row-less segment would never be given back
            raise WireError("a reserve names at least one key and one field")
        part = self.partitions.get(pid)
        fields: dict[str, _Field] = {}
        need = 0
        for name, f in wire_fields.items():
            spec = _wire.spec_from_wire(f.spec)
            spec.check(name)
            if part is not None and name in part.specs:
                part.specs[name].check_compatible(spec, name)
            rb = spec.row_nbytes()
            if rb is not None and f.nbytes != rb * len(keys):
                raise SchemaError(
                    name, f"field {name!r} declares {f.nbytes} bytes for {len(keys)} rows of {rb} bytes"
                )
            entry = _Field(spec, f.nbytes)
            if f.col is not None:
                col = _wire.column_from_wire(f.col, bufs, name)
                if col.num_rows != len(keys) or col.spec != spec or col.nbytes != f.nbytes:
                    raise WireError(
                        f"field {name!r}: the inline column ({col.num_rows} rows, {col.nbytes} bytes, "
                        f"{col.spec}) does not match what the request declares ({len(keys)} rows, "
                        f"{f.nbytes} bytes, {spec})"
                    )
                entry.col = col
            fields[name] = entry
            need += f.nbytes + (0 if rb is not None else 8 * (len(keys) + 1))
            if spec.kind == "ragged":
                need += 8 * len(keys) * spec.shape[0]
        self._check_capacity(need, pid)
        return fields, need

    def _admit(self, pid: str) -> Callable[[int], contextlib.AbstractContextManager[None]] | None:
        """What admits a fresh shared-memory file for a put to ``pid``: on an unbounded shard its host
        (``HostMemory``: the host's available memory, less what the store's other shards there are
        allocating); a bounded one checked its capacity already, and a warm file needs no new memory."""
        if self.capacity is not None:
            return None
        what = f"shard {self.shard_id}: a put to partition {pid!r}"
        return lambda nbytes: self.host.admit(nbytes, what)

    def _check_capacity(self, need: int, pid: str) -> None:
        if self.capacity is None:  # unbounded: still never more than the host could hold
            if self.used + self.pending + need > self.host_memory:
                raise StoreFullError(
                    f"shard {self.shard_id}: a put of {exact_bytes(need)} to partition {pid!r} (with "
                    f"{exact_bytes(self.used)} used and {exact_bytes(self.pending)} reserved) is larger than "
                    f"this host's memory, {exact_bytes(self.host_memory)}; nothing was written. Clear data "
                    "(dp.kv_clear / dp.clear_partition), or put in smaller batches"
                )
            return
        if self.used + self.pending + need > self.capacity:
            raise StoreFullError(
                f"shard {self.shard_id} is full: a put of {exact_bytes(need)} to partition {pid!r} would "
                f"exceed its capacity of {exact_bytes(self.capacity)} (used {exact_bytes(self.used)}, "
                f"reserved by puts in flight {exact_bytes(self.pending)}); nothing was written. Clear data "
                "(dp.kv_clear / dp.clear_partition), or start the store with more capacity "
                "(dp.init(capacity_bytes=...), `rlplane store start --capacity SIZE`)"
            )

    def put_ready(
        self, body: _protocol.PutReady, bufs: list[memoryview]
    ) -> tuple[_protocol.IndexCommit, PutUndo]:
        return run_job(self.job_put_ready(body, bufs))

    def job_put_ready(
        self, body: _protocol.PutReady, bufs: list[memoryview]
    ) -> Job[tuple[_protocol.IndexCommit, PutUndo]]:
        """Check and store a one-step put (every column inline): ``op_reserve``'s checks, then
        ``_commit``'s attach, with no reservation between them (nothing can come between the two:
        the rows are attached in steps, but from the same checked columns; and there is no shared
        memory to hand out). Returns the index commit that makes its rows ready (sent on by
        ``ShardServer``) and what takes the rows back if the index refuses it.

        The commit is built here from what this shard stored (partition, keys, fields, specs), so it
        can only name rows that are readable here; the client adds nothing but the tags.
        """
        if any(f.col is None for f in body.fields.values()):
            raise WireError("a one-step put carries every column inline")
        keys = _protocol.unique_keys(body.keys, "reserve")
        fields, _ = self._checked_fields(body.partition, keys, body.fields, bufs)
        segs = yield from self._attach_steps(body.partition, keys, fields, {}, {})
        specs = {name: f.spec for name, f in body.fields.items()}
        commit = _protocol.IndexCommit(body.partition, body.keys, list(body.fields), body.tags, specs=specs)
        return commit, PutUndo(body.partition, body.keys, segs)

    def undo_put(self, undo: PutUndo) -> None:
        """Take back the rows of a ``put_ready`` the index refused (it recorded nothing), except where a
        later put has replaced them already. The put's fields that no row holds any more lose their
        spec here too, so a refused dtype does not make this shard refuse the one the index decided
        (the index, which keeps every partition's schema, still checks each put)."""
        part = self.partitions.get(undo.pid)
        if part is None:
            return
        for key in undo.keys:
            row = part.rows.get(key)
            if row is None:
                continue
            for name, seg in undo.segs.items():
                code = row.get(name)
                if code is not None and code >> ROW_BITS == seg.sid:
                    del row[name]
                    self._unref(seg)
            if not row:
                del part.rows[key]
        for name in undo.segs:  # rare (a refused put): a scan of the partition is fine
            if name in part.specs and not any(name in row for row in part.rows.values()):
                del part.specs[name]
        if not part.rows and not part.specs:
            del self.partitions[undo.pid]

    def op_commit(self, body: _protocol.Commit, bufs: list[memoryview]) -> tuple[_protocol.Done, list[Any]]:
        return run_job(self.job_commit(body, bufs))

    def job_commit(
        self, body: _protocol.Commit, bufs: list[memoryview]
    ) -> Job[tuple[_protocol.Done, list[Any]]]:
        """Attach a reservation's rows to their keys (in steps: ``_attach_steps``)."""
        yield from self._commit(body, bufs)
        return _protocol.Done(), []

    def _commit(self, body: _protocol.Commit, bufs: list[memoryview]) -> Job[dict[str, Segment]]:
        """Attach a reservation's rows to their keys; returns the segment made for each field."""
        resv = self._resv.get(body.resv)
        if resv is None:
            raise ReservationExpiredError(
                f"shard {self.shard_id}: reservation {body.resv} is unknown or expired (the writer took "
                "longer than reservation_timeout_s between reserve and commit); nothing of it was written"
            )
        n = len(resv.keys)
        part = self.partitions.get(resv.pid)
        try:  # check everything before changing anything; a bad commit undoes its reservation
            offsets: dict[str, np.ndarray] = {}
            shapes: dict[str, np.ndarray] = {}
            for name, entry in resv.fields.items():
                spec = entry.spec
                if part is not None and name in part.specs:  # a partition dropped and re-created
                    part.specs[name].check_compatible(spec, name)
                if entry.file is not None and spec.row_nbytes() is None:
                    if name not in body.offsets:
                        raise WireError(f"commit of field {name!r} carries no offsets")
                    off = _wire.array_from_wire(body.offsets[name], bufs, n + 1).copy()
                    check_offsets(off, n, entry.nbytes, spec, name)
                    offsets[name] = off
                    if spec.kind == "ragged":
                        if name not in body.shapes:
                            raise WireError(f"commit of ragged field {name!r} carries no row shapes")
                        ndim = spec.shape[0]
                        shp = _wire.array_from_wire(body.shapes[name], bufs, n * ndim).copy().reshape(n, ndim)
                        check_shapes(shp, off, spec, name)
                        shapes[name] = shp
        except Exception:  # noqa: BLE001 - a commit that cannot be applied gives its space back
            self._release(self._take(body.resv))
            raise
        self._take(body.resv)
        return (yield from self._attach_steps(resv.pid, resv.keys, resv.fields, offsets, shapes))

    def _attach_steps(
        self,
        pid: str,
        keys: list[str],
        fields: dict[str, _Field],
        offsets: dict[str, np.ndarray],
        shapes: dict[str, np.ndarray],
    ) -> Job[dict[str, Segment]]:
        """Make checked rows live: one segment per field, each key's row pointing at it (replacing an
        older value of the field), ``ATTACH_SLICE`` keys per step (the server answers other requests
        between them; the put is answered after the last). Returns the segment made for each field.
        If the partition is cleared meanwhile, the rows not attached yet go with it."""
        part = self.partitions.get(pid)
        if part is None:
            part = self.partitions[pid] = _Partition()
        made = self._segments(part, len(keys), fields, offsets, shapes)
        for at in range(0, len(keys) if made else 0, ATTACH_SLICE):
            if at:
                yield None
                if self.partitions.get(pid) is not part:  # cleared: what is left goes unattached
                    for seg in made.values():
                        self._unref(seg, len(keys) - at)
                    break
            self._attach(part, keys[at : at + ATTACH_SLICE], at, made)
        return made

    def _segments(
        self,
        part: _Partition,
        n: int,
        fields: dict[str, _Field],
        offsets: dict[str, np.ndarray],
        shapes: dict[str, np.ndarray],
    ) -> dict[str, Segment]:
        """One segment per field of a put of ``n`` rows, accounted, each held by all ``n`` rows (those
        not attached in the end are let go: ``_attach_steps``)."""
        made: dict[str, Segment] = {}
        if fields:
            self.rows_put += n
        for name, entry in fields.items():
            spec = entry.spec
            part.specs.setdefault(name, spec)
            col = entry.col
            if col is not None:
                seg = Segment(spec, n, len(col.data), col.data, col.offsets, None, col.shapes)
            else:
                seg = Segment(spec, n, entry.nbytes, None, offsets.get(name), entry.file, shapes.get(name))
            seg.owner = part
            accounted = seg.accounted
            self.used += accounted
            self.bytes_put += accounted
            part.nbytes += accounted
            self.heap_bytes += seg.heap_bytes
            made[name] = seg
            part.segs[seg.sid] = seg
            seg.live = n
        return made

    def _attach(self, part: _Partition, keys: list[str], first: int, made: dict[str, Segment]) -> None:
        """Point the rows of ``keys`` at rows ``first``... of the segments ``made`` (one step)."""
        rows, n = part.rows, len(keys)
        if not any(map(rows.__contains__, keys)):  # new keys (the usual put): one pass at C speed
            names = list(made)
            codes = [range(row_code(seg, first), row_code(seg, first + n)) for seg in made.values()]
            if len(names) == 1:
                rows.update(zip(keys, [{names[0]: c} for c in codes[0]], strict=True))
            else:
                made_rows = [dict(zip(names, c, strict=True)) for c in zip(*codes, strict=True)]
                rows.update(zip(keys, made_rows, strict=True))
            return
        for name, seg in made.items():
            base = row_code(seg, first)
            for key, code in zip(keys, range(base, base + n), strict=True):
                row = rows.get(key)
                if row is None:
                    row = rows[key] = {}
                old = row.get(name)
                row[name] = code
                if old is not None:
                    self._unref(part.seg(old))

    def op_abort(self, body: _protocol.Abort, bufs: list[memoryview]) -> tuple[_protocol.Done, list[Any]]:
        resv = self._resv.get(body.resv)
        if resv is not None:  # the writer says it is done with the files: they may be reused
            self._release(self._take(body.resv))
        return _protocol.Done(), []

    def _release(self, resv: _Reservation) -> None:
        for entry in resv.fields.values():
            if entry.file is not None:
                self.pool.release(entry.file)

    def _take(self, rid: int) -> _Reservation:
        resv = self._resv.pop(rid)
        self.pending -= resv.nbytes
        return resv

    def _unref(self, seg: Segment, n: int = 1) -> None:
        """``n`` fewer rows (or pins) hold ``seg``; freed with the last."""
        seg.live -= n
        if seg.live == 0:
            self.used -= seg.accounted
            assert seg.owner is not None  # (a segment holding rows is attached to its partition)
            seg.owner.nbytes -= seg.accounted
            seg.owner.segs.pop(seg.sid, None)
            self.heap_bytes -= seg.heap_bytes
            if seg.file is not None:
                self.pool.release(seg.file)
                seg.file = None
            seg.data = None

    # ---- get --------------------------------------------------------------------------------
    def _resolve(
        self, pid: str, keys: list[str], fields: list[str] | None
    ) -> tuple[_Partition, list[dict[str, int]], list[str]]:
        part = self.partitions.get(pid)
        if part is None:
            raise PartitionNotFoundError(pid)
        rows = []
        for key in keys:
            row = part.rows.get(key)
            if row is None:
                raise KeyNotFoundError(key, pid)
            rows.append(row)
        if fields is None:  # the fields every requested key holds
            common = set(rows[0]).intersection(*rows[1:]) if rows else set()
            return part, rows, [f for f in part.specs if f in common]
        for name in fields:
            for key, row in zip(keys, rows, strict=True):
                if name not in row:
                    raise FieldNotFoundError(key, pid, name)
        return part, rows, fields

    def op_get(self, body: _protocol.Get, bufs: list[memoryview]) -> tuple[_protocol.GetReply, list[Any]]:
        pid, keys = body.partition, body.keys
        if not keys:
            raise WireError("a get names at least one key")
        part, rows, fields = self._resolve(pid, keys, body.fields)
        self.rows_got += len(keys)
        out: dict[str, _protocol.InlineRows | _protocol.SegmentRows] = {}
        frames: list[Any] = []
        for name in fields:
            codes = np.fromiter([row[name] for row in rows], dtype=np.int64, count=len(rows))
            row_of = codes & ROW_MASK
            sids, seg_of = np.unique(codes >> ROW_BITS, return_inverse=True)
            seg_of = seg_of.reshape(-1).astype(np.int64, copy=False)
            order = [part.segs[int(sid)] for sid in sids]
            if body.shm and all(s.file is not None for s in order):
                out[name] = self._shm_entry(order, seg_of, row_of, frames, body.export)
            else:
                # Rows of one put held in this process's heap, asked for in order: sent as they are
                # (the reply keeps them alive; only shared memory is ever reused under a reader).
                # In shared memory, and large enough: lent to the engine, the segment pinned.
                col = None
                if len(order) == 1 and (order[0].file is None or self.lend_min_bytes):
                    col = contiguous_view(order[0].column(), row_of)
                    if col is not None and order[0].file is not None:
                        col = self._lend(order[0], col)
                if col is None:
                    pieces = []
                    for j, seg in enumerate(order):
                        dst = np.flatnonzero(seg_of == j)
                        pieces.append((seg.column(), row_of[dst], dst))
                    col = assemble_any(len(keys), pieces)
                out[name] = _protocol.InlineRows(_wire.column_to_wire(col, frames))
        version = self.pool.version
        live = self.pool.live_ids() if body.version != version else None
        return _protocol.GetReply(out, version, live), frames

    def _lend(self, seg: Segment, col: Column) -> Column | None:
        """``col`` (rows of ``seg``'s shared memory) pinned for the engine, or None: too small to lend."""
        if memoryview(col.data).nbytes < self.lend_min_bytes:
            return None
        seg.live += 1  # released by ``give_back`` once the engine is done with it
        seg.pins += 1
        self._lent.append(seg)
        return col

    def take_lent(self) -> Callable[[], None] | None:
        """What the op just run lent, as the callback that returns it (any thread, once); None when
        nothing was lent. The server hands it to the engine that stages the reply."""
        if not self._lent:
            return None
        lent, self._lent = self._lent, []
        return lambda: self.returned.append(lent)

    def give_back(self) -> None:
        """Unpin what engines are done with (this core's thread)."""
        while self.returned:
            for seg in self.returned.popleft():
                seg.pins -= 1
                self._unref(seg)

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        if self.returned:  # (a client reports its reads in its next request: they go before it runs)
            self.give_back()
        return super().run(op, body, bufs)

    def _shm_entry(
        self, order: list[Segment], seg_of: np.ndarray, row_of: np.ndarray, frames: list[Any], export: bool
    ) -> _protocol.SegmentRows:
        # Export (never recycle) a segment only when the client can view it: one contiguous run.
        # The reply says so per segment; a client returns a view only of an exported segment and
        # copies (then checks the generation of) every other one.
        run = len(order) == 1 and (len(row_of) < 2 or bool(np.all(np.diff(row_of) == 1)))
        segs: list[_protocol.SegmentRef] = []
        for seg in order:
            file = seg.file
            assert file is not None  # (the caller sends shared memory only when every segment has it)
            view = export and run
            if view:
                file.exported = True
            off = -1 if seg.offsets is None else _wire.array_to_wire(seg.offsets, frames)
            shp = -1 if seg.shapes is None else _wire.array_to_wire(seg.shapes, frames)
            segs.append((file.ref(), seg.nbytes, seg.num_rows, off, view, _wire.spec_to_wire(seg.spec), shp))
        return _protocol.SegmentRows(
            segs, _wire.array_to_wire(seg_of, frames), _wire.array_to_wire(row_of, frames)
        )

    # ---- clear ------------------------------------------------------------------------------
    def op_clear(
        self, body: _protocol.Clear, bufs: list[memoryview]
    ) -> tuple[_protocol.RemovedReply, list[Any]]:
        part = self.partitions.get(body.partition)
        removed = 0
        used = self.used
        if part is not None:
            for key in body.keys:
                row = part.rows.pop(key, None)
                if row is not None:
                    removed += 1
                    for code in row.values():
                        self._unref(part.seg(code))
        self._cleared(removed, used)
        return _protocol.RemovedReply(removed), []

    def op_clear_partition(
        self, body: _protocol.OnePartition, bufs: list[memoryview]
    ) -> tuple[_protocol.RemovedReply, list[Any]]:
        part = self.partitions.pop(body.partition, None)
        removed = 0
        used = self.used
        if part is not None:
            removed = self.drop_rows(part)
        self._cleared(removed, used)
        return _protocol.RemovedReply(removed), []

    def drop_rows(self, part: _Partition) -> int:
        """Let go of every row of ``part`` (no longer in ``partitions``); returns how many there were.

        Costs its segments, not its rows: each segment loses every row at once (a checkpoint save that
        pinned one keeps it until written), and the rows themselves are freed ``DROP_SLICE`` at a time
        between requests (``free_some``): a million at once would hold every other caller up."""
        for seg in list(part.segs.values()):
            self._unref(seg, seg.live - seg.pins)
        n = len(part.rows)
        if n:
            self.dropped.append(part.rows)
            part.rows = {}
        return n

    def free_some(self, n: int = DROP_SLICE) -> int:
        """Free up to ``n`` rows of the partitions dropped; how many went (0: none is left)."""
        while self.dropped:
            rows = self.dropped[0]
            take = min(n, len(rows))
            for _ in range(take):
                rows.popitem()
            if not rows:
                self.dropped.popleft()
            if take:
                return take
        return 0

    def _cleared(self, rows: int, used_before: int) -> None:
        """Count a clear's rows and the bytes it freed (a segment is freed with its last row)."""
        self.rows_cleared += rows
        self.bytes_cleared += used_before - self.used

    # ---- housekeeping -----------------------------------------------------------------------
    def op_stats(
        self, body: _protocol.Stats, bufs: list[memoryview]
    ) -> tuple[_protocol.ShardStatsReply, list[Any]]:
        if body.trim:
            self.pool.trim(everything=True)
        return self.stats(), []

    def stats(self) -> _protocol.ShardStatsReply:
        """The shard's accounting (``dp.stats()``; ``clients`` is the server loop's to add)."""
        return _protocol.ShardStatsReply(
            shard=self.shard_id,
            bytes_used=self.used,
            bytes_reserved=self.pending,
            reservations_expired=self.expired,
            ready_puts=self.ready_puts,
            ready_batches=self.ready_batches,
            bytes_resident=self.pool.bytes_resident + self.heap_bytes,
            bytes_warm=self.pool.bytes_warm,
            bytes_heap=self.heap_bytes,
            capacity_bytes=self.capacity,
            shm_files=len(self.pool.live) + len(self.pool.warm),
            partitions={pid: len(p.rows) for pid, p in self.partitions.items()},
            partition_bytes={pid: p.nbytes for pid, p in self.partitions.items()},
        )

    def tick(self, now: float | None = None) -> None:
        """Fence reservations whose writer stalled or vanished, and give back idle warm memory."""
        now = time.monotonic() if now is None else now
        self.give_back()
        for rid in [r for r, v in self._resv.items() if v.deadline < now]:
            logger.warning("shard %d: reservation %d was never committed; fencing it", self.shard_id, rid)
            resv = self._take(rid)
            self.expired += 1
            for entry in resv.fields.values():
                if entry.file is not None:  # its writer may still write into it: never reuse it
                    self.pool.fence(entry.file)
        self.pool.trim(now)
        for hook in self.tick_hooks:
            hook(now)

    def close(self) -> None:
        self.partitions.clear()
        self.pool.close_all()
        self.host.close()


__all__ = ["PutUndo", "Segment", "ShardCore"]
