"""A TransferQueue-compatible front: ``import dataplane.tq as tq`` replaces ``import transfer_queue as tq``.

The names, keywords and error contract of TransferQueue 0.1.11's module functions, on this store::

    import dataplane.tq as tq

    tq.init()                                   # or tq.init(conf): a dict or OmegaConf config
    meta = tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td, tags=[{}, {}])
    td = tq.kv_batch_get(keys=["a", "b"], partition_id="train", select_fields=["prompt"])
    tq.kv_clear(keys=["a", "b"], partition_id="train")
    tq.close()

What differs from TransferQueue, and why:

* **A missing key raises** (``KeyNotFoundError``, a ``ValueError`` whose message says "not found",
  naming the key). TransferQueue silently drops missing keys when at least one key exists, so a
  batch can shrink without a sign.
* **Dense fields come back dense** (``[B, ...]``), and only fields whose rows differ in shape come
  back as nested tensors; TransferQueue returns every tensor field as a jagged nested tensor.
* **No ``data_parser``**: it is code shipped to and run by the storage servers; the store never runs
  code a client sends. Transform the data before the put.
* **The config**: ``backend.SimpleStorage.num_data_storage_units`` sets the number of shards, and
  ``controller.polling_mode`` / ``controller.sampler`` apply to ``get_client().get_meta``. Capacity
  is bytes here (``StoreConfig.capacity_bytes``), not a sample count; every other key is ignored,
  with one warning naming them.
* **``close()``** stops the store only in the process that started it; in TransferQueue any caller
  kills the shared controller.
* **Metas are key-based**: ``get_client().get_meta`` returns a ``KVBatchMeta`` that also answers
  ``global_indexes`` (the keys), ``is_ready`` and ``field_names``. A ``TransferQueueController``
  actor answers TransferQueue's introspection calls, in the ``transfer_queue`` namespace and in the
  caller's. TransferQueue's own KV end-to-end suite passes unchanged against this module.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dataplane import api as _api
from dataplane.meta import KVBatchMeta
from dataplane.metrics import endpoint as get_metrics_endpoint  # noqa: F401 - TransferQueue's name

logger = logging.getLogger(__name__)

# TransferQueue config keys this module honours, and the StoreConfig option each one sets.
_STORE_KEYS = {("backend", "SimpleStorage", "num_data_storage_units"): "num_shards"}
_DEFAULT_KEYS = {("backend", "storage_backend"): "SimpleStorage"}  # accepted when left at the default


class _Settings:
    polling_mode: bool = False
    sampler: Any = None
    controller: list | None = None  # the TransferQueueController actors this process started


settings = _Settings()
CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"


def _as_dict(conf: Any) -> dict[str, Any]:
    if conf is None:
        return {}
    if type(conf).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        conf = OmegaConf.to_container(conf, resolve=True)
    if not isinstance(conf, Mapping):
        raise TypeError(f"tq.init: conf must be a dict or an OmegaConf config, not {type(conf).__name__}")
    return dict(conf)


def _flatten(d: Mapping[str, Any], prefix: tuple = ()) -> dict[tuple, Any]:
    out: dict[tuple, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def init(conf: Any = None, *, config: Any = None) -> dict[str, Any]:
    """Attach to the store, or start an embedded one (TransferQueue's ``tq.init``).

    ``conf`` (or ``config``) may be a dict or an OmegaConf config in TransferQueue's layout; the
    parts that map onto this store are honoured, the rest ignored with one warning. Returns the
    honoured settings.
    """
    flat = _flatten(_as_dict(conf if conf is not None else config))
    options: dict[str, Any] = {}
    ignored = []
    for path, value in flat.items():
        if path in _STORE_KEYS:
            if value is not None:
                options[_STORE_KEYS[path]] = int(value)
        elif path == ("controller", "polling_mode"):
            settings.polling_mode = bool(value)
        elif path == ("controller", "sampler"):
            settings.sampler = value
        elif path in _DEFAULT_KEYS and value in (None, _DEFAULT_KEYS[path]):
            continue
        elif value is not None and value != {}:
            ignored.append(".".join(path))
    if ignored:
        logger.warning(
            "tq.init: these TransferQueue settings have no meaning for this store and are ignored: %s",
            ", ".join(sorted(ignored)),
        )
    info = _api.init(**options)
    _start_controller(info.extra["name"])
    return {"store": options, "polling_mode": settings.polling_mode}


def _start_controller(store_name: str) -> None:
    """The ``TransferQueueController`` actor TransferQueue code introspects: in the namespace
    TransferQueue 0.1.11 uses (``transfer_queue``) and, when it differs, in the caller's own (where
    older TransferQueue code looks it up with a bare ``ray.get_actor``)."""
    import ray

    from dataplane._tq_client import Controller

    if settings.controller:
        return
    here = ray.get_runtime_context().namespace
    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    started = []
    for namespace in dict.fromkeys([CONTROLLER_NAMESPACE, here]):
        # (asked by listing: a failed get_actor of a name then created cancels the creation)
        if (namespace, CONTROLLER_NAME) not in named:  # else another process started it
            actor = ray.remote(Controller).options(
                name=CONTROLLER_NAME, namespace=namespace, num_cpus=0.01, max_restarts=0
            )
            started.append(actor.remote(store_name))
    settings.controller = started


def get_client():
    """TransferQueue's low-level client (get_meta, get_data, put, status calls) on this store."""
    from dataplane._tq_client import TQClient

    if not _api.is_initialized():
        init()
    return TQClient(polling_mode=settings.polling_mode, sampler=settings.sampler)


def close() -> None:
    """Drop this process's client (and stop the store if this process started it)."""
    if settings.controller is not None:
        import ray

        for actor in settings.controller:
            ray.kill(actor)
        settings.controller = None
    _api.close()


def _something(fields: Any, tags: Any) -> None:
    if fields is None and not tags:
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")


def _no_parser(data_parser: Any) -> None:
    if data_parser is not None:
        raise NotImplementedError(
            "data_parser is not supported: the store never runs code a client sends; transform the "
            "data before the put"
        )


def kv_put(key: str, partition_id: str, fields: Any = None, tag: dict | None = None, data_parser: Any = None):
    """TransferQueue's ``kv_put``: upsert one row (tensors without the batch dim); returns its meta."""
    _no_parser(data_parser)
    _something(fields, tag)
    return _api.kv_put(key, partition_id, fields, tag)


def kv_batch_put(keys: list[str], partition_id: str, fields: Any = None, tags=None, data_parser: Any = None):
    """TransferQueue's ``kv_batch_put``: upsert rows; new fields add columns to existing keys."""
    _no_parser(data_parser)
    _something(fields, tags)
    return _api.kv_batch_put(keys, partition_id, fields, tags)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None):
    """TransferQueue's ``kv_batch_get``: rows in key order; without ``select_fields``, the fields
    every key holds."""
    return _api.kv_batch_get(keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None):
    """TransferQueue's ``kv_batch_get_by_meta``."""
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    return _api.kv_batch_get_by_meta(meta, select_fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    """TransferQueue's ``kv_list``: ``{partition: {key: tag}}``."""
    return _api.kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """TransferQueue's ``kv_clear``: unknown keys and partitions are ignored."""
    _api.kv_clear(keys, partition_id)


async def async_kv_put(key: str, partition_id: str, fields: Any = None, tag=None, data_parser: Any = None):
    _no_parser(data_parser)
    _something(fields, tag)
    return await _api.async_kv_put(key, partition_id, fields, tag)


async def async_kv_batch_put(keys, partition_id: str, fields: Any = None, tags=None, data_parser: Any = None):
    _no_parser(data_parser)
    _something(fields, tags)
    return await _api.async_kv_batch_put(keys, partition_id, fields, tags)


async def async_kv_batch_get(keys, partition_id: str, select_fields=None):
    return await _api.async_kv_batch_get(keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields=None):
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    return await _api.async_kv_batch_get_by_meta(meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    return await _api.async_kv_list(partition_id)


async def async_kv_clear(keys, partition_id: str) -> None:
    await _api.async_kv_clear(keys, partition_id)


__all__ = [
    "KVBatchMeta",
    "get_client",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
]
