"""TransferQueue's sampler interface: ``BaseSampler.sample(ready_indexes, batch_size, ...)`` returns
``(sampled, consumed)`` global indexes.

On this store a TransferQueue sampler runs in the consumer's process (``get_meta`` gives it the
ready rows' global indexes and claims the keys of what it samples); the store's index never runs
code a client sends. The results a sampler caches (``_states``) therefore live per consumer
process: ranks that must share one choice use ``RankAwareSampler`` or ``SeqlenBalancedSampler``,
which ``get_meta`` maps onto the index's own cache (the same ``(task, dp_rank, batch_index)`` gets
the same rows in every process).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

# (sampled, consumed) global indexes
Picked = tuple[list[int], list[int]]


class BaseSampler(ABC):
    """Base of TransferQueue samplers: subclasses implement ``sample``.

    ``_states[partition_id][task_name][dp_rank][batch_index]`` caches results so that a repeated
    call (another rank, a retry) gets the same rows.

    Example:
        >>> class EveryOther(BaseSampler):
        ...     def sample(self, ready_indexes, batch_size, *args, **kwargs):
        ...         picked = ready_indexes[::2][:batch_size]
        ...         return picked, picked
        >>> EveryOther()([0, 1, 2, 3], 2)
        ([0, 2], [0, 2])
    """

    def __init__(self) -> None:
        # partition -> task -> dp_rank -> batch_index -> what was sampled for it (RankAwareSampler
        # keeps the sampled list, as TransferQueue's does)
        self._states: dict[str, dict[str, dict[Hashable, dict[Hashable, Picked | list[int]]]]] = {}

    @abstractmethod
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any) -> Picked:
        """``(sampled, consumed)``: the rows to hand out now and those to mark consumed."""
        raise NotImplementedError(f"{type(self).__name__} must implement sample()")

    def __call__(self, *args: Any, **kwargs: Any) -> Picked:
        return self.sample(*args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        """Whether ``(partition_id, task_name, dp_rank, batch_index)`` has a cached result
        (False without a ``dp_rank`` in ``sampling_config``)."""
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        by_rank = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in by_rank and config.get("batch_index") in by_rank[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        """Forget the cached results of ``partition_id``."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        """The sampler's state (a dict ``load_checkpoint`` takes back)."""
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self._states = state["_states"]

    def _cached(
        self, partition_id: str, task_name: str, dp_rank: Hashable, batch_index: Hashable
    ) -> Picked | None:
        found = self._states.get(partition_id, {}).get(task_name, {}).get(dp_rank, {}).get(batch_index)
        return found if isinstance(found, tuple) else None

    def _cache(
        self, partition_id: str, task_name: str, dp_rank: Hashable, batch_index: Hashable, value: Picked
    ) -> None:
        by_rank = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
        by_rank.setdefault(dp_rank, {})[batch_index] = value


__all__ = ["BaseSampler"]
