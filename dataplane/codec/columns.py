"""The column codec: one field of a batch of rows <-> one byte buffer (plus offsets), and back.

A *column* is what shards store and move without understanding it: ``data`` holds every row's bytes
back to back, and variable-size rows also carry ``offsets`` (int64, ``num_rows + 1`` byte offsets,
``offsets[0] == 0``). The ``ColumnSpec`` says how to read the bytes back:

==========  ==============================  ======================================================
kind        produced from                   decoded as
==========  ==============================  ======================================================
dense       tensor / ndarray ``[B, ...]``   ``[B, ...]`` tensor, same dtype and values (zero-copy)
jagged      nested jagged tensor, or a      nested jagged tensor (``layout=torch.jagged``) whose
            list of B tensors ``[j_i, ...]``  values are a zero-copy view of the column
arrow       list of str / bytes / lists of  non-tensor stack of the Python values (Arrow large_*
            numbers, or a pyarrow array     layout: data buffer + int64 offsets)
object      anything else, pickled per row  non-tensor stack of the unpickled values
            (only with ``allow_pickle``)
==========  ==============================  ======================================================

Pickle appears only here, for ``object`` columns, and only when the writer opts in
(``allow_pickle=True`` or env ``DATAPLANE_ALLOW_PICKLE=1``); shards never unpickle.

Thread-safety: every function is pure (no shared state) and safe to call from several threads.
Decoded tensors are views that keep the column's buffer alive; do not write into views of a
read-only buffer (a received zmq frame, a read-only mapping).

Example:
    >>> import torch
    >>> cols = encode_fields({"x": torch.arange(6.0).view(3, 2)}, num_rows=3)
    >>> cols["x"].spec
    ColumnSpec(kind='dense', dtype='float32', shape=(2,))
    >>> from dataplane.codec.gather import gather
    >>> sub = gather([(cols["x"], np.array([2, 0]))])
    >>> decode_fields({"x": sub}, 2)["x"].tolist()
    [[4.0, 5.0], [0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np  # noqa: F401  (used by the doctest above)
import torch

from dataplane.codec.column_kinds import ValueEncoder, check_storable, decode_value, plain_rows, u8_tensor
from dataplane.codec.column_types import Column
from dataplane.codec.device import DeviceColumn, device_column
from dataplane.errors import BatchSizeError

if TYPE_CHECKING:
    from tensordict import TensorDict

# -- encode -------------------------------------------------------------------------------------


def encode_fields(
    fields: Mapping[str, Any], num_rows: int, *, allow_pickle: bool = False
) -> dict[str, Column]:
    """Encode each field of a batch of ``num_rows`` rows into a ``Column`` (runs on the writer).

    Args:
        fields: a TensorDict or a mapping of field name -> column value (tensor / ndarray ``[B, ...]``,
            nested jagged tensor, list of B tensors / str / bytes / lists of numbers / objects,
            pyarrow array, tensordict non-tensor data).
        num_rows: the batch size B every field must have.
        allow_pickle: allow ``object`` columns (pickled rows); also on with env DATAPLANE_ALLOW_PICKLE=1.

    Returns:
        ``{name: Column}``. Dense columns of contiguous CPU tensors are zero-copy views; CUDA tensors
        are staged through pinned host memory (one copy per field) and synchronised once at the end.

    Raises:
        BatchSizeError: a field does not have ``num_rows`` rows (names the field and both sizes).
        SerializationError: a value needs pickle and pickle is not allowed (names field, type, opt-in).
        SchemaError: the rows of one field disagree in dtype or trailing shape.

    Example:
        >>> cols = encode_fields({"s": ["a", "bc"], "x": torch.zeros(2)}, num_rows=2)
        >>> cols["s"].spec.kind, cols["x"].spec.kind
        ('arrow', 'dense')
    """
    enc = ValueEncoder(allow_pickle)
    items = _field_items(fields)
    out = {name: enc.encode(name, value, num_rows) for name, value in items}
    enc.finish()
    return out


def encode_put(
    fields: Mapping[str, Any], num_rows: int, *, allow_pickle: bool = False
) -> dict[str, Column | DeviceColumn]:
    """``encode_fields`` for a put: dense CUDA tensors stay on their device (``DeviceColumn``), to be
    copied once, straight into the store's shared memory where it is registered with CUDA
    (``client.ops.put``); every other field is encoded as ``encode_fields`` does."""
    items = _field_items(fields)
    kept = {}
    for name, value in items:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            col = device_column(name, value, num_rows)
            if col is not None:
                kept[name] = col
    if not kept:
        return cast(
            "dict[str, Column | DeviceColumn]", encode_fields(fields, num_rows, allow_pickle=allow_pickle)
        )
    rest = encode_fields({n: v for n, v in items if n not in kept}, num_rows, allow_pickle=allow_pickle)
    return {name: kept[name] if name in kept else rest[name] for name, _ in items}  # (the fields' order)


def encode_row(fields: Mapping[str, Any], *, allow_pickle: bool = False) -> dict[str, Column]:
    """Encode one sample into columns of one row each (used by ``kv_put``).

    A TensorDict with batch size ``[1]`` is encoded as a batch of one. Otherwise each value is one
    row: a tensor or ndarray gains a batch dim of 1 (dense); a list holding exactly one tensor, or a
    nested tensor of batch 1, is a jagged row; a str / bytes / list of numbers is an arrow row;
    anything else is an object row (pickle, opt-in).

    Example:
        >>> cols = encode_row({"tokens": torch.tensor([1, 2, 3]), "text": "hi"})
        >>> cols["tokens"].spec.shape, cols["text"].num_rows
        ((3,), 1)
    """
    if type(fields) is dict:
        # The common small put (a dict of CPU tensors): the same columns as the general path below
        # would make, without its per-value dispatch (it costs more than the encoding itself).
        cols = plain_rows(fields)
        if cols is not None:
            return cols
    batch_size = getattr(fields, "batch_size", None)
    if batch_size is not None and len(batch_size) >= 1:
        if batch_size[0] != 1:
            raise BatchSizeError(
                f"encode_row takes one sample; the TensorDict has batch size {batch_size[0]}"
            )
        return encode_fields(fields, 1, allow_pickle=allow_pickle)
    rows = {}
    for name, value in _field_items(fields):
        if isinstance(value, torch.Tensor):
            check_storable(name, value)  # before indexing it: a sparse tensor cannot even be indexed
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows[name] = value
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            rows[name] = value[None]
        elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor):
            rows[name] = value
        elif hasattr(value, "tolist") and type(value).__name__ in ("NonTensorData", "NonTensorStack"):
            rows[name] = [value.tolist()] if type(value).__name__ == "NonTensorData" else value
        else:
            rows[name] = [value]
    return encode_fields(rows, 1, allow_pickle=allow_pickle)


def _field_items(fields: Mapping[str, Any]) -> list[tuple[str, Any]]:
    if hasattr(fields, "batch_size") and hasattr(fields, "keys") and hasattr(fields, "get"):
        # TensorDict: .get keeps non-tensor entries as NonTensorData / NonTensorStack objects.
        return [(name, fields.get(name)) for name in fields.keys()]
    if not isinstance(fields, Mapping):
        raise TypeError(
            f"fields must be a TensorDict or a mapping name -> column, not {type(fields).__name__}"
        )
    for name in fields:
        if type(name) is not str:
            raise TypeError(f"field names must be str, got {name!r}")
    return list(fields.items())


# -- decode -------------------------------------------------------------------------------------


def decode_fields(
    columns: Mapping[str, Column | DeviceColumn],
    num_rows: int,
    *,
    device: Any = None,
    allow_pickle: bool = False,
) -> TensorDict:
    """Turn columns back into a ``TensorDict`` of batch size ``num_rows`` (runs on the reader).

    Dense columns become ``[B, ...]`` tensors viewing the column buffer (no copy), with exactly the
    stored dtype and values; jagged columns become nested jagged tensors over the buffer; arrow and
    object columns become non-tensor stacks (``td.get(name).tolist()`` gives the Python values).
    ``device`` moves the tensors there (a copy); a ``DeviceColumn`` (a get copied its rows straight
    to a device) is already there. Object columns are unpickled unless the reader
    passes ``allow_pickle=False`` (the writer already had to opt in to create them).

    Raises:
        BatchSizeError: a column does not have ``num_rows`` rows.
        SerializationError: an object column and ``allow_pickle=False``.
    """
    from tensordict import TensorDict

    values = {}
    for name, col in columns.items():
        if col.num_rows != num_rows:
            raise BatchSizeError(f"field {name!r} has {col.num_rows} rows, expected {num_rows}")
        values[name] = col.value() if isinstance(col, DeviceColumn) else decode_value(name, col, allow_pickle)
    td = TensorDict(values, batch_size=[num_rows])
    if device is not None:
        td = td.to(device)
    return td


__all__ = ["decode_fields", "encode_fields", "encode_put", "encode_row", "u8_tensor"]
