"""Which shard holds a (partition, key): the one placement rule every process applies alike.

A stable hash (``zlib.crc32`` of partition and key, never Python's per-process randomised ``hash()``)
modulo the number of shards. Clients route keys with it (``client.sharding.HashPlacement``); shards
use it to find their own rows in a checkpoint (``server.shard.checkpoint``), saved by a store of any
number of shards.

    >>> shard_of("train", "k0", 1)
    0
    >>> shards_of("train", ["k0", "k1"], 3).tolist() == [shard_of("train", k, 3) for k in ["k0", "k1"]]
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from itertools import repeat

import numpy as np


def shard_of(partition_id: str, key: str, num_shards: int) -> int:
    """The shard (``0 .. num_shards - 1``) that holds ``key`` of ``partition_id``."""
    return zlib.crc32(f"{partition_id}\0{key}".encode()) % num_shards


def shards_of(partition_id: str, keys: Sequence[str], num_shards: int) -> np.ndarray:
    """``shard_of`` of every one of ``keys`` at C speed: the checksum of the partition's prefix is
    computed once and continued over each key (``zlib.crc32``'s running value), no step per key."""
    start = zlib.crc32(f"{partition_id}\0".encode())
    crcs = map(zlib.crc32, map(str.encode, keys), repeat(start))
    return np.fromiter(crcs, dtype=np.int64, count=len(keys)) % num_shards


__all__ = ["shard_of", "shards_of"]
