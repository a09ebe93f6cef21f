"""TransferQueue's metadata classes on this store: ``BatchMeta`` (rows by global index, columnar) and
``KVBatchMeta`` (rows by key), with TransferQueue 0.1.11's constructors, attributes, methods and
error messages.

``KVBatchMeta`` here subclasses ``dataplane.KVBatchMeta``, so every ``dp.*`` call takes it; it
differs in what TransferQueue allows: every argument may be omitted (``KVBatchMeta()`` is an empty
batch), ``partition_id`` may be None, ``fields`` may be one str, tags and ``extra_info`` may hold
any value (deep-copied, as TransferQueue does; ``dp.KVBatchMeta`` admits plain values only).

``BatchMeta`` names rows by integer global index (``global_indexes``) and partition
(``partition_ids``), with a per-field schema, per-row production status and tags
(``custom_meta``). On this store a row is a key of a partition; the TransferQueue client hands out
global indexes for keys (stable, never reused, see ``dataplane.tq.client``), and a ``BatchMeta``
it built also carries the keys, so reading or writing its rows needs no lookup.

    >>> meta = BatchMeta(global_indexes=[0, 1, 2], partition_ids=["train"] * 3)
    >>> [m.global_indexes for m in meta.chunk(chunks=2)]
    [[0, 1], [2]]
"""

from __future__ import annotations

import copy
import itertools
import logging
import operator
from collections import defaultdict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

import numpy as np
import numpy.typing as npt

from dataplane._tq_controller import FieldSchema, Schema
from dataplane.errors import KeyNotFoundError
from dataplane.meta import KVBatchMeta as _StoreMeta

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

logger = logging.getLogger(__name__)

H = TypeVar("H", bound=Hashable)


class KeysNotInBatchError(KeyNotFoundError, RuntimeError):
    """``select_keys`` named keys this batch does not hold (a ``RuntimeError`` as in TransferQueue)."""


def values_equal(a: object, b: object) -> bool:
    """Equality of two ``extra_info`` values that also holds for tensors and arrays."""
    if type(a) is not type(b):
        return False
    if type(a).__module__.startswith("torch") and hasattr(a, "equal"):
        return bool(a.equal(b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: not equal
        return False


def merge_extra_info(infos: Sequence[dict[str, Any]], where: str) -> dict[str, Any]:
    """The union of batch-level ``extra_info`` dicts; a key with two different values raises."""
    merged: dict[str, object] = {}
    keysets = {frozenset(info) for info in infos}
    if len(keysets) > 1:
        logger.warning("%s: extra_info key sets differ across chunks; keeping the union of keys", where)
    for info in infos:
        for k, v in info.items():
            if k in merged and not values_equal(merged[k], v):
                raise ValueError(
                    f"{where}: extra_info key {k!r} has conflicting values across chunks "
                    f"({merged[k]!r} vs {v!r}); make them equal or drop the key before concatenating"
                )
            merged.setdefault(k, v)
    return merged


# ---- KVBatchMeta ----------------------------------------------------------------------------


@dataclass(eq=True, repr=False)
class KVBatchMeta(_StoreMeta):
    """TransferQueue's ``KVBatchMeta``: keys, one tag dict per key, a partition, fields, extra info.

    Args:
        keys: row keys (unique str). Default: none.
        tags: one dict per key (default: an empty dict per key).
        partition_id: the partition, or None (a meta made before it is known).
        fields: the field names (a list, or one str); None means all.
        extra_info: batch-level information (any values; deep-copied).

    Raises:
        ValueError: ``len(tags) != len(keys)`` ("keys and tags must have same length"), duplicate
            keys ("Got duplicated keys") or fields ("Got duplicated fields").
        TypeError: a key or the partition is not a str.

    Example:
        >>> meta = KVBatchMeta(keys=["a", "b"], tags=[{"i": 0}, {"i": 1}], partition_id="train")
        >>> [c.keys for c in meta.chunk(chunks=2)]
        [['a'], ['b']]
    """

    keys: list[str] = field(default_factory=list)
    tags: list[dict[Any, Any]] | None = None
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[Any, Any] | None = None

    def __post_init__(self) -> None:
        keys = list(self.keys) if not isinstance(self.keys, str) else [self.keys]
        for i, key in enumerate(keys):
            if type(key) is not str:
                raise TypeError(f"KVBatchMeta keys[{i}] is a {type(key).__name__}; keys must be str")
        if self.partition_id is not None and not isinstance(self.partition_id, str):
            raise TypeError(
                f"KVBatchMeta partition_id must be a str or None, not {type(self.partition_id).__name__}"
            )
        tags = [{} for _ in keys] if self.tags is None else copy.deepcopy(list(self.tags))
        if len(tags) != len(keys):
            raise ValueError(f"keys and tags must have same length, but got {len(keys)} and {len(tags)}")
        if len(set(keys)) != len(keys):
            dup = next(k for k, n in _counts(keys).items() if n > 1)
            raise ValueError(f"Got duplicated keys: {dup!r} appears more than once")
        fields = self.fields
        if fields is not None:
            fields = [fields] if isinstance(fields, str) else list(fields)
            if len(set(fields)) != len(fields):
                dup = next(f for f, n in _counts(fields).items() if n > 1)
                raise ValueError(f"Got duplicated fields: {dup!r} appears more than once")
        extra = {} if self.extra_info is None else self.extra_info
        if not isinstance(extra, dict):
            raise TypeError(f"KVBatchMeta extra_info must be a dict, not {type(extra).__name__}")
        self.keys, self.tags, self.fields, self.extra_info = keys, tags, fields, copy.deepcopy(extra)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def _derive(self, idx: Sequence[int], fields: list[str] | None) -> KVBatchMeta:
        tags = self._tag_list
        return KVBatchMeta(
            [self.keys[i] for i in idx], [tags[i] for i in idx], self.partition_id, fields, self.extra_info
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """The batch of ``keys_to_select`` (a subset, in that order) with their tags.

        Raises:
            ValueError: a key is named twice.
            KeysNotInBatchError: a key is not in this batch (also a ``RuntimeError``).
        """
        wanted = [keys_to_select] if isinstance(keys_to_select, str) else list(keys_to_select)
        if len(set(wanted)) != len(wanted):
            raise ValueError(
                f"Contain duplicate keys: {sorted(k for k, n in _counts(wanted).items() if n > 1)}"
            )
        pos = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in wanted if k not in pos]
        if missing:
            raise KeysNotInBatchError(
                missing[0],
                self.partition_id or "",
                f"Keys {missing} not found in current batch (partition {self.partition_id!r})",
            )
        return self._derive([pos[k] for k in wanted], self.fields)

    def reorder(self, indexes: Sequence[SupportsIndex]) -> KVBatchMeta:  # type: ignore[override]
        """Put the rows in the order ``indexes`` gives, in place (row ``i`` becomes ``indexes[i]``).

        Raises:
            ValueError: ``indexes`` has another length than the batch, repeats or leaves range.
        """
        idx = [operator.index(i) for i in indexes]
        if len(idx) != self.size:
            raise ValueError(
                f"Attempted to reorder with indexes length {len(idx)} that does not match "
                f"the batch size {self.size}."
            )
        if len(set(idx)) != len(idx):
            raise ValueError("Contain duplicate indexes.")
        if any(not 0 <= i < self.size for i in idx):
            raise ValueError(f"reorder indexes must lie in [0, {self.size}), got {idx}")
        tags = self._tag_list
        self.keys = [self.keys[i] for i in idx]
        self.tags = [tags[i] for i in idx]
        return self

    def chunk(self, chunks: int) -> list[KVBatchMeta]:  # type: ignore[override]
        """Split into exactly ``chunks`` batches in order, sizes differing by at most one (larger
        first); more chunks than rows gives empty ones."""
        if type(chunks) is not int or chunks < 1:
            raise ValueError(f"chunk(chunks) needs an int >= 1, got {chunks!r}")
        if self.size < chunks:
            logger.warning("chunking %d rows into %d chunks: some chunks are empty", self.size, chunks)
        return [self._derive(part, self.fields) for part in _even_parts(self.size, chunks)]

    @classmethod
    def concat(cls, data: Sequence[_StoreMeta]) -> KVBatchMeta:
        """Join batches in order; empty ones are skipped, no batches gives an empty batch.

        Raises:
            ValueError: field names or partitions differ, or an ``extra_info`` key conflicts.
        """
        parts = [m for m in data if m is not None and m.size > 0]
        if not parts:
            return cls()
        base_fields = parts[0].fields
        pid = parts[0].partition_id
        for m in parts:
            if m.fields is not None and set(m.fields) != set(base_fields or []):
                raise ValueError(f"Field names do not match for concatenation: {base_fields} vs {m.fields}")
            if m.partition_id != pid:
                raise ValueError(f"Partition do not match for concatenation: {pid!r} vs {m.partition_id!r}")
        extra = merge_extra_info([m.extra_info or {} for m in parts], "KVBatchMeta.concat")
        keys = [k for m in parts for k in m.keys]
        tags = [t for m in parts for t in (m.tags or [{} for _ in m.keys])]
        return cls(keys, tags, pid, base_fields, extra)


def _counts(items: Sequence[H]) -> dict[H, int]:
    out: dict[H, int] = defaultdict(int)
    for item in items:
        out[item] += 1
    return out


def _even_parts(n: int, chunks: int) -> Iterator[range]:
    base, rest = divmod(n, chunks)
    start = 0
    for i in range(chunks):
        stop = start + base + (1 if i < rest else 0)
        yield range(start, stop)
        start = stop


# ---- BatchMeta ------------------------------------------------------------------------------


def _schema_of(value: torch.Tensor | Sequence[object], batch_size: int, name: str) -> FieldSchema:
    """One field's schema entry (TransferQueue's layout) from a batch of values."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_nested:
        rows = value.unbind()
        if len(rows) != batch_size:
            raise ValueError(f"field {name!r} holds {len(rows)} rows, expected batch size {batch_size}")
        shapes: list[tuple[int, ...] | None] = [tuple(r.shape) for r in rows]
        return {
            "dtype": value.dtype,
            "shape": None,
            "is_nested": True,
            "is_non_tensor": False,
            "per_sample_shapes": shapes,
        }
    if isinstance(value, torch.Tensor):
        if value.shape[0] != batch_size:
            raise ValueError(f"field {name!r} has {value.shape[0]} rows, expected batch size {batch_size}")
        row_shape = tuple(value.shape[1:]) or (1,)  # TransferQueue records a [B] field as (1,) per row
        return {
            "dtype": value.dtype,
            "shape": torch.Size(row_shape),
            "is_nested": False,
            "is_non_tensor": False,
        }
    if len(value) != batch_size:
        raise ValueError(f"field {name!r} holds {len(value)} rows, expected batch size {batch_size}")
    return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}


def extract_field_schema(data: Any) -> Schema:
    """``{field: {dtype, shape, is_nested, is_non_tensor[, per_sample_shapes]}}`` of a TensorDict batch."""
    n = int(data.batch_size[0])
    if n == 0:
        return {}
    return {name: _schema_of(data.get(name), n, name) for name in data.keys()}


def mapping_schema(fields: Any, n: int) -> Schema:
    """The schema of a put's ``fields`` (a TensorDict, or a mapping of ``n``-row columns; a row of
    tensors without the batch dim when ``n`` is 1 and they are not batched); columns whose layout it
    cannot read are left out (the store took them; only their schema is unknown)."""
    import torch

    get = fields.get if hasattr(fields, "batch_size") else fields.__getitem__
    out: Schema = {}
    for name in list(fields.keys()):
        value = get(name)
        if (
            isinstance(value, torch.Tensor)
            and not value.is_nested
            and (value.dim() == 0 or value.shape[0] != n)
        ):
            value = value.unsqueeze(0)  # kv_put's row
        try:
            out[name] = _schema_of(value, n, name)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


def kept_schema(schema: Schema) -> Schema:
    """A schema as the controller keeps it: per field, without per-row shapes (a nested field whose
    rows all have one shape is kept with that shape)."""
    out: Schema = {}
    for name, meta in schema.items():
        entry = meta.copy()
        entry.pop("per_sample_shapes", None)
        # (a put's schema: every row of a nested field has a shape)
        shapes = {tuple(s) for s in meta.get("per_sample_shapes") or () if s is not None}
        if meta.get("is_nested") and shapes:
            entry["shape"] = next(iter(shapes)) if len(shapes) == 1 else None
            entry["is_nested"] = len(shapes) > 1
        out[name] = entry
    return out


class _SampleView:
    """One row of a ``BatchMeta``, read-only (mappings are ``MappingProxyType``)."""

    __slots__ = ("_batch", "_i")

    def __init__(self, batch: BatchMeta, i: int) -> None:
        self._batch, self._i = batch, i

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._i]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._i]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._i])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._i])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, object]]:
        """Each field's schema for this row (a nested field's ``shape`` is this row's shape)."""
        out: dict[str, MappingProxyType[str, object]] = {}
        for name, meta in self._batch.field_schema.items():
            row = meta.copy()
            shapes = row.pop("per_sample_shapes", None)
            if shapes is not None:
                row["shape"] = shapes[self._i]
            out[name] = MappingProxyType(row)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"_SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, fields={list(self._batch.field_schema)})"
        )


class _SampleViews:
    __slots__ = ("_batch",)

    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, i: int) -> _SampleView:
        return _SampleView(self._batch, i)

    def __iter__(self) -> Iterator[_SampleView]:
        return (_SampleView(self._batch, i) for i in range(len(self)))


class BatchMeta:
    """TransferQueue's ``BatchMeta``: a batch of rows by global index, with per-field schema,
    per-row production status (``1`` = ready) and tags, and batch-level ``extra_info``.

    Args:
        global_indexes: the rows' global indexes (ints; ``tq.get_client()`` hands them out).
        partition_ids: each row's partition (same length).
        field_schema: ``{field: {dtype, shape, is_nested, is_non_tensor[, per_sample_shapes]}}``.
        production_status: per row, 1 when every field is written (default: all 0).
        extra_info: batch-level information.
        custom_meta: one tag dict per row (default: empty dicts).
        _custom_backend_meta: per row, storage bookkeeping (kept for TransferQueue code; unused here).
        _keys: the rows' keys on this store, when known (the client sets them).

    With no arguments it is an empty batch (TransferQueue requires the first two).

    Raises:
        ValueError: a per-row list has another length than ``global_indexes``.

    Example:
        >>> meta = BatchMeta([0, 1], ["train", "train"], production_status=[1, 1])
        >>> meta.is_ready, meta.size
        (True, 2)
    """

    __slots__ = (
        "global_indexes",
        "partition_ids",
        "field_schema",
        "production_status",
        "extra_info",
        "custom_meta",
        "_custom_backend_meta",
        "_size",
        "_field_names",
        "_is_ready",
        "_keys",
    )

    def __init__(
        self,
        global_indexes: Sequence[int] | None = None,
        partition_ids: Sequence[str] | None = None,
        field_schema: Schema | None = None,
        production_status: npt.ArrayLike | None = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: Sequence[dict[str, Any]] | None = None,
        _custom_backend_meta: Sequence[dict[str, Any]] | None = None,
        _keys: Sequence[str] | None = None,
    ) -> None:
        self.global_indexes = list(global_indexes or [])
        self.partition_ids = list(partition_ids or [])
        self.field_schema = {k: v.copy() for k, v in (field_schema or {}).items()}
        self.extra_info = dict(extra_info or {})
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise ValueError(
                f"Length mismatch: global_indexes has {n}, partition_ids has {len(self.partition_ids)}"
            )
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True).reshape(-1)
            if len(self.production_status) != n:
                raise ValueError(f"production_status length {len(self.production_status)} != batch_size {n}")
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ValueError(f"Field {name!r} per_sample_shapes length {len(shapes)} != batch_size {n}")
        self.custom_meta = _per_row(custom_meta, n, "custom_meta")
        self._custom_backend_meta = _per_row(_custom_backend_meta, n, "_custom_backend_meta")
        self._keys = None if _keys is None else list(_keys)
        if self._keys is not None and len(self._keys) != n:
            raise ValueError(f"_keys length {len(self._keys)} != batch_size {n}")
        self._refresh()

    def _refresh(self) -> None:
        self._size = len(self.global_indexes)
        self._field_names = sorted(self.field_schema)
        self._is_ready = self._size > 0 and bool(np.all(self.production_status == 1))

    # -- pickling: one tuple in slot order; a read-only status array (Ray's zero-copy) is copied --

    def __getstate__(self) -> tuple[object, ...]:
        return tuple(getattr(self, slot, None) for slot in self.__slots__)

    def __setstate__(self, state: Sequence[object]) -> None:
        values = dict(zip(self.__slots__, state, strict=False))
        status = values.get("production_status")
        if isinstance(status, np.ndarray) and not status.flags.writeable:
            values["production_status"] = status.copy()
        for slot in self.__slots__:
            setattr(self, slot, values.get(slot))

    # -- size and readiness --------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of rows."""
        return getattr(self, "_size", 0) or 0

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        """The fields, sorted."""
        return list(getattr(self, "_field_names", None) or [])

    @property
    def is_ready(self) -> bool:
        """True when the batch is not empty and every row is produced."""
        return bool(getattr(self, "_is_ready", False))

    @property
    def samples(self) -> _SampleViews:
        """Read-only per-row views: ``meta.samples[i].fields["x"]["shape"]``."""
        return _SampleViews(self)

    @property
    def keys(self) -> list[str] | None:
        """The rows' keys on this store, when this meta came from the store (else None)."""
        return None if self._keys is None else list(self._keys)

    def get_dtypes(self, field_name: str) -> list[object]:
        """The field's dtype, once per row. Raises KeyError for an unknown field."""
        return [self._field(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[tuple[int, ...] | None]:
        """The field's shape per row. Raises KeyError for an unknown field."""
        meta = self._field(field_name)
        if meta.get("per_sample_shapes") is not None:
            return list(meta["per_sample_shapes"])
        return [meta.get("shape")] * self.size

    def _field(self, name: str) -> FieldSchema:
        if name not in self.field_schema:
            raise KeyError(f"Field {name!r} not found in field_schema (fields: {self.field_names})")
        return self.field_schema[name]

    # -- extra_info and custom_meta -----------------------------------------------------------

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of the per-row tags."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[dict[str, Any]] | None) -> None:
        """Merge one dict per row into the rows' tags (None: nothing).

        Raises:
            ValueError: the list's length differs from the batch size.
        """
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # -- fields and rows ----------------------------------------------------------------------

    def add_fields(self, tensor_dict: TensorDict, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``tensor_dict`` (a batch of this meta's size), in place; by default
        mark every row produced. Returns this meta."""
        n = int(tensor_dict.batch_size[0])
        if n == 0:
            return self
        if n != self.size:
            raise ValueError(f"add_fields batch size mismatch: self.size={self.size} vs tensor_dict={n}")
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = 1
        self._refresh()
        return self

    def _take(self, idx: Sequence[int], extra_info: dict[str, Any] | None = None) -> BatchMeta:
        schema: Schema = {}
        for name, meta in self.field_schema.items():
            new = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                new["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in idx]
            schema[name] = new
        return BatchMeta(
            [self.global_indexes[i] for i in idx],
            [self.partition_ids[i] for i in idx],
            schema,
            self.production_status[list(idx)],
            self.extra_info if extra_info is None else extra_info,
            [copy.deepcopy(self.custom_meta[i]) for i in idx],
            [copy.deepcopy(self._custom_backend_meta[i]) for i in idx],
            None if self._keys is None else [self._keys[i] for i in idx],
        )

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """A new meta of the rows at ``sample_indices`` (positions in this batch), in that order.

        Raises:
            ValueError: an index is outside ``[0, size)``.
        """
        idx = [operator.index(i) for i in sample_indices]
        if any(not 0 <= i < self.size for i in idx):
            raise ValueError(f"Sample indices must be in range [0, {self.size})")
        return self._take(idx)

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """A new meta of the same rows restricted to ``field_names`` (unknown names are dropped)."""
        names = [field_names] if isinstance(field_names, str) else list(field_names)
        out = self._take(range(self.size), copy.deepcopy(self.extra_info))
        out.field_schema = {f: out.field_schema[f] for f in names if f in out.field_schema}
        out._custom_backend_meta = [
            {f: v for f, v in m.items() if f.startswith("_") or f in names} for m in out._custom_backend_meta
        ]
        out._refresh()
        return out

    def copy(self) -> BatchMeta:
        """A deep copy."""
        return self._take(range(self.size), copy.deepcopy(self.extra_info))

    def __getitem__(self, item: object) -> BatchMeta:
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"BatchMeta index {item} out of range for a batch of {self.size}")
            return self.select_samples([i])
        if isinstance(item, slice):
            return self.select_samples(list(range(*item.indices(self.size))))
        raise TypeError(f"Indexing with {type(item).__name__} is not supported (an int or a slice)")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into exactly ``chunks`` metas in order, sizes differing by at most one (larger first)."""
        if type(chunks) is not int or chunks < 1:
            raise ValueError(f"chunk(chunks) needs an int >= 1, got {chunks!r}")
        if self.size < chunks:
            logger.warning("chunking %d rows into %d chunks: some chunks are empty", self.size, chunks)
        return [self._take(part) for part in _even_parts(self.size, chunks)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One meta per partition, in first-seen order."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, pid in enumerate(self.partition_ids):
            groups[pid].append(i)
        return [self._take(idx) for idx in groups.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """Same rows, the fields of both (``other`` wins a name clash); a row is produced only when
        both say so. Raises ValueError when the rows or partitions differ."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise ValueError(
                f"BatchMeta.union: global_indexes do not match: {self.global_indexes} "
                f"vs {other.global_indexes}"
            )
        if self.partition_ids != other.partition_ids:
            raise ValueError(
                f"BatchMeta.union: partition_ids do not match: {self.partition_ids} vs {other.partition_ids}"
            )
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        return BatchMeta(
            list(self.global_indexes),
            list(self.partition_ids),
            schema,
            np.bitwise_and(self.production_status, other.production_status),
            {**self.extra_info, **other.extra_info},
            [
                {**copy.deepcopy(a), **copy.deepcopy(b)}
                for a, b in zip(self.custom_meta, other.custom_meta, strict=True)
            ],
            [
                {**copy.deepcopy(a), **copy.deepcopy(b)}
                for a, b in zip(self._custom_backend_meta, other._custom_backend_meta, strict=True)
            ],
            self._keys if self._keys is not None else other._keys,
        )

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """Join metas in order (empty ones skipped; none gives an empty meta).

        Raises:
            ValueError: (``validate``) field names or a field's dtype differ, or an ``extra_info``
                key conflicts.
        """
        parts = [m for m in data if m and m.size > 0]
        if not parts:
            return cls.empty()
        if validate:
            names = parts[0].field_names
            for i, m in enumerate(parts):
                if m.field_names != names:
                    raise ValueError(
                        f"BatchMeta.concat: field_names mismatch at chunk[{i}]: expected {names}, got "
                        f"{m.field_names} (extra {set(m.field_names) - set(names)}, missing "
                        f"{set(names) - set(m.field_names)})"
                    )
            for name in names:
                dtype = parts[0].field_schema[name].get("dtype")
                for i, m in enumerate(parts[1:], start=1):
                    if m.field_schema[name].get("dtype") != dtype:
                        raise ValueError(
                            f"Field {name!r} dtype mismatch in concat: chunk[0]={dtype}, "
                            f"chunk[{i}]={m.field_schema[name].get('dtype')}"
                        )
        schema = {name: _merged_field(name, meta, parts) for name, meta in parts[0].field_schema.items()}
        keys = None if any(m._keys is None for m in parts) else [k for m in parts for k in m._keys or []]
        return cls(
            list(itertools.chain.from_iterable(m.global_indexes for m in parts)),
            list(itertools.chain.from_iterable(m.partition_ids for m in parts)),
            schema,
            np.concatenate([m.production_status for m in parts]),
            merge_extra_info([m.extra_info for m in parts], "BatchMeta.concat"),
            [t for m in parts for t in m.custom_meta],
            [t for m in parts for t in m._custom_backend_meta],
            keys,
        )

    def reorder(self, indices: Sequence[SupportsIndex]) -> None:
        """Put the rows in the order ``indices`` gives, in place.

        Raises:
            ValueError: wrong length, a repeated index, or one outside ``[0, size)``.
        """
        idx = [operator.index(i) for i in indices]
        if len(idx) != self.size:
            raise ValueError(f"Indices length {len(idx)} mismatch batch size {self.size}")
        if len(set(idx)) != len(idx):
            raise ValueError("Indices contain duplicates")
        if any(not 0 <= i < self.size for i in idx):
            raise ValueError(f"Reorder indices must be in range [0, {self.size})")
        self.global_indexes = [self.global_indexes[i] for i in idx]
        self.partition_ids = [self.partition_ids[i] for i in idx]
        self.production_status = self.production_status[idx]
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in idx]
        self.custom_meta = [self.custom_meta[i] for i in idx]
        self._custom_backend_meta = [self._custom_backend_meta[i] for i in idx]
        if self._keys is not None:
            self._keys = [self._keys[i] for i in idx]

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        """A meta of no rows."""
        return cls([], [], extra_info=extra_info)

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, is_ready={self.is_ready}, "
            f"global_indexes={self.global_indexes}, extra_info={self.extra_info})"
        )

    __repr__ = __str__


def _per_row(values: Sequence[dict[str, Any]] | None, n: int, what: str) -> list[dict[str, Any]]:
    if not values:
        return [{} for _ in range(n)]
    out = [dict(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{what} length {len(out)} != batch_size {n}")
    return out


def _merged_field(name: str, meta: FieldSchema, parts: Sequence[BatchMeta]) -> FieldSchema:
    """A field's schema over concatenated metas: nested if any part is, per-row shapes joined."""
    nested = any(m.field_schema.get(name, {}).get("is_nested", False) for m in parts)
    out: FieldSchema = {
        "dtype": meta.get("dtype"),
        "shape": None if nested else meta.get("shape"),
        "is_nested": nested,
        "is_non_tensor": meta.get("is_non_tensor", False),
    }
    if nested or any(m.field_schema.get(name, {}).get("per_sample_shapes") for m in parts):
        shapes: list[tuple[int, ...] | None] = []
        for m in parts:
            own = m.field_schema.get(name, {})
            shapes.extend(own.get("per_sample_shapes") or [own.get("shape")] * m.size)
        out["per_sample_shapes"] = shapes
    return out


__all__ = ["BatchMeta", "KVBatchMeta"]
