"""Columns whose bytes are on a GPU: a put's CUDA tensors and a get's output on a device.

A ``DeviceColumn`` is a dense or jagged column whose ``values`` (1-D uint8) live on a device; its
spec, offsets and row count are what a host ``Column`` of the same rows would carry. The copies
between it and host memory are one DMA each where the host side is registered with CUDA (a mapping
of a shard's file, ``transport.pinning``), else staged through a pinned buffer:

* put: ``write(out, pos, direct=...)`` copies rows ``pos`` into ``out``, the writer's mapping of its
  reservation (the rows of a put split over shards are gathered on the device first, a copy at
  device speed); ``host()`` is the staged copy, for rows sent as frames or to an unregistered file;
* get: ``gather_to_device(pieces, ...)`` copies rows out of the shards' mappings straight into one
  device buffer, a DMA per run of consecutive rows (many short runs: assembled on the host in a
  pinned buffer, then one DMA);
* ``sync()`` waits for the column's copies: a put syncs before its commit, a get before it checks
  the rows' generations (``client.ops``), so a row is never committed or handed out half copied.

A get's copies run on the caller's current stream, or with ``non_blocking`` on a stream of their
own, so they overlap with the work the caller queued before the get; the caller's stream waits for
them (an event) before anything it queues next.

Tensors on the CPU take the same code with plain copies (no streams), which is how the tests run
this module without a GPU. It imports torch (through ``column_kinds``): clients only, the store's
own processes never import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane.codec.column_kinds import check_storable, dtype_name, resolved, tensor_view, u8_tensor
from dataplane.codec.column_types import Column, ColumnSpec
from dataplane.codec.rows import Piece, assemble, byte_runs, out_offsets

if TYPE_CHECKING:
    import torch

# Above this many runs of rows in one field, a get assembles the rows on the host (one memcpy into a
# pinned buffer) and copies once: each device copy costs microseconds of the CPU's time on its own.
MAX_DEVICE_RUNS = 64


class DeviceColumn:
    """One field of ``num_rows`` rows whose bytes (``values``, 1-D uint8) are on a device."""

    __slots__ = ("_host", "_keep", "_pending", "num_rows", "offsets", "spec", "values")

    def __init__(
        self, spec: ColumnSpec, num_rows: int, values: torch.Tensor, offsets: np.ndarray | None = None
    ) -> None:
        self.spec = spec
        self.num_rows = num_rows
        self.values = values
        self.offsets = offsets
        self._host: Column | None = None
        self._pending: list[Any] = []  # CUDA events of copies in flight
        self._keep: list[torch.Tensor] = []  # what those copies read or write, alive until synced

    @property
    def nbytes(self) -> int:
        return int(self.values.numel())

    @property
    def shapes(self) -> None:
        """(Dense and jagged columns carry no per-row shapes.)"""
        return None

    def sync(self) -> None:
        """Wait until every copy to or from this column has finished."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()
        self._keep.clear()

    def host(self) -> Column:
        """The rows in host memory: one copy into a pinned buffer (made once, then kept)."""
        if self._host is None:
            import torch

            self.sync()
            staged = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.values.is_cuda)
            staged.copy_(self.values, non_blocking=True)
            if self.values.is_cuda:
                torch.cuda.current_stream(self.values.device).synchronize()
            data = memoryview(staged.numpy()).cast("B")
            self._host = Column(self.spec, self.num_rows, data, self.offsets)
        return self._host

    def write(self, out: memoryview, pos: np.ndarray, whole: bool, direct: bool) -> Column:
        """Copy rows ``pos`` (all of them, in order, when ``whole``) into ``out``; returns the piece
        written (its offsets for the commit). ``direct``: ``out`` is registered with CUDA, so the
        copy is one DMA from the device (finished by ``sync``); otherwise it is staged (``host``)."""
        n = len(pos)
        if not direct:
            return assemble(self.spec, n, [(self.host(), pos, np.arange(n))], out=out)
        src, offsets = (self.values, self.offsets) if whole else self._rows(pos)
        nbytes = int(src.numel())
        dst = u8_tensor(out[:nbytes])
        dst.copy_(src, non_blocking=True)
        self._record(src, dst)
        return Column(self.spec, n, out[:nbytes], offsets)

    def _rows(self, pos: np.ndarray) -> tuple[torch.Tensor, np.ndarray | None]:
        """Rows ``pos`` gathered on the device into one buffer (a copy at device speed: a put split
        over shards sends each its own rows), and their offsets (jagged)."""
        import torch

        if self.offsets is None:
            rb = self.spec.dense_row_nbytes()
            index = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(self.values.device)
            return self.values.view(self.num_rows, rb).index_select(0, index).reshape(-1), None
        offsets = out_offsets(len(pos), [(self, pos, np.arange(len(pos)))])
        # One slice per run of consecutive rows, put together by one cat: device memory for the
        # output alone (a gather index would cost 8 bytes per byte moved).
        starts, _, lengths = byte_runs(self.spec, self.offsets, pos, np.arange(len(pos)), offsets)
        runs = [self.values[int(a) : int(a) + int(n)] for a, n in zip(starts, lengths, strict=True)]
        return (torch.cat(runs) if runs else self.values[:0]), offsets

    def value(self) -> torch.Tensor:
        """The column as the tensor a get returns: dense ``[B, ...]``, or jagged (nested) when its
        rows differ in length; views of ``values``."""
        return tensor_view(self.values, self.spec, self.num_rows, self.offsets)

    def _record(self, *tensors: torch.Tensor) -> None:
        """Remember a copy just queued on the current stream (nothing to wait for on the CPU)."""
        if self.values.is_cuda:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.values.device))
            self._pending.append(event)
            self._keep.extend(tensors)


def device_column(name: str, t: torch.Tensor, num_rows: int) -> DeviceColumn | None:
    """A put's dense field as a ``DeviceColumn`` kept on its device (no copy when ``t`` is
    contiguous), or None when it is not a plain CUDA tensor of ``num_rows`` rows (the codec's
    general path then encodes it, staging CUDA tensors through pinned memory)."""
    import torch

    if type(t) is not torch.Tensor or not t.is_cuda or t.is_nested or t.dim() == 0 or t.shape[0] != num_rows:
        return None
    check_storable(name, t)
    t = resolved(t)
    values = t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return DeviceColumn(ColumnSpec("dense", dtype_name(t.dtype), tuple(t.shape[1:])), num_rows, values)


def can_gather_to_device(pieces: Sequence[Piece]) -> bool:
    """Whether a get's pieces of one field can be copied straight to a device: one spec for all, of
    dense or jagged rows (other kinds are decoded on the host, then moved)."""
    spec = pieces[0][0].spec
    return spec.kind in ("dense", "jagged") and all(col.spec == spec for col, _, _ in pieces)


@dataclass(frozen=True)
class GatherPlan:
    """Where the rows of a gather go: the output's offsets (jagged) and size, and each piece's byte
    runs (``byte_runs``); ``direct_ok`` when they are few enough for one DMA each."""

    offsets: np.ndarray | None
    total: int
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]

    @property
    def direct_ok(self) -> bool:
        return sum(len(r[0]) for r in self.runs) <= MAX_DEVICE_RUNS


def plan_gather(pieces: Sequence[Piece], num_rows: int) -> GatherPlan:
    """The plan of gathering ``pieces`` (``can_gather_to_device``) into ``num_rows`` rows: asked before
    registering the pieces' memory, which only a direct copy needs."""
    spec = pieces[0][0].spec
    offsets = None
    if spec.kind == "dense":
        total = spec.dense_row_nbytes() * num_rows
    else:
        offsets = out_offsets(num_rows, pieces)
        total = int(offsets[-1])
    runs = [byte_runs(spec, piece.offsets, src, dst, offsets) for piece, src, dst in pieces]
    return GatherPlan(offsets, total, runs)


def gather_to_device(
    pieces: Sequence[Piece],
    num_rows: int,
    device: Any,
    direct: bool,
    non_blocking: bool = False,
    plan: GatherPlan | None = None,
) -> DeviceColumn:
    """The rows of ``pieces`` (``can_gather_to_device``) as one column on ``device``.

    ``direct``: every piece's bytes are in registered host memory, so each run of rows is one DMA
    from there; otherwise (or past ``MAX_DEVICE_RUNS`` runs) the rows are assembled on the host into
    a pinned buffer first. ``plan``: ``plan_gather``'s, when the caller made it already. The copies
    are in flight on return: ``sync()`` before trusting them.
    """
    import torch

    spec = pieces[0][0].spec
    plan = plan if plan is not None else plan_gather(pieces, num_rows)
    offsets, total = plan.offsets, plan.total
    direct = direct and plan.direct_ok
    device = torch.device(device)
    stream = _stream(device, non_blocking)
    with _on(stream):
        out = torch.empty(total, dtype=torch.uint8, device=device)
        staged = None
        if direct:
            for (piece, _, _), (s_begin, d_begin, length) in zip(pieces, plan.runs, strict=True):
                host = u8_tensor(piece.data)
                for a, b, k in zip(s_begin.tolist(), d_begin.tolist(), length.tolist(), strict=True):
                    out[b : b + k].copy_(host[a : a + k], non_blocking=True)
        else:
            staged = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
            assemble(spec, num_rows, pieces, out=memoryview(staged.numpy()).cast("B"))
            out.copy_(staged, non_blocking=True)
    result = DeviceColumn(spec, num_rows, out, offsets)
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(stream)
        result._pending.append(event)
        result._keep.extend(c for c in (staged,) if c is not None)
        if non_blocking:  # the caller's stream waits for the copies; the output is used there
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            out.record_stream(current)
    return result


_streams: dict[int, Any] = {}


def _stream(device: torch.device, side: bool) -> Any:
    """The stream a get's copies run on: the current one, or (``side``) one of this module's."""
    if device.type != "cuda":
        return None
    import torch

    if not side:
        return torch.cuda.current_stream(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def _on(stream: Any) -> Any:
    import contextlib

    import torch

    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


__all__ = [
    "MAX_DEVICE_RUNS",
    "DeviceColumn",
    "GatherPlan",
    "can_gather_to_device",
    "device_column",
    "gather_to_device",
    "plan_gather",
]
