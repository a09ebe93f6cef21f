"""TransferQueue's streaming data loader (``transfer_queue.dataloader``) on this store."""

from dataplane.tq.dataloader import streaming_dataloader as _streaming_dataloader
from dataplane.tq.dataloader import streaming_dataset as _streaming_dataset
from dataplane.tq.dataloader.streaming_dataloader import *  # noqa: F403
from dataplane.tq.dataloader.streaming_dataset import *  # noqa: F403

__all__: list[str] = []
__all__ += _streaming_dataloader.__all__
__all__ += _streaming_dataset.__all__
