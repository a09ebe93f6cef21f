"""TransferQueue's module functions (``transfer_queue.interface``) on this store: ``init``,
``close``, ``get_client``, the KV calls sync and ``async_``, checkpoints.

The KV calls go straight to the store (``dataplane.api``): a put is one store put, a get one
store get, no controller round trip on the way. Their metas are this package's ``KVBatchMeta``;
their reads come in TransferQueue's layout (``layout="dense"`` keeps the store's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from dataplane import api as _api
from dataplane._tq_controller import CONTROLLER_NAMESPACE, SamplerSpec, Tags, visible_fields
from dataplane.errors import CheckpointError, FieldNotFoundError, StoreNotInitializedError
from dataplane.meta import KVBatchMeta as _StoreMeta
from dataplane.server.checkpoint_files import MANIFEST, shard_files
from dataplane.tq import _layout, _mixed, _session
from dataplane.tq.client import TransferQueueClient, no_data_parser, sampler_spec
from dataplane.tq.metadata import KVBatchMeta, kept_schema, mapping_schema

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from tensordict import TensorDict

    from dataplane.tq._layout import Columns

logger = logging.getLogger(__name__)

# TransferQueue's module state, for code that looks at it (its checkpoint tests do).
_TQ_CLIENT: TransferQueueClient | None = None
_TQ_CONTROLLER: ActorHandle | None = None
_TQ_STORAGE: object = None  # TransferQueue's storage manager: this store has none

# TransferQueue config keys this module honours, and the StoreConfig option each one sets.
_STORE_KEYS = {("backend", "SimpleStorage", "num_data_storage_units"): "num_shards"}
_DEFAULT_KEYS = {("backend", "storage_backend"): "SimpleStorage"}  # accepted when left at the default


def _as_dict(conf: object) -> dict[str, Any]:
    if conf is None:
        return {}
    if type(conf).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        conf = OmegaConf.to_container(conf, resolve=True)
    if not isinstance(conf, Mapping):
        raise TypeError(f"tq.init: conf must be a dict or an OmegaConf config, not {type(conf).__name__}")
    return dict(conf)


def _flatten(d: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _read_conf(conf: object) -> tuple[dict[str, Any], bool, object]:
    """``(store options, polling_mode, sampler)`` from TransferQueue's config layout; the keys with
    no meaning here are named in one warning."""
    flat = _flatten(_as_dict(conf))
    options: dict[str, Any] = {}  # StoreConfig options, by name
    polling, sampler = False, None
    ignored = []
    for path, value in flat.items():
        if path in _STORE_KEYS:
            if value is not None:
                options[_STORE_KEYS[path]] = int(value)
        elif path == ("controller", "polling_mode"):
            polling = bool(value)
        elif path == ("controller", "sampler"):
            sampler = value
        elif path in _DEFAULT_KEYS and value in (None, _DEFAULT_KEYS[path]):
            continue
        elif value is not None and value != {}:
            ignored.append(".".join(path))
    if ignored:
        logger.warning(
            "tq.init: these TransferQueue settings have no meaning for this store and are ignored: %s",
            ", ".join(sorted(ignored)),
        )
    return options, polling, sampler


class InitResult(TypedDict):
    """What ``init`` says took effect."""

    store: dict[str, int]  # the StoreConfig options taken from the config
    polling_mode: bool
    sampler: SamplerSpec | None


def init(conf: object = None, *, config: object = None) -> InitResult:
    """Attach to the store, or start an embedded one (TransferQueue's ``tq.init``).

    ``conf`` (or ``config``) may be a dict or an OmegaConf config in TransferQueue's layout; the
    parts that map onto this store are honoured (``backend.SimpleStorage.num_data_storage_units``
    is the number of shards; ``controller.polling_mode`` and ``controller.sampler`` apply to
    ``get_client().get_meta`` in every process of the cluster), the rest ignored with one warning.
    As in TransferQueue, a process that finds the system already initialised only attaches, and
    its ``conf`` is ignored. Joins (or starts) Ray when this process has not.

    Returns:
        What took effect: ``{"store": options, "polling_mode": bool, "sampler": spec}``.

    Example:
        >>> tq.init({"controller": {"polling_mode": True}})
    """
    global _TQ_CLIENT, _TQ_CONTROLLER
    options, polling, sampler = _read_conf(conf if conf is not None else config)
    import ray

    if not ray.is_initialized():
        _api.init(**options)  # joins or starts Ray, then attaches to or starts the store
    existing = _session._find(CONTROLLER_NAMESPACE)
    if existing is not None:  # another process initialised it: attach, its config wins
        shared = _session.attach()
    else:
        # A Ray worker attaches only: a store it started would die with it (a driver starts one).
        info = _api.init(attach_only=_in_ray_worker(), **options)
        spec = sampler_spec(sampler)
        _session.start_controllers(
            {"store": info.extra.get("name", "dataplane"), "polling_mode": polling, "sampler": spec}
        )
        shared = _session.attach()
    _TQ_CONTROLLER = _session.state.controller
    _TQ_CLIENT = TransferQueueClient()
    return {"store": options, "polling_mode": shared["polling_mode"], "sampler": shared["sampler"]}


def _in_ray_worker() -> bool:
    import ray

    return bool(ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


def close() -> None:
    """Detach this process; the process that started the store (and its controller) stops them.

    In TransferQueue any caller kills the shared controller; here only its creator does.
    """
    global _TQ_CLIENT, _TQ_CONTROLLER
    _session.close()
    _TQ_CLIENT = _TQ_CONTROLLER = None
    _api.close()


def get_client() -> TransferQueueClient:
    """TransferQueue's low-level client (``get_meta``, ``put``, ``get_data``, ...) on this store;
    attaches first in a process of the cluster that never called ``init``."""
    global _TQ_CLIENT, _TQ_CONTROLLER
    _session.attach()
    if _TQ_CLIENT is None:
        _TQ_CLIENT = TransferQueueClient()
    if _TQ_CONTROLLER is None:
        _TQ_CONTROLLER = _session.state.controller
    return _TQ_CLIENT


def get_metrics_endpoint() -> str | None:
    """TransferQueue's Prometheus endpoint: ``"host:port"`` of the Ray metrics agent on the node of the
    store's index (``http://host:port/metrics``; ``dataplane.metrics.endpoint``), None when there is
    none (metrics off, no store, Ray without its metrics agent)."""
    from dataplane.metrics import endpoint

    return endpoint()


# ---- KV calls ------------------------------------------------------------------------------


def _wrap(meta: _StoreMeta) -> KVBatchMeta:
    fields = None if meta.fields is None else visible_fields(meta.fields)
    return KVBatchMeta._trusted(meta.keys, meta._tag_list, meta._pid, fields)  # type: ignore[return-value]


def _check_put(fields: object, tags: object, data_parser: object) -> None:
    no_data_parser(data_parser)
    if fields is None and tags is None:
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")


def _put_done(partition_id: str, fields: Columns | None, meta: _StoreMeta) -> KVBatchMeta:
    """After a KV put: tell the controller the schema of what was written; the meta, wrapped."""
    _record_schema(partition_id, fields, len(meta.keys))
    return _wrap(meta)


def _row(fields: Columns | None) -> Columns | None:
    """kv_put's one row: nested tensors are refused as in TransferQueue."""
    if isinstance(fields, Mapping) and not hasattr(fields, "batch_size"):
        for name, value in fields.items():
            if getattr(value, "is_nested", False):
                raise ValueError(
                    f"field {name!r} is a nested tensor: please use (async)kv_batch_put for batch operation"
                )
    return fields


def _record_schema(partition_id: str, fields: Columns | None, n: int) -> None:
    """Tell the controller the schema of what a KV put wrote (for ``BatchMeta.field_schema``)."""
    if fields is not None:
        _session.tell("record_schema", partition_id, kept_schema(mapping_schema(fields, n)))


def kv_put(
    key: str,
    partition_id: str,
    fields: Columns | None = None,
    tag: Tags | None = None,
    data_parser: object = None,
) -> KVBatchMeta:
    """TransferQueue's ``kv_put``: upsert one row (a dict of tensors without the batch dim, or a
    TensorDict of one row); ``fields=None`` updates the tag only. Returns the row's meta."""
    _check_put(fields, tag, data_parser)
    _session.attach()
    tags = None if tag is None else [tag]
    row = _row(fields)
    meta = _mixed.put_row(key, partition_id, row, tags, lambda: _api.kv_put(key, partition_id, row, tag))
    return _put_done(partition_id, fields, meta)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Columns | None = None,
    tags: list[Tags] | None = None,
    data_parser: object = None,
) -> KVBatchMeta:
    """TransferQueue's ``kv_batch_put``: upsert rows; new fields add columns to existing keys."""
    _check_put(fields, tags, data_parser)
    _session.attach()
    meta = _mixed.put(
        partition_id,
        _layout.per_row_values(fields),
        len(keys),
        lambda cols: _api.kv_batch_put(keys, partition_id, cols, tags),
    )
    return _put_done(partition_id, fields, meta)


def _held_by_all(
    keys: list[str] | str, partition_id: str, select_fields: Any, error: FieldNotFoundError
) -> list[str]:
    """The selected fields every key holds; a field no key holds is left out (TransferQueue does, and
    verl's trainers ask for optional fields that way); one only some keys hold raises ``error``."""
    from dataplane.client import stream_ops as _stream_ops

    keys = [keys] if isinstance(keys, str) else list(keys)
    fields = [select_fields] if isinstance(select_fields, str) else list(select_fields)
    known = _api.current_client().run(_stream_ops.resolve(partition_id, keys))
    held = {f: sum(f in known.get(k, ()) for k in keys) for f in fields}
    if any(0 < n < len(keys) for n in held.values()):
        raise error
    return [f for f in fields if held[f] == len(keys)]


def _key_list(keys: list[str] | str) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def _empty(keys: list[str] | str) -> TensorDict:
    from tensordict import TensorDict

    return TensorDict({}, batch_size=[1 if isinstance(keys, str) else len(keys)])


def kv_batch_get(
    keys: list[str] | str,
    partition_id: str,
    select_fields: list[str] | str | None = None,
    *,
    layout: str = "jagged",
) -> TensorDict:
    """TransferQueue's ``kv_batch_get``: rows in key order, in TransferQueue's layout (tensor fields
    jagged; ``layout="dense"``: as the store returns them); without ``select_fields`` the fields
    every key holds. A missing key raises ``KeyNotFoundError`` (a ``ValueError``); a selected field
    no key holds is left out, as in TransferQueue; one that only some keys hold raises
    ``FieldNotFoundError``."""
    _layout.check_layout(layout)
    _session.attach()
    try:
        td = _api.kv_batch_get(keys, partition_id, select_fields)
    except FieldNotFoundError as exc:
        fields = _held_by_all(keys, partition_id, select_fields, exc)
        td = _api.kv_batch_get(keys, partition_id, fields) if fields else _empty(keys)
    td = _mixed.restore(td, _key_list(keys), partition_id, drop_hidden=select_fields is None)
    return _layout.to_layout(td, layout)


def kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None, *, layout: str = "jagged"
) -> TensorDict:
    """TransferQueue's ``kv_batch_get_by_meta``: ``kv_batch_get`` of the meta's keys and fields."""
    _layout.check_layout(layout)
    _session.attach()
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    td = _api.kv_batch_get_by_meta(meta, select_fields)
    td = _mixed.restore(td, list(meta.keys), meta._pid, drop_hidden=select_fields is None)
    return _layout.to_layout(td, layout)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Tags]]:
    """TransferQueue's ``kv_list``: ``{partition: {key: tag}}``."""
    _session.attach()
    return _api.kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """TransferQueue's ``kv_clear``: unknown keys and partitions are ignored."""
    _session.attach()
    keys = [keys] if isinstance(keys, str) else list(keys)
    _api.kv_clear(keys, partition_id)
    _session.tell("forget", partition_id, keys)


async def _attach() -> None:
    if _session.state.config is None or not _api.is_initialized():
        await asyncio.to_thread(_session.attach)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Columns | None = None,
    tag: Tags | None = None,
    data_parser: object = None,
) -> KVBatchMeta:
    _check_put(fields, tag, data_parser)
    await _attach()
    tags = None if tag is None else [tag]
    row = _row(fields)
    meta = await _mixed.async_put_row(
        key, partition_id, row, tags, lambda: _api.async_kv_put(key, partition_id, row, tag)
    )
    return _put_done(partition_id, fields, meta)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Columns | None = None,
    tags: list[Tags] | None = None,
    data_parser: object = None,
) -> KVBatchMeta:
    _check_put(fields, tags, data_parser)
    await _attach()
    meta = await _mixed.async_put(
        partition_id,
        _layout.per_row_values(fields),
        len(keys),
        lambda cols: _api.async_kv_batch_put(keys, partition_id, cols, tags),
    )
    return _put_done(partition_id, fields, meta)


async def async_kv_batch_get(
    keys: list[str] | str,
    partition_id: str,
    select_fields: list[str] | str | None = None,
    *,
    layout: str = "jagged",
) -> TensorDict:
    _layout.check_layout(layout)
    await _attach()
    try:
        td = await _api.async_kv_batch_get(keys, partition_id, select_fields)
    except FieldNotFoundError as exc:
        fields = await asyncio.to_thread(_held_by_all, keys, partition_id, select_fields, exc)
        td = await _api.async_kv_batch_get(keys, partition_id, fields) if fields else _empty(keys)
    td = await _mixed.async_restore(td, _key_list(keys), partition_id, drop_hidden=select_fields is None)
    return _layout.to_layout(td, layout)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None, *, layout: str = "jagged"
) -> TensorDict:
    _layout.check_layout(layout)
    await _attach()
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    td = await _api.async_kv_batch_get_by_meta(meta, select_fields)
    td = await _mixed.async_restore(td, list(meta.keys), meta._pid, drop_hidden=select_fields is None)
    return _layout.to_layout(td, layout)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Tags]]:
    await _attach()
    return await _api.async_kv_list(partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await _attach()
    keys = [keys] if isinstance(keys, str) else list(keys)
    await _api.async_kv_clear(keys, partition_id)
    _session.tell("forget", partition_id, keys)


# ---- checkpoints ---------------------------------------------------------------------------


def _initialized() -> None:
    """TransferQueue's rule for checkpoints: only a process that called ``init`` (or attached through
    ``get_client``) saves or loads."""
    if _TQ_CONTROLLER is None:
        raise StoreNotInitializedError("TransferQueue is not initialized: call tq.init() first")


def save_checkpoint(
    checkpoint_dir: str | Path, *, include_storage: bool = True, metadata: dict[str, Any] | None = None
) -> None:
    """TransferQueue's ``save_checkpoint``: the store's rows, tags, schemas and streaming state, with
    ``metadata`` (JSON values) kept alongside, written atomically (``dataplane.save_checkpoint``).
    The store always saves its rows (as TransferQueue does for its in-memory backend):
    ``include_storage=False`` only logs a warning.

    Then, for tools that read TransferQueue's layout, its two JSON files are written into the
    checkpoint, each atomically: ``simple_storage/storage_unit_info.json`` (one entry per shard of
    the store: ``position``, ``storage_unit_id``, and the ``files`` holding its rows, relative to
    ``checkpoint_dir``) and, last, ``metadata.json`` (``{"storage_saved": true, "user_metadata":
    metadata}``). The store's own manifest holds the same metadata and is what a load reads, so a
    checkpoint without them (a crash between the writes) still loads. TransferQueue's
    ``controller_state.pkl`` and ``su_<n>_<id>.pkl`` files are not written: they are pickles, and
    this store's checkpoint has none (the rows and the controller's state are in the store's own
    files).

    Raises:
        StoreNotInitializedError: this process did not call ``init`` (a ``RuntimeError``).
    """
    _initialized()
    if not include_storage:
        logger.warning(
            "tq.save_checkpoint: include_storage=False has no effect: the store's rows live in memory"
        )
    get_client().save_storage_checkpoint(str(checkpoint_dir), metadata=metadata)
    path = Path(checkpoint_dir)
    shards = _checkpoint_shards(path)
    if shards is not None:
        (path / _SU_DIR).mkdir(exist_ok=True)
        _write_json(path / _SU_DIR / _SU_INFO, _storage_units(shards))
    _write_json(path / "metadata.json", {"storage_saved": True, "user_metadata": metadata or {}})


# TransferQueue's storage-unit directory and its manifest, inside a checkpoint.
_SU_DIR = "simple_storage"
_SU_INFO = "storage_unit_info.json"


class _StorageUnit(TypedDict):
    """One entry of TransferQueue's ``storage_unit_info.json``."""

    position: int
    storage_unit_id: str
    files: list[str]


def _storage_units(shards: int) -> list[_StorageUnit]:
    """TransferQueue's ``storage_unit_info.json`` for a checkpoint of ``shards`` shards."""
    return [
        {"position": s, "storage_unit_id": f"shard-{s}", "files": list(shard_files(s))} for s in range(shards)
    ]


def _checkpoint_shards(path: Path) -> int | None:
    """How many shards saved the checkpoint at ``path`` (its manifest says), or None when the
    manifest cannot be read: the store's load then names what is wrong."""
    try:
        with open(path / MANIFEST, "rb") as f:
            shards = json.load(f).get("num_shards")
    except (OSError, ValueError, AttributeError):
        return None
    return shards if type(shards) is int else None


def _check_storage_units(path: Path) -> None:
    """A checkpoint's ``storage_unit_info.json``, when it has one, must describe its shards: one that
    does not (edited, or copied from another checkpoint) means the directory is not what was saved.

    Raises:
        CheckpointError: it lists another number of storage units, or other ones (a ``ValueError``).
    """
    info = path / _SU_DIR / _SU_INFO
    shards = _checkpoint_shards(path)
    if shards is None or not info.is_file():
        return
    try:
        with open(info) as f:
            units = json.load(f)
    except ValueError as exc:
        raise CheckpointError(str(info), f"{info} is not valid JSON ({exc}); nothing was loaded") from None
    if not isinstance(units, list) or len(units) != shards:
        listed = len(units) if isinstance(units, list) else "no list of"
        raise CheckpointError(
            str(info),
            f"storage unit count mismatch: {info} lists {listed} storage units, while the checkpoint "
            f"holds {shards} shards (its {MANIFEST}); it was changed after the save. Nothing was loaded",
        )
    if units != _storage_units(shards):
        raise CheckpointError(
            str(info),
            f"{info} does not describe the checkpoint's {shards} shards (its {MANIFEST}); it was "
            "changed after the save. Nothing was loaded",
        )


def _write_json(path: Path, value: object) -> None:
    """``value`` as JSON at ``path``, atomically (a temp file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """TransferQueue's ``load_checkpoint``: restore what ``save_checkpoint`` saved; partitions of the
    same names are replaced whole, as TransferQueue replaces its state.

    Raises:
        StoreNotInitializedError: this process did not call ``init`` (a ``RuntimeError``).
        FileNotFoundError: no checkpoint at ``checkpoint_dir``.
        CheckpointError: its ``storage_unit_info.json`` does not describe its shards ("count
            mismatch" when it lists another number); the store's checkpoint errors. A
            ``ValueError``. The checkpoint may come from a store of another number of shards.
    """
    _initialized()
    path = Path(checkpoint_dir)
    if not path.exists() and not Path(f"{checkpoint_dir}.old").exists():
        raise FileNotFoundError(f"no checkpoint at {str(checkpoint_dir)!r}")
    _check_storage_units(path)
    try:
        get_client().load_storage_checkpoint(str(checkpoint_dir))
    except FileNotFoundError as exc:
        if (path / "metadata.json").exists():
            raise
        raise FileNotFoundError(
            f"{str(checkpoint_dir)!r} holds no checkpoint of this store: no metadata.json, and {exc}"
        ) from exc


__all__ = [
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]
