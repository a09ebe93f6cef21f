"""Which shard holds a (partition, key): the one placement rule every process applies alike.

A stable hash (``zlib.crc32`` of partition and key, never Python's per-process randomised ``hash()``)
modulo the number of shards. Clients route keys with it (``client.sharding.HashPlacement``); shards
use it to find their own rows in a checkpoint (``server.shard.checkpoint``), saved by a store of any
number of shards.

    >>> shard_of("train", "k0", 1)
    0
"""

from __future__ import annotations

import zlib


def shard_of(partition_id: str, key: str, num_shards: int) -> int:
    """The shard (``0 .. num_shards - 1``) that holds ``key`` of ``partition_id``."""
    return zlib.crc32(f"{partition_id}\0{key}".encode()) % num_shards


__all__ = ["shard_of"]
