"""The storage-engine interface the KV API (and the worker bridge) talk to, and its one engine today.

An engine turns KV calls into *operations*: sans-IO generators (``ops.Op``) that the client runs
with blocking sockets or on an event loop. Six methods are required; nothing else is:

    put(keys, partition_id, columns, tags) -> Op[KVBatchMeta]   columns already encoded (``codec.columns``)
    get(keys, partition_id, fields, copy)  -> Op[dict[str, Column]]   rows in ``keys`` order
    clear(keys, partition_id)              -> Op[None]   unknown keys are ignored
    clear_partition(partition_id)          -> Op[None]
    list(partition_id | None)              -> Op[{partition: {key: tag}}]
    stats(trim)                            -> Op[(per-shard dicts, index dict)]

Lifecycles (client side = the process calling ``dp.*``; shard side = the storage actors):
    put: client encodes columns -> engine reserves space on each shard holding some of the keys and
         checks the schema with the index -> client copies rows (shared memory) or sends them as
         frames -> shards commit and the index records keys, fields and tags.
    get: client asks each shard holding some of the keys -> shards answer with shared-memory
         references or one frame per field -> client gathers rows in key order (one copy) or returns
         a zero-copy view.

Adding an engine means one class here (or in its own module) and one entry in ``ENGINES``;
``select_engine`` picks by preference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dataplane.client import ops as _ops


class StorageEngine(ABC):
    """Base class of storage engines (see the module docstring for the protocol)."""

    @abstractmethod
    def put(self, keys: list[str], partition_id: str, columns: dict[str, Any] | None, tags) -> _ops.Op: ...

    @abstractmethod
    def get(self, keys: list[str], partition_id: str, fields: list[str] | None, copy: bool) -> _ops.Op: ...

    @abstractmethod
    def clear(self, keys: list[str], partition_id: str) -> _ops.Op: ...

    @abstractmethod
    def clear_partition(self, partition_id: str) -> _ops.Op: ...

    @abstractmethod
    def list(self, partition_id: str | None) -> _ops.Op: ...

    @abstractmethod
    def stats(self, trim: bool) -> _ops.Op: ...


class ShardedEngine(StorageEngine):
    """Hash-placed shards holding columnar segments; shared memory on the same host, zmq frames across."""

    def __init__(self, route: _ops.Route) -> None:
        self.route = route

    def put(self, keys, partition_id, columns, tags) -> _ops.Op:
        return _ops.put(self.route, keys, partition_id, columns, tags)

    def get(self, keys, partition_id, fields, copy) -> _ops.Op:
        return _ops.get(self.route, keys, partition_id, fields, copy)

    def clear(self, keys, partition_id) -> _ops.Op:
        return _ops.clear(self.route, keys, partition_id)

    def clear_partition(self, partition_id) -> _ops.Op:
        return _ops.clear_partition(self.route, partition_id)

    def list(self, partition_id) -> _ops.Op:
        return _ops.list_keys(self.route, partition_id)

    def stats(self, trim) -> _ops.Op:
        return _ops.stats(self.route, trim)


ENGINES: dict[str, type[StorageEngine]] = {"sharded": ShardedEngine}
_PREFERENCE = ("sharded",)


def select_engine(registry: dict[str, Any]) -> type[StorageEngine]:
    """The engine class for a service registry: its ``engine`` entry, else the first preferred one."""
    name = registry.get("engine") or _PREFERENCE[0]
    if name not in ENGINES:
        raise NotImplementedError(f"storage engine {name!r} is not available here; known: {sorted(ENGINES)}")
    return ENGINES[name]


__all__ = ["ENGINES", "ShardedEngine", "StorageEngine", "select_engine"]
