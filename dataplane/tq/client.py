"""TransferQueue's low-level client (``TransferQueueClient``, what ``tq.get_client()`` returns) on
this store: every public method of TransferQueue 0.1.11's client, sync and ``async_``, with its
signature.

Rows are named as TransferQueue names them, by ``BatchMeta`` (integer global indexes; see
``dataplane._tq_controller``). Under it each row is a key of a partition of the store:

* ``get_meta(mode="fetch")`` is ``dataplane.next_batch`` (the sampler of the TransferQueue config
  chooses; in polling mode too few ready rows give an empty meta at once, else it waits up to
  ``sampling_config["timeout_s"]``, default 5 s, then raises ``GetMetaTimeoutError``);
  ``"force_fetch"`` is every row of the partition; ``"insert"`` hands out new rows.
* ``put`` writes a batch into a meta's rows (``put(data, partition_id=...)`` into new rows),
  ``get_data`` reads a meta's rows, in TransferQueue's layout unless ``layout="dense"``.
* ``kv_retrieve_meta`` / ``kv_retrieve_keys`` translate between keys and global indexes.

What differs: a missing key raises ``KeyNotFoundError`` (TransferQueue drops it silently);
``set_custom_meta`` and ``put`` merge tags into the stored ones (TransferQueue replaces each row's
dict, which loses a concurrent writer's tags); ``data_parser`` raises ``NotImplementedError``
(the store never runs code a client sends); the ZMQ knobs of the constructor are ignored.

Example:
    >>> client = tq.get_client()
    >>> meta = client.put(td, partition_id="step0")               # new rows
    >>> batch = client.get_meta(["responses"], 8, "step0", task_name="reward")
    >>> client.get_data(batch)["responses"].offsets()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dataplane import api, stream
from dataplane._tq_controller import SamplerSpec, Tags, visible_fields
from dataplane.errors import BatchTimeoutError, KeyNotFoundError
from dataplane.samplers import ReadyRows, Sampler
from dataplane.samplers import SequentialSampler as _StoreSequential
from dataplane.tq import _layout, _mixed, _session
from dataplane.tq.metadata import BatchMeta, extract_field_schema, kept_schema
from dataplane.tq.sampler import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler
from dataplane.tq.sampler import SequentialSampler as TQSequentialSampler

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from dataplane.meta import KVBatchMeta
    from dataplane.tq._layout import Columns

T = TypeVar("T")

logger = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 5.0  # a non-polling fetch waits this long for rows (TransferQueue: 5 s)


def _putter(keys: list[str], pid: str, tags: list[Tags] | None) -> Callable[[Columns | None], KVBatchMeta]:
    """A put of ``keys``' columns into ``pid`` (with ``tags``), for ``_mixed.put`` to call."""

    def put(cols: Columns | None) -> KVBatchMeta:
        return api.kv_batch_put(keys, pid, cols, tags)

    return put


class GetMetaTimeoutError(BatchTimeoutError, RuntimeError):
    """A ``get_meta(mode="fetch")`` outside polling mode found too few ready rows within its timeout
    (a ``TimeoutError``, and a ``RuntimeError`` as TransferQueue's controller error is)."""


class UnknownIndexError(KeyNotFoundError, RuntimeError):
    """A global index no TransferQueue call handed out (or of another partition, or cleared)."""


def no_data_parser(data_parser: object) -> None:
    if data_parser is not None:
        raise NotImplementedError(
            "data_parser is not supported: it is code shipped to and run by TransferQueue's storage "
            "servers, and this store never runs code a client sends; transform the data before the put"
        )


# ---- samplers: TransferQueue's, on the store's next_batch ----------------------------------------


class _PartitionTags:
    """``get_custom_meta(indexes) -> {index: tag}`` over the ready rows (what TransferQueue's
    samplers read from the controller's partition)."""

    def __init__(self, tags: dict[int, Tags]) -> None:
        self._tags = tags

    def get_custom_meta(self, global_indexes: Sequence[int]) -> dict[int, Tags]:
        return {gi: self._tags.get(gi, {}) for gi in global_indexes}


class _RunHere(Sampler):
    """A TransferQueue sampler run in this process over the ready rows' global indexes; the keys of
    what it samples are claimed (consumed = sampled on this store)."""

    def __init__(
        self, sampler: BaseSampler, partition_id: str, task_name: str, config: dict[str, Any]
    ) -> None:
        self.sampler, self.partition_id, self.task_name, self.config = (
            sampler,
            partition_id,
            task_name,
            config,
        )

    def sample(
        self,
        ready: ReadyRows,
        batch_size: int,
        *,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        finished: bool = False,
    ) -> list[str] | None:
        keys = list(ready)
        gis = _session.ask("indexes", self.partition_id, keys, True)
        by_gi = dict(zip(gis, keys, strict=True))
        tags = _PartitionTags({gi: ready.tag(k) for gi, k in by_gi.items()})
        kwargs = {k: v for k, v in self.config.items() if k not in ("task_name", "partition_id")}
        sampled, _consumed = self.sampler.sample(
            list(gis),
            batch_size,
            task_name=self.task_name,
            partition_id=self.partition_id,
            partition=tags,
            **kwargs,
        )
        if not sampled:
            return [] if finished else None
        return [by_gi[gi] for gi in sampled]


# What names a sampler: an instance or a class of TransferQueue's, the store's, or a shared spec.
SamplerLike = Sampler | BaseSampler | type[BaseSampler] | SamplerSpec | None


def store_sampler(
    sampler: SamplerLike, partition_id: str, task_name: str, config: dict[str, Any]
) -> Sampler | None:
    """The store sampler for a TransferQueue sampler (an instance, a class, or a spec from the
    shared config): sequential and rank-aware run in the store's index (rank-aware through
    ``dp_rank`` / ``batch_index``), the others in this process."""
    if sampler is None:
        return None
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, dict):
        sampler = sampler_from_spec(sampler)
    if isinstance(sampler, type):
        sampler = sampler()
    if isinstance(sampler, (TQSequentialSampler, RankAwareSampler)):
        return _StoreSequential()
    if isinstance(sampler, BaseSampler):
        return _RunHere(sampler, partition_id, task_name, config)
    raise TypeError(
        f"sampler must be a TransferQueue BaseSampler or a dataplane Sampler, not {type(sampler).__name__}"
    )


_KNOWN = {
    cls.__name__: cls
    for cls in (TQSequentialSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler)
}


def sampler_spec(sampler: object) -> SamplerSpec | None:
    """A plain description of a known TransferQueue sampler (what the controller shares with every
    process), or None for the default. A sampler class of your own is not shared: it is code, and
    processes attach with the config only (pass it per call: ``sampling_config={"sampler": ...}``)."""
    if sampler is None:
        return None
    if isinstance(sampler, str):
        if sampler not in _KNOWN:
            raise ValueError(f"Could not find sampler {sampler!r}; known: {sorted(_KNOWN)}")
        return {"name": sampler}
    cls = sampler if isinstance(sampler, type) else type(sampler)
    if cls not in _KNOWN.values():
        raise ValueError(
            f"sampler {cls.__name__} is not one of TransferQueue's ({sorted(_KNOWN)}): processes of the "
            "cluster share the config, never code; pass your own per call with "
            "get_meta(..., sampling_config={'sampler': ...})"
        )
    params: dict[str, int] = {}
    if not isinstance(sampler, type):
        for attr in ("n_samples_per_prompt", "dp_size"):
            if hasattr(sampler, attr):
                params[attr] = getattr(sampler, attr)
    return {"name": cls.__name__, "params": params}


def sampler_from_spec(spec: SamplerSpec) -> BaseSampler:
    return _KNOWN[spec["name"]](**spec.get("params", {}))


# ---- the client --------------------------------------------------------------------------------


class TransferQueueClient:
    """TransferQueue's client on this store (see the module docstring). Sync methods and their
    ``async_`` twins; the async ones run the sync call in a worker thread.

    Args:
        client_id, controller_info, zmq_io_threads, zmq_max_sockets: TransferQueue's constructor
            arguments, accepted and ignored (the client attaches to the store of this cluster).
    """

    def __init__(
        self,
        client_id: str | None = None,
        controller_info: object = None,
        zmq_io_threads: int | None = None,
        zmq_max_sockets: int | None = None,
    ) -> None:
        self.client_id = client_id or "dataplane.tq"

    def initialize_storage_manager(self, manager_type: str = "SimpleStorage", config: object = None) -> None:
        """TransferQueue's storage backend choice: this store is the backend; nothing to do."""

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to completion from sync code (TransferQueue's helper of the same name)."""
        return asyncio.run(coro)

    def _keys(self, meta: BatchMeta) -> list[str]:
        if meta._keys is not None:
            return list(meta._keys)
        found = _session.ask("locate", list(meta.global_indexes))
        keys = []
        for gi, pid, hit in zip(meta.global_indexes, meta.partition_ids, found, strict=True):
            if hit is None or hit[0] != pid:
                raise UnknownIndexError(
                    str(gi),
                    pid,
                    f"global index {gi} of partition {pid!r} is unknown (never handed out, or cleared)",
                )
            keys.append(hit[1])
        return keys

    def _by_partition(self, meta: BatchMeta) -> list[tuple[str, list[int], list[str]]]:
        """``(partition, positions, keys)`` per partition, in first-seen order."""
        keys = self._keys(meta)
        groups: dict[str, tuple[list[int], list[str]]] = {}
        for i, (pid, key) in enumerate(zip(meta.partition_ids, keys, strict=True)):
            pos, ks = groups.setdefault(pid, ([], []))
            pos.append(i)
            ks.append(key)
        return [(pid, pos, ks) for pid, (pos, ks) in groups.items()]

    def _meta(
        self,
        partition_id: str,
        keys: list[str],
        tags: list[Tags],
        fields: list[str],
        status: Sequence[int] | None = None,
    ) -> BatchMeta:
        gis, schema = _session.ask("describe", partition_id, keys, fields)
        return BatchMeta(
            gis,
            [partition_id] * len(keys),
            schema,
            np.ones(len(keys), dtype=np.int8) if status is None else status,
            custom_meta=tags,
            _keys=keys,
        )

    def _resolve(
        self, partition_id: str, keys: list[str] | None
    ) -> tuple[dict[str, Tags], dict[str, list[str]]]:
        """The partition's ``{key: tag}`` and the fields each of ``keys`` (all when None) holds."""
        from dataplane.client import stream_ops as _stream_ops

        listed = api.kv_list(partition_id).get(partition_id, {})
        want = list(listed) if keys is None else keys
        if not want:
            return listed, {}
        known = api.current_client().run(_stream_ops.resolve(partition_id, want))
        return listed, {k: visible_fields(f) for k, f in known.items()}

    # -- metadata ------------------------------------------------------------------------------

    def get_meta(
        self,
        data_fields: list[str] | str | None = None,
        batch_size: int | None = None,
        partition_id: str | None = None,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """TransferQueue's ``get_meta``; see the module docstring for the modes.

        ``sampling_config`` goes to the sampler (``dp_rank``, ``batch_index``, ...); two keys are
        this store's: ``sampler`` (a sampler for this call) and ``timeout_s`` (how long a fetch
        waits for rows, woken by puts; in polling mode too).
        """
        config = _session.attach()
        if partition_id is None:
            raise ValueError("get_meta needs a partition_id")
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields or [])
        if mode == "insert":
            gis, keys = _session.ask("new_rows", partition_id, int(batch_size or 0))
            return BatchMeta(gis, [partition_id] * len(gis), _keys=keys)
        if mode == "force_fetch":
            listed, known = self._resolve(partition_id, None)
            keys = list(listed)
            if not fields:
                fields = sorted({f for k in keys for f in known.get(k, [])})
            status = [int(all(f in known.get(k, ()) for f in fields)) for k in keys]
            return self._meta(partition_id, keys, [dict(listed[k]) for k in keys], fields, status)
        if mode != "fetch":
            raise ValueError(f"get_meta: mode must be 'fetch', 'force_fetch' or 'insert', not {mode!r}")
        if batch_size is None:
            raise ValueError("get_meta(mode='fetch') needs a batch_size")
        cfg = dict(sampling_config or {})
        sampler = cfg.pop("sampler", None) or config.get("sampler")
        wait = cfg.pop("timeout_s", None)  # explicit: wait this long, even in polling mode
        polling = bool(config.get("polling_mode"))
        timeout = float(wait) if wait is not None else (0.0 if polling else DEFAULT_FETCH_TIMEOUT_S)
        task = task_name or "default"
        try:
            got = stream.next_batch(
                partition_id,
                task,
                batch_size,
                fields,
                sampler=store_sampler(sampler, partition_id, task, cfg),
                timeout_s=timeout,
                dp_rank=cfg.get("dp_rank"),
                dp_size=cfg.get("dp_size"),
                batch_index=cfg.get("batch_index"),
            )
        except BatchTimeoutError as exc:
            if polling:
                return BatchMeta.empty()
            raise GetMetaTimeoutError(
                partition_id,
                f"get_meta: fewer than {batch_size} rows of partition {partition_id!r} were ready for task "
                f"{task!r} within {timeout:.1f} s (polling_mode is off; set sampling_config['timeout_s'] "
                "to wait longer, or use polling mode)",
            ) from exc
        if got.size == 0:
            return BatchMeta.empty()
        return self._meta(partition_id, list(got.keys), [dict(t) for t in got.tags or []], fields)

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """The ``BatchMeta`` of ``keys``: their global indexes, tags, the fields every one holds.

        Raises:
            KeyNotFoundError: a key is not stored (unless ``create``, which hands out indexes for
                new keys: rows with no fields yet, not produced).
            ValueError: an empty list. TypeError: a key that is not a str.
        """
        _session.attach()
        keys = _key_list(keys)
        listed, known = self._resolve(partition_id, keys)
        missing = [k for k in keys if k not in listed]
        if missing and not create:
            raise KeyNotFoundError(
                missing[0], partition_id, f"keys {missing[:8]} not found in partition {partition_id!r}"
            )
        held = [set(known.get(k, ())) for k in keys if k in listed]
        fields = sorted(set.intersection(*held)) if held else []
        status = [int(k in listed and bool(fields)) for k in keys]
        return self._meta(partition_id, keys, [dict(listed.get(k, {})) for k in keys], fields, status)

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """The keys of ``global_indexes`` in ``partition_id``.

        Raises:
            UnknownIndexError: an index of no key of that partition (also a ``RuntimeError``).
        """
        _session.attach()
        if isinstance(global_indexes, (int, np.integer)):
            global_indexes = [int(global_indexes)]
        elif isinstance(global_indexes, (list, tuple)):
            if not global_indexes:
                raise ValueError("Received an empty list as `global_indexes`.")
            if not all(isinstance(i, (int, np.integer)) for i in global_indexes):
                raise TypeError("Not all elements in `global_indexes` are int.")
            global_indexes = [int(i) for i in global_indexes]
        else:
            raise TypeError(
                "Only int or list of int are allowed as `global_indexes`, "
                f"not {type(global_indexes).__name__}"
            )
        keys: list[str] = _session.ask("keys", partition_id, global_indexes)
        for gi, key in zip(global_indexes, keys, strict=True):
            if key is None:
                raise UnknownIndexError(
                    str(gi),
                    partition_id,
                    f"Some global_indexes have no corresponding keys: {gi} in {partition_id!r}",
                )
        return keys

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Tags]]:
        """``{partition: {key: tag}}`` for one partition or all."""
        _session.attach()
        return api.kv_list(partition_id)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store ``metadata.custom_meta`` as the rows' tags (merged into what is stored)."""
        _session.attach()
        if metadata.size == 0:
            return
        for pid, pos, keys in self._by_partition(metadata):
            api.kv_batch_put(keys, pid, None, [metadata.custom_meta[i] for i in pos])

    # -- data ----------------------------------------------------------------------------------

    def put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[..., object] | None = None,
    ) -> BatchMeta:
        """Write ``data`` into ``metadata`` 's rows (or new rows of ``partition_id``), with the meta's
        tags; returns the meta with the new fields added and every row produced."""
        no_data_parser(data_parser)
        _session.attach()
        if metadata is None:
            if partition_id is None:
                raise ValueError("partition_id must be provided if metadata is not given")
            metadata = self.get_meta(
                _mixed.field_names(data), int(data.batch_size[0]), partition_id, mode="insert"
            )
        if not metadata or metadata.size == 0:
            raise ValueError("metadata cannot be none or empty")
        if int(data.batch_size[0]) != metadata.size:
            raise ValueError(f"put: data has {int(data.batch_size[0])} rows but the metadata {metadata.size}")
        schema = extract_field_schema(data)
        groups = self._by_partition(metadata)
        for pid, pos, keys in groups:
            part = data if len(groups) == 1 else _rows(data, pos)
            tags = [metadata.custom_meta[i] for i in pos]
            tags_or_none = tags if any(tags) else None
            _mixed.put(pid, _layout.per_row_values(part), len(keys), _putter(keys, pid, tags_or_none))
            _session.tell("record_schema", pid, kept_schema(schema))
        return metadata.add_fields(data)

    def get_data(self, metadata: BatchMeta, *, layout: str = "jagged") -> TensorDict:
        """The rows of ``metadata`` (its fields), a TensorDict in TransferQueue's layout (tensor
        fields jagged; ``layout="dense"``: as the store returns them). Empty meta or no fields:
        an empty TensorDict."""
        from tensordict import TensorDict

        _layout.check_layout(layout)
        _session.attach()
        if not metadata or metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        fields = metadata.field_names
        groups = self._by_partition(metadata)
        if len(groups) == 1:
            pid, _, keys = groups[0]
            return _layout.to_layout(self._read(keys, pid, fields), layout)
        parts = [(pos, self._read(keys, pid, fields)) for pid, pos, keys in groups]
        return _layout.to_layout(_scatter(parts, metadata.size, fields), layout)

    @staticmethod
    def _read(keys: list[str], pid: str, fields: list[str]) -> TensorDict:
        return _mixed.restore(api.kv_batch_get(keys, pid, fields), keys, pid, drop_hidden=False)

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Free the rows of ``metadata``."""
        _session.attach()
        if metadata.size == 0:
            return
        for pid, _, keys in self._by_partition(metadata):
            api.kv_clear(keys, pid)
            _session.tell("forget", pid, keys)

    def clear_partition(self, partition_id: str) -> None:
        """Free every row of ``partition_id`` and forget the partition."""
        _session.attach()
        api.clear_partition(partition_id)
        _session.tell("forget", partition_id, None)

    def get_partition_list(self) -> list[str]:
        _session.attach()
        return list(api.kv_list())

    # -- status --------------------------------------------------------------------------------

    def _partition_rows(self, partition_id: str) -> tuple[list[str], list[int], dict[str, list[str]]]:
        listed, known = self._resolve(partition_id, None)
        keys = list(listed)
        gis = _session.ask("indexes", partition_id, keys, True) if keys else []
        order = sorted(range(len(keys)), key=lambda i: gis[i])
        return [keys[i] for i in order], [gis[i] for i in order], known

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global indexes, 1 where task_name consumed the row)`` over the partition's rows."""
        import torch

        from dataplane.client import stream_ops as _stream_ops

        _session.attach()
        keys, gis, _ = self._partition_rows(partition_id)
        done = set(api.current_client().run(_stream_ops.consumed(partition_id, task_name))) if keys else set()
        status = torch.tensor([int(k in done) for k in keys], dtype=torch.int8)
        return torch.tensor(gis, dtype=torch.int64), status

    def get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global indexes, [rows, fields] 1 where the row holds the field)``."""
        import torch

        _session.attach()
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields)
        keys, gis, known = self._partition_rows(partition_id)
        status = [[int(f in known.get(k, ())) for f in fields] for k in keys]
        table = torch.tensor(status, dtype=torch.int8).reshape(len(keys), len(fields))
        return torch.tensor(gis, dtype=torch.int64), table

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when the partition has rows and ``task_name`` consumed every one."""
        _, status = self.get_consumption_status(task_name, partition_id)
        return bool(status.numel() > 0 and bool(status.all()))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        """True when the partition has rows and every one holds every one of ``data_fields``."""
        _, status = self.get_production_status(data_fields, partition_id)
        return bool(status.shape[0] > 0 and bool(status.all()))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the partition's rows unconsumed again, for ``task_name`` or every task."""
        _session.attach()
        stream.reset_consumption(partition_id, task_name)
        return True

    # -- checkpoints ---------------------------------------------------------------------------

    def save_controller_checkpoint(self, path: str) -> None:
        raise NotImplementedError(_CONTROLLER_CHECKPOINT)

    def load_controller_checkpoint(self, path: str) -> None:
        raise NotImplementedError(_CONTROLLER_CHECKPOINT)

    def save_storage_checkpoint(self, checkpoint_dir: str, *, metadata: dict[str, Any] | None = None) -> None:
        """The store's checkpoint (``dataplane.save_checkpoint``): rows, tags, schemas, streaming
        state, and ``metadata``; what ``tq.save_checkpoint`` calls."""
        import dataplane  # looked up at the call, so a test can stand in for the store's checkpoint

        _session.attach()
        dataplane.save_checkpoint(checkpoint_dir, metadata=metadata)

    def load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Load the store's checkpoint (``dataplane.load_checkpoint``), replacing partitions of the
        same names; what ``tq.load_checkpoint`` calls."""
        import dataplane

        _session.attach()
        dataplane.load_checkpoint(checkpoint_dir, overwrite=True)

    def close(self) -> None:
        """Nothing to release: the client is this process's store client (``tq.close()`` detaches)."""

    # -- async twins (the sync call in a worker thread; ``socket`` is TransferQueue's, ignored) --

    async def async_get_meta(
        self,
        data_fields: list[str] | str | None = None,
        batch_size: int | None = None,
        partition_id: str | None = None,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
        socket: object = None,
    ) -> BatchMeta:
        return await asyncio.to_thread(
            self.get_meta, data_fields, batch_size, partition_id, mode, task_name, sampling_config
        )

    async def async_set_custom_meta(self, metadata: BatchMeta, socket: object = None) -> None:
        await asyncio.to_thread(self.set_custom_meta, metadata)

    async def async_put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[..., object] | None = None,
    ) -> BatchMeta:
        no_data_parser(data_parser)
        return await asyncio.to_thread(self.put, data, metadata, partition_id)

    async def async_get_data(self, metadata: BatchMeta, *, layout: str = "jagged") -> TensorDict:
        return await asyncio.to_thread(self.get_data, metadata, layout=layout)

    async def async_clear_partition(self, partition_id: str) -> None:
        await asyncio.to_thread(self.clear_partition, partition_id)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.clear_samples, metadata)

    async def async_get_consumption_status(
        self, task_name: str, partition_id: str, socket: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await asyncio.to_thread(self.get_consumption_status, task_name, partition_id)

    async def async_get_production_status(
        self, data_fields: list[str], partition_id: str, socket: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await asyncio.to_thread(self.get_production_status, data_fields, partition_id)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return await asyncio.to_thread(self.check_consumption_status, task_name, partition_id)

    async def async_check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return await asyncio.to_thread(self.check_production_status, data_fields, partition_id)

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None, socket: object = None
    ) -> bool:
        return await asyncio.to_thread(self.reset_consumption, partition_id, task_name)

    async def async_get_partition_list(self, socket: object = None) -> list[str]:
        return await asyncio.to_thread(self.get_partition_list)

    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False, socket: object = None
    ) -> BatchMeta:
        return await asyncio.to_thread(self.kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str, socket: object = None
    ) -> list[str]:
        return await asyncio.to_thread(self.kv_retrieve_keys, global_indexes, partition_id)

    async def async_kv_list(
        self, partition_id: str | None = None, socket: object = None
    ) -> dict[str, dict[str, Tags]]:
        return await asyncio.to_thread(self.kv_list, partition_id)

    async def async_save_controller_checkpoint(self, path: str, socket: object = None) -> None:
        self.save_controller_checkpoint(path)

    async def async_load_controller_checkpoint(self, path: str, socket: object = None) -> None:
        self.load_controller_checkpoint(path)

    async def async_save_storage_checkpoint(
        self, checkpoint_dir: str, *, metadata: dict[str, Any] | None = None
    ) -> None:
        await asyncio.to_thread(self.save_storage_checkpoint, checkpoint_dir, metadata=metadata)

    async def async_load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await asyncio.to_thread(self.load_storage_checkpoint, checkpoint_dir)


AsyncTransferQueueClient = TransferQueueClient

_CONTROLLER_CHECKPOINT = (
    "TransferQueue's separate controller checkpoint has no equivalent here: the store saves rows, tags "
    "and streaming state as one checkpoint; use tq.save_checkpoint(dir) / tq.load_checkpoint(dir)"
)


def _key_list(keys: object) -> list[str]:
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"Only string or list of strings are allowed as `keys`, not {type(keys).__name__}")
    if not keys:
        raise ValueError("Received an empty list as keys.")
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("Not all elements in `keys` are strings.")
    return list(keys)


def _rows(data: TensorDict, positions: list[int]) -> TensorDict:
    """The rows at ``positions`` of a TensorDict batch (nested fields row by row)."""
    import torch
    from tensordict import TensorDict

    out: dict[str | tuple[str, ...], object] = {}  # (a TensorDict's keys)
    index = torch.tensor(positions, dtype=torch.int64)
    for name in data.keys():
        value = data.get(name)
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            out[name] = torch.nested.as_nested_tensor([rows[i] for i in positions], layout=torch.jagged)
        elif isinstance(value, torch.Tensor):
            out[name] = value.index_select(0, index)
        else:
            values = value.tolist() if hasattr(value, "tolist") else list(value)
            out[name] = [values[i] for i in positions]
    return TensorDict(out, batch_size=[len(positions)])


def _scatter(parts: list[tuple[list[int], TensorDict]], size: int, fields: list[str]) -> TensorDict:
    """One TensorDict of ``size`` rows from per-partition reads (their rows at ``positions``)."""
    import torch
    from tensordict import TensorDict

    out: dict[str, object] = {}
    for name in fields:
        rows: list[object] = [None] * size
        for positions, td in parts:
            value = td.get(name)
            values = value.unbind() if isinstance(value, torch.Tensor) else value.tolist()
            for p, v in zip(positions, values, strict=True):
                rows[p] = v
        if all(isinstance(r, torch.Tensor) for r in rows):
            out[name] = _mixed.pack_rows(rows)
        else:
            out[name] = rows
    return TensorDict(out, batch_size=[size])


__all__ = ["AsyncTransferQueueClient", "GetMetaTimeoutError", "TransferQueueClient", "UnknownIndexError"]
