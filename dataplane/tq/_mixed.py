"""A field whose dtype differs between puts, as TransferQueue allows, on columns of one type each.

TransferQueue stores every row by itself: a field put as float32 for some keys and as int64 for
others is accepted (its controller logs an error and carries on), and a read returns the rows as
TransferQueue packs any list of rows: a jagged nested tensor where the requested rows share a dtype
(each read keeps its rows' dtype), a strided nested tensor of the first requested row's dtype where
they do not (``torch.nested.as_nested_tensor`` casts the others), and 0-dim rows stacked with
torch's type promotion.

The store decides a field's type once per partition (``dp.*`` puts of another are refused). A
``dataplane.tq`` put whose tensor rows have another dtype, or another number of dims, writes instead

* in the field itself, empty rows of the stored type: placeholders, so that the keys hold the field
  as they do in TransferQueue (listed, ready for ``get_meta``, read with the others), and
* the real rows in a hidden field, ``__tq_rows__:<name>``: one self-describing binary value per row
  (dtype, shape, bytes), so any dtype fits one column of the store.

A read that gets empty rows of a tensor field reads those keys' hidden rows, which replace them.
So that a real empty row is never taken for a placeholder of older data, a put whose rows of a tensor
field include empty ones writes their hidden rows too (a rare case, the only one besides a retyped
put that writes them). Other writers (``dp.*``) see the placeholders as what they are: empty rows.

Why not one column per dtype: the index's readiness, listings and ``get_meta`` work on field names,
and a key holding ``mask`` in one column and another key in a second column would no longer hold the
same field. Placeholders keep every one of those paths unchanged, and cost nothing to a put or a read
of a field whose rows agree (the common case): a put checks for empty rows, a read for empty rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from dataplane import api as _api
from dataplane._tq_controller import ROWS_FIELD_PREFIX
from dataplane.codec.column_types import describe_family
from dataplane.errors import FieldNotFoundError, SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from dataplane._tq_controller import Tags
    from dataplane.meta import KVBatchMeta
    from dataplane.tq._layout import Columns

T = TypeVar("T")

# How a refused field is stored: ``[kind, dtype, dims per row]`` (from ``SchemaMismatchError.stored``).
StoredAs = list[Any]

# A put learns one field's stored type per refusal; a put of more fields than this is refused as is.
# (Nothing is remembered between puts: a partition cleared and written again may store the field with
# the other dtype, and then the rows go in as they are. A retyped put costs one refused put.)
_MAX_RETYPES = 64

__all__ = [
    "async_put",
    "async_put_row",
    "async_restore",
    "field_names",
    "hidden",
    "pack_rows",
    "put",
    "put_row",
    "restore",
]


def hidden(name: str) -> str:
    """The hidden field holding ``name``'s rows of another dtype."""
    return ROWS_FIELD_PREFIX + name


# ---- rows <-> bytes -------------------------------------------------------------------------------


def _encode_row(row: torch.Tensor) -> bytes:
    import torch

    flat = row.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return msgspec.msgpack.encode([str(row.dtype).removeprefix("torch."), list(row.shape), raw])


def _decode_row(blob: bytes, field: str) -> torch.Tensor:
    import torch

    from dataplane.codec.column_types import torch_dtype

    try:
        name, shape, raw = msgspec.msgpack.decode(bytes(blob))
        dtype = torch_dtype(name)
        if not raw:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(tuple(shape))
    except (ValueError, TypeError, RuntimeError, msgspec.DecodeError) as exc:
        raise SchemaError(
            field, f"field {field!r}: a row of {hidden(field)!r} cannot be read ({exc})"
        ) from None


# ---- what a put holds -----------------------------------------------------------------------------


def field_names(fields: Columns) -> list[str]:
    """The names of a put's or a read's columns (a TensorDict's top-level keys are strings)."""
    return [name for name in fields.keys() if isinstance(name, str)]


def _getter(fields: Columns) -> Callable[[str], object]:
    get: Callable[[str], object] = fields.get if hasattr(fields, "batch_size") else fields.__getitem__
    return get


def _rows(value: object, n: int) -> list[torch.Tensor] | None:
    """The ``n`` tensor rows of a column, or None for a column that is not one of tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return list(value.unbind())
        if value.dim() >= 1 and value.shape[0] == n:
            return list(value.unbind(0))
        return None
    if (
        isinstance(value, (list, tuple))
        and len(value) == n
        and n > 0
        and isinstance(value[0], torch.Tensor)  # (a list of strings is told at its first value)
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return list(value)
    return None


def _family(value: object, n: int) -> list[str | int] | None:
    """``["tensor", dtype, dims per row]`` of a column of tensor rows of one dtype, else None."""
    import torch

    if isinstance(value, torch.Tensor) and (value.is_nested or (value.dim() >= 1 and value.shape[0] == n)):
        return ["tensor", str(value.dtype).removeprefix("torch."), value.dim() - 1]
    rows = _rows(value, n)
    if not rows or len({r.dtype for r in rows}) != 1 or len({r.dim() for r in rows}) != 1:
        return None
    return ["tensor", str(rows[0].dtype).removeprefix("torch."), rows[0].dim()]


def _has_empty_row(value: object, n: int) -> bool:
    """Whether a column of tensor rows has a row of no elements (cheap for dense and jagged ones)."""
    import torch

    if not isinstance(value, torch.Tensor):
        rows = _rows(value, n)
        if not rows:
            return False
        return any(r.numel() == 0 and r.dim() > 0 for r in rows)
    if not value.is_nested:
        return value.dim() >= 2 and n > 0 and value.shape[0] == n and value[0].numel() == 0
    if value.layout == torch.jagged:
        if any(s == 0 for s in value.shape[2:]):
            return n > 0
        return bool((value.offsets().diff() == 0).any())
    return any(r.numel() == 0 for r in value.unbind())


def _plan(fields: Columns, n: int, retyped: dict[str, StoredAs]) -> Columns:
    """What to write for ``fields``: the same object when nothing is retyped (``retyped``: the type
    each refused field is stored as) and no tensor row is empty, else a dict of columns with
    placeholders and hidden rows."""
    import torch

    from dataplane.codec.column_types import torch_dtype

    get = _getter(fields)
    changes: dict[str, object] = {}
    for name in field_names(fields):
        if name.startswith(ROWS_FIELD_PREFIX):
            continue
        value = get(name)
        stored = retyped.get(name)
        if stored is not None:
            rows = _rows(value, n)
            assert rows is not None  # (learned only for columns of tensor rows)
            changes[name] = torch.empty((n, *[0] * stored[2]), dtype=torch_dtype(stored[1]))
            changes[hidden(name)] = [_encode_row(r) for r in rows]
        elif _has_empty_row(value, n):
            rows = _rows(value, n)
            assert rows is not None
            changes[hidden(name)] = [_encode_row(r) for r in rows]
    if not changes:
        return fields
    out = {name: get(name) for name in field_names(fields)}
    out.update(changes)
    return out


def _learn(pid: str, fields: Columns, n: int, exc: SchemaMismatchError, retyped: dict[str, StoredAs]) -> bool:
    """Note in ``retyped`` the type a refused put's field is stored as; whether the put can be
    written again.

    Raises:
        SchemaError: the field is stored as 0-dim rows (a ``[B]`` tensor), which have no empty row to
            hold a place: the fix is named.
    """
    name = exc.field
    kind, _, rest = str(exc.stored).partition(":")
    dtype, _, dims = rest.partition(":")
    stored: StoredAs = [kind, dtype, int(dims) if dims.isdigit() else dims]
    if name.startswith(ROWS_FIELD_PREFIX) or name not in field_names(fields):
        return False
    value = _getter(fields)(name)
    if _rows(value, n) is None or stored[0] != "tensor":
        return False  # strings, objects, JSON: TransferQueue's differences end at tensors here
    if stored[2] == 0:
        mine = _family(value, n)
        theirs = describe_family(mine) if mine else "tensors of several dtypes"
        raise SchemaError(
            name,
            f"field {name!r} of partition {pid!r} holds 0-dim rows (a [B] tensor) of {stored[1]}, and "
            f"this put's rows are {theirs}: dataplane.tq keeps each row's dtype as TransferQueue does "
            "only for fields of rows with dims (an empty row holds the place of each one of another "
            f"dtype). Write these as {stored[1]} (.to(torch.{stored[1]})), or under another field name",
        ) from exc
    if retyped.get(name) == stored:
        return False  # retyped already, and refused all the same: nothing more to try
    retyped[name] = stored
    return True


def put(
    pid: str,
    fields: Columns | None,
    n: int,
    write: Callable[[Columns | None], T],
    retyped: dict[str, StoredAs] | None = None,
) -> T:
    """``write(columns)`` (a store put of ``n`` rows), with retyped rows and hidden rows as planned;
    a put refused for a field stored with another dtype is written again with placeholders."""
    if fields is None:
        return write(None)
    retyped = dict(retyped or {})
    for _ in range(_MAX_RETYPES):
        try:
            return write(_plan(fields, n, retyped))
        except SchemaMismatchError as exc:
            if not _learn(pid, fields, n, exc, retyped):
                raise
    return write(_plan(fields, n, retyped))


async def async_put(
    pid: str,
    fields: Columns | None,
    n: int,
    write: Callable[[Columns | None], Awaitable[T]],
    retyped: dict[str, StoredAs] | None = None,
) -> T:
    """``put`` for an async ``write``."""
    if fields is None:
        return await write(None)
    retyped = dict(retyped or {})
    for _ in range(_MAX_RETYPES):
        try:
            return await write(_plan(fields, n, retyped))
        except SchemaMismatchError as exc:
            if not _learn(pid, fields, n, exc, retyped):
                raise
    return await write(_plan(fields, n, retyped))


def _as_batch(row: Columns) -> Columns:
    """A ``kv_put`` row (tensors without the batch dim, or a TensorDict of batch size 1) as a batch of one."""
    import torch

    if hasattr(row, "batch_size"):
        td = cast("TensorDict", row)
        return td if len(td.batch_size) and td.batch_size[0] == 1 else td.unsqueeze(0)
    assert isinstance(row, Mapping)
    return {
        k: v.unsqueeze(0) if isinstance(v, torch.Tensor) and not v.is_nested else [v] for k, v in row.items()
    }


def _row_is_plain(row: Columns) -> bool:
    """Whether a ``kv_put`` row goes to the store as it is: no empty tensor row."""
    batch = _as_batch(row)
    get = _getter(batch)
    return not any(_has_empty_row(get(name), 1) for name in field_names(batch))


def put_row(
    key: str, pid: str, row: Columns | None, tags: list[Tags] | None, write_row: Callable[[], KVBatchMeta]
) -> KVBatchMeta:
    """``kv_put``: ``write_row()`` as it is when the row needs nothing of this module, else a batch
    put of one row as ``put`` writes it."""
    if row is None or not isinstance(row, Mapping) and not hasattr(row, "batch_size"):
        return write_row()
    retyped: dict[str, StoredAs] = {}
    if _row_is_plain(row):
        try:
            return write_row()
        except SchemaMismatchError as exc:
            if not _learn(pid, _as_batch(row), 1, exc, retyped):
                raise
    return put(pid, _as_batch(row), 1, lambda cols: _api.kv_batch_put([key], pid, cols, tags), retyped)


async def async_put_row(
    key: str,
    pid: str,
    row: Columns | None,
    tags: list[Tags] | None,
    write_row: Callable[[], Awaitable[KVBatchMeta]],
) -> KVBatchMeta:
    """``put_row`` for an async ``write_row``."""
    if row is None or not isinstance(row, Mapping) and not hasattr(row, "batch_size"):
        return await write_row()
    retyped: dict[str, StoredAs] = {}
    if _row_is_plain(row):
        try:
            return await write_row()
        except SchemaMismatchError as exc:
            if not _learn(pid, _as_batch(row), 1, exc, retyped):
                raise
    return await async_put(
        pid, _as_batch(row), 1, lambda cols: _api.async_kv_batch_put([key], pid, cols, tags), retyped
    )


# ---- reads ----------------------------------------------------------------------------------------


def _empty_rows(value: object) -> list[int]:
    """Positions of the rows of no elements in a read's tensor field (placeholders, or empty rows)."""
    import torch

    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return []
    if not value.is_nested:
        return list(range(value.shape[0])) if value[0].numel() == 0 else []
    if value.layout == torch.jagged:
        if any(s == 0 for s in value.shape[2:]):
            return list(range(value.shape[0]))
        empty: list[int] = (value.offsets().diff() == 0).nonzero().flatten().tolist()
        return empty
    return [i for i, r in enumerate(value.unbind()) if r.numel() == 0]


def pack_rows(rows: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """Rows as TransferQueue packs them (see the module docstring); rows of one dtype and shape are
    stacked dense (``dataplane.tq``'s layouts make them jagged on request)."""
    import torch

    dtypes = {r.dtype for r in rows}
    if len(dtypes) == 1 and len({tuple(r.shape) for r in rows}) == 1:
        return torch.stack(rows)
    if all(r.dim() == 0 for r in rows):
        return torch.stack(rows)  # type promotion, as torch.stack does for TransferQueue
    attempts = (torch.jagged, torch.strided) if len(dtypes) == 1 else (torch.strided,)
    for layout in attempts:
        try:
            return torch.nested.as_nested_tensor(rows, layout=layout)
        except (RuntimeError, TypeError):
            continue
    return list(rows)


def _hidden_rows(keys: list[str], pid: str, name: str) -> dict[str, bytes]:
    """``{key: blob}`` of the keys among ``keys`` that hold hidden rows of ``name``."""
    from dataplane.client import stream_ops as _stream_ops

    field = hidden(name)
    try:
        got = _api.kv_batch_get(keys, pid, [field])
        have = keys
    except FieldNotFoundError:  # some hold none: real empty rows (or rows dp.* wrote)
        known = _api.current_client().run(_stream_ops.resolve(pid, keys))
        have = [k for k in keys if field in known.get(k, ())]
        if not have:
            return {}
        got = _api.kv_batch_get(have, pid, [field])
    return dict(zip(have, got.get(field).tolist(), strict=True))


def restore(td: TensorDict, keys: list[str], pid: str, drop_hidden: bool) -> TensorDict:
    """A store read of ``keys`` with each placeholder replaced by its hidden row (the rows repacked as
    TransferQueue packs them); hidden fields dropped when the caller did not select them."""
    from tensordict import TensorDict

    names = field_names(td)
    present = {n for n in names if n.startswith(ROWS_FIELD_PREFIX)}
    todo = {}
    for name in names:
        if name in present:
            continue
        empty = _empty_rows(td.get(name))
        if empty:
            todo[name] = empty
    if not todo and not (drop_hidden and present):
        return td
    out = {}
    for name in names:
        if name in present and drop_hidden:
            continue
        value = td.get(name)
        if name in todo:
            empty = todo[name]
            if hidden(name) in present:
                blobs = td.get(hidden(name)).tolist()
                found = {keys[i]: blobs[i] for i in empty}
            else:
                found = _hidden_rows([keys[i] for i in empty], pid, name)
            if found:
                rows = list(value.unbind(0) if not value.is_nested else value.unbind())
                for i in empty:
                    if keys[i] in found:
                        rows[i] = _decode_row(found[keys[i]], name)
                value = pack_rows(rows)
        out[name] = value
    return TensorDict(out, batch_size=td.batch_size, device=td.device)


async def async_restore(td: TensorDict, keys: list[str], pid: str, drop_hidden: bool) -> TensorDict:
    """``restore`` from a coroutine: its reads (only where a placeholder was read) in a thread."""
    names = field_names(td)
    if not any(n.startswith(ROWS_FIELD_PREFIX) for n in names) and not any(
        _empty_rows(td.get(n)) for n in names
    ):
        return td
    return await asyncio.to_thread(restore, td, keys, pid, drop_hidden)
