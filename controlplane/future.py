"""``BatchFuture``: the lazy result of a non-blocking concat-collect call.

A ``blocking=False`` call of a PROTO / nd-compute method returns a ``BatchFuture`` over the
per-rank ``ObjectRef`` results instead of waiting. Passed to another group's method, it is
chunked on the driver *without fetching anything*: each chunk records which rows of the
logical batch it stands for (a list of row operations), and the worker that receives it
fetches only the upstream parts that hold those rows (``materialize``). When the expected
part sizes turn out wrong (a method returned a different number of rows than it received),
the worker falls back to fetching every part, so the answer is always right.

A batch class may name its own future type instead (verl's ``DataProto`` -> ``DataProtoFuture``):
see ``future_maker``. Such a future is built from the per-rank refs and a collect function, and
is resolved on the worker by its own ``get()``.

Example:
    >>> fut = producer_wg.generate(batch)          # registered blocking=False
    >>> out = consumer_wg.score(fut)               # each consumer rank pulls only its rows
    >>> full = fut.get()                           # or resolve on the driver
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import ray

from controlplane import _config, batch

logger = logging.getLogger(__name__)

# Row operations, applied in order to the concatenation of the parts:
#   ("trim", k)          drop the last k rows (undo padding)
#   ("pad", k)           append k copies of the last row
#   ("window", a, b)     keep rows a:b
#   ("frac", i, n)       keep the i-th of n chunks (used when the length is not known yet)
_Op: TypeAlias = (
    tuple[Literal["trim", "pad"], int] | tuple[Literal["window"], int, int] | tuple[Literal["frac"], int, int]
)
_Index: TypeAlias = npt.NDArray[np.int64]


class BatchFuture:
    """A batch that is the ordered concatenation of remote results, not fetched yet.

    Args:
        refs: one ``ray.ObjectRef`` per collected rank, in batch order.
        part_sizes: expected number of samples behind each ref, when known (enables
            fetching only the needed parts).
        allows_uneven_chunks: whether chunks of this future may differ in size (true when
            the producing call consumed an uneven-chunkable batch such as ``KVBatchMeta``).
    """

    def __init__(
        self,
        refs: Sequence[ray.ObjectRef],
        part_sizes: Sequence[int] | None = None,
        *,
        allows_uneven_chunks: bool = False,
        ops: Sequence[_Op] = (),
    ) -> None:
        self.refs = list(refs)
        if not self.refs:
            raise ValueError("a BatchFuture needs at least one ObjectRef")
        for i, ref in enumerate(self.refs):
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(f"BatchFuture part {i} is a {type(ref).__name__}, not a ray.ObjectRef")
        if part_sizes is not None:
            part_sizes = [int(s) for s in part_sizes]
            if len(part_sizes) != len(self.refs):
                raise ValueError(f"{len(part_sizes)} part sizes given for {len(self.refs)} refs")
        self.part_sizes = part_sizes
        self.allows_uneven_chunks = allows_uneven_chunks
        self.ops: tuple[_Op, ...] = tuple(ops)
        # Global ranks that produced the parts (set by the collect functions; informational).
        self.source_ranks: list[int] | None = None

    def __repr__(self) -> str:
        size = self.known_length
        shown = "?" if size is None else size
        return f"BatchFuture(parts={len(self.refs)}, len={shown}, ops={list(self.ops)})"

    # ------------------------------------------------------------------ lengths
    @property
    def known_length(self) -> int | None:
        """Number of samples, or ``None`` while the part sizes are unknown."""
        if self.part_sizes is None:
            return None
        return _apply_ops_len(sum(self.part_sizes), self.ops, self.allows_uneven_chunks)

    def __len__(self) -> int:
        size = self.known_length
        if size is None:
            raise TypeError("the length of this BatchFuture is unknown until it is resolved")
        return size

    # ----------------------------------------------------------- batch protocol
    def _with(self, op: _Op) -> BatchFuture:
        return BatchFuture(
            self.refs, self.part_sizes, allows_uneven_chunks=self.allows_uneven_chunks, ops=(*self.ops, op)
        )

    def chunk(self, n: int) -> list[BatchFuture]:
        """``n`` futures, each standing for consecutive rows; nothing is fetched."""
        size = self.known_length
        if size is None:
            if any(op[0] == "frac" for op in self.ops):
                raise NotImplementedError("cannot re-chunk a BatchFuture chunk of unknown size; call .get()")
            return [self._with(("frac", i, n)) for i in range(n)]
        if size % n and not self.allows_uneven_chunks:
            raise ValueError(f"BatchFuture has {size} samples, which does not divide into {n} equal chunks")
        if not self.ops and self.allows_uneven_chunks and n == len(self.refs):
            sizes = list(self.part_sizes or [])  # one chunk per part: no slicing needed on the worker
        else:
            sizes = batch.chunk_sizes(size, n)
        out, start = [], 0
        for s in sizes:
            out.append(self._with(("window", start, start + s)))
            start += s
        return out

    @classmethod
    def concat(cls, futures: Sequence[BatchFuture]) -> BatchFuture:
        """Join futures that carry no row operations (plain collected results)."""
        if not futures:
            raise ValueError("cannot concatenate an empty list of BatchFutures")
        if any(f.ops for f in futures):
            raise NotImplementedError("cannot concatenate chunked/padded BatchFutures; call .get()")
        known = [f.part_sizes for f in futures if f.part_sizes is not None]
        sizes = [s for part in known for s in part] if len(known) == len(futures) else None
        refs = [r for f in futures for r in f.refs]
        return cls(refs, sizes, allows_uneven_chunks=all(f.allows_uneven_chunks for f in futures))

    def pad(self, k: int) -> BatchFuture:
        """A future with ``k`` copies of the last sample appended."""
        return self if k <= 0 else self._with(("pad", k))

    def trim(self, k: int) -> BatchFuture:
        """A future without its last ``k`` samples."""
        return self if k <= 0 else self._with(("trim", k))

    # -------------------------------------------------------------- resolution
    def get(self, timeout: float | None = None) -> Any:
        """Fetch the needed parts and build the batch (driver or worker).

        Args:
            timeout: seconds to wait for the parts; default ``CONTROLPLANE_FUTURE_TIMEOUT_S`` (600).

        Raises:
            TimeoutError: the parts were not ready in time (names how many and how long).
        """
        timeout = _config.future_timeout_s() if timeout is None else timeout
        which = self._needed()
        if which is not None:
            result = self._build_from(which, self._fetch(which, timeout))
            if result is not _MISMATCH:
                return result
        every = list(range(len(self.refs)))
        return self._build_from(every, self._fetch(every, timeout), trust_sizes=False)

    async def get_async(self, timeout: float | None = None) -> Any:
        """``get`` for coroutines: awaits the parts instead of blocking the event loop.

        An async actor must use this (the ``@register`` wrapper does for ``async def``
        methods): a blocking wait there could wait on a task queued behind it on the same actor.
        """
        timeout = _config.future_timeout_s() if timeout is None else timeout
        which = self._needed()
        if which is not None:
            result = self._build_from(which, await self._fetch_async(which, timeout))
            if result is not _MISMATCH:
                return result
        every = list(range(len(self.refs)))
        return self._build_from(every, await self._fetch_async(every, timeout), trust_sizes=False)

    def _needed(self) -> list[int] | None:
        """Indices of the parts holding this future's rows, or ``None`` if sizes are unknown."""
        if self.part_sizes is None:
            return None
        index = _row_index(sum(self.part_sizes), self.ops, self.allows_uneven_chunks)
        first, last = _needed_parts(index, self.part_sizes)
        return list(range(first, last + 1))

    def _build_from(self, which: list[int], fetched: list[Any], trust_sizes: bool = True) -> Any:
        actual = [batch.length(p) for p in fetched]
        if trust_sizes and self.part_sizes is not None:  # (``which`` then came from ``_needed``)
            expected = [self.part_sizes[i] for i in which]
            if actual != expected:
                logger.warning(
                    "BatchFuture parts %s have %s samples, expected %s; fetching every part",
                    which,
                    actual,
                    expected,
                )
                return _MISMATCH
            offset = sum(self.part_sizes[: which[0]])
            index = _row_index(sum(self.part_sizes), self.ops, self.allows_uneven_chunks) - offset
        else:
            index = _row_index(sum(_known(n) for n in actual), self.ops, self.allows_uneven_chunks)
        return _select(batch.concat(fetched), index)

    def _fetch(self, which: list[int], timeout: float) -> list[Any]:
        try:
            values: list[Any] = ray.get([self.refs[i] for i in which], timeout=timeout)
            return values
        except ray.exceptions.GetTimeoutError as exc:
            raise self._timeout(which, timeout) from exc

    async def _fetch_async(self, which: list[int], timeout: float) -> list[Any]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(self.refs[i] for i in which)), timeout)
        except TimeoutError as exc:
            raise self._timeout(which, timeout) from exc

    def _timeout(self, which: list[int], timeout: float) -> TimeoutError:
        return TimeoutError(f"BatchFuture: parts {which} of {len(self.refs)} not ready after {timeout}s")


_MISMATCH = object()


def _apply_ops_len(total: int, ops: Sequence[_Op], uneven: bool) -> int:
    return len(_row_index(total, ops, uneven))


def _known(size: int | None) -> int:
    """A fetched part's length (a fetched part is never a future, so its length is known)."""
    if size is None:
        raise TypeError("a BatchFuture part has no length")
    return size


def _row_index(total: int, ops: Sequence[_Op], uneven: bool) -> _Index:
    """Indices into the concatenated parts of the rows this future stands for, in order."""
    index = np.arange(total, dtype=np.int64)
    for op in ops:
        match op:
            case ("trim", k):
                if k > len(index):
                    raise ValueError(f"cannot trim {k} samples from a batch of {len(index)}")
                index = index[: len(index) - k]
            case ("pad", k):
                if len(index) == 0:
                    raise ValueError("cannot pad an empty batch")
                index = np.concatenate([index, np.full(k, index[-1], dtype=np.int64)])
            case ("window", a, b):
                index = index[a:b]
            case ("frac", i, n):
                if len(index) % n and not uneven:
                    raise ValueError(f"BatchFuture has {len(index)} samples, not divisible into {n} chunks")
                sizes = batch.chunk_sizes(len(index), n)
                start = sum(sizes[:i])
                index = index[start : start + sizes[i]]
            case _:  # pragma: no cover - ops are built only by this module
                raise AssertionError(f"unknown BatchFuture op {op!r}")
    return index


def _needed_parts(index: _Index, sizes: Sequence[int]) -> tuple[int, int]:
    """First and last part (inclusive) holding the rows in ``index``."""
    bounds = np.cumsum(sizes)
    if len(index) == 0:
        return 0, 0
    first = int(np.searchsorted(bounds, index.min(), side="right"))
    last = int(np.searchsorted(bounds, index.max(), side="right"))
    return first, last


def _select(local: Any, index: _Index) -> Any:
    """Rows ``index`` of ``local``; a slice when the rows are contiguous."""
    n = len(index)
    if n == 0:
        return batch.take(local, 0, 0)
    start = int(index[0])
    if np.array_equal(index, np.arange(start, start + n)):
        if start == 0 and n == batch.length(local):
            return local
        return batch.take(local, start, start + n)
    if batch.is_tensordict(local):
        import torch

        return local[torch.as_tensor(index)]
    if isinstance(local, list | tuple):
        rows = [local[int(i)] for i in index]
        return tuple(rows) if isinstance(local, tuple) else rows
    raise TypeError(f"cannot pick padded/reordered rows of a {type(local).__name__}")


# ---------------------------------------------------------------- foreign future types
# A function that wraps per-rank results: ``maker(refs, collect_fn) -> future``, where
# ``collect_fn(list of fetched parts) -> batch``.
FutureMaker: TypeAlias = Callable[[list[ray.ObjectRef], Callable[[list[Any]], Any]], Any]

# Argument types that are never futures: checked first, since every worker call checks every argument.
_PLAIN = (list, tuple, dict, str, bytes, int, float, bool)


def is_batch_future(value: object) -> bool:
    """True for a ``BatchFuture`` or a foreign batch future (duck typing verl's ``DataProtoFuture``):
    an object with a ``get()`` method and a non-empty list of ``ray.ObjectRef`` in ``futures``.

    Example:
        >>> is_batch_future(wg.generate_later(batch))   # a blocking=False PROTO call
        True
    """
    if isinstance(value, BatchFuture):
        return True
    if value is None or isinstance(value, _PLAIN) or batch.is_tensordict(value):
        return False
    if not callable(getattr(type(value), "get", None)):
        return False
    try:
        refs = getattr(value, "futures", None)
    except Exception:  # an object with an exotic __getattr__ is simply not a future
        return False
    return isinstance(refs, list | tuple) and bool(refs) and all(isinstance(r, ray.ObjectRef) for r in refs)


def future_maker(value: object) -> FutureMaker | None:
    """How a non-blocking call whose batch argument is ``value`` wraps its per-rank results.

    Looked up on the batch's class, first match wins:

    1. ``make_future(refs, collect_fn)``: a classmethod (or staticmethod) building any future;
    2. ``future_type``: a class called as ``future_type(collect_fn=collect_fn, futures=refs)``
       (the fields of verl's ``DataProtoFuture``);
    3. the batch is itself a foreign future (``is_batch_future``): results get the same type;
    4. verl's naming: the class's module defines ``<ClassName>Future`` with a ``get`` method
       (``verl.protocol.DataProto`` -> ``DataProtoFuture``), used as in 2.

    ``None`` (lists, TensorDicts, ``BatchFuture``, classes without any of these) means the
    call returns a ``BatchFuture``. ``refs`` hold no padded samples: they are removed first.

    Example:
        >>> class MyBatch:
        ...     future_type = MyBatchFuture     # MyBatchFuture(collect_fn=..., futures=[...])
        >>> wg.generate_later(MyBatch(...))      # -> a MyBatchFuture
    """
    if value is None or isinstance(value, BatchFuture | list | tuple) or batch.is_tensordict(value):
        return None
    cls = type(value)
    hook: FutureMaker | None = getattr(cls, "make_future", None)
    if callable(hook):
        return hook
    ftype = getattr(cls, "future_type", None)
    if ftype is None and is_batch_future(value):
        ftype = cls
    if ftype is None:
        ftype = _sibling_future_type(cls)
    if ftype is None:
        return None
    if not callable(ftype):
        raise TypeError(f"{cls.__name__}.future_type must be a class, got {type(ftype).__name__}")
    return functools.partial(_construct_future, ftype)


def _sibling_future_type(cls: type) -> type | None:
    module = sys.modules.get(getattr(cls, "__module__", ""))
    candidate = getattr(module, f"{cls.__name__}Future", None) if module is not None else None
    if isinstance(candidate, type) and callable(getattr(candidate, "get", None)):
        return candidate
    return None


def _construct_future(ftype: type, refs: list[ray.ObjectRef], collect_fn: Callable[[list[Any]], Any]) -> Any:
    return ftype(collect_fn=collect_fn, futures=refs)


def wrap_future(maker: FutureMaker, future: BatchFuture, pad: int) -> Any:
    """The batch class's own future over the parts of ``future``, without ``pad`` padded samples.

    Padded samples sit at the end: parts holding only padding are dropped, and the one part
    that holds both is trimmed by a small Ray task next to the data (the driver fetches
    nothing), so a future type that knows nothing of padding still resolves to the real rows.

    Returns:
        The new future, or ``None`` when padding cannot be located (unknown part sizes).
    """
    refs = list(future.refs)
    if pad:
        if future.part_sizes is None:
            return None
        refs = unpadded_refs(refs, future.part_sizes, pad)
    return maker(refs, batch.concat)


def unpadded_refs(refs: Sequence[ray.ObjectRef], sizes: Sequence[int], pad: int) -> list[ray.ObjectRef]:
    """``refs`` without the last ``pad`` samples of their concatenation (see ``wrap_future``)."""
    remaining = sum(sizes) - pad
    if remaining < 0:
        raise ValueError(f"cannot remove {pad} padded samples from parts of sizes {list(sizes)}")
    kept: list[ray.ObjectRef] = []
    for ref, size in zip(refs, sizes, strict=True):
        if remaining <= 0:
            break
        if size <= remaining:
            kept.append(ref)
        else:
            kept.append(_trim_part.remote(ref, size, size - remaining))
        remaining -= size
    return kept


def _trim_expected(part: Any, expected: int, k: int) -> Any:
    got = batch.length(part)
    if got != expected:
        raise ValueError(
            f"cannot remove padding: a rank returned {got} samples for the {expected} it received; "
            "a padded non-blocking call needs one output row per input row"
        )
    return batch.trim(part, k)


# num_cpus=0: a bookkeeping task must never wait for a CPU slot held by the workers.
_trim_part = ray.remote(num_cpus=0)(_trim_expected)


def materialize(value: Any) -> Any:
    """``value.get()`` if it is a batch future (``is_batch_future``), else ``value``."""
    return value.get() if is_batch_future(value) else value


async def materialize_async(value: Any) -> Any:
    """Like ``materialize`` for coroutines: awaits instead of blocking the actor's event loop.

    A foreign future without ``get_async`` is resolved in a thread, since its ``get()`` blocks.
    """
    if isinstance(value, BatchFuture):
        return await value.get_async()
    if not is_batch_future(value):
        return value
    get_async = getattr(value, "get_async", None)
    if callable(get_async):
        return await get_async()
    return await asyncio.get_running_loop().run_in_executor(None, value.get)
