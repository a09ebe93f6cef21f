"""Which copy moves a column's bytes between a tensor and the store: one pure function.

``copy_path`` decides, for bytes that go through a mapping of a shard's file on this host (a column
for a shard elsewhere travels as frames, staged: ``client.ops`` decides that first), from three
facts: the tensor's device, whether that mapping is registered with CUDA, and the room left under
the process's cap on registered bytes. ``transport.pinning`` asks it for every device copy
(and registers a mapping when it answers ``REGISTER``); ``client.ops`` follows its answers. No
torch, no IO: the tests walk every branch on CPU.
"""

from __future__ import annotations

import enum


class CopyPath(enum.Enum):
    """How one column's bytes move between a tensor and the store."""

    MEMCPY = "memcpy"  # a CPU tensor: plain host copies, no accelerator involved
    DIRECT = "direct"  # one DMA between the device and a registered shared-memory mapping
    REGISTER = "register"  # register the mapping first (room under the cap), then DIRECT
    STAGED = "staged"  # through a pinned staging buffer and a host copy (or as frames, off this host)


def copy_path(device: str, registered: bool, map_bytes: int, cap_left: int) -> CopyPath:
    """The copy a column of a tensor on ``device`` (a device type: "cpu", "cuda") takes through a
    mapping of a shard's file here.

    ``registered``: that mapping is registered already; ``map_bytes``: the size registering it would
    pin; ``cap_left``: the pinned bytes still allowed in this process.
    """
    if device == "cpu":
        return CopyPath.MEMCPY
    if registered:
        return CopyPath.DIRECT
    if map_bytes <= cap_left:
        return CopyPath.REGISTER
    return CopyPath.STAGED


__all__ = ["CopyPath", "copy_path"]
