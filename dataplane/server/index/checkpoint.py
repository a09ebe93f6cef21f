"""The index's side of a store checkpoint: its metadata in ``index.msgpack``, saved and staged.

What is saved per partition: its keys in the index's order, each key's tag and the fields it holds,
the confirmed schema of each field (a put still being prepared is not in a checkpoint), and the
streaming state (``PartitionStreams.snapshot``). Fields are stored once per distinct set
(``layouts``) and each key names its set (``layout``), so a partition of a million rows of the same
fields costs a million small integers, not a million lists.

The operations (mixed into ``IndexCore``; each runs on the index's one thread, so a snapshot is one
consistent instant of the metadata):

* ``checkpoint_save``: write the snapshot into the directory being saved, keep it for the finish;
* ``checkpoint_finish``: drop the keys the shards no longer held (cleared while the save ran: the
  clear wins) and write the file again, if there were any; the save is over;
* ``checkpoint_stage``: read ``index.msgpack`` of a checkpoint, check it, build its partitions aside;
* ``checkpoint_install``: put the staged partitions in place (after the shards installed their rows);
* ``checkpoint_drop``: forget a save's snapshot or a staged load.

Only the newest save and the newest staged load are kept: one whose saving process died holds
metadata only, until the next checkpoint replaces it.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from dataplane.errors import CheckpointError
from dataplane.server.checkpoint_files import (
    INDEX_FILE,
    VERSION,
    PartKeys,
    decode_file,
    open_dir,
    read_small,
    write_small,
)
from dataplane.server.index.records import FieldSchema, PartMeta
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
    """``index.msgpack`` decoded, checked (``decode_file(data, path, IndexKeys)``: keys and fields only)."""
    return decode_file(data, path, IndexState)


class IndexCheckpoints:
    """The checkpoint operations of ``IndexCore`` (see the module docstring)."""

    partitions: dict[str, PartMeta]
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
    def op_checkpoint_save(self, body: _protocol.CheckpointSave) -> _protocol.CheckpointSaveReply:
        dir_fd = open_dir(body.path, body.token, self._who())
        try:
            parts = [self._snapshot(pid, part) for pid, part in self.partitions.items()]
            data = msgspec.msgpack.encode({"version": VERSION, "partitions": parts})
            entry = write_small(INDEX_FILE, data, dir_fd)
        finally:
            os.close(dir_fd)
        path = os.path.join(body.path, INDEX_FILE)
        save = next(self._ckpt_ids)
        self._ckpt()["saves"] = {save: (path, data, entry)}  # the newest save only
        return _protocol.CheckpointSaveReply(save, entry, {p["pid"]: len(p["keys"]) for p in parts})

    def _snapshot(self, pid: str, part: PartMeta) -> dict[str, Any]:
        layouts: dict[frozenset[str], int] = {}
        names: list[str] = []
        layout = []
        for key, held in part.keys.held_items():
            names.append(key)
            layout.append(layouts.setdefault(held, len(layouts)))
        schema = self.schemas.get(pid, {})
        tag = part.keys.tag
        return {
            "pid": pid,
            "keys": names,
            "layouts": [sorted(fields) for fields in layouts],
            "layout": layout,
            "tags": [tag(key) for key in names] if part.keys.tagged() else [{}] * len(names),
            "schema": [[name, entry.family] for name, entry in schema.items() if entry.confirmed],
            "streams": part.streams.snapshot(time.monotonic()),
        }

    def op_checkpoint_finish(self, body: _protocol.CheckpointFinish) -> _protocol.CheckpointFinishReply:
        saved = self._ckpt()["saves"].pop(body.save, None)
        if saved is None:
            raise CheckpointError(
                "", f"checkpoint save {body.save} is unknown to the index (a later save replaced it)"
            )
        path, data, entry = saved
        state = decode_index(data, path)
        missing = {pid: set(keys) for pid, keys in body.missing.items() if keys}
        if missing:  # cleared while the shards saved: out of the metadata too, as if cleared before
            parts = []
            for p in state.partitions:
                part, _ = self._restore(p, path)
                for key in missing.get(p.pid, ()):
                    if part.keys.remove(key):
                        part.streams.on_clear(key)
                part.keys.settle()
                parts.append(self._snapshot_state(p, part))
            os.unlink(path)
            entry = write_small(path, msgspec.msgpack.encode({"version": VERSION, "partitions": parts}))
            counts = {p["pid"]: len(p["keys"]) for p in parts}
        else:
            counts = {p.pid: len(p.keys) for p in state.partitions}
        return _protocol.CheckpointFinishReply(entry, counts)

    def _snapshot_state(self, p: PartState, part: PartMeta) -> dict[str, Any]:
        out = self._snapshot(p.pid, part)
        out["schema"] = p.schema  # the schema as saved, not the live one
        return out

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
            fields = p.fields_of()
            if len(p.tags) != len(p.keys) or len(set(p.keys)) != len(p.keys):
                raise ValueError("keys and tags disagree, or a key repeats")
            sets: dict[int, frozenset[str]] = {}  # (fields_of answers one list per layout: by its id)
            for key, tag, held in zip(p.keys, p.tags, fields, strict=True):
                got = sets.get(id(held))
                if got is None:
                    got = sets[id(held)] = frozenset(held)
                part.keys.restore(key, got, tag)
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
