"""Placement: which shard holds a (partition, key). A small strategy class, computed by clients.

The default, ``HashPlacement``, is a stable hash (``zlib.crc32`` of partition and key, never
Python's per-process randomised ``hash()``), so every process routes a key to the same shard with
no index lookup. Its assumption: the number of shards is fixed for the life of the store.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dataplane.wire.placement import shard_of, shards_of


class Placement:
    """Base strategy: subclasses implement ``shard_of``; ``group`` may be overridden for speed."""

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards={num_shards} must be >= 1")
        self.num_shards = num_shards

    def shard_of(self, partition_id: str, key: str) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement shard_of(partition_id, key)")

    def group(self, partition_id: str, keys: Sequence[str]) -> dict[int, np.ndarray]:
        """Positions of ``keys`` per shard, each in ascending (batch) order."""
        if self.num_shards == 1:
            return {0: np.arange(len(keys), dtype=np.int64)} if len(keys) else {}
        owner = self._owners(partition_id, keys)
        return {int(s): np.flatnonzero(owner == s) for s in np.unique(owner)}

    def _owners(self, partition_id: str, keys: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.shard_of(partition_id, k) for k in keys), dtype=np.int64, count=len(keys))


class HashPlacement(Placement):
    """crc32(partition \\0 key) mod num_shards."""

    def shard_of(self, partition_id: str, key: str) -> int:
        return shard_of(partition_id, key, self.num_shards)

    def _owners(self, partition_id: str, keys: Sequence[str]) -> np.ndarray:
        return shards_of(partition_id, keys, self.num_shards)  # (at C speed)


__all__ = ["HashPlacement", "Placement"]
