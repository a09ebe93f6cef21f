"""Row assembly: scatter rows of several column pieces into one column with a single copy.

A *piece* is ``(column, src_rows, dst_rows)``: rows ``src_rows`` of ``column`` go to positions
``dst_rows`` of the output. Shards use it to build a reply in request order (zmq path); clients use
it to build a batch from several shards' segments (shared-memory path) and to cut a put into
per-shard parts. Runs of consecutive rows are copied as one slice, so a batch that was written in
order is read back with one ``memcpy`` per run, not per row. A request that is exactly one
contiguous run of one piece can be answered without any copy (``contiguous_view``).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from dataplane._layout import Block

Piece = tuple[Any, np.ndarray, np.ndarray]

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


_HUGE_MIN_BYTES = 2 << 20


def alloc(nbytes: int) -> np.ndarray:
    """A fresh uint8 buffer; large ones ask for transparent huge pages, so filling them costs
    one page fault per 2 MiB instead of per 4 KiB (the fault cost, not the copy, dominates)."""
    if nbytes < _HUGE_MIN_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP on this kernel: plain pages
        pass
    return np.frombuffer(m, dtype=np.uint8)


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def row_lengths(col: Any, rows: np.ndarray) -> np.ndarray:
    """Byte length of each of ``rows`` of ``col``."""
    if col.offsets is None:
        return np.full(len(rows), col.spec.row_nbytes(), dtype=np.int64)
    off = col.offsets
    return off[rows + 1] - off[rows]


def nbytes_of(col: Any, rows: np.ndarray) -> int:
    return int(row_lengths(col, rows).sum())


def assemble(spec: Any, num_rows: int, pieces: Sequence[Piece], out: memoryview | None = None) -> Any:
    """One column of ``num_rows`` rows built from ``pieces`` with one copy (into ``out`` if given).

    Every output row must be covered by exactly one piece row (not checked row by row).
    """
    if spec.row_nbytes() is not None:
        rb = spec.row_nbytes()
        total = rb * num_rows
        dst_buf = _u8(out)[:total] if out is not None else alloc(total)
        for col, src, dst in pieces:
            _copy_dense(_u8(col.data), rb, src, dst, dst_buf)
        return Block(spec=spec, num_rows=num_rows, data=memoryview(dst_buf), offsets=None)
    lens = np.zeros(num_rows, dtype=np.int64)
    for col, src, dst in pieces:
        lens[dst] = row_lengths(col, src)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    dst_buf = _u8(out)[:total] if out is not None else alloc(total)
    for col, src, dst in pieces:
        s0, d0, n = _runs(src, dst)
        data = _u8(col.data)
        for a, b, k in zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True):
            lo, hi = int(col.offsets[a]), int(col.offsets[a + k])
            start = int(offsets[b])
            dst_buf[start : start + hi - lo] = data[lo:hi]
    return Block(spec=spec, num_rows=num_rows, data=memoryview(dst_buf), offsets=offsets)


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
    s0, d0, n = _runs(src, dst)
    if rb >= _RUN_LOOP_MIN_ROW_BYTES or len(n) * 8 <= len(src):
        for a, b, k in zip(s0.tolist(), d0.tolist(), n.tolist(), strict=True):
            _copy(out[b * rb : (b + k) * rb], data[a * rb : (a + k) * rb])
        return
    rows = data[: (int(src.max()) + 1) * rb].reshape(-1, rb)
    out.reshape(-1, rb)[dst] = rows[src]


def contiguous_view(col: Any, src: np.ndarray) -> Any | None:
    """A zero-copy column of rows ``src`` of ``col`` when they are one increasing run, else None."""
    n = len(src)
    if n == 0 or int(src[-1]) - int(src[0]) != n - 1 or (n > 1 and not bool(np.all(np.diff(src) == 1))):
        return None
    a = int(src[0])
    if col.offsets is None:
        rb = col.spec.row_nbytes()
        return Block(spec=col.spec, num_rows=n, data=col.data[a * rb : (a + n) * rb], offsets=None)
    lo, hi = int(col.offsets[a]), int(col.offsets[a + n])
    return Block(spec=col.spec, num_rows=n, data=col.data[lo:hi], offsets=col.offsets[a : a + n + 1] - lo)


__all__ = ["Piece", "assemble", "contiguous_view", "nbytes_of", "row_lengths"]
