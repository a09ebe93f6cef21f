"""TransferQueue's ``StreamingDataLoader``: a torch ``DataLoader`` over a ``StreamingDataset`` that
hands out its ``(TensorDict, BatchMeta)`` micro-batches unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from tensordict import TensorDict

from dataplane.tq.dataloader.streaming_dataset import StreamingDataset
from dataplane.tq.metadata import BatchMeta

T = TypeVar("T")


def _identity(item: T) -> T:
    return item


class StreamingDataLoader(torch.utils.data.DataLoader):
    """TransferQueue's constructor; ``batch_size`` is the dataset's business (``None`` here).

    ``num_workers > 0`` is refused: a worker process forked from a Ray process cannot use Ray, and
    this store's client attaches through it. For prefetching in the background use
    ``dataplane.StreamingDataset`` (its ``prefetch`` runs in threads of this process).

    Example:
        >>> for td, meta in StreamingDataLoader(dataset):
        ...     loss = model(td)
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[[tuple[TensorDict, BatchMeta]], object] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: object = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        if num_workers:
            raise NotImplementedError(
                f"StreamingDataLoader(num_workers={num_workers}): DataLoader worker processes cannot "
                "attach to the store (they are forked from a Ray process); use num_workers=0, or "
                "dataplane.StreamingDataset(..., prefetch=N) to fetch ahead in threads"
            )
        self.dataset: StreamingDataset = dataset
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=0,
            collate_fn=collate_fn or _identity,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        """Replay the dataset's buffered batches."""
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        """Switch the dataset to ``partition_id``."""
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[tuple[TensorDict, BatchMeta]]:
        """The dataset's buffered ``(TensorDict, BatchMeta)`` batches."""
        return self.dataset.buffer


__all__ = ["StreamingDataLoader"]
