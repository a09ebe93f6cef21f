"""The worker the controller-bypass benchmark (``bench.bypass``) runs.

Imported by the driver and, through the pickled class, by every Ray worker process.

* ``BypassWorker.classic_step``: ``Dispatch.DP_COMPUTE_PROTO`` as the controller does it: the driver
  chunks its batch (each chunk a compact copy, so every sample is sent once) and ships it by value.
* ``BypassWorker.store_step``: receives a ``KVBatchMeta`` chunk, fetches its rows from the store,
  writes the new field back under the same keys and returns the updated meta.

Both compute the same field, ``old_log_probs * 2``.
"""

from __future__ import annotations

import os
from typing import Any

from controlplane import Dispatch, Worker, register

IN_FIELDS = ("prompts", "responses", "old_log_probs")
SOURCE = "old_log_probs"
OUT = "log_probs_x2"


def _step(data: Any) -> Any:
    from tensordict import TensorDict

    return TensorDict({OUT: data[SOURCE] * 2}, batch_size=data.batch_size)


class BypassWorker(Worker):
    """The worker under test: the same step on a driver-sent batch or on store metadata.

    Example:
        >>> wg = RayWorkerGroup(pool, RayClassWithInitArgs(BypassWorker, "bench-bypass"))
        >>> wg.attach_store()
        >>> wg.classic_step(batch)[OUT].shape == batch[SOURCE].shape
        True
    """

    def __init__(self, store_name: str) -> None:
        super().__init__()
        self.store_name = store_name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def attach_store(self) -> int:
        """Attach to the driver's store (untimed) and return this worker's pid."""
        import dataplane as dp

        dp.init(name=self.store_name)
        return os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def classic_step(self, data: Any) -> Any:
        """Classic path: the chunk arrives by value; return the new field for the driver to concat."""
        return _step(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, bridge=False)  # moves its own data
    def store_step(self, meta: Any) -> Any:
        """Store path: fetch this shard by meta, compute, write back under the same keys, return meta."""
        import dataplane as dp

        if len(meta) == 0:
            return meta
        return dp.kv_batch_put(meta.keys, meta.partition_id, _step(dp.kv_batch_get_by_meta(meta)))
