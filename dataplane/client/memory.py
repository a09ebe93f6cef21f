"""What an operation needs of shared memory: the port ``ops`` maps shard files through.

``ops`` never maps anything itself: it asks the ``SharedMemory`` its ``Route`` carries. The real
one (``dataplane.client.mappings.ShardMemory``) maps the shards' memfd files through ``/proc``; a
test passes one backed by bytearrays and drives the operations with scripted replies.

The contract (the integrity of reads rests on it, see ``dataplane.server.shard.segments``):

* ``view(shard, ref)`` is a writable view of the whole file ``ref`` names
  (``[file_id, fd, size, inode, slot, generation]``, as a shard's reply gives it), or raises
  ``SegmentUnavailable`` when the file cannot be mapped here (closed since the shard named it,
  another host or pid namespace, no access);
* ``generations(shard)`` is the shard's generation table read live: ``len`` is its number of
  slots, ``table[slot]`` the generation the slot holds *now* (0: no live file there), so a reader
  that copied rows out of a file can check afterwards that they were still that generation's;
* ``pin(shard, ref)``: the copy between a device and the file ``ref`` names takes
  (``codec.paths.CopyPath``): ``DIRECT`` once its mapping is registered with CUDA (registered now
  if the process's cap allows), ``STAGED`` otherwise; asked only for device copies;
* ``version(shard)`` / ``prune(shard, version, live)``: the shard's file-set version this client
  last saw, and forgetting the mappings of files no longer in ``live`` (the shard sends ``live``
  whenever the version a request carried is not current).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dataplane.codec.paths import CopyPath


class SegmentUnavailable(OSError):
    """This client cannot map a shard's file (closed, another host or pid namespace, no access)."""


class SharedMemory(Protocol):
    """The shards' files as this process maps them (see the module docstring)."""

    def view(self, shard: int, ref: Sequence[int]) -> memoryview: ...

    def generations(self, shard: int) -> Sequence[int]: ...

    def pin(self, shard: int, ref: Sequence[int]) -> CopyPath: ...

    def version(self, shard: int) -> int: ...

    def prune(self, shard: int, version: int, live: list[int]) -> None: ...


__all__ = ["SegmentUnavailable", "SharedMemory"]
