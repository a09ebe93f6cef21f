"""TransferQueue's sequence-length balanced sampler: whole groups for the global batch, split across
data-parallel ranks so each gets about the same number of tokens (Karmarkar-Karp)."""

from __future__ import annotations

import logging
from typing import Any

from dataplane.samplers import balanced_partition
from dataplane.tq.sampler.grpo_group_n_sampler import GRPOGroupNSampler

logger = logging.getLogger(__name__)


class PartitionSizeError(ValueError, AssertionError):
    """The weights cannot be split as asked (too few items, or a count that does not divide).

    Also an ``AssertionError``, which is what TransferQueue raises there."""


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole groups for ``batch_size * dp_size`` rows, split over ``dp_size`` ranks by token count.

    The first call for ``(partition_id, task_name, batch_index)`` picks the groups (as
    ``GRPOGroupNSampler``), weighs each row by its tag ``total_lengths`` (from ``partition=``, an
    object with ``get_custom_meta(indexes) -> {index: tag}``; without one the rows are split in
    equal runs), balances whole groups across ranks and caches every rank's part; each rank's call
    returns its own part.

    Args:
        n_samples_per_prompt: rows per group.
        dp_size: data-parallel ranks (> 0).

    Example:
        >>> s = SeqlenBalancedSampler(dp_size=2)
        >>> s.sample([0, 1, 2, 3], 2, task_name="t", partition_id="p", dp_rank=1, batch_index=0)
        ([2, 3], [2, 3])
    """

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size
        self._balanced_cache: dict[tuple[Any, ...], list[list[int]]] = {}

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        dp_rank = kwargs.get("dp_rank", 0)
        batch_index = kwargs.get("batch_index", 0)
        key = (partition_id, task_name, batch_index)
        parts = self._balanced_cache.get(key)
        if parts is None:
            chosen, _ = super().sample(
                ready_indexes, batch_size * self.dp_size, task_name=task_name, partition_id=partition_id
            )
            if not chosen:
                return [], []
            parts = self._split(chosen, kwargs.get("partition"))
            self._balanced_cache[key] = parts
            for rank in range(self.dp_size):  # every rank's part, so that rank finds it cached
                mine = parts[rank] if rank < len(parts) else []
                self._cache(partition_id, task_name, rank, batch_index, (mine, list(mine)))
        mine = list(parts[dp_rank]) if dp_rank < len(parts) else []
        return mine, list(mine)

    def _split(self, chosen: list[int], partition: Any) -> list[list[int]]:
        if partition is None:
            logger.warning("SeqlenBalancedSampler: no partition given, splitting the rows in equal runs")
            step = len(chosen) // self.dp_size
            return [
                chosen[r * step : (r + 1) * step if r < self.dp_size - 1 else len(chosen)]
                for r in range(self.dp_size)
            ]
        tags = partition.get_custom_meta(chosen)
        lengths = [tags.get(i, {}).get("total_lengths", 1) for i in chosen]
        n = self.n_samples_per_prompt
        if len(lengths) >= n and len(lengths) % n == 0:  # balance whole groups
            groups = [sum(lengths[g * n : (g + 1) * n]) for g in range(len(lengths) // n)]
            by_group = get_seqlen_balanced_partitions(groups, self.dp_size, equal_size=True)
            return [[chosen[g * n + s] for g in part for s in range(n)] for part in by_group]
        by_row = get_seqlen_balanced_partitions(lengths, self.dp_size, equal_size=False)
        return [[chosen[i] for i in part] for part in by_row]

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for key in [k for k in self._balanced_cache if k[0] == partition_id]:
            del self._balanced_cache[key]

    def save_checkpoint(self) -> dict[str, Any]:
        return {**super().save_checkpoint(), "_balanced_cache": self._balanced_cache}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        super().load_checkpoint(state)
        self._balanced_cache = state["_balanced_cache"]


def get_seqlen_balanced_partitions(
    seqlen_list: list[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Indexes of ``seqlen_list`` in ``k_partitions`` non-empty parts with balanced sums (each part
    sorted); ``equal_size`` also makes the counts equal.

    Raises:
        PartitionSizeError: fewer items than parts, or ``equal_size`` with a count ``k`` does not
            divide.
    """
    n = len(seqlen_list)
    if n < k_partitions:
        raise PartitionSizeError(f"number of items:[{n}] < k_partitions:[{k_partitions}]")
    if equal_size and n % k_partitions:
        raise PartitionSizeError(f"{n} items do not split into {k_partitions} parts of equal size")
    parts = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    if any(not p for p in parts):
        raise PartitionSizeError(f"balancing {n} items over {k_partitions} parts left one empty")
    return parts


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp largest differencing over ``seqlen_list`` (see ``dataplane.samplers``)."""
    return balanced_partition([float(x) for x in seqlen_list], k_partitions, equal_size=equal_size)


__all__ = ["SeqlenBalancedSampler"]
