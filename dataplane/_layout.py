"""Torch-free column layout for the parts that only move bytes (shards, index, wire, row assembly).

``Layout`` carries the same three fields as the codec's ``ColumnSpec`` (kind, dtype, shape) and
``Block`` the same four as its ``Column`` (spec, num_rows, data, offsets), so the codec reads a
``Block`` as it reads a ``Column``. Shards never import torch: a shard process stays small
and starts fast, and it cannot interpret (let alone unpickle) the bytes it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from dataplane.errors import SchemaError

# Bytes per element of the torch dtype names the codec writes.
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 2,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}  # fmt: skip


def itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:  # a dtype name this table does not know yet: ask torch (client side only)
        from dataplane._column_types import torch_dtype

        size = torch_dtype(dtype).itemsize
    return size


class Layout(msgspec.Struct, frozen=True):
    """How to read a column's bytes (mirrors the codec's ``ColumnSpec``)."""

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    def row_nbytes(self) -> int | None:
        if self.kind != "dense":
            return None
        return itemsize(self.dtype) * math.prod(self.shape)

    def check_compatible(self, other: Any, field: str) -> None:
        if (self.kind, self.dtype, tuple(self.shape)) != (other.kind, other.dtype, tuple(other.shape)):
            raise SchemaError(
                field,
                f"field {field!r}: new data {_describe(other)} does not match the stored column "
                f"{_describe(self)}; write it with the stored dtype and shape, or use a new field name",
            )


def _describe(spec: Any) -> str:
    return f"(kind={spec.kind}, dtype={spec.dtype}, shape={tuple(spec.shape)})"


@dataclass
class Block:
    """Rows of one column as bytes (mirrors the codec's ``Column``)."""

    spec: Any
    num_rows: int
    data: memoryview
    offsets: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data) + (0 if self.offsets is None else self.offsets.nbytes)


__all__ = ["Block", "Layout", "itemsize"]
