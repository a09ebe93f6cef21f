"""Client side of shared memory: map a shard's memfd files through ``/proc`` and cache the mappings.

``MappingCache`` opens a shard's file through ``/proc/<shard pid>/fd/<fd>``, checks
its inode (so a reused fd number or another pid namespace is detected), maps it once with
``MAP_POPULATE`` (the mapping keeps no file descriptor, see ``_mapping``) and caches it by the
never-reused file id. The shard tells clients which files are still alive, and mappings of closed
files are dropped.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from dataplane.wire.shm import boot_id, fd_limit_error, map_fd


class ShmUnavailable(OSError):
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
            m = map_remote(pid, *ref[1:4], populate=False)  # sparse: only the slots read get pages
            with self._lock:
                self._tables[shard] = m
        return m

    def version(self, shard: int) -> int:
        return self._versions.get(shard, -1)

    def view(self, shard: int, pid: int, ref: list[int]) -> memoryview:
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


def map_remote(pid: int, fd: int, size: int, inode: int, populate: bool = True) -> memoryview:
    """Map another process's memfd through /proc; raises ShmUnavailable when it is not that file.

    The mapping holds no file descriptor (``_mapping.map_fd``). Running out of descriptors while
    opening the file raises ``ResourceLimitError`` naming the limit.
    """
    path = f"/proc/{pid}/fd/{fd}"
    try:
        local = os.open(path, os.O_RDWR)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(f"mapping a shard segment ({path})", exc) from exc
        raise ShmUnavailable(f"cannot open {path}: {exc}") from exc
    try:
        if os.fstat(local).st_ino != inode:
            raise ShmUnavailable(
                f"{path} is not the shard's segment (inode mismatch: closed, other host or pid ns)"
            )
        return map_fd(local, size, populate=populate)
    finally:
        os.close(local)


def probe(pid: int, ref: list[Any], host_boot_id: str) -> bool:
    """True when this process can map the shard's files (same kernel, /proc access, same pid ns)."""
    if not host_boot_id or host_boot_id != boot_id():
        return False
    try:
        map_remote(pid, ref[1], ref[2], ref[3], populate=False)
        return True
    except (ShmUnavailable, OSError, ValueError):
        return False
