"""TransferQueue's default sampler: the first ``batch_size`` ready rows."""

from __future__ import annotations

from typing import Any

from dataplane.tq.sampler.base import BaseSampler


class SequentialSampler(BaseSampler):
    """The first ``batch_size`` ready rows (fewer if fewer are ready); consumed = sampled.

    Example:
        >>> SequentialSampler().sample([4, 5, 6], 2)
        ([4, 5], [4, 5])
    """

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        picked = list(ready_indexes[:batch_size])
        return picked, picked


__all__ = ["SequentialSampler"]
