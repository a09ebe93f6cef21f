"""Column types: ``ColumnSpec`` (how to read a column's bytes) and ``Column`` (the bytes).

One definition serves both sides: the codec (``dataplane.codec.columns``, which imports torch) builds and
reads them, and the parts that only move bytes (shards, index, wire, row assembly) carry them. This
module therefore never imports torch at module level: a shard process stays small and starts fast,
and it cannot interpret (let alone unpickle) the bytes it holds. Dense row sizes come from an
itemsize table; only a dtype name the table does not know asks torch (client side only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import msgspec
import numpy as np

from dataplane.errors import SchemaError, SchemaMismatchError

if TYPE_CHECKING:
    import torch

KINDS = ("dense", "jagged", "ragged", "arrow", "json", "object")
TENSOR_KINDS = ("dense", "jagged", "ragged")  # one field may mix them: shape belongs to the row
MAX_DIMS = 32
MAX_ROW_BYTES = 1 << 48  # a row (or jagged element) larger than this is a lie, not data
_ARROW_DTYPES = ("large_string", "large_binary")
_KIND_DTYPE = {"json": "msgpack", "object": "pickle"}  # kinds with one fixed dtype name

# What every segment of one field shares (``ColumnSpec.family``); a list on the wire.
Family: TypeAlias = tuple[str, str, int] | tuple[str, str]

# Bytes per element of the torch dtype names the codec writes.
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "int16": 2, "uint16": 2,
    "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}  # fmt: skip


def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named ``dtype`` ("float32" -> 4), without importing torch."""
    size = _ITEMSIZE.get(dtype)
    if size is None:  # a dtype name this table does not know yet: ask torch (client side only)
        size = torch_dtype(dtype).itemsize
    return size


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32", "bfloat16", ...); imports torch on first use."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


class ColumnSpec(msgspec.Struct, frozen=True):
    """How to read a column's bytes: kind, element type and shape information.

    ``shape`` by kind: *dense*, every row's shape; *jagged*, the dims after the first (rows differ
    in their first dim: lengths come from the offsets); *ragged*, ``(ndim,)`` (rows differ in any
    dim: each row's shape is in ``Column.shapes``); other kinds, ``()``.

    A field's *schema* is its ``family()``: kind group and dtype (and, for tensors, the number of
    dims per row). Segments of one field may have different specs of one family: a dense batch of
    3-token rows and another of 5-token rows are one int64 field with 1-dim rows.

    Example:
        >>> ColumnSpec("dense", "bfloat16", (4,)).row_nbytes()
        8
        >>> ColumnSpec("dense", "int64", (3,)).family() == ColumnSpec("jagged", "int64", ()).family()
        True
    """

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    def row_nbytes(self) -> int | None:
        """Bytes per row for fixed-size rows (dense), else ``None``."""
        if self.kind != "dense":
            return None
        return itemsize(self.dtype) * math.prod(self.shape)

    def dense_row_nbytes(self) -> int:
        """``row_nbytes`` of a dense spec (a column without offsets); ``ValueError`` for other kinds."""
        size = self.row_nbytes()
        if size is None:
            raise ValueError(f"{self.kind} rows have no fixed size")
        return size

    def row_ndim(self) -> int:
        """Dims of one row (tensor kinds)."""
        if self.kind == "jagged":
            return 1 + len(self.shape)
        if self.kind == "ragged":
            return self.shape[0]
        return len(self.shape)

    def family(self) -> Family:
        """What every segment of one field shares: ``("tensor", dtype, row ndim)`` or ``(kind, dtype)``."""
        if self.kind in TENSOR_KINDS:
            return ("tensor", self.dtype, self.row_ndim())
        return (self.kind, self.dtype)

    def check(self, field: str) -> None:
        """Raise ``SchemaError`` naming ``field`` unless this spec is one the codec can write.

        Peers declare specs on the wire; a shard checks them before storing anything, so a spec
        it cannot size (unknown dtype, negative or absurd shape) never reaches its memory.
        """
        if self in _CHECKED:  # every put checks its specs, most of them seen many times before
            return
        self._check(field)
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED.add(self)

    def _check(self, field: str) -> None:
        kind, dtype, shape = self.kind, self.dtype, self.shape
        if kind not in KINDS:
            raise SchemaError(field, f"field {field!r}: unknown column kind {kind!r}; known: {KINDS}")
        if len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
            raise SchemaError(field, f"field {field!r}: invalid row shape {tuple(shape)}")
        if kind in TENSOR_KINDS:
            if dtype not in _ITEMSIZE:
                raise SchemaError(field, f"field {field!r}: dtype {dtype!r} cannot be stored")
            if kind == "ragged":
                if len(shape) != 1 or not 1 <= shape[0] <= MAX_DIMS:
                    raise SchemaError(field, f"field {field!r}: ragged columns declare (ndim,), got {shape}")
                return
            if self.row_bytes() > MAX_ROW_BYTES:
                raise SchemaError(field, f"field {field!r}: rows of shape {tuple(shape)} are too large")
            if kind == "jagged" and self.row_bytes() == 0:
                raise SchemaError(field, f"field {field!r}: jagged rows with an empty trailing shape {shape}")
            return
        if shape:
            raise SchemaError(field, f"field {field!r}: {kind} columns have no row shape, got {tuple(shape)}")
        if kind == "arrow":
            if dtype not in _ARROW_DTYPES and not (dtype.startswith("large_list<") and dtype.endswith(">")):
                raise SchemaError(field, f"field {field!r}: unknown arrow type {dtype!r}")
        elif dtype != _KIND_DTYPE[kind]:
            raise SchemaError(field, f"field {field!r}: {kind} columns have dtype {_KIND_DTYPE[kind]!r}")

    def row_bytes(self) -> int:
        """Bytes of one step along a variable row: a dense row, one jagged element row, one ragged item."""
        if self.kind == "ragged":
            return itemsize(self.dtype)
        return itemsize(self.dtype) * math.prod(self.shape)

    def check_compatible(self, other: ColumnSpec, field: str) -> None:
        """Raise ``SchemaError`` naming ``field`` unless ``other`` can join this column.

        Rows may have any shape; the kind group, the dtype and (tensors) the number of dims per row
        must be those of the column.
        """
        if other == self:
            return
        if self.family() != other.family():
            raise SchemaMismatchError(
                field,
                ":".join(map(str, self.family())),
                f"field {field!r}: new data ({describe_family(other.family())}) does not match the stored "
                f"column ({describe_family(self.family())}); write it with the stored dtype, or use a new "
                "field name",
            )


# Specs that passed ``ColumnSpec.check`` (whether a spec passes depends on its values only; the field
# name is only for the message): a set of frozen structs, emptied when full (a safe, bounded cache).
_CHECKED: set[ColumnSpec] = set()
_CHECKED_MAX = 4096


def describe_family(family: Sequence[str | int]) -> str:
    """``("tensor", "float32", 1)`` -> "float32 tensors with 1 dim per row"."""
    if family[0] == "tensor":
        return f"{family[1]} tensors with {family[2]} dim{'s' if family[2] != 1 else ''} per row"
    return {
        "arrow": f"arrow {family[1]} values",
        "json": "JSON-like values",
        "object": "pickled objects",
    }.get(str(family[0]), str(tuple(family)))


def check_offsets(off: np.ndarray | None, n: int, size: int, spec: ColumnSpec, field: str) -> None:
    """Raise ``SchemaError`` unless ``off`` are valid byte offsets of ``n`` variable-size rows in
    ``size`` bytes: ``n + 1`` int64 values rising from 0 to ``size`` (tensors: on element boundaries)."""
    if off is None or off.dtype != np.int64 or off.ndim != 1 or len(off) != n + 1:
        got = None if off is None else off.shape
        raise SchemaError(field, f"field {field!r}: {n} rows need {n + 1} int64 offsets, got {got}")
    if off[0] != 0 or off[-1] != size or (n > 1 and bool(np.any(np.diff(off) < 0))):
        raise SchemaError(field, f"field {field!r}: offsets must rise from 0 to the data length {size}")
    if spec.kind in ("jagged", "ragged") and bool(np.any(off % spec.row_bytes())):
        raise SchemaError(field, f"field {field!r}: {spec.kind} offsets off element boundaries")


def check_shapes(shapes: np.ndarray | None, off: np.ndarray, spec: ColumnSpec, field: str) -> None:
    """Raise ``SchemaError`` unless ``shapes`` are the ragged rows' shapes: int64 ``[n, ndim]``, each
    row's elements filling exactly its bytes (``off`` already checked)."""
    n, ndim = len(off) - 1, spec.shape[0]
    if shapes is None or shapes.dtype != np.int64 or shapes.shape != (n, ndim):
        got = None if shapes is None else shapes.shape
        raise SchemaError(
            field, f"field {field!r}: {n} ragged rows need int64 shapes ({n}, {ndim}), got {got}"
        )
    if n and (bool(np.any(shapes < 0)) or bool(np.any(shapes > MAX_ROW_BYTES))):
        raise SchemaError(field, f"field {field!r}: ragged row shapes out of range")
    if n and not np.array_equal(np.prod(shapes, axis=1) * spec.row_bytes(), np.diff(off)):
        raise SchemaError(field, f"field {field!r}: ragged row shapes do not match their bytes")


@dataclass(eq=False)  # offsets is an ndarray: == would be ambiguous
class Column:
    """One field of ``num_rows`` rows in buffer form.

    Attributes:
        spec: how to read the bytes.
        num_rows: number of rows.
        data: 1-D uint8 memoryview of every row's bytes back to back (C order). When encoded from a
            contiguous CPU tensor it is a zero-copy view of that tensor.
        offsets: int64 ``[num_rows + 1]`` byte offsets into ``data`` for variable-size rows (jagged,
            ragged, arrow, json, object), starting at 0; ``None`` for dense rows.
        shapes: int64 ``[num_rows, ndim]``, each row's shape, for ragged rows only.
    """

    spec: ColumnSpec
    num_rows: int
    data: memoryview
    offsets: np.ndarray | None = None
    shapes: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of row data (offsets not counted)."""
        return self.data.nbytes

    def check(self, field: str) -> None:
        """Raise ``SchemaError`` naming ``field`` unless the buffers hold exactly ``num_rows`` rows.

        Dense: ``num_rows * row bytes`` bytes and no offsets. Variable-size kinds: ``num_rows + 1``
        offsets from 0, never decreasing, ending at the data length (jagged: on element boundaries).
        Cost: O(num_rows) on the offsets, nothing per byte.
        """
        self.spec.check(field)
        n, size = self.num_rows, memoryview(self.data).nbytes
        if type(n) is not int or n < 0:
            raise SchemaError(field, f"field {field!r}: invalid row count {n!r}")
        rb = self.spec.row_nbytes()
        if rb is not None:
            if self.offsets is not None or size != n * rb:
                raise SchemaError(
                    field, f"field {field!r}: {n} rows of {rb} bytes need {n * rb} bytes of data, got {size}"
                )
            return
        check_offsets(self.offsets, n, size, self.spec, field)
        if self.spec.kind == "ragged":
            check_shapes(self.shapes, self.var_offsets(), self.spec, field)
        elif self.shapes is not None:
            raise SchemaError(field, f"field {field!r}: only ragged columns carry row shapes")

    def var_offsets(self) -> np.ndarray:
        """``offsets`` of a column of variable-size rows (every kind but dense has them)."""
        if self.offsets is None:
            raise ValueError(f"a {self.spec.kind} column without offsets")
        return self.offsets

    def ragged_shapes(self) -> np.ndarray:
        """``shapes`` of a ragged column (the one kind that has them)."""
        if self.shapes is None:
            raise ValueError(f"a {self.spec.kind} column without row shapes")
        return self.shapes

    def row_shapes(self, rows: np.ndarray) -> np.ndarray:
        """Shapes of ``rows`` (tensor kinds) as int64 ``[len(rows), ndim]``."""
        spec = self.spec
        if spec.kind == "dense":
            return np.broadcast_to(np.asarray(spec.shape, dtype=np.int64), (len(rows), len(spec.shape)))
        shapes: np.ndarray
        if spec.kind == "ragged":
            shapes = self.ragged_shapes()[rows]
            return shapes
        offsets = self.var_offsets()
        lengths = (offsets[rows + 1] - offsets[rows]) // spec.row_bytes()
        trailing = np.broadcast_to(np.asarray(spec.shape, dtype=np.int64), (len(rows), len(spec.shape)))
        return np.column_stack([lengths, trailing]) if len(spec.shape) else lengths[:, None]

    def row_range(self, start: int, stop: int) -> tuple[int, int]:
        """Byte range ``[begin, end)`` in ``data`` of rows ``start..stop-1``."""
        if self.offsets is None:
            r = self.spec.dense_row_nbytes()
            return start * r, stop * r
        return int(self.offsets[start]), int(self.offsets[stop])


__all__ = [
    "KINDS",
    "MAX_DIMS",
    "TENSOR_KINDS",
    "Column",
    "check_offsets",
    "check_shapes",
    "describe_family",
    "Family",
    "ColumnSpec",
    "itemsize",
    "torch_dtype",
]
