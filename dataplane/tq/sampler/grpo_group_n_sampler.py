"""TransferQueue's group sampler: only whole groups of ``n_samples_per_prompt`` consecutive global
indexes (a group's rows put together, as one insert, get consecutive indexes)."""

from __future__ import annotations

from typing import Any

from dataplane.tq.sampler.base import BaseSampler


class GRPOGroupNSampler(BaseSampler):
    """``batch_size // n_samples_per_prompt`` runs of ``n`` consecutive ready indexes, or nothing.

    Args:
        n_samples_per_prompt: rows per group (> 0).

    With ``dp_rank`` in the call, the result is cached under ``(partition_id, task_name, dp_rank,
    batch_index)`` and a repeated call returns it.

    Raises:
        ValueError: ``n_samples_per_prompt <= 0``, or ``batch_size`` not a multiple of it.

    Example:
        >>> GRPOGroupNSampler(n_samples_per_prompt=3).sample([0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6)
        ([3, 4, 5, 9, 10, 11], [3, 4, 5, 9, 10, 11])
    """

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        cached = self._cached(partition_id, task_name, dp_rank, batch_index)
        if cached is not None:
            return cached
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise ValueError(f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})")
        groups = consecutive_runs(sorted(ready_indexes), n, batch_size // n)
        if len(groups) < batch_size // n:
            return [], []
        picked = [i for g in groups for i in g]
        result = (picked, list(picked))
        if dp_rank is not None:
            self._cache(partition_id, task_name, dp_rank, batch_index, result)
        return result


def consecutive_runs(indexes: list[int], n: int, want: int) -> list[list[int]]:
    """Up to ``want`` non-overlapping runs of ``n`` consecutive ints, scanning sorted ``indexes``."""
    runs: list[list[int]] = []
    i = 0
    while i + n <= len(indexes) and len(runs) < want:
        window = indexes[i : i + n]
        if window[-1] - window[0] == n - 1 and len(set(window)) == n:
            runs.append(window)
            i += n
        else:
            i += 1
    return runs


__all__ = ["GRPOGroupNSampler"]
