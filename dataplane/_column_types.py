"""Column types: ``ColumnSpec`` (how to read a column's bytes) and ``Column`` (the bytes).

See ``dataplane._columns`` for the codec that produces and reads them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from dataplane.errors import SchemaError

KINDS = ("dense", "jagged", "arrow", "object")


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
        return torch_dtype(self.dtype).itemsize * math.prod(self.shape)

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


def _spec_str(spec: ColumnSpec) -> str:
    return f"(kind={spec.kind}, dtype={spec.dtype}, shape={tuple(spec.shape)})"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32", "bfloat16", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dtype


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

    def row_range(self, start: int, stop: int) -> tuple[int, int]:
        """Byte range ``[begin, end)`` in ``data`` of rows ``start..stop-1``."""
        if self.offsets is None:
            r = self.spec.row_nbytes()
            return start * r, stop * r
        return int(self.offsets[start]), int(self.offsets[stop])


def u8_tensor(data: memoryview) -> torch.Tensor:
    """A 1-D uint8 tensor viewing ``data`` (no copy; also for empty and read-only buffers)."""
    if memoryview(data).nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # A read-only buffer (zmq frame, read-only mapping) is fine: we never write through it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


__all__ = ["KINDS", "Column", "ColumnSpec", "torch_dtype", "u8_tensor"]
