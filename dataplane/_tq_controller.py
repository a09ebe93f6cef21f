"""The ``TransferQueueController`` actor of ``dataplane.tq``: what TransferQueue's controller holds
that this store does not (the store itself keeps rows, tags, readiness and consumption).

* **Global indexes.** TransferQueue names rows by integer global indexes; this store names them by
  key. The controller hands out an index per ``(partition, key)`` the first time a TransferQueue
  call asks for one, in the order of the keys asked (so a batch of new keys gets consecutive
  indexes, which ``GRPOGroupNSampler`` relies on). An index is never reused: a cleared key written
  again gets a new one, so a stale ``BatchMeta`` can never name another row's data.
* **Field schemas** (dtype, row shape, nested or not) of what the TransferQueue calls wrote, per
  partition and field, for ``BatchMeta.field_schema``.
* **The config** every process of the cluster attaches with (store name, ``polling_mode``, sampler).
* TransferQueue's introspection calls (``list_partitions``, ``clear_partition``,
  ``get_partition_snapshot``).

``tq.init`` starts one in TransferQueue's namespace (``transfer_queue``) and, when the caller's
namespace differs, a second one there (older TransferQueue code looks it up with a bare
``ray.get_actor``); the second asks the first for indexes, so both answer alike.

It lives outside the ``dataplane.tq`` package because an actor's process imports the package of its
class: ``dataplane.tq``'s front door imports tensordict (and with it ``torch._dynamo``), some 4.5
CPU-seconds per process, twice per ``tq.init``; this module needs numpy and the client only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast, overload

import numpy as np

from dataplane import api

if TYPE_CHECKING:
    from ray.actor import ActorHandle

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"

# Fields ``dataplane.tq`` keeps for itself: the rows of a field put with another dtype than the one
# its partition stores (``dataplane.tq._mixed``). Here, so that this module lists fields without them
# and without importing ``dataplane.tq``.
ROWS_FIELD_PREFIX = "__tq_rows__:"


class FieldSchema(TypedDict, total=False):
    """One field's entry of TransferQueue's ``field_schema``."""

    dtype: object  # a torch.dtype; None for a non-tensor field or one of unknown dtype
    shape: tuple[int, ...] | None  # a row's shape (a torch.Size); None when rows differ
    is_nested: bool
    is_non_tensor: bool
    per_sample_shapes: list[tuple[int, ...] | None]  # each row's shape, in a BatchMeta's schema only


Schema = dict[str, FieldSchema]


class SamplerSpec(TypedDict):
    """A known TransferQueue sampler by class name, with its constructor's parameters."""

    name: str
    params: NotRequired[dict[str, int]]


class TQConfig(TypedDict):
    """The config every process of the cluster attaches with."""

    store: str  # the store's name
    polling_mode: bool
    sampler: SamplerSpec | None


Tags = dict[str, object]  # one row's tags: a user's values, passed along


def visible_fields(fields: Iterable[str]) -> list[str]:
    """``fields`` less ``dataplane.tq``'s hidden ones."""
    return [f for f in fields if not f.startswith(ROWS_FIELD_PREFIX)]


class GlobalIndexes:
    """``(partition, key) <-> int``; indexes start at 0 and are never reused. Plain class."""

    def __init__(self) -> None:
        self._by_key: dict[str, dict[str, int]] = {}
        self._by_index: dict[int, tuple[str, str]] = {}
        self._next = itertools.count()

    def of(self, partition_id: str, keys: list[str], create: bool) -> list[int | None]:
        """The index of each key (None for an unknown key unless ``create``)."""
        known = self._by_key.setdefault(partition_id, {}) if create else self._by_key.get(partition_id, {})
        out: list[int | None] = []
        for key in keys:
            gi = known.get(key)
            if gi is None and create:
                gi = next(self._next)
                known[key] = gi
                self._by_index[gi] = (partition_id, key)
            out.append(gi)
        return out

    def new_rows(self, partition_id: str, n: int) -> tuple[list[int], list[str]]:
        """``n`` fresh indexes and the keys this store will use for them (``"#<index>"``)."""
        known = self._by_key.setdefault(partition_id, {})
        gis, keys = [], []
        for _ in range(n):
            gi = next(self._next)
            key = f"#{gi}"
            while key in known:  # a user key that looks like ours: skip to a free index
                gi = next(self._next)
                key = f"#{gi}"
            known[key] = gi
            self._by_index[gi] = (partition_id, key)
            gis.append(gi)
            keys.append(key)
        return gis, keys

    def keys(self, partition_id: str | None, indexes: list[int]) -> list[str | None]:
        """The key of each index (None where the index is unknown or of another partition)."""
        out: list[str | None] = []
        for gi in indexes:
            found = self._by_index.get(gi)
            out.append(found[1] if found and (partition_id is None or found[0] == partition_id) else None)
        return out

    def locate(self, indexes: list[int]) -> list[tuple[str, str] | None]:
        """``(partition, key)`` of each index (None where unknown)."""
        return [self._by_index.get(gi) for gi in indexes]

    def forget(self, partition_id: str, keys: list[str] | None = None) -> None:
        """Drop the indexes of ``keys`` (all of the partition's when None)."""
        known = self._by_key.get(partition_id, {})
        for key in list(known) if keys is None else keys:
            gi = known.pop(key, None)
            if gi is not None:
                self._by_index.pop(gi, None)
        if not known:
            self._by_key.pop(partition_id, None)


class FieldSchemas:
    """Per partition and field: dtype, row shape (None once rows differ), nested, non-tensor."""

    def __init__(self) -> None:
        self._by_pid: dict[str, Schema] = {}

    def record(self, partition_id: str, schema: Schema) -> None:
        mine = self._by_pid.setdefault(partition_id, {})
        for name, new in schema.items():
            old = mine.get(name)
            entry = new.copy()
            entry.pop("per_sample_shapes", None)
            if old is not None and (old.get("is_nested") or old.get("shape") != entry.get("shape")):
                entry["shape"], entry["is_nested"] = None, not entry.get("is_non_tensor", False)
            if old is not None and old.get("dtype") is not None:
                entry["dtype"] = old["dtype"]  # TransferQueue's controller keeps the first put's dtype
            mine[name] = entry

    def get(self, partition_id: str, fields: list[str]) -> Schema:
        """Each field's schema; a field no TransferQueue call wrote gets an entry of unknown dtype."""
        mine = self._by_pid.get(partition_id, {})
        unknown: FieldSchema = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}
        return {f: mine.get(f, unknown).copy() for f in fields}

    def forget(self, partition_id: str) -> None:
        self._by_pid.pop(partition_id, None)


class ProductionTable:
    """``[global_index, column]`` -> 1 when that row holds that field (TransferQueue's 2-D status).

    Sparse: indexes are global and never reused, so a dense table would be as tall as the largest.
    """

    def __init__(self, rows: dict[int, np.ndarray], num_columns: int) -> None:
        self._rows, self.num_columns = rows, num_columns

    @overload
    def __getitem__(self, item: tuple[int, int]) -> int: ...
    @overload
    def __getitem__(self, item: int) -> np.ndarray: ...
    def __getitem__(self, item: tuple[int, int] | int) -> int | np.ndarray:
        if isinstance(item, tuple):
            gi, col = item
            row = self._rows.get(int(gi))
            return 0 if row is None else int(row[col])
        row = self._rows.get(int(item))
        return np.zeros(self.num_columns, dtype=np.int8) if row is None else row

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class Snapshot:
    """What TransferQueue's ``get_partition_snapshot`` exposes, for one partition."""

    partition_id: str
    keys_mapping: dict[str, int] = field(default_factory=dict)
    global_indexes: set[int] = field(default_factory=set)
    custom_meta: dict[int, Tags] = field(default_factory=dict)
    field_name_mapping: dict[str, int] = field(default_factory=dict)
    production_status: ProductionTable = field(default_factory=lambda: ProductionTable({}, 0))


def snapshot(partition_id: str, indexes_of: Callable[[str, list[str]], list[int]]) -> Snapshot:
    """The partition's keys (with their global indexes), tags, fields and which row holds which."""
    from dataplane.client import stream_ops as _stream_ops

    listed = api.kv_list(partition_id).get(partition_id, {})
    snap = Snapshot(partition_id)
    if not listed:
        return snap
    keys = list(listed)
    known = api.current_client().run(_stream_ops.resolve(partition_id, keys))
    gis = indexes_of(partition_id, keys)
    for key, gi in zip(keys, gis, strict=True):
        snap.keys_mapping[key] = gi
        snap.global_indexes.add(gi)
        snap.custom_meta[gi] = dict(listed[key])
        for f in visible_fields(known.get(key, [])):
            snap.field_name_mapping.setdefault(f, len(snap.field_name_mapping))
    rows = {}
    for key, gi in snap.keys_mapping.items():
        row = np.zeros(len(snap.field_name_mapping), dtype=np.int8)
        for f in visible_fields(known.get(key, [])):
            row[snap.field_name_mapping[f]] = 1
        rows[gi] = row
    snap.production_status = ProductionTable(rows, len(snap.field_name_mapping))
    return snap


class Controller:
    """The actor (see the module docstring). ``primary`` is None for the one in TransferQueue's
    namespace (it keeps the indexes); the other gets its handle and asks it."""

    def __init__(self, config: TQConfig, primary: ActorHandle | None = None) -> None:
        api.init(name=config["store"], attach_only=True)
        self._config = config.copy()
        self._primary = primary
        self._indexes = GlobalIndexes()
        self._schemas = FieldSchemas()

    # -- config --------------------------------------------------------------------------------

    def get_config(self) -> TQConfig:
        return self._config.copy()

    def ping(self) -> bool:
        return True

    # -- global indexes and schemas --------------------------------------------------------------

    def indexes(self, partition_id: str, keys: list[str], create: bool = True) -> list[int | None]:
        if self._primary is not None:
            import ray

            found: list[int | None] = ray.get(self._primary.indexes.remote(partition_id, keys, create))
            return found
        return self._indexes.of(partition_id, keys, create)

    def _created(self, partition_id: str, keys: list[str]) -> list[int]:
        return cast("list[int]", self.indexes(partition_id, keys, True))  # created: none is None

    def describe(self, partition_id: str, keys: list[str], fields: list[str]) -> tuple[list[int], Schema]:
        """Indexes for ``keys`` (created as needed) and the schemas of ``fields``: one round trip
        for a ``BatchMeta``."""
        gis = cast("list[int]", self._indexes.of(partition_id, keys, True))  # created: none is None
        return gis, self._schemas.get(partition_id, fields)

    def new_rows(self, partition_id: str, n: int) -> tuple[list[int], list[str]]:
        return self._indexes.new_rows(partition_id, n)

    def keys(self, partition_id: str | None, indexes: list[int]) -> list[str | None]:
        return self._indexes.keys(partition_id, indexes)

    def locate(self, indexes: list[int]) -> list[tuple[str, str] | None]:
        return self._indexes.locate(indexes)

    def record_schema(self, partition_id: str, schema: Schema) -> None:
        self._schemas.record(partition_id, schema)

    def schemas(self, partition_id: str, fields: list[str]) -> Schema:
        return self._schemas.get(partition_id, fields)

    def forget(self, partition_id: str, keys: list[str] | None = None) -> None:
        self._indexes.forget(partition_id, keys)
        if keys is None:
            self._schemas.forget(partition_id)

    # -- TransferQueue's introspection calls ---------------------------------------------------

    def list_partitions(self) -> list[str]:
        return list(api.kv_list())

    def clear_partition(self, partition_id: str) -> None:
        api.clear_partition(partition_id)
        if self._primary is None:
            self.forget(partition_id)
        else:
            self._primary.forget.remote(partition_id)

    def get_partition_snapshot(self, partition_id: str) -> Snapshot | None:
        snap = snapshot(partition_id, self._created)
        return snap if snap.keys_mapping or partition_id in api.kv_list() else None
