"""Shared-memory mappings registered with CUDA, so a GPU copies to and from them at pinned speed.

A CUDA copy between a device and *pageable* host memory runs through the driver's own small pinned
bounce buffers, a fraction of the bus's speed. A mapping of a shard's file registered with
``cudaHostRegister`` is pinned memory as far as the GPU is concerned: a put of a CUDA tensor copies
device -> the writer's mapping of its reservation, and a get onto a device copies the mapping ->
device, each one DMA with no host copy.

Which copy a transfer takes is one pure function, ``codec.paths.copy_path`` (the tests walk every
branch on CPU). ``PinRegistry`` keeps the registrations of one process:

* one per mapping (the whole file, registered the first time a device copy touches it), cached
  until the mapping goes: the registry hooks the mapping's unmap (``transport.shm.before_unmap``),
  and unregisters before the pages are unmapped;
* bounded: registered bytes never exceed ``cap_bytes`` (``DATAPLANE_PINNED_BYTES``, default 8 GiB;
  0 turns registration off). A mapping that would pass the cap is not registered: that copy takes
  the staged path (through a pinned buffer of torch's caching host allocator, then a memcpy, as
  without registration) and is counted in ``stats()["staged"]``. Nothing is evicted: the room comes
  back when mapped files are closed (the shard closes a freed file past its warm pool);
* the CUDA calls are the pair ``(register, unregister)`` it is built with (``cuda_calls()`` in a
  process with a GPU); tests pass callables of their own that record the calls. Without CUDA, the
  process-wide registry has none, and nothing is registered.

Registration is per process (``cudaHostRegisterPortable``: valid in every CUDA context of it).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from dataplane import config
from dataplane.codec.paths import CopyPath, copy_path
from dataplane.transport.shm import before_unmap

# cudaHostRegister(address, nbytes) -> 0 on success, a CUDA error code otherwise; cudaHostUnregister(address).
Register = Callable[[int, int], int]
Unregister = Callable[[int], int]

_PORTABLE = 1  # cudaHostRegisterPortable


class PinRegistry:
    """The mappings of this process registered with CUDA, within ``cap_bytes`` (module docstring)."""

    def __init__(self, cap_bytes: int, calls: tuple[Register, Unregister] | None) -> None:
        self.cap_bytes = max(0, cap_bytes) if calls is not None else 0
        self._calls = calls
        self._entries: dict[int, int] = {}  # the registered mappings' sizes, by address
        self._hooked: set[int] = set()  # addresses whose unmap runs ``release`` (hooked once each)
        self._pinned = 0
        self._counts = {"registered": 0, "unregistered": 0, "direct": 0, "staged": 0, "failed": 0}
        # Reentrant: an unmap (``release``) can run from the garbage collector inside ``pin``.
        self._lock = threading.RLock()

    def pin(self, mapping: memoryview, device: str = "cuda") -> CopyPath:
        """Register ``mapping``'s whole file mapping if it is not yet and the cap allows; the path a
        copy between it and a tensor on ``device`` then takes (DIRECT or STAGED; MEMCPY for "cpu")."""
        addr, size = _extent(mapping)
        with self._lock:
            registered = addr in self._entries
            path = copy_path(device, registered, size, self.cap_bytes - self._pinned)
            if path is CopyPath.REGISTER:
                path = self._register(mapping, addr, size)
            if path is not CopyPath.MEMCPY:
                self._counts["direct" if path is CopyPath.DIRECT else "staged"] += 1
            return path

    def _register(self, mapping: memoryview, addr: int, size: int) -> CopyPath:
        assert self._calls is not None  # (a cap above 0 needs the calls)
        # The hook first: a mapping whose unmap cannot be hooked (not ``map_fd``'s) is never
        # registered, as its pages could be unmapped while CUDA still holds them.
        if addr not in self._hooked:
            if not before_unmap(mapping, self.release):
                self._counts["failed"] += 1
                return CopyPath.STAGED
            self._hooked.add(addr)  # (a registration that fails is tried again later: one hook serves)
        if self._calls[0](addr, size) != 0:
            self._counts["failed"] += 1
            return CopyPath.STAGED
        self._entries[addr] = size
        self._pinned += size
        self._counts["registered"] += 1
        return CopyPath.DIRECT

    def release(self, addr: int) -> None:
        """Unregister the mapping at ``addr`` (run by its unmap, before the pages go); no-op if unknown."""
        with self._lock:
            self._hooked.discard(addr)  # (the address may be a new mapping's next)
            size = self._entries.pop(addr, None)
            if size is None:
                return
            self._pinned -= size
            self._counts["unregistered"] += 1
        assert self._calls is not None
        self._calls[1](addr)

    def stats(self) -> dict[str, int]:
        """Registered bytes and mappings now, the cap, and counts of registrations and copy paths."""
        with self._lock:
            return {
                "pinned_bytes": self._pinned,
                "pinned_mappings": len(self._entries),
                "cap_bytes": self.cap_bytes,
                **self._counts,
            }


def _extent(mapping: memoryview) -> tuple[int, int]:
    """Address and size of the whole mapping ``mapping`` views (a slice views its mapping's start)."""
    base = mapping.obj
    if isinstance(base, ctypes.Array):
        return ctypes.addressof(base), ctypes.sizeof(base)
    raw = memoryview(base).cast("B") if not isinstance(base, memoryview) else base
    return ctypes.addressof(ctypes.c_char.from_buffer(raw)), raw.nbytes


def cuda_calls() -> tuple[Register, Unregister] | None:
    """``cudaHostRegister`` / ``cudaHostUnregister`` of this process's CUDA runtime; None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    rt = torch.cuda.cudart()
    clear = _last_error_reset()

    def register(addr: int, nbytes: int) -> int:
        err = int(rt.cudaHostRegister(addr, nbytes, _PORTABLE))
        if err and clear is not None:
            # A failed runtime call is also this thread's "last error", which torch checks after its
            # next kernel launch: it would raise there, in an unrelated op. The copy is staged instead.
            clear()
        return err

    def unregister(addr: int) -> int:
        return int(rt.cudaHostUnregister(addr))

    return register, unregister


def _last_error_reset() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the CUDA runtime this process has loaded (torch's), found by its file
    in ``/proc/self/maps`` so it is the same instance; None if there is none to find."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart" in line.rsplit("/", 1)[-1]})
        for path in paths:
            reset: Callable[[], int] = ctypes.CDLL(path).cudaGetLastError
            return reset
    except (OSError, AttributeError):
        pass
    return None


_registry: PinRegistry | None = None
_registry_lock = threading.Lock()


def registry() -> PinRegistry:
    """This process's registry (made on first use: only a device copy asks, so CUDA is up by then)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PinRegistry(config.pinned_bytes(), cuda_calls())
        return _registry


__all__ = ["PinRegistry", "cuda_calls", "registry"]
