"""Client side of shared memory: map a shard's memfd files through ``/proc`` and cache the mappings.

``MappingCache`` opens a shard's file through ``/proc/<shard pid>/fd/<fd>``, checks
its inode (so a reused fd number or another pid namespace is detected), maps it once with
``MAP_POPULATE`` (the mapping keeps no file descriptor, see ``transport.shm``) and caches it by the
never-reused file id. The shard tells clients which files are still alive, and mappings of closed
files are dropped. ``ShardMemory`` is what the operations read through (``dataplane.client.memory``):
one store's shards, their pids and generation tables, over a ``MappingCache``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

from dataplane.client.memory import SegmentUnavailable
from dataplane.codec.paths import CopyPath
from dataplane.errors import WireError
from dataplane.transport.pinning import registry
from dataplane.transport.shm import GEN, fd_limit_error, generation, map_fd


class ShmUnavailable(SegmentUnavailable):
    """This client cannot map the shard's file (another host, another pid namespace, closed, no access)."""


class MappingCache:
    """Client-side cache of shard file mappings, keyed by (shard, never-reused file id). Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], memoryview] = {}
        self._tables: dict[int, memoryview] = {}
        self._versions: dict[int, int] = {}
        self._lock = threading.Lock()

    def table(self, shard: int, pid: int, ref: list[int]) -> memoryview:
        """The shard's generation table (mapped once; read with ``generation(table, slot)``)."""
        with self._lock:
            m = self._tables.get(shard)
        if m is None:
            fd, size, inode = ref[1:4]
            m = map_remote(pid, fd, size, inode, populate=False)  # sparse: only the slots read get pages
            with self._lock:
                self._tables[shard] = m
        return m

    def version(self, shard: int) -> int:
        return self._versions.get(shard, -1)

    def view(self, shard: int, pid: int, ref: Sequence[int]) -> memoryview:
        """A writable view of the whole file ``ref`` of shard ``shard`` (process ``pid``)."""
        file_id, fd, size, inode = ref[:4]
        key = (shard, file_id)
        with self._lock:
            m = self._maps.get(key)
        if m is None:
            m = map_remote(pid, fd, size, inode)
            with self._lock:
                self._maps[key] = m
        return m

    def prune(self, shard: int, version: int, live: list[int]) -> None:
        """Forget mappings of the shard's files that are no longer alive (views keep their own)."""
        alive = set(live)
        with self._lock:
            for key in [k for k in self._maps if k[0] == shard and k[1] not in alive]:
                del self._maps[key]  # unmapped when the last view of it is dropped
            self._versions[shard] = version

    def drop_shard(self, shard: int) -> None:
        with self._lock:
            for key in [k for k in self._maps if k[0] == shard]:
                del self._maps[key]
            self._tables.pop(shard, None)
            self._versions.pop(shard, None)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._tables.clear()
            self._versions.clear()

    def __len__(self) -> int:
        return len(self._maps)


class GenerationTable(Sequence[int]):
    """A shard's mapped generation table as a sequence: ``table[slot]`` reads the slot's generation now."""

    __slots__ = ("_table",)

    def __init__(self, table: memoryview) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table) // GEN.size

    def __getitem__(self, slot: int) -> int:  # type: ignore[override]  # one slot, never a slice
        if not 0 <= slot < len(self):
            raise IndexError(f"generation table slot {slot} outside 0..{len(self) - 1}")
        return generation(self._table, slot)


class ShardMemory:
    """The shared memory of one store's shards, mapped through ``/proc`` (``memory.SharedMemory``).

    ``pids`` and ``tables`` come from the registry the index hands out at attach time: each shard's
    process id and the ref of its generation table.
    """

    def __init__(self, pids: list[int], tables: list[list[int]], cache: MappingCache | None = None) -> None:
        self.pids = list(pids)
        self.tables = tables
        self.cache = MappingCache() if cache is None else cache

    def view(self, shard: int, ref: Sequence[int]) -> memoryview:
        return self.cache.view(shard, self.pids[shard], ref)

    def generations(self, shard: int) -> GenerationTable:
        return GenerationTable(self.cache.table(shard, self.pids[shard], self.tables[shard]))

    def pin(self, shard: int, ref: Sequence[int]) -> CopyPath:
        return registry().pin(self.view(shard, ref))

    def version(self, shard: int) -> int:
        return self.cache.version(shard)

    def prune(self, shard: int, version: int, live: list[int]) -> None:
        self.cache.prune(shard, version, live)


def map_remote(pid: int, fd: int, size: int, inode: int, populate: bool = True) -> memoryview:
    """Map another process's memfd through /proc; raises ShmUnavailable when it is not that file.

    The mapping holds no file descriptor (``transport.shm.map_fd``). Running out of descriptors while
    opening the file raises ``ResourceLimitError`` naming the limit. A ``size`` past the end of the
    file (a corrupt or hostile reference: touching such a mapping beyond the file kills the process
    with SIGBUS) raises ``WireError`` naming the file and both sizes, before anything is mapped.
    """
    for name, value in (("fd", fd), ("size", size), ("inode", inode)):
        if type(value) is not int:
            raise WireError(f"a shard's segment reference has {name}={value!r}, not an integer")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        local = os.open(path, os.O_RDWR)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(f"mapping a shard segment ({path})", exc) from exc
        raise ShmUnavailable(f"cannot open {path}: {exc}") from exc
    try:
        st = os.fstat(local)
        if st.st_ino != inode:
            raise ShmUnavailable(
                f"{path} is not the shard's segment (inode mismatch: closed, other host or pid ns)"
            )
        if size > st.st_size:
            raise WireError(
                f"a shard named {size} bytes of its segment {path} (inode {inode}), but the file holds "
                f"{st.st_size}: the reference is corrupt; nothing was mapped"
            )
        return map_fd(local, size, populate=populate)
    finally:
        os.close(local)


def probe(pid: int, ref: list[Any]) -> bool:
    """True when this process can map the shard's files (``/proc`` access, the file really the
    shard's): asked only of a shard in this process's pid namespace (``transport.locality``)."""
    try:
        map_remote(pid, ref[1], ref[2], ref[3], populate=False)
        return True
    except (ShmUnavailable, OSError, ValueError):
        return False
