"""Shared-memory segments: memfd files owned by a shard, mapped directly by same-host clients.

Shard side (``ShmPool``): every segment is an anonymous ``memfd_create`` file, so nothing is ever
written to ``/dev/shm``; its pages vanish when the shard process dies and the last mapping drops,
which is why no segment can outlive the store, even after a crash. Pages are allocated up front
with ``posix_fallocate`` (much cheaper than faulting them in through a copy).

Lifetime invariants (what makes a read return only bytes some completed put wrote):

* **Generation.** Every file has a slot in the shard's *generation table* (one small memfd that
  clients map once, next to the files), holding the file's generation: a number, unique within the
  shard, that changes each time the rows the file holds stop being live (the file is freed, then
  maybe reused by another put), and 0 once the file is closed. A get reply names the slot and the
  generation it saw; a reader that copies out of a file checks, after copying, that the slot still
  holds that generation, and retries otherwise. Rows of a live file are never written: a writer
  only writes into a file it reserved, before the commit that makes it readable.
* **Exported files are never reused.** A file handed out as a zero-copy view (*exported*) is
  closed without giving its pages back when freed, so the view keeps its bytes for as long as the
  reader holds it; nobody else ever writes them.
* **Fenced files are never reused.** A file whose reservation expired before its writer committed
  (the writer stalled or died) is closed, never recycled: a late writer still holding a mapping
  scribbles on memory that no row refers to, and the pages go when its mapping goes.
* **Whoever serves a file's mapping is told before it is reused.** ``ShmPool.on_free`` (a transfer
  engine that registered the mapping for remote readers, ``transport.mooncake_engine``) runs with the
  shard's mapping of a file when the file stops holding rows, before its next generation; a file it
  answers False for (a remote reader may still read it) is closed, never reused.

Reuse policy (``bytes_warm`` in ``stats()``): a freed file goes to a warm pool and is handed to the
next put that fits it (size within 1.3x), so a steady put/clear cycle never faults fresh pages and
clients keep their mappings. A warm file is given back to the OS (its pages punched out with
``MADV_REMOVE``, then closed) once it has been idle ``warm_idle_s`` or when the warm pool exceeds
``warm_retain_bytes``.

The client side (mapping these files) is ``dataplane.client.mappings``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dataplane.errors import StoreFullError
from dataplane.transport.shm import GEN, fd_limit_error, map_fd

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_REUSE_SLACK = 1.3
TABLE_SLOTS = 1 << 20  # live files per shard; the table is sparse: only touched pages cost memory


def size_class(nbytes: int) -> int:
    """Bytes actually allocated for a request of ``nbytes``: pages, then 1/8-power-of-two steps."""
    n = max(PAGE, -(-nbytes // PAGE) * PAGE)
    if n <= 16 * PAGE:
        return n
    step = 1 << (n.bit_length() - 4)  # 8 classes per doubling: at most 12.5% slack
    return -(-n // step) * step


class GenTable:
    """The shard's generation table: one 8-byte slot per open file (see the module docstring).

    A memfd like the segments, so clients map it the same way (and it doubles as the probe that
    tells a client it can map the shard's files at all). Generations come from one counter, so a
    slot reused by another file never shows a generation a reader saw before.
    """

    def __init__(self, prefix: str = "dataplane", slots: int = TABLE_SLOTS) -> None:
        self.file = ShmFile.create(0, slots * GEN.size, prefix, allocate=False)
        self._view: memoryview | None = self.file.view()  # None once closed
        self._slots = slots
        self._unused = 0  # slots below this have been handed out at least once
        self._free: list[int] = []  # slots given back since
        self._next_gen = 1

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        if self._unused >= self._slots:
            raise StoreFullError(f"a shard holds at most {self._slots} shared-memory segments at once")
        self._unused += 1
        return self._unused - 1

    def give_back(self, slot: int) -> None:
        self.set(slot, 0)
        self._free.append(slot)

    def new_generation(self, slot: int) -> int:
        gen, self._next_gen = self._next_gen, self._next_gen + 1
        self.set(slot, gen)
        return gen

    def set(self, slot: int, gen: int) -> None:
        if self._view is None:
            raise ValueError("the generation table is closed")
        GEN.pack_into(self._view, slot * GEN.size, gen)

    def ref(self) -> list[int]:
        return self.file.ref()

    def close(self) -> None:
        self._view = None
        self.file.close(punch=True)


@dataclass(eq=False)
class ShmFile:
    """One memfd file (shard side); ``slot`` / ``gen``: its place in the generation table."""

    file_id: int
    size: int
    fd: int = -1
    inode: int = 0
    slot: int = -1
    gen: int = 0
    exported: bool = False
    freed_at: float = 0.0
    _view: memoryview | None = field(default=None, repr=False)

    @classmethod
    def create(cls, file_id: int, size: int, prefix: str = "dataplane", allocate: bool = True) -> ShmFile:
        try:
            fd = os.memfd_create(f"{prefix}-seg-{file_id}", os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error("creating a shared-memory segment", exc) from exc
            raise
        try:
            os.ftruncate(fd, size)
            if allocate:
                os.posix_fallocate(fd, 0, size)
            return cls(file_id=file_id, size=size, fd=fd, inode=os.fstat(fd).st_ino)
        except OSError:
            os.close(fd)
            raise

    def view(self) -> memoryview:
        """The shard's own mapping of the whole file (mapped on first use)."""
        if self._view is None:
            self._view = map_fd(self.fd, self.size)
        return self._view

    @property
    def mapped(self) -> memoryview | None:
        """The shard's own mapping of the file, if it made one (``view``), without making it."""
        return self._view

    def ref(self) -> list[int]:
        """What a client needs to map and check this file: [file_id, fd, size, inode, slot, generation]."""
        return [self.file_id, self.fd, self.size, self.inode, self.slot, self.gen]

    def close(self, punch: bool) -> None:
        """Give the pages back (``punch``) and close; live views elsewhere keep their own mappings."""
        if self.fd < 0:
            return
        if punch:
            try:
                m = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
                m.madvise(mmap.MADV_REMOVE)
                m.close()
            except (OSError, ValueError) as exc:  # the close below still frees them eventually
                logger.debug("MADV_REMOVE failed on segment file %d: %s", self.file_id, exc)
        os.close(self.fd)
        self.fd = -1
        self._view = None  # unmapped when the last view of it is gone


class ShmPool:
    """The shard's shared-memory files: live ones, and a warm pool of freed ones (see module doc)."""

    def __init__(self, warm_idle_s: float, warm_retain_bytes: int, prefix: str = "dataplane") -> None:
        self.prefix = prefix
        self.warm_idle_s = warm_idle_s
        self.warm_retain_bytes = warm_retain_bytes
        self.table = GenTable(prefix)
        self._next_id = 1
        self.live: dict[int, ShmFile] = {}
        self.warm: list[ShmFile] = []
        self.version = 0  # bumps whenever a file is closed, so clients know to prune mappings
        # Told with the shard's mapping of a file that stops holding rows, before it is reused or
        # closed; False: something may still read it, so it is closed, never reused (module doc).
        self.on_free: Callable[[memoryview], bool] | None = None

    def acquire(
        self,
        nbytes: int,
        admit: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        allocate: bool = True,
    ) -> ShmFile:
        """A file of at least ``nbytes``: a warm one that fits, else a fresh one, whose allocation
        runs inside ``admit(bytes)`` when given (it may refuse: a warm file needs no new memory). A
        fresh file's pages are allocated up front unless ``allocate`` is false (the caller fills it
        with ``write``/``sendfile``, which allocate pages as they go)."""
        best = None
        for f in self.warm:
            if nbytes <= f.size <= max(size_class(nbytes), int(nbytes * _REUSE_SLACK)):
                if best is None or f.size < best.size:
                    best = f
        if best is not None:
            self.warm.remove(best)
        else:
            size = size_class(nbytes)
            with admit(size) if admit is not None else contextlib.nullcontext():
                slot = self.table.take()
                try:
                    best = ShmFile.create(self._next_id, size, self.prefix, allocate)
                except BaseException:
                    self.table.give_back(slot)
                    raise
            self._next_id += 1
            best.slot, best.gen = slot, self.table.new_generation(slot)
        self.live[best.file_id] = best
        return best

    def release(self, f: ShmFile) -> None:
        """A file is no longer used by any row: warm it (next generation), or close it if exported."""
        self.live.pop(f.file_id, None)
        if not self._freed(f) or f.exported:
            self._close(f, punch=False)
            return
        f.gen = self.table.new_generation(f.slot)  # before any reuse: readers of the old rows will see it
        f.freed_at = time.monotonic()
        self.warm.append(f)
        self.trim()

    def fence(self, f: ShmFile) -> None:
        """A reserved file whose writer may still write into it: close it, never reuse it."""
        self.live.pop(f.file_id, None)
        self._freed(f)
        self._close(f, punch=False)

    def _freed(self, f: ShmFile) -> bool:
        """Tell ``on_free`` that ``f`` holds no rows any more; whether its memory may be reused."""
        mapping = f.mapped
        return mapping is None or self.on_free is None or self.on_free(mapping)

    def trim(self, now: float | None = None, everything: bool = False) -> int:
        """Close warm files idle too long or above the retained watermark; returns bytes given back."""
        now = time.monotonic() if now is None else now
        keep: list[ShmFile] = []
        given = 0
        budget = self.warm_retain_bytes
        for f in sorted(self.warm, key=lambda x: x.freed_at, reverse=True):  # newest kept first
            if not everything and now - f.freed_at < self.warm_idle_s and f.size <= budget:
                budget -= f.size
                keep.append(f)
            else:
                given += f.size
                self._close(f, punch=True)
        self.warm = keep
        return given

    def _close(self, f: ShmFile, punch: bool) -> None:
        if f.slot >= 0:
            self.table.give_back(f.slot)
            f.slot = -1
        f.close(punch=punch)
        self.version += 1

    def close_all(self) -> None:
        for f in self.live.values():  # (warm files were told when they were freed)
            self._freed(f)
        for f in [*self.live.values(), *self.warm]:
            self._close(f, punch=not f.exported)
        self.live.clear()
        self.warm.clear()
        self.table.close()

    def live_ids(self) -> list[int]:
        return sorted(self.live)

    @property
    def bytes_resident(self) -> int:
        return sum(f.size for f in self.live.values()) + self.bytes_warm

    @property
    def bytes_warm(self) -> int:
        return sum(f.size for f in self.warm)


__all__ = ["GenTable", "ShmFile", "ShmPool", "size_class"]
