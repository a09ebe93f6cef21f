"""How an unbounded shard admits a put: against its host's available memory, shared by the store's
shards on that host.

A shard with no ``capacity_bytes`` may take what the host can hold, but every shard of the store on
the same host draws on the same memory, so none may judge alone. What a shard allocates for a put is
the shared memory of its reservation, and that allocation is immediate (``ShmFile.create`` fallocates
the pages at reserve time): once allocated, the bytes are gone from the host's available memory
(``MemAvailable`` of ``/proc/meminfo``, what ``psutil.virtual_memory().available`` reports), and
every shard sees them there. What no shard can see there is an allocation another shard has admitted
and not finished yet. So each shard of the store on a host has an 8-byte slot in one small shared
file (``/dev/shm/rlplane-<store>-<id>.alloc``, one per store instance, ``id`` from its secret), and a
reservation is admitted under an exclusive lock of that file:

1. sum the other slots: the bytes the other shards are allocating right now;
2. refuse (``StoreFullError``) when the put's bytes exceed the host's available memory less that sum;
3. else write the put's bytes into this shard's slot; unlock; allocate; clear the slot.

So two shards can never both admit what only one of them can allocate. Only fresh allocations are
admitted here: a put that reuses a warm segment needs no new memory (its pages are resident), and
puts whose rows travel inline are in memory already (as the request that carried them). The rule is
conservative in one small way: an allocation that just finished is counted twice until its slot is
cleared a moment later. A shard killed while allocating leaves its slot counted until the store is
restarted. A shard that cannot open the file (no ``/dev/shm``) admits against the
host's available memory alone, and says so once in its log. The file is removed when the shards
close; a store whose shards were killed leaves one page behind.

    >>> host = HostMemory.private()
    >>> with host.admit(1 << 20, "a put of 1 MiB"):
    ...     pass  # allocate here
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator

import numpy as np

from dataplane.errors import StoreFullError

logger = logging.getLogger(__name__)

SLOTS = 4096  # shards of one store on one host (the file is sparse: untouched slots cost nothing)
_DIR = "/dev/shm"


_meminfo = [-1]  # /proc/meminfo, kept open: a pread costs half of an open, read and close


def available_bytes() -> int:
    """The host's available memory now (``MemAvailable``: free plus what the kernel can reclaim)."""
    if _meminfo[0] < 0:
        _meminfo[0] = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
    data = os.pread(_meminfo[0], 8192, 0)
    at = data.find(b"MemAvailable:")
    if at < 0:  # (kernels before 3.14)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(data[at + len(b"MemAvailable:") : data.index(b"kB", at)]) * 1024


class HostMemory:
    """This shard's view of its host's memory: admit an allocation, publishing it while it runs."""

    def __init__(self, fd: int = -1, slot: int = 0, path: str | None = None) -> None:
        self._fd = fd
        self._slot = slot
        self._path = path
        self._slots: np.ndarray | None = None
        if fd >= 0:
            import mmap

            self._map = mmap.mmap(fd, SLOTS * 8)
            self._slots = np.frombuffer(self._map, dtype=np.int64)

    @classmethod
    def private(cls) -> HostMemory:
        """Admission against the host's available memory alone (no other shard to share it with)."""
        return cls()

    @classmethod
    def for_store(cls, name: str, secret: str, shard: int) -> HostMemory:
        """Slot ``shard`` of the store's file on this host, shared with its other shards here."""
        if not 0 <= shard < SLOTS:
            logger.warning("shard %d: no slot in the host's allocation file; admitting alone", shard)
            return cls.private()
        store = hashlib.sha256(secret.encode()).hexdigest()[:16]  # this store instance, not its secret
        path = os.path.join(_DIR, f"rlplane-{name}-{store}.alloc")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size < SLOTS * 8:  # every shard asks for the same size: no race
                    os.ftruncate(fd, SLOTS * 8)
                return cls(fd, shard, path)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            logger.warning("shard %d: cannot share %s (%s); admitting puts alone", shard, path, exc)
            return cls.private()

    @contextlib.contextmanager
    def admit(self, nbytes: int, what: str) -> Iterator[None]:
        """Admit allocating ``nbytes`` (``what`` names the put in a refusal): ``StoreFullError`` when
        the host has not that much available beyond what the store's other shards here are
        allocating; else the bytes are published for the length of the ``with`` block."""
        slots = self._slots
        if slots is None:
            self._check(nbytes, 0, what)
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # (a system call on each side: the slots read are current)
        try:
            others = int(slots.sum()) - int(slots[self._slot])
            self._check(nbytes, others, what)
            slots[self._slot] = nbytes
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            yield
        finally:
            slots[self._slot] = 0  # allocated (the host's available memory shows it now) or given up

    @staticmethod
    def _check(nbytes: int, others: int, what: str) -> None:
        available = available_bytes()
        if nbytes > available - others:
            allocating = (
                f", less {others} bytes the store's other shards here are allocating" if others else ""
            )
            raise StoreFullError(
                f"{what} needs {nbytes} bytes of shared memory, more than this host has available "
                f"({available} bytes{allocating}); nothing was written. Free memory on the host (clear "
                "data with dp.kv_clear / dp.clear_partition), or give the store a capacity_bytes"
            )

    def close(self) -> None:
        """Forget the file (removed: the store is stopping; a shard still running keeps its mapping)."""
        if self._fd < 0:
            return
        self._slots = None
        self._map.close()
        os.close(self._fd)
        self._fd = -1
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


__all__ = ["HostMemory", "available_bytes"]
