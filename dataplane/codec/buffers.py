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
from collections.abc import Callable
from typing import Any

import numpy as np

from dataplane import config

# Below this size malloc's own free lists serve warm memory; pooling would only add overhead.
MIN_POOLED_BYTES = 2 << 20
_HUGE_PAGE = 2 << 20


class BufferPool:
    """Idle output mappings keyed by their (2 MiB-rounded) size. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Every mapping the pool made and that still lives, with its address (``pooled``).
        self._address: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()
        self._drop_hooks: list[Callable[[int], None]] = []
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
        new = m is None
        if m is None:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):  # no transparent huge pages here: plain pages
                pass
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes)
        if new:
            with self._lock:
                self._address[m] = int(arr.ctypes.data)
        weakref.finalize(arr, self._give_back, m, size)
        return arr

    def _give_back(self, m: mmap.mmap, size: int) -> None:
        # Runs while the dying array still exports ``m``: never close it here, only keep or drop it.
        dropped = []
        with self._lock:
            if size > self.max_bytes:
                dropped.append(m)
            else:
                while self._idle_bytes + size > self.max_bytes:
                    old_size, old = self._since.popitem(last=False)[1]
                    self._idle[old_size].remove(old)
                    self._idle_bytes -= old_size
                    dropped.append(old)
                self._idle.setdefault(size, []).append(m)
                self._since[id(m)] = (size, m)
                self._idle_bytes += size
        self._dropped(dropped)

    def _dropped(self, maps: list[mmap.mmap]) -> None:
        """Tell the drop hooks the address of each mapping the pool let go of."""
        hooks = list(self._drop_hooks)
        for m in maps:
            addr = self._address.pop(m, None)
            if addr is not None:
                for hook in hooks:
                    hook(addr)

    def pooled(self, view: memoryview) -> tuple[memoryview, int] | None:
        """The whole pooled mapping ``view`` (or what it was built from: arrays, memoryviews) lies in,
        as a uint8 view that keeps it mapped, and its address; None when it lies in none."""
        obj: Any = view.obj
        for _ in range(8):  # (an array of a memoryview of an array of the mapping, at most)
            if isinstance(obj, mmap.mmap):
                addr = self._address.get(obj)
                return None if addr is None else (memoryview(obj).cast("B"), addr)
            obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
            if obj is None:
                return None
        return None

    def on_drop(self, hook: Callable[[int], None]) -> Callable[[], None]:
        """Call ``hook(address)`` for every pooled mapping the pool lets go of (any thread, maybe in
        a garbage collector's finalizer: it must only take note); returns what unhooks it."""
        self._drop_hooks.append(hook)
        return lambda: self._drop_hooks.remove(hook) if hook in self._drop_hooks else None

    def clear(self) -> None:
        """Drop every idle buffer (their memory goes back to the OS)."""
        with self._lock:
            dropped = [m for maps in self._idle.values() for m in maps]
            self._idle.clear()
            self._since.clear()
            self._idle_bytes = 0
        self._dropped(dropped)


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


def pooled(view: memoryview) -> tuple[memoryview, int] | None:
    """The whole pooled mapping ``view`` lies in and its address (``BufferPool.pooled``)."""
    return _pool.pooled(view)


def on_drop(hook: Callable[[int], None]) -> Callable[[], None]:
    """``hook(address)`` for every pooled mapping the pool lets go of (``BufferPool.on_drop``)."""
    return _pool.on_drop(hook)


def take(nbytes: int) -> np.ndarray:
    """A uint8 output buffer of ``nbytes``: pooled above ``MIN_POOLED_BYTES``, plain below."""
    if nbytes < MIN_POOLED_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    return _pool.take(nbytes)
