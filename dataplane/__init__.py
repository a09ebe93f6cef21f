"""dataplane: a sharded in-cluster batch store for RL post-training.

All real data (prompts, responses, log-probs, rewards, advantages) lives in storage
shards as columnar segments, addressed by ``KVBatchMeta``. The KV functions follow
TransferQueue's names, so code written against it moves over by changing one import::

    import dataplane as dp

    dp.init()
    meta = dp.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td)
    td = dp.kv_batch_get_by_meta(meta)
    dp.close()
"""

import typing as _typing

from dataplane import _bridge_hook  # noqa: F401 - installs __worker_bridge__ on metas
from dataplane.api import (
    async_clear_partition,
    async_close,
    async_init,
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    async_stats,
    clear_partition,
    close,
    init,
    is_initialized,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    stats,
)
from dataplane.checkpoint import (
    CheckpointInfo,
    async_load_checkpoint,
    async_save_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dataplane.config import StoreConfig
from dataplane.errors import (
    BatchSizeError,
    BatchTimeoutError,
    CheckpointError,
    CheckpointNotFoundError,
    ClusterAuthError,
    ClusterConnectError,
    DataplaneError,
    FieldNotFoundError,
    KeyNotFoundError,
    LeaseExpiredError,
    PartitionNotFoundError,
    ProtocolVersionError,
    RequestTooLargeError,
    ReservationExpiredError,
    ResourceLimitError,
    SchedulingError,
    SchemaError,
    SerializationError,
    ShardUnavailableError,
    StaleMetaError,
    StoreFullError,
    StoreNotInitializedError,
    WireError,
)
from dataplane.meta import KVBatchMeta, StoreInfo
from dataplane.samplers import GroupSampler, Sampler, SeqlenBalancedSampler, SequentialSampler
from dataplane.stream import (
    StreamRequest,
    StreamResult,
    ack,
    async_ack,
    async_consumption,
    async_finish_partition,
    async_next_batch,
    async_release,
    async_reset_consumption,
    consumption,
    finish_partition,
    next_batch,
    release,
    reset_consumption,
)

__version__ = "0.1.0"

__all__ = [
    "BatchSizeError",
    "BatchTimeoutError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ClusterAuthError",
    "ClusterConnectError",
    "GroupSampler",
    "Sampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StreamRequest",
    "StreamingDataLoader",
    "StreamingDataset",
    "StreamResult",
    "ack",
    "async_ack",
    "async_consumption",
    "async_finish_partition",
    "async_next_batch",
    "async_release",
    "async_reset_consumption",
    "consumption",
    "finish_partition",
    "next_batch",
    "release",
    "reset_consumption",
    "DataplaneError",
    "FieldNotFoundError",
    "KVBatchMeta",
    "KeyNotFoundError",
    "LeaseExpiredError",
    "PartitionNotFoundError",
    "ProtocolVersionError",
    "RequestTooLargeError",
    "ReservationExpiredError",
    "ResourceLimitError",
    "SchedulingError",
    "SchemaError",
    "SerializationError",
    "ShardUnavailableError",
    "StaleMetaError",
    "StoreConfig",
    "StoreFullError",
    "StoreInfo",
    "StoreNotInitializedError",
    "WireError",
    "__version__",
    "async_clear_partition",
    "async_close",
    "async_init",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "async_load_checkpoint",
    "async_save_checkpoint",
    "async_stats",
    "clear_partition",
    "close",
    "init",
    "is_initialized",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "stats",
]

# StreamingDataset and StreamingDataLoader subclass torch's classes: imported on first use, so the
# store's own processes (shards, index), which import this package, never load torch. A type checker
# sees the plain imports instead (and no module __getattr__, so a misspelt ``dp.name`` stays an error).
_LAZY = {"StreamingDataset": "dataplane.dataset", "StreamingDataLoader": "dataplane.dataloader"}

if _typing.TYPE_CHECKING:
    from dataplane.dataloader import StreamingDataLoader
    from dataplane.dataset import StreamingDataset
else:

    def __getattr__(name: str) -> _typing.Any:
        if name in _LAZY:
            import importlib

            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'dataplane' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``__all__``), the lazy ones included; not the helpers this module imports."""
    return sorted(__all__)
