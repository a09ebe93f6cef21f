"""Reusable output buffers for reads: copy-out gets land in warm pages.

Copying 64 MiB into freshly mapped pages runs at a fraction of memcpy speed on a small host (the
page faults, not the copy, dominate), and every copy-out get needs a fresh output buffer. So large
buffers come from a per-process pool: each is an anonymous mapping (with transparent huge pages
asked for), handed out as a numpy array, and returned to the pool when the last array, memoryview
or tensor built on it is garbage collected. The pool keeps at most ``max_bytes`` of idle buffers:
a buffer coming back makes room by dropping the idle ones that came back longest ago (a loop
moving batches of one size finds its size pooled, whatever sizes came before); one larger than
``max_bytes`` is simply dropped (each is unmapped once nothing references it).

    >>> buf = take(8 << 20)          # a uint8 array of 8 MiB
    >>> del buf                      # its mapping goes back to the pool for the next read
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict

import numpy as np

from dataplane import config

# Below this size malloc's own free lists serve warm memory; pooling would only add overhead.
MIN_POOLED_BYTES = 2 << 20
_HUGE_PAGE = 2 << 20


class BufferPool:
    """Idle output mappings keyed by their (2 MiB-rounded) size. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._since: OrderedDict[int, tuple[int, mmap.mmap]] = OrderedDict()  # id -> idle, oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` (contents undefined), warm if the pool had one of its size."""
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
        with self._lock:
            free = self._idle.get(size)
            m = free.pop() if free else None
            if m is not None:
                self._idle_bytes -= size
                del self._since[id(m)]
        if m is None:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):  # no transparent huge pages here: plain pages
                pass
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._give_back, m, size)
        return arr

    def _give_back(self, m: mmap.mmap, size: int) -> None:
        # Runs while the dying array still exports ``m``: never close it here, only keep or drop it.
        with self._lock:
            if size > self.max_bytes:
                return
            while self._idle_bytes + size > self.max_bytes:
                old_size, old = self._since.popitem(last=False)[1]
                self._idle[old_size].remove(old)
                self._idle_bytes -= old_size
            self._idle.setdefault(size, []).append(m)
            self._since[id(m)] = (size, m)
            self._idle_bytes += size

    def clear(self) -> None:
        """Drop every idle buffer (their memory goes back to the OS)."""
        with self._lock:
            self._idle.clear()
            self._since.clear()
            self._idle_bytes = 0


_pool = BufferPool(config.read_buffer_pool_bytes())


_POPULATE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # (Linux 5.14; the constant is newer than Python's)


def take_faulted(nbytes: int) -> np.ndarray:
    """``take(nbytes)`` with every page faulted in, in one pass: for a buffer several threads fill at
    once (a transfer engine's connections), which fault fresh pages far slower together (each waits
    on the others' faults) than one pass does; a pooled buffer's pages are present already (no cost)."""
    arr = take(nbytes)
    base = arr.base.obj if isinstance(arr.base, memoryview) else arr.base  # (numpy views the mapping)
    if isinstance(base, mmap.mmap):
        try:
            base.madvise(_POPULATE)
        except OSError:  # (an older kernel: the threads that fill it fault its pages)
            pass
    return arr


def take(nbytes: int) -> np.ndarray:
    """A uint8 output buffer of ``nbytes``: pooled above ``MIN_POOLED_BYTES``, plain below."""
    if nbytes < MIN_POOLED_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    return _pool.take(nbytes)
