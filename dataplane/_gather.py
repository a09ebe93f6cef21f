"""Kind-agnostic row gather: rows of several columns into one buffer with one copy.

Shards use it to answer a get over the wire; same-node clients use it to read shared-memory
segments directly. ``gather_view`` is the zero-copy case (one contiguous run of one part).

Example:
    >>> import torch
    >>> from dataplane._columns import encode_fields
    >>> col = encode_fields({"x": torch.arange(4)}, 4)["x"]
    >>> gather([(col, [3, 0]), (col, [1])]).num_rows
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dataplane._column_types import Column, u8_tensor


def _index(idx: Any, col: Column, part: int) -> np.ndarray:
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= col.num_rows):
        bad = idx[(idx < 0) | (idx >= col.num_rows)][0]
        raise IndexError(f"gather: row {int(bad)} of part {part} is out of range ({col.num_rows} rows)")
    return idx


def _run(idx: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` when ``idx`` is one ascending contiguous run, else None."""
    if idx.size == 0:
        return 0, 0
    start, stop = int(idx[0]), int(idx[-1]) + 1
    if stop - start == idx.size and (idx.size < 2 or bool(np.all(np.diff(idx) == 1))):
        return start, stop
    return None


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
    total = 0
    for i, (col, idx) in enumerate(parts):
        idx = _index(idx, col, i)
        if col.offsets is None:
            total += idx.size * col.spec.row_nbytes()
        else:
            total += int((col.offsets[idx + 1] - col.offsets[idx]).sum())
    return total


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
        >>> from dataplane._columns import encode_fields
        >>> col = encode_fields({"x": torch.arange(4)}, 4)["x"]
        >>> gather_view([(col, [1, 2])]).num_rows, gather_view([(col, [2, 1])])
        (2, None)
    """
    if len(parts) != 1:
        return None
    col, idx = parts[0]
    run = _run(_index(idx, col, 0))
    return None if run is None else slice_rows(col, *run)


def gather(
    parts: Sequence[tuple[Column, Any]], out: memoryview | None = None, *, field: str = "<column>"
) -> Column:
    """Rows ``idx`` of each ``(column, idx)`` part, concatenated in order, with one copy.

    All parts must share one spec. Dense rows are copied as whole row blocks (slicing for runs,
    ``index_select`` otherwise); variable-size rows as byte ranges, consecutive rows merged into one
    range, many small ranges with one vectorised numpy ``take``.

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
        ValueError: ``out`` is too small.
    """
    prepared = _prepare(parts, field)
    spec = prepared[0][0].spec
    n = sum(idx.size for _, idx in prepared)
    total = gathered_nbytes(prepared)
    dst = _out_array(out, total)
    if spec.kind == "dense":
        _gather_dense(prepared, dst, spec.row_nbytes())
        offsets = None
    else:
        offsets = _gather_variable(prepared, dst)
    return Column(spec, n, memoryview(dst), offsets)


def _out_array(out: memoryview | None, total: int) -> np.ndarray:
    if out is None:
        return np.empty(total, dtype=np.uint8)
    arr = np.frombuffer(out, dtype=np.uint8) if memoryview(out).nbytes else np.empty(0, np.uint8)
    if arr.size < total:
        raise ValueError(f"gather: out has {arr.size} bytes, {total} are needed")
    if not arr.flags.writeable:
        raise ValueError("gather: out is read-only")
    return arr[:total]


def _word(row_bytes: int, *ptrs: int) -> torch.dtype:
    """Widest element type that divides the row and aligns every pointer: index_select moves words."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and all(p % size == 0 for p in ptrs):
            return dtype
    return torch.uint8


def _gather_dense(parts: list[tuple[Column, np.ndarray]], dst: np.ndarray, row_bytes: int) -> None:
    if row_bytes == 0 or dst.size == 0:
        return
    out = torch.from_numpy(dst)
    pos = 0
    for col, idx in parts:
        k = idx.size
        if k == 0:
            continue
        src = u8_tensor(col.data)
        word = _word(row_bytes, src.data_ptr(), out.data_ptr())
        width = row_bytes // word.itemsize
        src_rows = src.view(word).view(col.num_rows, width)
        dst_rows = out[pos * row_bytes : (pos + k) * row_bytes].view(word).view(k, width)
        run = _run(idx)
        if run is not None:
            dst_rows.copy_(src_rows[run[0] : run[1]])
        else:
            torch.index_select(src_rows, 0, torch.from_numpy(idx), out=dst_rows)
        pos += k


# Below this average run length (bytes) variable rows are copied by one vectorised take, above it
# by one slice copy per run. Measured on the 2-core CI machine: a Python-level slice copy costs
# ~2 us per run, a take ~16 ns per byte (its int64 index included): break-even near 150 bytes.
_RUN_LOOP_MIN_BYTES = 256


def _gather_variable(parts: list[tuple[Column, np.ndarray]], dst: np.ndarray) -> np.ndarray:
    lengths = [col.offsets[idx + 1] - col.offsets[idx] for col, idx in parts]
    offsets = np.zeros(sum(x.size for x in lengths) + 1, dtype=np.int64)
    if offsets.size > 1:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    row = 0
    for col, idx in parts:
        if idx.size:
            src = np.frombuffer(col.data, dtype=np.uint8) if col.data.nbytes else np.empty(0, np.uint8)
            _copy_ranges(src, col.offsets, idx, dst, offsets[row : row + idx.size + 1])
        row += idx.size
    return offsets


def _copy_ranges(src: np.ndarray, src_off: np.ndarray, idx: np.ndarray, dst: np.ndarray, dst_off) -> None:
    # Merge consecutive rows (idx[i+1] == idx[i] + 1) into runs: one byte range per run.
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks, [idx.size])) - 1
    s_begin = src_off[idx[first]]
    s_end = src_off[idx[last] + 1]
    d_begin = dst_off[first]
    run_len = s_end - s_begin
    total = int(run_len.sum())
    if total == 0:
        return
    if total >= _RUN_LOOP_MIN_BYTES * first.size:
        for sb, se, db in zip(s_begin.tolist(), s_end.tolist(), d_begin.tolist(), strict=True):
            dst[db : db + (se - sb)] = src[sb:se]
        return
    # Vectorised: byte i of run r comes from s_begin[r] + (i - d_start_of_run_r).
    base = int(dst_off[0])
    shift = np.repeat(s_begin - (d_begin - base), run_len)
    np.take(src, shift + np.arange(total, dtype=np.int64), out=dst[base : base + total])


__all__ = ["gather", "gather_view", "gathered_nbytes", "slice_rows"]
