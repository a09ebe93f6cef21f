"""TransferQueue's ``StreamingDataset`` (a torch ``IterableDataset`` of ``(TensorDict, BatchMeta)``
micro-batches) and ``chunk_batch_fn``, on this store's client.

The constructor is TransferQueue's; ``config`` (TransferQueue's, for its own client) is accepted
and not needed: the dataset uses this process's attachment (``tq.get_client()``). An empty fetch
waits on the store for rows (woken by puts, at most ``TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_INTERVAL``
seconds, default 1) instead of sleeping.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from torch.utils.data import IterableDataset

from dataplane.errors import BatchTimeoutError
from dataplane.tq.metadata import BatchMeta

if TYPE_CHECKING:
    from dataplane.tq.client import TransferQueueClient

logger = logging.getLogger(__name__)

# TransferQueue's hooks, called with keyword arguments (see default_fetch_batch_fn, chunk_batch_fn)
FetchBatchFn = Callable[..., tuple[TensorDict | None, BatchMeta]]
ProcessBatchFn = Callable[..., Iterable[tuple[TensorDict, BatchMeta]]]


def _wait_s() -> float:
    return float(os.environ.get("TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_INTERVAL", "1"))


class StreamingDataset(IterableDataset):
    """Micro-batches of ``micro_batch_size`` rows from batches of ``batch_size`` that ``task_name``
    takes from ``partition_id`` (every rank with the same ``dp_rank`` gets the same rows: the
    store's ``(task, dp_rank, batch_index)`` cache).

    Args:
        config: TransferQueue's config (unused here).
        batch_size, micro_batch_size: rows per fetch and per yielded micro-batch.
        data_fields: the fields to read (at least one).
        partition_id, task_name, dp_rank: where from, which consumer, which data-parallel replica.
        should_check_consumption_status: stop once the task consumed the whole partition (and the
            buffer is drained); else an endless stream.
        fetch_batch_fn, process_batch_fn: TransferQueue's hooks (defaults: ``default_fetch_batch_fn``,
            ``chunk_batch_fn``).

    Fetched batches stay in ``buffer`` for ``reset()`` (replay) until ``step(partition_id)``.

    Example:
        >>> ds = StreamingDataset(None, 8, 4, ["input_ids"], "train", "update_actor", dp_rank=0)
        >>> for td, meta in StreamingDataLoader(ds): ...
    """

    def __init__(
        self,
        config: object,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: FetchBatchFn | None = None,
        process_batch_fn: ProcessBatchFn | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(f"data_fields must be a list with at least one field name, got {data_fields}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        super().__init__()
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = list(data_fields)
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self.buffer: list[tuple[TensorDict, BatchMeta]] = []
        self.batch_index = 0
        self._tq_client: TransferQueueClient | None = None

    def _client(self) -> TransferQueueClient:
        if self._tq_client is None:
            from dataplane.tq.interface import get_client

            self._tq_client = get_client()
        return self._tq_client

    def _done(self) -> bool:
        return (
            self.should_check_consumption_status
            and self.batch_index >= len(self.buffer)
            and self._client().check_consumption_status(self.task_name, self.partition_id)
        )

    def __iter__(self) -> Iterator[tuple[TensorDict, BatchMeta]]:
        client = self._client()
        while not self._done():
            if self.batch_index < len(self.buffer):
                batch = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(*batch, micro_batch_size=self.micro_batch_size)
                continue
            data, meta = self.fetch_batch_fn(
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config={**self.sampling_config, "timeout_s": _wait_s()},
                batch_index=self.batch_index,
            )
            if data is not None:
                self.buffer.append((data, meta))

    def reset(self) -> None:
        """Replay the buffered batches from the first."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to ``partition_id``: drop the buffer and start over."""
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id


def default_fetch_batch_fn(
    tq_client: TransferQueueClient,
    data_fields: list[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[TensorDict | None, BatchMeta]:
    """One batch for ``batch_index`` (``(None, empty meta)`` when none is ready in time)."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    try:
        meta = tq_client.get_meta(
            data_fields=data_fields,
            batch_size=batch_size,
            partition_id=partition_id,
            task_name=task_name,
            sampling_config=config,
        )
    except BatchTimeoutError:
        return None, BatchMeta.empty()
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(
    td: TensorDict, batch_meta: BatchMeta, micro_batch_size: int = 1
) -> list[tuple[TensorDict, BatchMeta]]:
    """``td`` and its meta split into micro-batches of ``micro_batch_size`` rows (the last may be
    shorter); nested fields keep their layout.

    Raises:
        TypeError: ``td`` is not a TensorDict.
        ValueError: ``micro_batch_size`` is not a positive int or exceeds the batch.
    """
    if not isinstance(td, TensorDict):
        raise TypeError(f"Expected TensorDict, got {type(td).__name__}")
    if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    if len(td.batch_size) == 0:
        raise ValueError("Input TensorDict must have non-empty batch_size")
    total = int(td.batch_size[0])
    if micro_batch_size > total:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) exceeds total batch size ({total})")
    splits = -(-total // micro_batch_size)
    metas = batch_meta.chunk(splits)
    # Nested tensors do not slice along the batch dim: take them apart once, slice the rest natively.
    nested = {
        k: (v.unbind(0), v.layout) for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested
    }
    dense = {k: v for k, v in td.items() if k not in nested}
    dense_td = TensorDict(dense, batch_size=td.batch_size) if dense else None
    out = []
    for i in range(splits):
        start, stop = i * micro_batch_size, min((i + 1) * micro_batch_size, total)
        part = dense_td[start:stop] if dense_td is not None else TensorDict({}, batch_size=(stop - start,))
        for k, (rows, layout) in nested.items():
            part[k] = torch.nested.as_nested_tensor(list(rows[start:stop]), layout=layout)
        out.append((part, metas[i]))
    return out


__all__ = ["StreamingDataset"]
