"""A shard's side of a store checkpoint: it writes its own rows into the directory, and reads them back.

The bytes never leave the shard's node through anything but the filesystem: no driver, no index.

**Save** (``ShardCheckpoints.save``, a Ray call on the shard's actor, so its request loop keeps
serving meanwhile):

1. read the keys the index saved (``index.msgpack``, written a moment before) and keep those this
   shard holds (``wire.placement``); a key whose row, or one of whose fields, is gone (a clear that
   raced the save) is reported *missing*, and the index drops it from the checkpoint;
2. under the shard's lock, look up those rows and *pin* their segments (one extra reference each),
   so a clear or an overwrite that comes while the files are written cannot free them;
3. without the lock, write them: a segment whose chosen rows are one contiguous run of at least
   ``DIRECT_MIN`` bytes goes to the file straight from shared memory; smaller runs and scattered
   rows of one spec are gathered into chunks of about ``GATHER_MAX`` bytes first (one copy);
4. unpin.

A chunk is a column exactly as the wire describes one (``column_to_wire``: spec, rows, buffers),
so every kind (dense, jagged, ragged tensors, arrow strings and lists, JSON-like values, pickled
objects as opaque bytes) keeps its exact dtype and shapes, and a get after a load answers as it did
at the save.

**Load** is two-phase, so that a load is all or nothing across the shards and the index:

* ``stage``: read the keys the index lists and keep this shard's (by the new store's hashing: the
  checkpoint may come from another number of shards), read the chunks holding them (each buffer's
  checksum checked), and build the partitions aside, their memory reserved against the capacity.
  The rows staged must be exactly the rows the index lists for this shard, or nothing loads;
* ``commit``: put them in place (the partitions they replace are kept aside);
* ``finish``: drop what they replaced, or, when the index refused to install its side, put it back.

A staged load whose process died is dropped when its deadline passes (the shard's tick), one
committed but never finished is finished then.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import itemgetter
from typing import Any

import msgspec
import numpy as np

from dataplane.codec.column_types import Column, ColumnSpec
from dataplane.codec.rows import assemble, contiguous_view, nbytes_of
from dataplane.errors import CheckpointError, StoreFullError, WireError
from dataplane.server.checkpoint_files import (
    INDEX_FILE,
    VERSION,
    DataWriter,
    RawIndexKeys,
    decode_file,
    keys_in_slices,
    open_checked,
    open_dir,
    read_into,
    read_small,
    shard_files,
    write_small,
)
from dataplane.server.jobs import run_job
from dataplane.server.pieces import encode_list, encode_parts, pieces
from dataplane.server.shard.core import ROW_BITS, ROW_MASK, Segment, ShardCore, _Partition, row_code
from dataplane.server.shard.segments import ShmFile
from dataplane.wire.frames import column_from_wire, column_to_wire
from dataplane.wire.placement import shards_of
from dataplane.wire.protocol import FileEntry, ShardSaveReply, ShardStageReply, WireColumn

logger = logging.getLogger(__name__)

DIRECT_MIN = 1 << 20  # a contiguous run of rows this large is written straight from its segment
GATHER_MAX = 16 << 20  # smaller runs of one spec are gathered into chunks of about this many bytes
PIN_SLICE = 2048  # keys a save looks up per hold of the shard's lock (its requests are answered between)
MANIFEST_SLICE = 16384  # keys a save encodes per call into its manifest


class Chunk(msgspec.Struct):
    """Rows of one field in a shard's data file: ``keys`` are positions in the partition's keys."""

    field: str
    col: WireColumn
    bufs: list[tuple[int, int, int]]  # per buffer of ``col``: offset in the data file, bytes, crc32
    keys: list[int]


class ShardPart(msgspec.Struct):
    pid: str
    keys: list[str]
    chunks: list[Chunk]


class ShardManifest(msgspec.Struct):
    version: int
    shard: int
    data: int  # bytes of the data file
    partitions: list[ShardPart]


# The keys of a partition a shard holds in a checkpoint, and the fields each holds, as parts of a few
# thousand keys each (and so are a plan's keys), in tuples: the collector stops tracking a tuple of
# strings at its first look, so each key part is walked once, while small (a part of fields holds
# the shared field lists, so stays tracked, but is walked a part at a time). A list of a million keys
# was walked by every collection until the heap's next freeze (a save's lists held the shard's loop
# up to 24 ms in one collection), and one tuple of a million by the first (16 ms).
_Wanted = tuple[list[tuple[str, ...]], list[tuple[list[str], ...]]]
# What a save writes of one partition: its pid, its keys, and per field per segment (by id) the
# segment, its rows and each row's key position: arrays, a few per slice of keys, so a million rows
# make no object the collector tracks.
_BySegment = dict[int, tuple[Segment, list[np.ndarray], list[np.ndarray]]]
_PartPlan = tuple[str, list[tuple[str, ...]], dict[str, _BySegment]]
# A chunk a load reads: its pid, the chunk, the key of each of its rows, the rows to take (None: all).
_Selected = tuple[str, Chunk, list[str], np.ndarray | None]


@dataclass(eq=False)
class _Load:
    """A staged load (``parts`` built aside), then a committed one (``previous``: what it replaced)."""

    pids: list[str]  # every partition of the checkpoint: each replaces this shard's partition of its name
    parts: dict[str, _Partition]  # those of them with rows on this shard
    segs: list[Segment]
    files: list[ShmFile]  # the shared memory its segments use (given back if it is dropped)
    need: int  # bytes reserved (``ShardCore.pending``) until the commit
    deadline: float
    committed: bool = False
    previous: dict[str, _Partition] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)  # (key, field) pairs staged, per partition


HANDOFF_S = 0.0005  # the interpreter's switch interval while a save runs (5 ms by default)


class _QuickHandoff:
    """While a save runs beside the request loop, the interpreter lock (GIL) goes back to the loop
    within ``HANDOFF_S`` instead of 5 ms: the loop gives it up at every socket call, so each request
    waited on the saving thread several times over (a convoy). Saves may overlap: the interval is
    set by the first and restored by the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._before = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(min(self._before, HANDOFF_S))
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    sys.setswitchinterval(self._before)


_quick_handoff = _QuickHandoff()


class ShardCheckpoints:
    """Checkpoint save and load of one shard (``ShardActor`` holds one; see the module docstring).

    Every change to the shard's state happens under ``lock`` (the one its request loop holds);
    files are written and read without it.
    """

    def __init__(self, core: ShardCore, lock: threading.Lock, node: str, heap_below: int) -> None:
        self.core = core
        self.lock = lock
        self.node = node
        self.heap_below = heap_below  # loaded chunks smaller than this live in the heap, not a memfd
        self._loads: dict[int, _Load] = {}
        core.tick_hooks.append(self._expire)

    @property
    def who(self) -> str:
        return f"shard {self.core.shard_id} on node {self.node}"

    def _mine(self, path: str, entry: Any, num_shards: int) -> dict[str, _Wanted]:
        """The keys of ``index.msgpack`` placed on this shard in a store of ``num_shards``, with the
        fields each holds (keys holding tags only have no rows), in two lists per partition. The
        keys are decoded a slice at a time (``keys_in_slices``): a million in one call held the
        interpreter from the request loop for 60-120 ms; and no dict is grown key by key (its last
        resize alone held it some 40 ms)."""
        index_path = os.path.join(path, INDEX_FILE)
        index = decode_file(read_small(index_path, entry, self.who), index_path, RawIndexKeys)
        me = self.core.shard_id
        out: dict[str, _Wanted] = {}
        for p in index.partitions:
            key_parts: list[tuple[str, ...]] = []
            field_parts: list[tuple[list[str], ...]] = []
            for keys, fields in keys_in_slices(p, index_path):
                if num_shards == 1:
                    ours: list[Any] = fields
                else:
                    held = np.fromiter(map(bool, fields), dtype=bool, count=len(fields))
                    ours = ((shards_of(p.pid, keys, num_shards) == me) & held).tolist()
                key_parts.append(tuple(compress(keys, ours)))
                field_parts.append(tuple(compress(fields, ours)))
                del keys, fields
                # A young collection now (its few objects, about 0.2 ms): the slice's key tuple is
                # walked once and no longer tracked; else, as decoding makes few tracked objects,
                # every slice's parts would wait in the youngest generation for one collection to
                # walk them all (19.5 ms for a million keys).
                gc.collect(0)
            out[p.pid] = (key_parts, field_parts)
        return out

    # ---- save -----------------------------------------------------------------------------------
    def save(self, path: str, token: str, num_shards: int, index_entry: dict[str, int]) -> ShardSaveReply:
        """Write this shard's rows of the index's snapshot into ``path``; returns its files' manifest
        entries, rows saved per partition, and the keys it no longer held (``missing``)."""
        with _quick_handoff():
            return self._save(path, token, num_shards, index_entry)

    def _save(self, path: str, token: str, num_shards: int, index_entry: dict[str, int]) -> ShardSaveReply:
        dir_fd = open_dir(path, token, self.who)
        try:
            mine = self._mine(path, index_entry, num_shards)
            plan, missing, pinned = self._pin(mine)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            files, size = self._write(dir_fd, plan)
        except OSError as exc:
            raise CheckpointError(
                path,
                f"{self.who} could not write its rows into {path} ({exc}); the previous checkpoint is "
                "unchanged",
            ) from exc
        finally:
            os.close(dir_fd)
            with self.lock:
                for seg in pinned:
                    seg.pins -= 1
                    self.core._unref(seg)
        rows = {pid: sum(map(len, keys)) for pid, keys, _ in plan}
        return ShardSaveReply(files, rows, size, missing)

    def _pin(self, mine: dict[str, _Wanted]) -> tuple[list[_PartPlan], dict[str, list[str]], list[Segment]]:
        """Where each wanted row is, its segment pinned until written; the keys no longer held. The
        lock is taken ``PIN_SLICE`` keys at a time, so the shard's requests are answered between (each
        key's row is the one it held when its slice was looked at, as a save beside puts can be)."""
        plan: list[_PartPlan] = []
        missing: dict[str, list[str]] = {}
        pinned: dict[int, Segment] = {}
        for pid, (wanted, wanted_fields) in mine.items():
            kept_parts: list[tuple[str, ...]] = []
            n_kept = 0
            locs: dict[str, _BySegment] = {}
            gone: list[str] = []
            slices = (
                (keys[at : at + PIN_SLICE], fields[at : at + PIN_SLICE])
                for keys, fields in zip(wanted, wanted_fields, strict=True)
                for at in range(0, len(keys), PIN_SLICE)
            )
            for chunk, fields in slices:
                with self.lock:
                    part = self.core.partitions.get(pid)
                    rows: list[dict[str, int] | None] = (
                        [None] * len(chunk) if part is None else list(map(part.rows.get, chunk))
                    )
                    kept, codes = _lookup(chunk, rows, fields, gone)
                    for name, (code, pos) in codes.items():
                        _place(part, name, code, pos + n_kept, locs, pinned)  # type: ignore[arg-type]
                    kept_parts.append(tuple(kept))
                    n_kept += len(kept)
                time.sleep(0)  # (the loop, waiting for the lock, takes it now: a Lock is not fair)
            if gone:
                missing[pid] = gone
            plan.append((pid, kept_parts, locs))
        return plan, missing, list(pinned.values())

    def _write(self, dir_fd: int, plan: list[_PartPlan]) -> tuple[dict[str, FileEntry], int]:
        """Write ``plan``'s rows into this shard's data file, then its manifest: their manifest
        entries, and the data file's size."""
        man_name, bin_name = shard_files(self.core.shard_id)
        writer = DataWriter(bin_name, dir_fd)
        try:
            parts = []
            for pid, keys, locs in plan:
                chunks = []
                for name, entries in locs.items():
                    for col, positions, source in _chunks(entries):
                        bufs: list[Any] = []
                        desc = column_to_wire(col, bufs)
                        written = []
                        for i, buf in enumerate(bufs):
                            if i == desc.data and source is not None:  # straight from the segment's file
                                written.append(writer.append_from(*source, buf))
                            else:
                                written.append(writer.append(buf))
                        # (lists encoded a slice per C call: a million items in one held the
                        # request loop for tens of milliseconds)
                        at = run_job(encode_list(positions, MANIFEST_SLICE))
                        chunks.append({"field": name, "col": desc, "bufs": written, "keys": at})
                parts.append({"pid": pid, "keys": run_job(encode_parts(keys)), "chunks": chunks})
            size = writer.close()
        finally:
            writer.abandon()
        manifest = {"version": VERSION, "shard": self.core.shard_id, "data": size, "partitions": parts}
        entry = write_small(man_name, pieces(manifest), dir_fd)
        return {man_name: entry, bin_name: {"bytes": size}}, size

    # ---- load -----------------------------------------------------------------------------------
    def stage(
        self,
        path: str,
        load: int,
        num_shards: int,
        files: dict[str, Any],
        saved_shards: int,
        timeout_s: float,
    ) -> ShardStageReply:
        """Read this shard's rows of the checkpoint at ``path`` (saved by a store of ``saved_shards``)
        into partitions built aside; ``CheckpointError`` naming the file when anything is wrong."""
        expect = {
            pid: dict(zip(chain.from_iterable(keys), chain.from_iterable(fields), strict=True))
            for pid, (keys, fields) in self._mine(path, _entry(files, INDEX_FILE, path), num_shards).items()
        }
        sources = [self.core.shard_id] if saved_shards == num_shards else list(range(saved_shards))
        plans = []
        for s in sources:
            man_name, bin_name = shard_files(s)
            man_path = os.path.join(path, man_name)
            man = decode_file(
                read_small(man_path, _entry(files, man_name, path), self.who), man_path, ShardManifest
            )
            bin_entry = _entry(files, bin_name, path)
            if man.data != bin_entry.get("bytes"):
                raise CheckpointError(
                    man_path, f"{man_path} and the checkpoint's manifest disagree on {bin_name}'s size"
                )
            plans.append((os.path.join(path, bin_name), man.data, _select(man, expect, man_path)))
        need = sum(sum(b[1] for b in chunk.bufs) for _, _, sel in plans for _, chunk, _, _ in sel)
        with self.lock:
            self._reserve(need, path)
        staged = _Load(list(expect), {}, [], [], need, time.monotonic() + timeout_s)
        try:
            for bin_path, size, selected in plans:
                self._read(bin_path, size, selected, staged)
            _check_complete(staged, expect, path)
        except BaseException:
            with self.lock:
                self._release(staged)
            raise
        with self.lock:
            for old in self._loads.values():  # the newest staged load only (see the module doc)
                if not old.committed:
                    self._release(old)
            self._loads = {k: v for k, v in self._loads.items() if v.committed}
            self._loads[load] = staged
        rows = {pid: len(part.rows) for pid, part in staged.parts.items()}
        return ShardStageReply(rows, sum(seg.nbytes for seg in staged.segs))

    def _reserve(self, need: int, path: str) -> None:
        try:
            self.core._check_capacity(need, "(a checkpoint)")
        except StoreFullError as exc:
            raise StoreFullError(
                f"{self.who} cannot hold the {need} bytes of its rows of checkpoint {path}: {exc}; nothing "
                "was loaded"
            ) from None
        self.core.pending += need

    def _read(self, bin_path: str, size: int, selected: list[_Selected], staged: _Load) -> None:
        if not selected:
            return
        fd = open_checked(bin_path, size, self.who)
        try:
            for pid, chunk, keys, rows in selected:
                seg = self._read_chunk(fd, bin_path, size, pid, chunk, rows, staged)
                part = staged.parts.setdefault(pid, _Partition())
                seg.owner = part  # (its bytes count in the partition's once the load commits)
                part.segs[seg.sid] = seg
                part.specs.setdefault(chunk.field, seg.spec)
                if rows is not None:
                    keys = list(map(keys.__getitem__, rows.tolist()))
                _attach_loaded(part, keys, chunk.field, seg, bin_path, pid)
                staged.pairs[pid] = staged.pairs.get(pid, 0) + len(keys)
                seg.live = len(keys)
        finally:
            os.close(fd)

    def _read_chunk(
        self,
        fd: int,
        bin_path: str,
        size: int,
        pid: str,
        chunk: Chunk,
        rows: np.ndarray | None,
        staged: _Load,
    ) -> Segment:
        """One chunk's rows (all, or ``rows`` of them) as a new segment: data of ``heap_below`` bytes or
        more in a shared-memory file (read straight into it when all rows are taken), the rest in the heap."""
        what = f"partition {pid!r} field {chunk.field!r}"
        views: list[memoryview] = []
        shm: ShmFile | None = None
        for i, entry in enumerate(chunk.bufs):
            nbytes = entry[1]
            dst_fd = -1
            if i == chunk.col.data and rows is None and nbytes >= self.heap_below:
                shm = self._acquire(nbytes, staged, allocate=False)
                dst, dst_fd = shm.view()[:nbytes], shm.fd
            else:
                dst = np.empty(nbytes, dtype=np.uint8).data  # (the array's memoryview, as memoryview(array))
            read_into(fd, bin_path, dst, entry, size, f"{what} (buffer {i})", dst_fd)
            views.append(dst)
        try:
            col = column_from_wire(chunk.col, views, chunk.field)
        except WireError as exc:
            raise CheckpointError(
                bin_path, f"checkpoint file {bin_path}: {what}: {exc}; nothing was loaded"
            ) from exc
        if len(chunk.keys) != col.num_rows:
            raise CheckpointError(
                bin_path, f"{bin_path}: {what} has {col.num_rows} rows for {len(chunk.keys)} keys"
            )
        if rows is not None:  # a store of another number of shards: this shard's rows of the chunk only
            nbytes = nbytes_of(col, rows)
            out = None
            if nbytes >= self.heap_below:
                shm = self._acquire(nbytes, staged)
                out = shm.view()[:nbytes]
            col = assemble(col.spec, len(rows), [(col, rows, np.arange(len(rows)))], out=out)
        seg = Segment(
            col.spec, col.num_rows, col.nbytes, None if shm else col.data, col.offsets, shm, col.shapes
        )
        staged.segs.append(seg)
        return seg

    def _acquire(self, nbytes: int, staged: _Load, allocate: bool = True) -> ShmFile:
        with self.lock:
            f = self.core.pool.acquire(nbytes, allocate=allocate)
        staged.files.append(f)
        return f

    def _release(self, staged: _Load) -> None:
        """Give back a staged load's memory and its reservation (under the lock)."""
        self.core.pending -= staged.need
        staged.need = 0
        for f in staged.files:
            self.core.pool.release(f)
        staged.files.clear()
        staged.segs.clear()
        staged.parts.clear()

    def commit(self, load: int) -> None:
        """Put a staged load's partitions in place; what they replace is kept until ``finish``."""
        with self.lock:
            staged = self._loads.get(load)
            if staged is None or staged.committed:
                raise CheckpointError(
                    "", f"{self.who}: checkpoint load {load} is not staged here (expired or replaced)"
                )
            core = self.core
            core.pending -= staged.need
            staged.need = 0
            for seg in staged.segs:  # (each holds rows: every chunk read has at least one)
                core.used += seg.accounted
                assert seg.owner is not None  # (set when its chunk was read)
                seg.owner.nbytes += seg.accounted
                core.heap_bytes += seg.heap_bytes
            staged.files.clear()  # owned by their segments now
            for pid in staged.pids:  # the checkpoint's partition replaces this shard's whole, rows or none
                old = core.partitions.pop(pid, None)
                if old is not None:
                    staged.previous[pid] = old
                if pid in staged.parts:
                    core.partitions[pid] = staged.parts[pid]
            staged.committed = True

    def finish(self, load: int, keep: bool) -> None:
        """Drop what a committed load replaced (``keep``), or undo the load and put that back."""
        with self.lock:
            staged = self._loads.pop(load, None)
            if staged is None:
                return
            if not staged.committed:
                self._release(staged)
                return
            core = self.core
            if not keep:
                for pid in staged.pids:
                    part = core.partitions.pop(pid, None)
                    if part is not None:
                        core.drop_rows(part)
                core.partitions.update(staged.previous)
            else:
                for old in staged.previous.values():
                    core.drop_rows(old)
            staged.previous.clear()

    def drop(self, load: int) -> None:
        """Forget a load that failed elsewhere (staged: freed; committed: undone)."""
        self.finish(load, keep=False)

    def _expire(self, now: float) -> None:
        """The shard's tick (under the lock): loads whose process never finished them."""
        for load, staged in list(self._loads.items()):
            if now < staged.deadline:
                continue
            del self._loads[load]
            logger.warning(
                "%s: checkpoint load %d was never finished; %s",
                self.who,
                load,
                "keeping it" if staged.committed else "dropping it",
            )
            if staged.committed:
                for old in staged.previous.values():
                    self.core.drop_rows(old)
            else:
                self._release(staged)


def _lookup(
    keys: Sequence[str], rows: list[dict[str, int] | None], fields: Sequence[list[str]], gone: list[str]
) -> tuple[Sequence[str], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The keys of a slice whose rows hold their fields (the others added to ``gone``), and per
    field the row codes and the kept keys' positions. The usual slice (every key held, one field
    set) at C speed, no step per key; any other key by key."""
    n, first = len(keys), fields[0] if fields else []
    if n and first and None not in rows and fields.count(first) == n:
        try:
            if len(first) == 1:
                codes = np.fromiter(map(itemgetter(first[0]), rows), dtype=np.int64, count=n)  # type: ignore[arg-type]
                return keys, {first[0]: (codes, np.arange(n))}
            table = np.array(list(map(itemgetter(*first), rows)), dtype=np.int64).reshape(n, len(first))  # type: ignore[arg-type]
            return keys, {f: (table[:, j], np.arange(n)) for j, f in enumerate(first)}
        except KeyError:  # (a field gone from some key: key by key)
            pass
    kept: list[str] = []
    by_field: dict[str, tuple[list[int], list[int]]] = {}
    for key, row, want in zip(keys, rows, fields, strict=True):
        if row is None or not all(map(row.__contains__, want)):  # (no frame per key)
            gone.append(key)
            continue
        for f in want:
            got = by_field.get(f)
            if got is None:
                got = by_field[f] = ([], [])
            got[0].append(row[f])
            got[1].append(len(kept))
        kept.append(key)
    return kept, {
        f: (np.array(c, dtype=np.int64), np.array(p, dtype=np.int64)) for f, (c, p) in by_field.items()
    }


def _place(
    part: _Partition,
    name: str,
    codes: np.ndarray,
    pos: np.ndarray,
    locs: dict[str, _BySegment],
    pinned: dict[int, Segment],
) -> None:
    """File rows of field ``name`` (their codes, and their keys' positions) under their segments in
    ``locs``, each segment pinned once (released by ``_unref`` once written)."""
    sids = codes >> ROW_BITS
    each = np.unique(sids).tolist()
    by_seg = locs.setdefault(name, {})
    for sid in each:
        seg = part.segs[sid]
        if len(each) == 1:
            rows, at = codes & ROW_MASK, pos
        else:
            mask = sids == sid
            rows, at = codes[mask] & ROW_MASK, pos[mask]
        got = by_seg.get(id(seg))
        if got is None:
            got = by_seg[id(seg)] = (seg, [], [])
        got[1].append(rows)
        got[2].append(at)
        if id(seg) not in pinned:
            pinned[id(seg)] = seg
            seg.live += 1
            seg.pins += 1


Source = tuple[int, int] | None  # the segment file and byte offset a chunk's data is in, if it is


def _chunks(by_seg: _BySegment) -> Iterator[tuple[Column, np.ndarray, Source]]:
    """One field's saved rows (per segment: its rows and their key positions) as columns to write,
    with the key position of each row and where the data lies: whole contiguous runs straight from
    their segment (its file, for a segment in shared memory), the rest gathered."""
    pending: dict[ColumnSpec, list[tuple[Column, np.ndarray, np.ndarray]]] = {}
    pending_bytes: dict[ColumnSpec, int] = {}
    for seg, rows_l, pos_l in by_seg.values():
        rows, pos = np.concatenate(rows_l), np.concatenate(pos_l)
        order = np.argsort(rows, kind="stable")
        rows, pos = rows[order], pos[order]
        col = seg.column()
        view = col if len(rows) == seg.num_rows else contiguous_view(col, rows)
        if view is not None and view.nbytes >= DIRECT_MIN:
            start = col.row_range(int(rows[0]), int(rows[0]) + 1)[0]
            yield view, pos, None if seg.file is None else (seg.file.fd, start)
            continue
        spec = seg.spec
        pending.setdefault(spec, []).append((col, rows, pos))
        pending_bytes[spec] = pending_bytes.get(spec, 0) + nbytes_of(col, rows)
        if pending_bytes[spec] >= GATHER_MAX:
            yield _gather(spec, pending.pop(spec))
            pending_bytes[spec] = 0
    for spec, rest in pending.items():
        yield _gather(spec, rest)


def _gather(
    spec: ColumnSpec, pieces: list[tuple[Column, np.ndarray, np.ndarray]]
) -> tuple[Column, np.ndarray, Source]:
    total, parts = 0, []
    for col, rows, _ in pieces:
        parts.append((col, rows, np.arange(total, total + len(rows))))
        total += len(rows)
    return assemble(spec, total, parts), np.concatenate([p for _, _, p in pieces]), None


def _entry(files: dict[str, Any], name: str, path: str) -> Any:
    entry = files.get(name)
    if not isinstance(entry, dict):
        raise CheckpointError(path, f"the manifest of checkpoint {path} does not list {name}")
    return entry


def _select(man: ShardManifest, expect: dict[str, dict[str, list[str]]], path: str) -> list[_Selected]:
    """The chunks of a shard manifest holding rows this shard loads: ``(pid, chunk, the key of each
    of its rows, the rows to take or None for all)``. Per chunk, at C speed: the fields a key holds
    are shared lists (one per distinct set), so each chunk tests its field against a few of them."""
    out: list[_Selected] = []
    for part in man.partitions:
        want = expect.get(part.pid, {})
        for chunk in part.chunks:
            outside = bool(chunk.keys) and (min(chunk.keys) < 0 or max(chunk.keys) >= len(part.keys))
            if len(chunk.bufs) < 1 or outside:
                raise CheckpointError(path, f"checkpoint file {path}: a chunk of {part.pid!r} is malformed")
            keys = list(map(part.keys.__getitem__, chunk.keys))
            fields = list(map(want.get, keys))
            sets = dict(zip(map(id, fields), fields, strict=True))  # (the distinct ones)
            ok = {i for i, held in sets.items() if held is not None and chunk.field in held}
            if not ok:
                continue
            rows = None
            if len(ok) < len(sets):
                taken = np.fromiter(map(ok.__contains__, map(id, fields)), dtype=bool, count=len(keys))
                rows = np.flatnonzero(taken)
            out.append((part.pid, chunk, keys, rows))
    return out


def _attach_loaded(part: _Partition, keys: list[str], name: str, seg: Segment, path: str, pid: str) -> None:
    """Point ``keys`` at the rows of loaded segment ``seg`` (field ``name``): new keys at C speed, as
    a put's are (a partition's first field), others key by key; a key given the field twice is a
    ``CheckpointError``."""
    rows, first = part.rows, row_code(seg, 0)
    codes = range(first, first + len(keys))
    if not any(map(rows.__contains__, keys)):
        before = len(rows)
        rows.update(zip(keys, [{name: code} for code in codes], strict=True))
        if len(rows) - before == len(keys):
            return
        twice = next(k for k, n in Counter(keys).items() if n > 1)
        raise CheckpointError(path, f"{path}: key {twice!r} of {pid!r} holds {name!r} twice")
    for key, code in zip(keys, codes, strict=True):
        row = rows.setdefault(key, {})
        if name in row:
            raise CheckpointError(path, f"{path}: key {key!r} of {pid!r} holds {name!r} twice")
        row[name] = code


def _check_complete(staged: _Load, expect: dict[str, dict[str, list[str]]], path: str) -> None:
    """The staged rows must be exactly the rows the index lists for this shard. Every (key, field)
    loaded was listed (``_select``) and none twice (``_attach_loaded``), so equal counts settle it
    at C speed; the rest only finds what to name."""
    for pid, wanted in expect.items():
        rows = staged.parts[pid].rows if pid in staged.parts else {}
        if staged.pairs.get(pid, 0) == sum(map(len, wanted.values())) and len(rows) == len(wanted):
            continue
        for key, fields in wanted.items():
            have = rows.get(key, {})
            lost = [f for f in fields if f not in have]
            if lost:
                raise CheckpointError(
                    path,
                    f"checkpoint {path} lists key {key!r} of partition {pid!r} with fields {lost}, but no "
                    "shard file holds them; nothing was loaded",
                )
        if len(rows) != len(wanted):
            raise CheckpointError(
                path, f"checkpoint {path}: the shard files hold rows of {pid!r} the index does not list"
            )


__all__ = ["ShardCheckpoints"]
