"""Checked row gather: rows of several columns, concatenated in request order, with one copy.

The copying is ``dataplane.codec.rows`` (the store's own get path); this module is the checked front for
callers outside the store: it takes any int sequence as indices, checks them and the parts' specs,
and sizes or checks an ``out`` buffer. ``gather_view`` is the zero-copy case (one contiguous run of
one part).

Example:
    >>> import torch
    >>> from dataplane.codec.columns import encode_fields
    >>> col = encode_fields({"x": torch.arange(4)}, 4)["x"]
    >>> gather([(col, [3, 0]), (col, [1])]).num_rows
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dataplane.codec.column_types import Column
from dataplane.codec.rows import assemble, contiguous_view, nbytes_of


def _index(idx: Any, col: Column, part: int) -> np.ndarray:
    rows = np.asarray(idx, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= col.num_rows):
        bad = rows[(rows < 0) | (rows >= col.num_rows)][0]
        raise IndexError(f"gather: row {int(bad)} of part {part} is out of range ({col.num_rows} rows)")
    return rows


def _prepare(parts: Sequence[tuple[Column, Any]], field: str) -> list[tuple[Column, np.ndarray]]:
    if not parts:
        raise ValueError("gather needs at least one part")
    prepared = [(col, _index(idx, col, i)) for i, (col, idx) in enumerate(parts)]
    spec = prepared[0][0].spec
    for col, _ in prepared[1:]:
        spec.check_compatible(col.spec, field)
    return prepared


def gathered_nbytes(parts: Sequence[tuple[Column, Any]]) -> int:
    """Bytes ``gather(parts)`` writes: size an ``out`` buffer (e.g. a shared-memory segment) with it."""
    return sum(nbytes_of(col, _index(idx, col, i)) for i, (col, idx) in enumerate(parts))


def slice_rows(col: Column, start: int, stop: int) -> Column:
    """Rows ``start..stop-1`` of ``col`` as a zero-copy Column (offsets rebased: a small copy)."""
    if not 0 <= start <= stop <= col.num_rows:
        raise IndexError(f"slice_rows: [{start}, {stop}) is out of range for a column of {col.num_rows} rows")
    begin, end = col.row_range(start, stop)
    offsets = None if col.offsets is None else col.offsets[start : stop + 1] - col.offsets[start]
    return Column(col.spec, stop - start, col.data[begin:end], offsets)


def gather_view(parts: Sequence[tuple[Column, Any]]) -> Column | None:
    """A zero-copy Column when the request is one contiguous ascending run of rows of one part, else None.

    Example:
        >>> import torch
        >>> from dataplane.codec.columns import encode_fields
        >>> col = encode_fields({"x": torch.arange(4)}, 4)["x"]
        >>> gather_view([(col, [1, 2])]).num_rows, gather_view([(col, [2, 1])])
        (2, None)
    """
    if len(parts) != 1:
        return None
    col, idx = parts[0]
    idx = _index(idx, col, 0)
    return slice_rows(col, 0, 0) if idx.size == 0 else contiguous_view(col, idx)


def gather(
    parts: Sequence[tuple[Column, Any]], out: memoryview | None = None, *, field: str = "<column>"
) -> Column:
    """Rows ``idx`` of each ``(column, idx)`` part, concatenated in order, with one copy.

    All parts must share one spec. The copy is ``dataplane.codec.rows.assemble``: runs of consecutive
    rows as one slice each, scattered short rows with one vectorised numpy gather.

    Args:
        parts: ``(column, row indices)`` pairs; indices are any int sequence / array.
        out: a writable buffer of at least ``gathered_nbytes(parts)`` bytes to write into (e.g. a
            shared-memory segment); a fresh buffer when None.
        field: the field name, for error messages.

    Returns:
        A Column whose ``data`` is ``out[:nbytes]`` (or the fresh buffer).

    Raises:
        SchemaError: parts with different specs (names the field and both specs).
        IndexError: an index out of range of its part.
        ValueError: ``out`` is too small or read-only.
    """
    prepared = _prepare(parts, field)
    pieces = []
    n = 0
    for col, idx in prepared:
        pieces.append((col, idx, np.arange(n, n + idx.size, dtype=np.int64)))
        n += idx.size
    if out is not None:
        _check_out(out, sum(nbytes_of(col, idx) for col, idx in prepared))
    return assemble(prepared[0][0].spec, n, pieces, out)


def _check_out(out: memoryview, total: int) -> None:
    view = memoryview(out)
    if view.nbytes < total:
        raise ValueError(f"gather: out has {view.nbytes} bytes, {total} are needed")
    if view.readonly:
        raise ValueError("gather: out is read-only")


__all__ = ["gather", "gather_view", "gathered_nbytes", "slice_rows"]
