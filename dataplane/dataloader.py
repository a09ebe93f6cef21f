"""``StreamingDataLoader``: TransferQueue's DataLoader over a ``StreamingDataset``, with its constructor.

A ``torch.utils.data.DataLoader`` with ``batch_size=None`` (the dataset makes the batches) and a
collate that hands each item over as it is, so ``for td in dp.StreamingDataLoader(ds)`` yields the
dataset's TensorDicts (``td["meta"]`` the ``KVBatchMeta`` of their rows). It takes TransferQueue
0.1.11's arguments, in its order (``dataset, num_workers, collate_fn, pin_memory, worker_init_fn,
multiprocessing_context, prefetch_factor, persistent_workers, pin_memory_device``), and its
``reset()`` and ``step(partition_id)``. Two differences, both on purpose:

* Workers (``num_workers > 0``) start with ``multiprocessing_context="spawn"`` unless another is
  given: a forked worker inherits this process's Ray connection, which does not work after a fork
  (``StreamingDataset`` explains it).
* There is no ``get_buffer()``: batches are not kept in this process; the index service remembers
  which rows each batch index got, which is what ``reset()`` replays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from dataplane.dataset import StreamingDataset


class StreamingDataLoader(DataLoader):
    """Iterate a ``StreamingDataset`` as its batches come: ``for td in StreamingDataLoader(ds)``.

    Args:
        dataset: a ``dp.StreamingDataset`` (or any iterable dataset that makes its own batches).
        num_workers: DataLoader worker processes; each is a consumer of the dataset's task (spawned).
        collate_fn: applied to each item (default: the item itself).
        pin_memory, worker_init_fn, prefetch_factor, persistent_workers, pin_memory_device: as
            ``torch.utils.data.DataLoader``'s.
        multiprocessing_context: how workers start (default ``"spawn"`` when there are workers).

    Example:
        >>> loader = dp.StreamingDataLoader(dp.StreamingDataset("step0", "train", 8, ["responses"]))
        >>> for td in loader:
        ...     print(td.batch_size, td["meta"].keys[:2])
        torch.Size([8]) ['s0', 's1']
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        if num_workers > 0 and multiprocessing_context is None:
            multiprocessing_context = "spawn"
        super().__init__(
            dataset,
            batch_size=None,  # the dataset makes the batches
            shuffle=None,
            num_workers=num_workers,
            collate_fn=collate_fn if collate_fn is not None else StreamingDataset.collate,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        """Start the next pass over the dataset's batches from the first (``StreamingDataset.reset``)."""
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        """Switch the dataset to ``partition_id``, from its first batch (``StreamingDataset.step``)."""
        self.dataset.step(partition_id)


__all__ = ["StreamingDataLoader"]
