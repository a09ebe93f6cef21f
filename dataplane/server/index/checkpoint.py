"""The index's side of a store checkpoint: its metadata in ``index.msgpack``, saved and staged.

What is saved per partition: its keys in the index's order, each key's tag and the fields it holds,
the confirmed schema of each field (a put still being prepared is not in a checkpoint), and the
streaming state (``PartitionStreams.snapshot``). Fields are stored once per distinct set
(``layouts``) and each key names its set (``layout``), so a partition of a million rows of the same
fields costs a million small integers, not a million lists.

The operations (mixed into ``IndexCore``; each runs on the index's one thread):

* ``checkpoint_save``: write the snapshot into the directory being saved, keep it for the finish. A
  job (``server.jobs``): each partition is copied at one instant (a consistent one: copies at C
  speed, a few tens of milliseconds for a million keys), then encoded a slice at a time into the
  buffers of the file (``server.pieces``), which a thread writes; other requests are answered between
  the steps. A put committed meanwhile is in the snapshot only as far as it had been recorded when
  its partition was copied (the rest came after the save began, as far as the checkpoint is
  concerned); the shards save after the index, so every key listed has its rows;
* ``checkpoint_finish``: drop the keys the shards no longer held (cleared while the save ran: the
  clear wins) and write the file again, if there were any (read back in one step: a rare case);
  the save is over;
* ``checkpoint_stage``: read ``index.msgpack`` of a checkpoint, check it, build its partitions aside;
* ``checkpoint_install``: put the staged partitions in place (after the shards installed their rows);
* ``checkpoint_drop``: forget a save's snapshot or a staged load.

Only the newest save and the newest staged load are kept: one whose saving process died holds
metadata only, until the next checkpoint replaces it.
"""

from __future__ import annotations

import itertools
import operator
import os
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, cast

import msgspec

from dataplane.errors import CheckpointError
from dataplane.server.checkpoint_files import (
    INDEX_FILE,
    VERSION,
    PartKeys,
    check_layout,
    decode_file,
    open_dir,
    read_small,
    write_small,
)
from dataplane.server.index.keytable import Tag
from dataplane.server.index.records import FieldSchema, PartMeta
from dataplane.server.index.streams import ConsumedAt
from dataplane.server.jobs import Job, in_thread, run_job
from dataplane.server.pieces import Big, encode_list, pieces
from dataplane.wire import protocol as _protocol


class PartState(PartKeys):
    """One partition of ``index.msgpack`` in full."""

    tags: list[dict[Any, Any]]
    schema: list[tuple[str, list[Any]]]
    streams: dict[str, Any]


class IndexState(msgspec.Struct):
    version: int
    partitions: list[PartState]


def decode_index(data: bytes, path: str) -> IndexState:
    """``index.msgpack`` decoded in full, checked (a shard reads its keys only: ``RawIndexKeys``)."""
    return decode_file(data, path, IndexState)


SLICE = 16384  # keys encoded per step of a save (a few milliseconds)


@dataclass
class _Frozen:
    """One partition's metadata at one instant (``_freeze``), to be encoded in slices."""

    pid: str
    names: list[str | None]  # (None: a hole a cleared key left)
    held: list[frozenset[str] | None]
    tags: dict[str, Tag]
    schema: list[Any]
    streams: dict[str, Any]  # (each task's consumed keys a ``ConsumedAt``, read against ``names``)


def _freeze(pid: str, part: PartMeta, schema: list[Any]) -> _Frozen:
    """``part`` as it is now, by copies at C speed (tags are replaced, never changed, when a key is
    retagged, so a shallow copy holds), but for each task's consumed keys, read later in slices."""
    names, held, tags = part.keys.copy_rows()
    return _Frozen(pid, names, held, tags, schema, part.streams.snapshot(time.monotonic()))


def _encode_part(
    pid: str, part: PartMeta, schema: list[Any]
) -> Generator[None, None, tuple[dict[str, Any], int]]:
    """Partition ``pid`` as it is now (``_freeze``), encoded a slice per step: its ``PartState`` with
    its big lists encoded (``pieces.Big``), and its key count. Fields are stored once per distinct
    set (``layouts``), each key naming its set (``layout``)."""
    f = _freeze(pid, part, schema)
    try:
        yield None
        return (yield from _encode_frozen(f))
    finally:  # (however the job ends: the tasks stop telling the snapshot of their changes)
        for task in f.streams["tasks"]:
            if isinstance(task["consumed"], ConsumedAt):
                task["consumed"].close()


def _encode_frozen(f: _Frozen) -> Generator[None, None, tuple[dict[str, Any], int]]:
    layouts: dict[frozenset[str], int] = {}
    keys, layout, tags = Big(0, []), Big(0, []), Big(0, [])
    for at in range(0, len(f.names), SLICE):
        names, held = f.names[at : at + SLICE], f.held[at : at + SLICE]
        live = list(map(operator.is_not, names, repeat(None)))
        live_names = cast(list[str], list(compress(names, live)))
        live_held = cast(list[frozenset[str]], list(compress(held, live)))
        for fields in set(live_held):
            layouts.setdefault(fields, len(layouts))
        keys.extend(live_names)
        layout.extend(list(map(layouts.__getitem__, live_held)))
        get = f.tags.get
        tags.extend([get(k) or {} for k in live_names] if f.tags else [{}] * len(live_names))
        yield None
    for task in f.streams["tasks"]:  # (what the stream state holds per key: encoded in slices too)
        consumed, task["consumed"] = task["consumed"], Big(0, [])
        for at in range(0, len(f.names), SLICE):
            task["consumed"].extend(consumed.read(f.names[at : at + SLICE]))
            yield None
        consumed.close()
        for stream in task["streams"]:
            stream["ready"] = yield from encode_list(stream["ready"], SLICE)
    state = {
        "pid": f.pid,
        "keys": keys,
        "cuts": keys.cuts(),  # (so that a shard decodes the keys a slice at a time)
        "layouts": [sorted(fields) for fields in layouts],
        "layout": layout,
        "tags": tags,
        "schema": f.schema,
        "streams": f.streams,
    }
    return state, keys.n


def _write_and_close(data: list[bytes | memoryview], dir_fd: int) -> dict[str, int]:
    """``index.msgpack`` written durably in the directory ``dir_fd``, which is then closed."""
    try:
        return write_small(INDEX_FILE, data, dir_fd)
    finally:
        os.close(dir_fd)


class IndexCheckpoints:
    """The checkpoint operations of ``IndexCore`` (see the module docstring)."""

    partitions: dict[str, PartMeta]
    building: dict[str, PartMeta]  # partitions whose consumers' streams are being gathered
    build_some: Callable[[], None]  # (``IndexRecords.build_some``: one slice of them)
    schemas: dict[str, dict[str, FieldSchema]]
    changed: set[str]
    queue_lease: Callable[[float, str, str, str], None]  # (``IndexCore.queue_lease``)
    drop: Callable[[PartMeta], None]  # (``IndexRecords.drop``)
    node = ""  # where the index runs, for messages (``IndexActor`` sets it)

    _ckpt_ids = itertools.count(1)

    def _who(self) -> str:
        return f"the index on node {self.node or socket.gethostname()}"

    def _ckpt(self) -> dict[str, dict[int, Any]]:
        state: dict[str, dict[int, Any]] = self.__dict__.setdefault(
            "_checkpoints", {"saves": {}, "loads": {}}
        )
        return state

    # ---- save -----------------------------------------------------------------------------------
    # A save runs in steps (``server.jobs``): each partition is copied at one instant (copies at C
    # speed, no step per key), then encoded a slice at a time, and the file is written on a thread,
    # so the index answers other requests throughout. Each partition is one consistent instant; the
    # shards save after the index anyway, and the finish drops what was cleared meanwhile.
    def op_checkpoint_save(self, body: _protocol.CheckpointSave) -> _protocol.CheckpointSaveReply:
        return run_job(self.job_checkpoint_save(body))

    def job_checkpoint_save(self, body: _protocol.CheckpointSave) -> Job[_protocol.CheckpointSaveReply]:
        dir_fd = open_dir(body.path, body.token, self._who())
        try:
            while self.building:  # a consumer's stream being gathered: a snapshot holds it whole
                self.build_some()
                yield None
            parts: list[dict[str, Any]] = []
            counts: dict[str, int] = {}
            for pid in list(self.partitions):
                part = self.partitions.get(pid)
                if part is None:  # (cleared between two steps)
                    continue
                state, counts[pid] = yield from _encode_part(pid, part, self._confirmed(pid))
                parts.append(state)
            data = pieces({"version": VERSION, "partitions": parts})  # (the file's buffers, not joined)
        except BaseException:
            os.close(dir_fd)
            raise
        written = in_thread(_write_and_close, data, dir_fd)  # (the thread closes the directory)
        yield written
        entry = written.result()
        path = os.path.join(body.path, INDEX_FILE)
        save = next(self._ckpt_ids)
        self._ckpt()["saves"] = {save: (path, data, entry, counts)}  # the newest save only
        return _protocol.CheckpointSaveReply(save, entry, counts)

    def saved_partition(self, pid: str) -> dict[str, Any]:
        """What a save now writes of partition ``pid``, read back as plain values (less ``cuts``,
        which tell how the keys were encoded, not what they are)."""
        state, _ = run_job(_encode_part(pid, self.partitions[pid], self._confirmed(pid)))
        decoded: dict[str, Any] = msgspec.msgpack.decode(b"".join(pieces(state)))
        del decoded["cuts"]
        return decoded

    def _confirmed(self, pid: str) -> list[Any]:
        """The schema a checkpoint saves of partition ``pid``: its confirmed fields."""
        return [[name, entry.family] for name, entry in self.schemas.get(pid, {}).items() if entry.confirmed]

    def op_checkpoint_finish(self, body: _protocol.CheckpointFinish) -> _protocol.CheckpointFinishReply:
        return run_job(self.job_checkpoint_finish(body))

    def job_checkpoint_finish(self, body: _protocol.CheckpointFinish) -> Job[_protocol.CheckpointFinishReply]:
        saved = self._ckpt()["saves"].pop(body.save, None)
        if saved is None:
            raise CheckpointError(
                "", f"checkpoint save {body.save} is unknown to the index (a later save replaced it)"
            )
        path, data, entry, counts = saved
        missing = {pid: set(keys) for pid, keys in body.missing.items() if keys}
        if not missing:
            return _protocol.CheckpointFinishReply(entry, counts)
        # Cleared while the shards saved: out of the metadata too, as if cleared before (rare: the
        # file is read back whole, in one step).
        state = decode_index(b"".join(data), path)
        parts: list[dict[str, Any]] = []
        counts = {}
        for p in state.partitions:
            part, _ = self._restore(p, path)
            for key in missing.get(p.pid, ()):
                if part.keys.remove(key):
                    part.streams.on_clear(key)
            part.keys.settle()
            yield None
            # (the schema as saved, not the live one)
            saved_state, counts[p.pid] = yield from _encode_part(p.pid, part, p.schema)
            parts.append(saved_state)
        os.unlink(path)
        written = in_thread(write_small, path, pieces({"version": VERSION, "partitions": parts}))
        yield written
        return _protocol.CheckpointFinishReply(written.result(), counts)

    # ---- load -----------------------------------------------------------------------------------
    def op_checkpoint_stage(self, body: _protocol.CheckpointStage) -> _protocol.CheckpointStageReply:
        path = os.path.join(body.path, INDEX_FILE)
        state = decode_index(read_small(path, {"bytes": body.bytes, "crc32": body.crc32}, self._who()), path)
        staged = {}
        for p in state.partitions:
            if p.pid in staged:
                raise CheckpointError(path, f"checkpoint file {path} lists partition {p.pid!r} twice")
            staged[p.pid] = self._restore(p, path)
        load = next(self._ckpt_ids)
        self._ckpt()["loads"] = {load: staged}  # the newest staged load only
        return _protocol.CheckpointStageReply(
            load=load,
            partitions={pid: len(part.keys) for pid, (part, _) in staged.items()},
            existing=sorted(pid for pid in staged if pid in self.partitions),
        )

    def _restore(self, p: PartState, path: str) -> tuple[PartMeta, dict[str, FieldSchema]]:
        """A partition's metadata and schema rebuilt from its saved state (checked)."""
        try:
            part = PartMeta()
            if len(p.tags) != len(p.keys):
                raise ValueError(f"{len(p.tags)} tags for {len(p.keys)} keys")
            check_layout(len(p.keys), p.layouts, p.layout)
            part.keys.restore(p.keys, [frozenset(fields) for fields in p.layouts], p.layout, p.tags)
            part.streams.restore(p.streams, time.monotonic())
            schema = {str(name): FieldSchema(list(family), confirmed=True) for name, family in p.schema}
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                path,
                f"checkpoint file {path}: partition {p.pid!r} is inconsistent ({exc}); nothing was loaded",
            ) from exc
        return part, schema

    def op_checkpoint_install(self, body: _protocol.CheckpointInstall) -> _protocol.Done:
        staged = self._ckpt()["loads"].get(body.load)
        if staged is None:
            raise CheckpointError(
                "", f"checkpoint load {body.load} is unknown to the index (a later load replaced it)"
            )
        existing = sorted(pid for pid in staged if pid in self.partitions)
        if existing and not body.overwrite:  # created since the stage: refuse, nothing changed
            raise CheckpointError("", f"the store now holds partitions {existing}; nothing was loaded")
        del self._ckpt()["loads"][body.load]
        for pid, (part, schema) in staged.items():
            old = self.partitions.get(pid)
            if old is not None:
                self.drop(old)
            self.partitions[pid] = part
            self.schemas[pid] = schema
            self.changed.add(pid)  # consumers waiting on it look again
            for task_name, task in part.streams.tasks.items():  # its leases run out here from now on
                for take, lease in task.leases.items():
                    self.queue_lease(lease.deadline, pid, task_name, take)
        return _protocol.Done()

    def op_checkpoint_drop(self, body: _protocol.CheckpointDrop) -> _protocol.Done:
        state = self._ckpt()
        state["saves"].pop(body.id, None)
        state["loads"].pop(body.id, None)
        return _protocol.Done()


__all__ = ["IndexCheckpoints", "IndexState", "PartState", "decode_index"]
