"""TransferQueue's low-level client and controller, on this store (the parts of ``dataplane.tq``
that are objects rather than module functions).

``TQClient`` (what ``tq.get_client()`` returns) maps TransferQueue's batch-at-a-time streaming calls
onto ``dataplane.stream``: ``get_meta(mode="fetch")`` is ``next_batch``, ``put`` without metadata
inserts rows under fresh keys, ``get_data`` reads a meta's rows. Its metas are ``KVBatchMeta`` s:
keys, not TransferQueue's global indexes.

``Controller`` answers the introspection calls TransferQueue code makes on its named actor
``TransferQueueController`` (``list_partitions``, ``clear_partition``, ``get_partition_snapshot``):
``tq.init`` starts one in the caller's Ray namespace. A snapshot numbers the keys of a partition in
their put order; the numbers are stable only within one snapshot.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane import api, stream
from dataplane.errors import BatchTimeoutError
from dataplane.meta import KVBatchMeta
from dataplane.samplers import GroupSampler, Sampler, SeqlenBalancedSampler, SequentialSampler

# TransferQueue sampler names (its config's controller.sampler) and what each becomes here.
_SAMPLERS = {
    "SequentialSampler": lambda cfg: SequentialSampler(),
    "RankAwareSampler": lambda cfg: SequentialSampler(),  # rank awareness comes from dp_rank/batch_index
    "GRPOGroupNSampler": lambda cfg: GroupSampler("uid", int(cfg.get("n_samples_per_prompt", 1))),
    "SeqlenBalancedSampler": lambda cfg: SeqlenBalancedSampler(
        "total_lengths", int(cfg.get("dp_size", 1)), "uid", int(cfg.get("n_samples_per_prompt", 1))
    ),
}


def make_sampler(sampler: Any, config: dict[str, Any] | None = None) -> Sampler | None:
    """A sampler from TransferQueue's forms: an instance, a class, or a name in its config."""
    if sampler is None or isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, type) and issubclass(sampler, Sampler):
        return sampler()
    name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", type(sampler).__name__)
    if name not in _SAMPLERS:
        raise ValueError(f"sampler {name!r} has no equivalent here; known: {sorted(_SAMPLERS)}")
    return _SAMPLERS[name](config or {})


class TQBatchMeta(KVBatchMeta):
    """A ``KVBatchMeta`` that also answers the ``BatchMeta`` attributes TransferQueue code reads:
    ``global_indexes`` (here the keys: the row identifiers this store has), ``is_ready`` and
    ``field_names``."""

    @classmethod
    def of(cls, meta: KVBatchMeta) -> TQBatchMeta:
        return cls._trusted(meta.keys, meta.tags, meta.partition_id, meta.fields)

    @property
    def global_indexes(self) -> list[str]:
        return list(self.keys)

    @property
    def is_ready(self) -> bool:
        """Every row of a fetched meta is ready; an empty meta is not (TransferQueue's rule)."""
        return self.size > 0

    @property
    def field_names(self) -> list[str]:
        return sorted(self.fields or [])


class TQClient:
    """TransferQueue's ``TransferQueueClient`` calls (and their ``async_`` twins) on this store.

    Example:
        >>> client = tq.get_client()
        >>> meta = client.put(td, partition_id="step0")               # new rows under fresh keys
        >>> batch = client.get_meta(["responses"], 8, "step0", task_name="reward")
        >>> client.get_data(batch)
    """

    def __init__(self, polling_mode: bool = False, sampler: Any = None) -> None:
        self.polling_mode = polling_mode
        self.sampler = make_sampler(sampler)

    # ---- metadata ------------------------------------------------------------------------------
    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> KVBatchMeta:
        """``fetch``: the next ready rows for ``task_name`` (``next_batch``; in polling mode an empty
        meta when too few are ready, else it waits); ``force_fetch``: every row of the partition;
        ``insert``: ``batch_size`` fresh keys for a later ``put(data, metadata=...)``."""
        return TQBatchMeta.of(
            self._get_meta(data_fields, batch_size, partition_id, mode, task_name, sampling_config)
        )

    def _get_meta(
        self, data_fields, batch_size, partition_id, mode, task_name, sampling_config
    ) -> KVBatchMeta:
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields)
        if mode == "insert":
            keys = [uuid.uuid4().hex for _ in range(batch_size)]
            return KVBatchMeta(keys, None, partition_id, fields)
        if mode == "force_fetch":
            listed = api.kv_list(partition_id).get(partition_id, {})
            return KVBatchMeta(list(listed), list(listed.values()), partition_id, fields)
        if mode != "fetch":
            raise ValueError(f"get_meta: mode must be 'fetch', 'force_fetch' or 'insert', not {mode!r}")
        cfg = dict(sampling_config or {})
        try:
            return stream.next_batch(
                partition_id,
                task_name or "default",
                batch_size,
                fields,
                sampler=make_sampler(cfg.pop("sampler", None), cfg) or self.sampler,
                timeout_s=0.0 if self.polling_mode else cfg.get("timeout_s"),
                dp_rank=cfg.get("dp_rank"),
                dp_size=cfg.get("dp_size"),
                batch_index=cfg.get("batch_index"),
            )
        except BatchTimeoutError:
            return KVBatchMeta.empty(partition_id)

    def get_data(self, metadata: KVBatchMeta):
        """The rows of ``metadata`` (an empty TensorDict for an empty meta)."""
        from tensordict import TensorDict

        if metadata.size == 0 or not metadata.fields:
            return TensorDict({}, batch_size=[0])
        return api.kv_batch_get_by_meta(metadata)

    def put(
        self, data: Any, metadata: KVBatchMeta | None = None, partition_id: str | None = None
    ) -> KVBatchMeta:
        """Write ``data``: into ``metadata`` 's rows, or as new rows of ``partition_id`` under fresh keys."""
        if metadata is None:
            if partition_id is None:
                raise ValueError("put: pass metadata, or a partition_id to insert new rows into")
            n = int(data.batch_size[0])
            metadata = KVBatchMeta([uuid.uuid4().hex for _ in range(n)], None, partition_id)
        return api.kv_batch_put(metadata.keys, metadata.partition_id, data)

    def set_custom_meta(self, metadata: KVBatchMeta) -> None:
        api.kv_batch_put(metadata.keys, metadata.partition_id, None, metadata.tags)

    def clear_samples(self, metadata: KVBatchMeta) -> None:
        api.kv_clear(metadata.keys, metadata.partition_id)

    def clear_partition(self, partition_id: str) -> None:
        api.clear_partition(partition_id)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        stream.reset_consumption(partition_id, task_name)
        return True

    def get_partition_list(self) -> list[str]:
        return list(api.kv_list())

    # ---- status --------------------------------------------------------------------------------
    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when ``task_name`` has taken every row of the partition."""
        try:
            got = stream.consumption(partition_id, task_name)
        except KeyError:
            return False
        return got["total"] > 0 and got["consumed"] >= got["total"]

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        """True when every row of the partition holds every one of ``data_fields``."""
        try:
            got = stream.consumption(partition_id, "__production__", list(data_fields))
        except KeyError:
            return False
        return got["total"] > 0 and got["produced"] == got["total"]

    def get_consumption_status(self, task_name: str, partition_id: str):
        """``(row numbers, 1 where consumed)`` over the partition's rows in put order."""
        import torch

        snap = snapshot(partition_id)
        done = _consumed_keys(partition_id, task_name, snap)
        status = [1 if k in done else 0 for k in snap.keys_mapping]
        return torch.arange(len(status)), torch.tensor(status, dtype=torch.int8)

    def get_production_status(self, data_fields: list[str], partition_id: str):
        """``(row numbers, [rows, fields] 1 where produced)`` over the partition's rows in put order."""
        import torch

        snap = snapshot(partition_id)
        cols = [snap.field_name_mapping.get(f) for f in data_fields]
        status = np.zeros((len(snap.keys_mapping), len(cols)), dtype=np.int8)
        for j, c in enumerate(cols):
            if c is not None:
                status[:, j] = snap.production_status[:, c]
        return torch.arange(len(status)), torch.from_numpy(status)

    def close(self) -> None:
        """Nothing to release: the client is the process's store client."""

    # ---- async twins ---------------------------------------------------------------------------
    async def async_get_meta(self, *args, **kwargs) -> KVBatchMeta:
        return await _in_thread(self.get_meta, *args, **kwargs)

    async def async_get_data(self, metadata: KVBatchMeta):
        if metadata.size == 0 or not metadata.fields:
            return self.get_data(metadata)
        return await api.async_kv_batch_get_by_meta(metadata)

    async def async_put(
        self, data: Any, metadata: KVBatchMeta | None = None, partition_id: str | None = None
    ):
        return await _in_thread(self.put, data, metadata, partition_id)

    async def async_clear_partition(self, partition_id: str) -> None:
        await api.async_clear_partition(partition_id)

    async def async_clear_samples(self, metadata: KVBatchMeta) -> None:
        await api.async_kv_clear(metadata.keys, metadata.partition_id)

    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        await stream.async_reset_consumption(partition_id, task_name)
        return True

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return await _in_thread(self.check_consumption_status, task_name, partition_id)

    async def async_check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return await _in_thread(self.check_production_status, data_fields, partition_id)


async def _in_thread(fn, *args, **kwargs):
    import asyncio

    return await asyncio.to_thread(fn, *args, **kwargs)


def _consumed_keys(partition_id: str, task_name: str, snap: Snapshot) -> set[str]:
    from dataplane.client import stream_ops as _stream_ops

    body = {"pid": partition_id, "task": task_name}
    return set(api._client().run(_stream_ops.stream_call("consumed", body))["keys"])


@dataclass
class Snapshot:
    """What TransferQueue's ``get_partition_snapshot`` exposes, for one partition."""

    partition_id: str
    keys_mapping: dict[str, int] = field(default_factory=dict)
    global_indexes: set[int] = field(default_factory=set)
    custom_meta: dict[int, dict] = field(default_factory=dict)
    field_name_mapping: dict[str, int] = field(default_factory=dict)
    production_status: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int8))


def snapshot(partition_id: str) -> Snapshot:
    """The partition's keys (numbered in put order), tags, fields and which key holds which field."""
    from dataplane.client import stream_ops as _stream_ops

    client = api._client()
    listed = api.kv_list(partition_id).get(partition_id, {})
    snap = Snapshot(partition_id)
    if not listed:
        return snap
    known = client.run(_stream_ops.stream_call("resolve", {"pid": partition_id, "keys": list(listed)}))[
        "known"
    ]
    for i, (key, tag) in enumerate(listed.items()):
        snap.keys_mapping[key] = i
        snap.global_indexes.add(i)
        snap.custom_meta[i] = dict(tag)
        for f in known.get(key, []):
            snap.field_name_mapping.setdefault(f, len(snap.field_name_mapping))
    snap.production_status = np.zeros((len(listed), len(snap.field_name_mapping)), dtype=np.int8)
    for key, i in snap.keys_mapping.items():
        for f in known.get(key, []):
            snap.production_status[i, snap.field_name_mapping[f]] = 1
    return snap


class Controller:
    """TransferQueue's ``TransferQueueController`` introspection calls (a Ray actor that ``tq.init``
    starts in the caller's namespace, attached to the store)."""

    def __init__(self, store_name: str) -> None:
        api.init(name=store_name, attach_only=True)

    def list_partitions(self) -> list[str]:
        return list(api.kv_list())

    def clear_partition(self, partition_id: str) -> None:
        api.clear_partition(partition_id)

    def get_partition_snapshot(self, partition_id: str) -> Snapshot | None:
        snap = snapshot(partition_id)
        return snap if snap.keys_mapping or partition_id in api.kv_list() else None


__all__ = ["Controller", "Snapshot", "TQBatchMeta", "TQClient", "make_sampler", "snapshot"]
