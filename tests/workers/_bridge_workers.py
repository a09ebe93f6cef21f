"""Worker classes for the bridge tests (importable by Ray workers)."""

from __future__ import annotations

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import dataplane as dp
from controlplane import Dispatch, Worker, make_nd_compute_dispatch_fn, register
from workers import bridged_register, tqbridge

PAIR = make_nd_compute_dispatch_fn("pair")


class BridgeWorker(Worker):
    """Mesh "pair": every rank is in dp replica 0; only rank 0 (or ``collect``) is a collect rank."""

    def __init__(self, collect: bool | None = None) -> None:
        super().__init__()
        is_collect = self.rank == 0 if collect is None else collect
        self._register_dispatch_collect_info("pair", dp_rank=0, is_collect=is_collect)

    @register(dispatch_mode=PAIR)  # register alone bridges, with the mesh's collect ranks
    def double(self, batch: TensorDict) -> TensorDict:
        # rank 1 would write a visibly different value if it wrote at all
        return TensorDict({"y2": batch["x"] * 2 + 1000 * self.rank}, batch.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_one(self, batch: TensorDict) -> TensorDict:
        batch["y"] = batch["x"] + 1  # returns its input with a new field: only "y" is written
        return batch

    @bridged_register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def async_scale(self, batch: TensorDict) -> TensorDict:
        scale = batch.get_non_tensor("scale") if "scale" in batch.keys() else 1
        return TensorDict(
            {"z": batch["x"].float() * scale, "rank": torch.full((batch.shape[0],), self.rank)},
            batch.batch_size,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    @tqbridge(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stamp(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"stamp": torch.full((batch.shape[0],), self.rank)}, batch.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, batch: TensorDict) -> dict:
        return {"rows": int(batch.shape[0]), "sum": float(batch["x"].sum())}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def seen(self, batch: TensorDict) -> dict:
        """What the method received: tensor fields and extra_info entries."""
        tensors = sorted(k for k in batch.keys() if isinstance(batch.get(k), torch.Tensor))
        extra = {k: batch.get_non_tensor(k) for k in batch.keys() if k not in tensors}
        return {"tensors": tensors, "extra": extra, "rows": int(batch.shape[0])}

    @bridged_register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC, call_on_empty=True)
    def rows_seen(self, batch: TensorDict) -> dict:
        """Called even for an empty stream batch (a method that must run on every rank)."""
        return {"rows": int(batch.shape[0]), "rank": self.rank}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def wrong_size(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"bad": torch.zeros(batch.shape[0] + 1)}, [batch.shape[0] + 1])

    @register(dispatch_mode=PAIR)
    @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)  # disagrees with register: register's mode wins
    def mismatched(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"m": batch["x"] + 1000 * self.rank}, batch.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, bridge=False)
    def raw(self, meta: dp.KVBatchMeta) -> list:
        """Not bridged: gets the meta itself."""
        return [type(meta).__name__, meta.size]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def decode(self, batch: TensorDict, vary: bool = False) -> TensorDict:
        """Per-row strings and chat messages (columns) and a batch-level value (extra_info)."""
        rows = batch["x"].tolist()
        out = TensorDict({}, batch.batch_size)
        out["text"] = NonTensorStack(*[f"row {x}" for x in rows])
        out["chat"] = NonTensorStack(*[NonTensorData([{"role": "user", "content": str(x)}]) for x in rows])
        out.set_non_tensor("temperature", 0.5 + self.rank * vary)
        return out
