"""How an unbounded shard admits a put: against its host's available memory, shared by the store's
shards on that host.

A shard with no ``capacity_bytes`` may take what the host can hold, but every shard of the store on
the same host draws on the same memory, so none may judge alone. What a shard allocates for a put is
the shared memory of a fresh segment, and that allocation is immediate (``ShmFile.create``
fallocates the pages at reserve time): once allocated, the bytes are gone from the host's available
memory (``MemAvailable`` of ``/proc/meminfo``, what ``psutil.virtual_memory().available`` reports),
where every shard sees them. What no shard can see there is an allocation another shard has admitted
and not finished yet. So the store's shards on one host share a *ledger*: one small memfd with an
8-byte slot per shard, made by each unbounded shard and, once the store's starter has told every
shard of its peers (``share``), the one of the host's first shard, which the others open through
``/proc/<pid>/fd`` (as clients open segments; they keep it open, so it outlives that shard). Nothing
is ever written to ``/dev/shm``. A fresh allocation is admitted under an exclusive lock (``flock``)
of the ledger:

1. sum the other slots: the bytes the other shards are allocating right now;
2. refuse (``StoreFullError``) when the allocation exceeds the host's available memory less that sum;
3. else write the bytes into this shard's slot; unlock; allocate; clear the slot.

So two shards can never both admit what only one of them can allocate. Only fresh allocations are
admitted: a put that reuses a warm segment needs no new memory (its pages are resident), and puts
whose rows travel inline are in memory already (as the request that carried them). The rule is
conservative in one small way: an allocation that just finished is counted twice until its slot is
cleared a moment later. A shard killed while allocating leaves its slot counted until the store is
restarted. A shard that cannot open its peer's ledger (another pid namespace) admits against the
host's available memory and its own allocations alone, and says so in its log.

    >>> host = HostMemory.private()
    >>> with host.admit(1 << 20, "a put of 1 MiB"):
    ...     pass  # allocate here
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dataplane.errors import StoreFullError
from dataplane.transport.locality import Locality

logger = logging.getLogger(__name__)

SLOTS = 4096  # shards of one store (the ledger is sparse: untouched slots cost nothing)
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
    """One shard's admission of fresh shared memory on its host (see the module docstring)."""

    def __init__(self, slot: int = 0, ledger: bool = False, name: str = "dataplane") -> None:
        self._slot = slot
        self._fd = -1
        self._slots: np.ndarray | None = None
        if ledger and 0 <= slot < SLOTS:
            fd = os.memfd_create(f"{name}-host-ledger", os.MFD_CLOEXEC)
            os.ftruncate(fd, SLOTS * 8)
            self._use(fd)

    @classmethod
    def private(cls) -> HostMemory:
        """Admission against the host's available memory alone (no other shard to share it with)."""
        return cls()

    @classmethod
    def for_shard(cls, name: str, shard: int) -> HostMemory:
        """A shard's own ledger, to be shared with its peers on the host (``share``)."""
        return cls(shard, ledger=True, name=name)

    def _use(self, fd: int) -> None:
        self._close_ledger()
        self._fd = fd
        self._map = mmap.mmap(fd, SLOTS * 8)
        self._slots = np.frombuffer(self._map, dtype=np.int64)

    def ref(self) -> list[int] | None:
        """What a peer needs to open this shard's ledger: ``[pid, fd, inode]`` (None: it has none)."""
        if self._fd < 0:
            return None
        return [os.getpid(), self._fd, os.fstat(self._fd).st_ino]

    def share(self, peers: list[dict[str, Any]], here: Locality) -> None:
        """Use the ledger of the first of ``peers`` (the store's shards, as ``ShardActor.info``
        describes them) on this host: its own when that is this shard. A peer's ledger is opened
        through ``/proc/<pid>``, so only peers in this pid namespace count (shards in another
        container on the same kernel admit against the memory they see, alone)."""
        mine = [
            p
            for p in peers
            if p.get("host_ledger") and here.shares_pids(Locality.from_dict(p.get("locality")))
        ]
        if self._fd < 0 or not mine:
            return
        first = min(mine, key=lambda p: p["shard"])["host_ledger"]
        if list(first) == self.ref():  # this shard is the host's first
            return
        pid, fd, inode = first
        path = f"/proc/{pid}/fd/{fd}"
        try:
            theirs = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            logger.warning("cannot open the host's ledger %s (%s): this shard admits puts alone", path, exc)
            return
        if os.fstat(theirs).st_ino != inode:
            os.close(theirs)
            logger.warning("%s is not the host's ledger (another pid namespace?): admitting alone", path)
            return
        self._use(theirs)

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
            allocating = f", less {others} bytes the store's other shards here are allocating" * bool(others)
            raise StoreFullError(
                f"{what} needs {nbytes} bytes of shared memory, more than this host has available "
                f"({available} bytes{allocating}); nothing was written. Free memory on the host (clear "
                "data with dp.kv_clear / dp.clear_partition), or give the store a capacity_bytes"
            )

    def _close_ledger(self) -> None:
        if self._fd < 0:
            return
        self._slots = None
        self._map.close()
        os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        self._close_ledger()


__all__ = ["HostMemory", "available_bytes"]
