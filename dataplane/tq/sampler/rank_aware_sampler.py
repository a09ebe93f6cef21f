"""TransferQueue's rank-aware sampler: every rank of one data-parallel replica gets the same rows."""

from __future__ import annotations

from typing import Any

from dataplane.tq.sampler.base import BaseSampler


class RankAwareSampler(BaseSampler):
    """The first caller for ``(partition_id, task_name, dp_rank, batch_index)`` takes the first
    ``batch_size`` ready rows (nothing if fewer are ready) and caches them; later callers with the
    same key (the other ranks of that replica) get the cached rows.

    Raises:
        ValueError: ``dp_rank < 0``.

    Example:
        >>> s = RankAwareSampler()
        >>> s.sample([0, 1, 2], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
        ([0, 1], [0, 1])
        >>> s.sample([2], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
        ([0, 1], [0, 1])
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int,
        batch_index: int,
        task_name: str,
        partition_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        by_batch = self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        cached = by_batch.get(batch_index)
        if isinstance(cached, list):
            return cached, cached
        picked = list(ready_indexes[:batch_size])
        if len(picked) < batch_size:
            return [], []
        by_batch[batch_index] = picked
        return picked, picked


__all__ = ["RankAwareSampler"]
