"""Row assembly: scatter rows of several column pieces into one column with a single copy.

A *piece* is ``(column, src_rows, dst_rows)``: rows ``src_rows`` of ``column`` go to positions
``dst_rows`` of the output. Shards use it to build a reply in request order (zmq path); clients use
it to build a batch from several shards' segments (shared-memory path) and to cut a put into
per-shard parts. Runs of consecutive rows are copied as one slice, so a batch that was written in
order is read back with one ``memcpy`` per run, not per row. A request that is exactly one
contiguous run of one piece can be answered without any copy (``contiguous_view``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeAlias

import numpy as np

from dataplane.codec import buffers as _buffers
from dataplane.codec.column_types import Column, ColumnSpec, itemsize

Piece: TypeAlias = tuple[Column, np.ndarray, np.ndarray]

# Below this many bytes per row, numpy fancy indexing beats a Python loop over runs.
_RUN_LOOP_MIN_ROW_BYTES = 2048


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split (src, dst) into maximal runs where both advance by one: (src starts, dst starts, lengths)."""
    n = len(src)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [n])))
    return src[starts], dst[starts], lens


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def byte_runs(
    spec: ColumnSpec,
    src_offsets: np.ndarray | None,
    src: np.ndarray,
    dst: np.ndarray,
    dst_offsets: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``src`` of a column going to rows ``dst`` of another, as maximal byte runs: (source
    starts, destination starts, lengths). Dense rows have no offsets (``None``); variable rows take
    each side's byte offsets. For copies that pay per call (a device copy per run)."""
    if src_offsets is None or dst_offsets is None:
        s0, d0, n = _runs(src, dst)
        rb = spec.dense_row_nbytes()
        return s0 * rb, d0 * rb, n * rb
    return _variable_runs(src_offsets, dst_offsets, src, dst)


def _variable_runs(
    src_offsets: np.ndarray, dst_offsets: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``byte_runs`` of variable-size rows: each side's byte offsets give where a run starts and ends."""
    s0, d0, n = _runs(src, dst)
    s_begin = src_offsets[s0]
    return s_begin, dst_offsets[d0], src_offsets[s0 + n] - s_begin


class Sized(Protocol):
    """What sizing rows needs of a column: its spec and offsets (a ``Column``, or a ``DeviceColumn``
    whose bytes are on a GPU)."""

    @property
    def spec(self) -> ColumnSpec: ...

    @property
    def offsets(self) -> np.ndarray | None: ...


def row_lengths(col: Sized, rows: np.ndarray) -> np.ndarray:
    """Byte length of each of ``rows`` of ``col``."""
    if col.offsets is None:
        return np.full(len(rows), col.spec.dense_row_nbytes(), dtype=np.int64)
    off = col.offsets
    lengths: np.ndarray = off[rows + 1] - off[rows]
    return lengths


def nbytes_of(col: Sized, rows: np.ndarray) -> int:
    return int(row_lengths(col, rows).sum())


def out_offsets(num_rows: int, pieces: Sequence[tuple[Sized, np.ndarray, np.ndarray]]) -> np.ndarray:
    """The byte offsets of the ``num_rows`` variable-size rows ``pieces`` put together (each piece's
    rows ``src`` landing at rows ``dst``)."""
    lengths = np.zeros(num_rows, dtype=np.int64)
    for col, src, dst in pieces:
        lengths[dst] = row_lengths(col, src)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def assemble(
    spec: ColumnSpec, num_rows: int, pieces: Sequence[Piece], out: memoryview | None = None
) -> Column:
    """One column of ``num_rows`` rows built from ``pieces`` with one copy (into ``out`` if given).

    Every output row must be covered by exactly one piece row (not checked row by row).
    """
    rb = spec.row_nbytes()
    if rb is not None:
        total = rb * num_rows
        dst_buf = _u8(out)[:total] if out is not None else _buffers.take(total)
        for col, src, dst in pieces:
            _copy_dense(_u8(col.data), rb, src, dst, dst_buf)
        return Column(spec=spec, num_rows=num_rows, data=dst_buf.data, offsets=None)
    offsets = out_offsets(num_rows, pieces)
    total = int(offsets[-1])
    dst_buf = _u8(out)[:total] if out is not None else _buffers.take(total)
    for col, src, dst in pieces:
        if len(src):
            _copy_variable(_u8(col.data), col.var_offsets(), offsets, src, dst, dst_buf)
    shapes = None
    if spec.kind == "ragged":
        shapes = np.zeros((num_rows, spec.shape[0]), dtype=np.int64)
        for col, src, dst in pieces:
            shapes[dst] = col.ragged_shapes()[src]
    return Column(spec=spec, num_rows=num_rows, data=dst_buf.data, offsets=offsets, shapes=shapes)


def assemble_any(num_rows: int, pieces: Sequence[Piece]) -> Column:
    """``assemble`` for pieces of one field that may differ in spec (rows of any shape, one dtype).

    Pieces of one spec take ``assemble`` as they are (no extra work on the common path). Tensor
    pieces of different specs (say dense rows of 3 and of 5 tokens) become one column whose kind
    follows the rows asked for: dense when they all have one shape, jagged when they differ only
    in their first dim, ragged otherwise. Every output row is still copied once.
    """
    spec = pieces[0][0].spec
    if all(col.spec == spec for col, _, _ in pieces):
        return assemble(spec, num_rows, pieces)
    ndim, dtype = spec.row_ndim(), spec.dtype
    shapes = np.zeros((num_rows, ndim), dtype=np.int64)
    for col, src, dst in pieces:
        shapes[dst] = col.row_shapes(src)
    same = num_rows == 0 or bool(np.all(shapes == shapes[0]))
    if same:
        out_spec = ColumnSpec("dense", dtype, tuple(int(d) for d in (shapes[0] if num_rows else ())))
    elif ndim >= 1 and bool(np.all(shapes[:, 1:] == shapes[0, 1:])):
        out_spec = ColumnSpec("jagged", dtype, tuple(int(d) for d in shapes[0, 1:]))
    else:
        out_spec = ColumnSpec("ragged", dtype, (ndim,))
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.prod(shapes, axis=1) * itemsize(dtype), out=offsets[1:])
    dst_buf = _buffers.take(int(offsets[-1]))
    for col, src, dst in pieces:
        if len(src):
            _copy_variable(_u8(col.data), _byte_offsets(col), offsets, src, dst, dst_buf)
    data = dst_buf.data
    if out_spec.kind == "dense":
        return Column(spec=out_spec, num_rows=num_rows, data=data)
    return Column(
        spec=out_spec,
        num_rows=num_rows,
        data=data,
        offsets=offsets,
        shapes=shapes if out_spec.kind == "ragged" else None,
    )


def _byte_offsets(col: Column) -> np.ndarray:
    """``col``'s row byte offsets; dense rows have implicit ones, made here."""
    if col.offsets is not None:
        return col.offsets
    return np.arange(col.num_rows + 1, dtype=np.int64) * col.spec.dense_row_nbytes()


# Below this average run length (bytes) variable rows are copied by one vectorised take, above it
# by one slice copy per run: a Python-level slice copy has a fixed cost per run, a take a cost per
# byte (its int64 index included); the measured break-even (bench/RESULTS.md) is a little below this.
_RUN_LOOP_MIN_BYTES = 256


def _copy_variable(
    data: np.ndarray,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    out: np.ndarray,
) -> None:
    """Copy variable-size rows ``src`` (byte offsets ``src_off``) to rows ``dst`` of ``out`` (``dst_off``)."""
    s_begin, d_begin, run_len = _variable_runs(src_off, dst_off, src, dst)
    total = int(run_len.sum())
    if total == 0:
        return
    if total >= _RUN_LOOP_MIN_BYTES * len(run_len):
        for sb, db, k in zip(s_begin.tolist(), d_begin.tolist(), run_len.tolist(), strict=True):
            out[db : db + k] = data[sb : sb + k]
        return
    # Many short runs: one vectorised take per chunk of runs. The byte index arrays cost 8 bytes
    # per byte moved, so chunks keep them to a few MiB however large the get is.
    in_order = len(run_len) == 1 or bool(np.all(d_begin[1:] == d_begin[:-1] + run_len[:-1]))
    run_end = np.cumsum(run_len)
    cuts = np.searchsorted(run_end, np.arange(_TAKE_CHUNK_BYTES, total, _TAKE_CHUNK_BYTES), side="right")
    for r0, r1 in itertools.pairwise([0, *np.unique(cuts).tolist(), len(run_len)]):
        if r1 > r0:
            _take_runs(data, s_begin[r0:r1], d_begin[r0:r1], run_len[r0:r1], out, in_order)


_TAKE_CHUNK_BYTES = 4 << 20


def _take_runs(
    data: np.ndarray,
    s_begin: np.ndarray,
    d_begin: np.ndarray,
    run_len: np.ndarray,
    out: np.ndarray,
    in_order: bool,
) -> None:
    # Byte i of the runs laid end to end comes from s_begin[r] + (i - start of run r).
    total = int(run_len.sum())
    run_start = np.cumsum(run_len) - run_len
    within = np.arange(total, dtype=np.int64)
    src_pos = np.repeat(s_begin - run_start, run_len) + within
    if in_order:
        base = int(d_begin[0])  # the runs land back to back (e.g. a gather in request order)
        np.take(data, src_pos, out=out[base : base + total])
    else:
        out[np.repeat(d_begin - run_start, run_len) + within] = data[src_pos]


_PARALLEL_MIN_BYTES = 8 << 20
_helper: ThreadPoolExecutor | None = None


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src; a large copy is split with one helper thread (numpy drops the GIL while copying,
    and the page faults of a fresh destination then run on two cores)."""
    global _helper
    n = len(dst)
    if n < _PARALLEL_MIN_BYTES:
        dst[:] = src
        return
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="dataplane-copy")
    half = (n // 2) & ~4095
    job = _helper.submit(dst[:half].__setitem__, slice(None), src[:half])
    dst[half:] = src[half:]
    job.result()


def _copy_dense(data: np.ndarray, rb: int, src: np.ndarray, dst: np.ndarray, out: np.ndarray) -> None:
    if len(src) == 0 or rb == 0:
        return
    if rb < _RUN_LOOP_MIN_ROW_BYTES:
        # Count the runs before building them: a random permutation has one run per row, and
        # listing a million runs costs more than the copy itself.
        dst_step = np.diff(dst) == 1
        runs = len(src) - int(np.count_nonzero((np.diff(src) == 1) & dst_step))
        if runs * 8 > len(src):
            _take_rows(data, rb, src, dst, out, in_order=bool(dst_step.all()))
            return
    s0, d0, n = _runs(src, dst)
    for a, b, k in zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True):
        _copy(out[b * rb : (b + k) * rb], data[a * rb : (a + k) * rb])


def _take_rows(
    data: np.ndarray, rb: int, src: np.ndarray, dst: np.ndarray, out: np.ndarray, in_order: bool
) -> None:
    # Many short runs: move whole rows as fixed-size void elements (one memcpy each, in C), which
    # is several times faster than indexing a [rows, row_bytes] uint8 array.
    row = np.dtype((np.void, rb))
    rows = data[: (int(src.max()) + 1) * rb].view(row)
    out_rows = out.view(row)
    if in_order:
        first = int(dst[0])
        np.take(rows, src, out=out_rows[first : first + len(dst)])  # no temporary
    else:
        out_rows[dst] = rows[src]


def contiguous_view(col: Column, src: np.ndarray) -> Column | None:
    """A zero-copy column of rows ``src`` of ``col`` when they are one increasing run, else None."""
    n = len(src)
    if n == 0 or int(src[-1]) - int(src[0]) != n - 1 or (n > 1 and not bool(np.all(np.diff(src) == 1))):
        return None
    a = int(src[0])
    if col.offsets is None:
        rb = col.spec.dense_row_nbytes()
        return Column(spec=col.spec, num_rows=n, data=col.data[a * rb : (a + n) * rb], offsets=None)
    lo, hi = int(col.offsets[a]), int(col.offsets[a + n])
    shapes = None if col.shapes is None else col.shapes[a : a + n]
    offsets = col.offsets[a : a + n + 1] - lo
    return Column(spec=col.spec, num_rows=n, data=col.data[lo:hi], offsets=offsets, shapes=shapes)


__all__ = [
    "Piece",
    "assemble",
    "assemble_any",
    "byte_runs",
    "contiguous_view",
    "nbytes_of",
    "out_offsets",
    "row_lengths",
    "Sized",
]
