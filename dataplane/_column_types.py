"""Column types: ``ColumnSpec`` (how to read a column's bytes) and ``Column`` (the bytes).

One definition serves both sides: the codec (``dataplane._columns``, which imports torch) builds and
reads them, and the parts that only move bytes (shards, index, wire, row assembly) carry them. This
module therefore never imports torch at module level: a shard process stays small and starts fast,
and it cannot interpret (let alone unpickle) the bytes it holds. Dense row sizes come from an
itemsize table; only a dtype name the table does not know asks torch (client side only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from dataplane.errors import SchemaError

if TYPE_CHECKING:
    import torch

KINDS = ("dense", "jagged", "arrow", "json", "object")
MAX_DIMS = 32
MAX_ROW_BYTES = 1 << 48  # a row (or jagged element) larger than this is a lie, not data
_ARROW_DTYPES = ("large_string", "large_binary")
_KIND_DTYPE = {"json": "msgpack", "object": "pickle"}  # kinds with one fixed dtype name

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
    """How to read a column's bytes: kind, element type and per-row (dense) or trailing (jagged) shape.

    Example:
        >>> ColumnSpec("dense", "bfloat16", (4,)).row_nbytes()
        8
    """

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    def row_nbytes(self) -> int | None:
        """Bytes per row for fixed-size rows (dense), else ``None``."""
        if self.kind != "dense":
            return None
        return itemsize(self.dtype) * math.prod(self.shape)

    def check(self, field: str) -> None:
        """Raise ``SchemaError`` naming ``field`` unless this spec is one the codec can write.

        Peers declare specs on the wire; a shard checks them before storing anything, so a spec
        it cannot size (unknown dtype, negative or absurd shape) never reaches its memory.
        """
        kind, dtype, shape = self.kind, self.dtype, self.shape
        if kind not in KINDS:
            raise SchemaError(field, f"field {field!r}: unknown column kind {kind!r}; known: {KINDS}")
        if len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
            raise SchemaError(field, f"field {field!r}: invalid row shape {tuple(shape)}")
        if kind in ("dense", "jagged"):
            if dtype not in _ITEMSIZE:
                raise SchemaError(field, f"field {field!r}: dtype {dtype!r} cannot be stored")
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
        """Bytes of one element row: a dense row, or one step along a jagged row's first dim."""
        return itemsize(self.dtype) * math.prod(self.shape)

    def check_compatible(self, other: ColumnSpec, field: str) -> None:
        """Raise ``SchemaError`` naming ``field`` and both specs unless ``other`` can join this column.

        Kind, dtype and shape (dense: per-row shape; jagged: trailing shape) must all be equal.
        """
        if self != other:
            raise SchemaError(
                field,
                f"field {field!r}: new data {_spec_str(other)} does not match the stored column "
                f"{_spec_str(self)}; write it with the stored dtype and shape, or use a new field name",
            )


def check_offsets(off: np.ndarray | None, n: int, size: int, spec: ColumnSpec, field: str) -> None:
    """Raise ``SchemaError`` unless ``off`` are valid byte offsets of ``n`` variable-size rows in
    ``size`` bytes: ``n + 1`` int64 values rising from 0 to ``size`` (jagged: on element boundaries)."""
    if off is None or off.dtype != np.int64 or off.ndim != 1 or len(off) != n + 1:
        got = None if off is None else off.shape
        raise SchemaError(field, f"field {field!r}: {n} rows need {n + 1} int64 offsets, got {got}")
    if off[0] != 0 or off[-1] != size or (n > 1 and bool(np.any(np.diff(off) < 0))):
        raise SchemaError(field, f"field {field!r}: offsets must rise from 0 to the data length {size}")
    if spec.kind == "jagged" and bool(np.any(off % spec.row_bytes())):
        raise SchemaError(field, f"field {field!r}: jagged offsets off element boundaries")


def _spec_str(spec: ColumnSpec) -> str:
    return f"(kind={spec.kind}, dtype={spec.dtype}, shape={tuple(spec.shape)})"


@dataclass(eq=False)  # offsets is an ndarray: == would be ambiguous
class Column:
    """One field of ``num_rows`` rows in buffer form.

    Attributes:
        spec: how to read the bytes.
        num_rows: number of rows.
        data: 1-D uint8 memoryview of every row's bytes back to back (C order). When encoded from a
            contiguous CPU tensor it is a zero-copy view of that tensor.
        offsets: int64 ``[num_rows + 1]`` byte offsets into ``data`` for variable-size rows (jagged,
            arrow, object), starting at 0; ``None`` for dense rows.
    """

    spec: ColumnSpec
    num_rows: int
    data: memoryview
    offsets: np.ndarray | None = None

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

    def row_range(self, start: int, stop: int) -> tuple[int, int]:
        """Byte range ``[begin, end)`` in ``data`` of rows ``start..stop-1``."""
        if self.offsets is None:
            r = self.spec.row_nbytes()
            return start * r, stop * r
        return int(self.offsets[start]), int(self.offsets[stop])


__all__ = ["KINDS", "MAX_DIMS", "Column", "check_offsets", "ColumnSpec", "itemsize", "torch_dtype"]
