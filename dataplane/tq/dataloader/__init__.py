"""TransferQueue's streaming data loader (``transfer_queue.dataloader``) on this store."""

from dataplane.tq.dataloader.streaming_dataloader import StreamingDataLoader
from dataplane.tq.dataloader.streaming_dataset import StreamingDataset

__all__ = ["StreamingDataLoader", "StreamingDataset"]
