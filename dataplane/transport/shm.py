"""The shared-memory contract between a shard and same-host clients.

``map_fd(fd, size) -> memoryview``: shared mappings of a file that hold no file descriptor;
``GEN`` / ``generation``: the layout of the shard's generation table (one 8-byte slot per file);
``boot_id``: which kernel a process runs on; ``fd_limit_error``: the typed error for running out
of descriptors. The shard side is ``dataplane.server.shard.segments``, the client side
``dataplane.client.mappings``.

Why ``map_fd``:

Python's ``mmap.mmap`` (before 3.13) keeps a duplicate of the file descriptor for as long as the
mapping lives, so every mapped segment would cost its process one more fd: a client holding a
few hundred live segments ran out of descriptors. A mapping made with ``mmap(2)`` directly needs
no descriptor once it exists; this module makes one, exposes it as a writable ``memoryview``, and
unmaps it when the last view, numpy array or tensor built on it is garbage collected.

    >>> view = map_fd(fd, 1 << 20)   # fd may be closed right away
    >>> view[:4] = b"data"
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import resource
import struct
from collections.abc import Callable

from dataplane.errors import ResourceLimitError

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


class _Unmapper:
    """Owns one mapping; unmaps it when collected (the buffer object that exports it holds us),
    after running the callbacks ``before_unmap`` gave it (each with the mapping's address)."""

    __slots__ = ("addr", "before", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self.before: list[Callable[[int], None]] = []

    def __del__(self) -> None:
        for callback in self.before:
            try:
                callback(self.addr)
            except Exception:  # (an unmap must happen whatever a callback does)
                logger.exception("a callback before unmapping %#x failed", self.addr)
        _libc.munmap(self.addr, self.size)


def map_fd(fd: int, size: int, *, populate: bool = False) -> memoryview:
    """A writable shared mapping of the first ``size`` bytes of ``fd``, as a uint8 memoryview.

    The descriptor is not kept: close it whenever you like. The mapping lives as long as anything
    refers to the returned view (or to a buffer made from it).

    Raises:
        OSError: ``mmap(2)`` failed (errno kept), e.g. ``ENOMEM``.
    """
    if size <= 0:
        raise ValueError(f"map_fd: size must be > 0, got {size}")
    flags = mmap.MAP_SHARED | (MAP_POPULATE if populate else 0)
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * size).from_address(addr)
    buf._unmapper = _Unmapper(addr, size)  # type: ignore[attr-defined]  # lives as long as buf
    return memoryview(buf).cast("B")


def before_unmap(view: memoryview, callback: Callable[[int], None]) -> bool:
    """Have ``callback(address)`` run just before the mapping ``view`` (or a slice of it) views is
    unmapped (``transport.pinning`` unregisters it from CUDA there). False when ``view`` is not a
    ``map_fd`` mapping (nothing to hook)."""
    unmapper = getattr(view.obj, "_unmapper", None)
    if not isinstance(unmapper, _Unmapper):
        return False
    unmapper.before.append(callback)
    return True


def mapping_of(view: memoryview) -> memoryview | None:
    """The whole ``map_fd`` mapping ``view`` (or a slice of it) views, as a uint8 view that keeps it
    mapped; None when ``view`` is not of such a mapping."""
    base = view.obj
    if not isinstance(getattr(base, "_unmapper", None), _Unmapper):
        return None
    return memoryview(base).cast("B")


__all__ = ["before_unmap", "map_fd", "mapping_of"]


GEN = struct.Struct("<Q")  # one slot of a generation table


def generation(table: memoryview, slot: int) -> int:
    """The generation in ``slot`` of a mapped generation table (0: no live file there)."""
    gen: int = GEN.unpack_from(table, slot * GEN.size)[0]
    return gen


def boot_id() -> str:
    """This host's boot id: equal boot ids (and a passing inode probe) mean the same kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def fd_limit_error(what: str, exc: OSError) -> ResourceLimitError:
    """The typed error for running out of file descriptors, naming the process's limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ResourceLimitError(
        f"{what}: this process ran out of file descriptors ({exc}); its limit is {soft} (hard {hard}). "
        "Raise it (ulimit -n / resource.setrlimit) or close what holds them."
    )
