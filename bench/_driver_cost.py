"""What a call costs the driver: bytes it pickles for the workers, and its peak RSS growth.

Used by ``bench.bypass`` (driver side; Linux for the RSS figure).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import pickle
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def pickled_bytes(obj: object) -> int:
    """Size of ``obj`` pickled with protocol 5, out-of-band buffers included (what Ray ships for it).

    A torch tensor that is a view pickles its whole storage, so a slice of a batch costs the batch.

    Example:
        >>> pickled_bytes(b"x" * 1000) > 1000
        True
    """
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(memoryview(b).nbytes for b in buffers)


def _status_bytes(name: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{name}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {name}")
    return int(match.group(1)) * 1024


def _malloc_trim() -> None:
    """Give free heap pages back to the OS, so memory a call reuses shows up as growth."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def peak_rss_growth(fn: Callable[[], T]) -> tuple[int | None, T]:
    """Run ``fn``; return (peak RSS during it minus RSS before it, or None where unmeasurable; its result).

    The peak is the kernel's high-water mark ``VmHWM``, reset by writing 5 to
    ``/proc/self/clear_refs`` just before the call. Pages already resident before the call (for
    example Ray object-store memory the driver mapped in an earlier call) do not count again.
    """
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_bytes("VmRSS")
    except (OSError, RuntimeError):  # not Linux, or clear_refs not writable
        return None, fn()
    result = fn()
    return max(0, _status_bytes("VmHWM") - before), result
