"""``StreamingDataset``: a torch ``IterableDataset`` over the rows a consumer task takes from the store.

It turns the streaming API (``next_batch`` + ``kv_batch_get_by_meta``) into a loop a trainer can
``for`` over, fetching the next batch on a background thread while the current one is processed::

    import dataplane as dp
    from torch.utils.data import DataLoader

    dp.init()
    ds = dp.StreamingDataset("step3", "train", 64, ["responses", "rewards"], micro_batch_size=16)
    for td in DataLoader(ds, batch_size=None):   # or dp.StreamingDataLoader(ds)
        loss = step(td)                      # a TensorDict of up to 16 rows
        meta = td["meta"]                    # the KVBatchMeta of exactly those rows

How it behaves:

* **Batches.** Each batch is one ``next_batch(partition_id, task_name, batch_size, fields,
  dp_rank=..., dp_size=..., batch_index=...)`` call followed by one get of its rows. The loop ends when
  the partition is finished and drained (``next_batch`` returns an empty meta). Rows come whole
  batches of ``batch_size`` except the last; with ``micro_batch_size`` each batch is handed out in
  slices of that many rows (the last slice of a batch possibly shorter). "Finished" is the
  partition's, not the fields': if another stage still adds one of ``fields`` (say, rewards) after
  the producers called ``finish_partition``, the loop ends once the rows complete so far are
  drained; finish the partition only when every field this dataset reads is written.
* **What a yielded TensorDict carries.** The requested ``fields`` (dense when the rows agree in
  shape, jagged nested tensors otherwise, as ``kv_batch_get`` returns them) and one non-tensor entry,
  ``td["meta"]``: the ``KVBatchMeta`` (keys, tags, partition, fields) of exactly the rows of this
  TensorDict, in row order. Drop it with ``td.exclude("meta")`` where only tensors are wanted. It is
  a ``StreamBatch``: a ``TensorDict`` in every respect but one, iterating it yields its keys, as the
  mapping it is (a plain TensorDict yields its rows; ``td.unbind(0)`` gives them here).
* **Prefetch.** With ``prefetch=n >= 1`` a background thread takes and reads up to ``n`` batches
  ahead of the one being processed (a bounded hand-over: it never runs further ahead). ``prefetch=0``
  fetches in the iterating thread, one batch at a time. The thread stops when the iterator is
  exhausted, raises, is closed (``close()``, ``with``), is garbage collected (an early ``break``), or
  the interpreter exits. It waits for rows in slices of ``WAIT_SLICE_S`` seconds (each a
  ``next_batch`` call with that timeout, which takes nothing when it expires), so a stop is seen
  within one slice; closing the iterator waits for that (and a get in flight). It is a daemon
  thread, stopped by an ``atexit`` hook before the store client closes: exit never hangs on it.
* **Batch index and peers.** Batch ``i`` of a pass is requested with ``batch_index = start + i`` (the
  index service remembers, per task and ``dp_rank``, which rows each batch index got). So every
  iterator of the same ``(partition_id, task_name, fields, dp_rank)`` gets the same batches in the same
  order: the TP/PP peers of one data-parallel rank each iterate their own ``StreamingDataset`` and see
  identical data, and different ``dp_rank`` s see disjoint rows. A later pass over the same dataset
  object continues after the last batch it handed over: batches that were prefetched but never
  handed over (an early ``break``) are handed over then, as the index service still remembers the
  rows of each batch index (the most recent indexes per task, see
  ``dataplane.server.index.streams.RANK_CACHE``).
* **DataLoader.** ``DataLoader(ds, batch_size=None)``, as every PyTorch user writes it, or
  ``dp.StreamingDataLoader(ds)`` (TransferQueue's constructor; it sets ``batch_size=None`` and a
  pass-through collate itself). With ``batch_size=None`` torch applies its ``default_convert`` to each
  item; it walks a mapping key by key, which a plain TensorDict breaks (it iterates over rows, and
  the walk fails with a ``TypeError`` deep in tensordict); a ``StreamBatch`` iterates over its keys,
  so the walk hands back the same tensors and entries (a shallow copy). ``collate_fn=
  StreamingDataset.collate`` (the item itself) still works.
* **DataLoader workers.** With ``num_workers=0`` the dataset runs in the loop's process. With
  ``num_workers > 0`` each worker is a consumer of its own: it calls ``next_batch`` for the same
  task, which hands every row to exactly one of them, so together they yield every row once (in no
  fixed order across workers). Worker ``w`` of ``W`` uses batch indexes ``start + w``,
  ``start + w + W``, ... so they never share one; peers must use the same ``num_workers``. Workers
  must be started with ``multiprocessing_context="spawn"``: a worker attaches
  to the store through Ray itself (it learns the Ray address and store name when the dataset is sent
  to it, so call ``dp.init()`` in the main process first), and a *forked* worker would inherit this
  process's Ray connection and sockets, which cannot be used after a fork; iterating in a forked
  process raises ``StoreNotInitializedError`` saying so. A worker's copy of the dataset starts each
  pass at the batch index the main process's dataset is at, so a second pass with fresh workers
  would be handed the first pass's batches again (remembered per batch index): for several passes
  over one partition use ``persistent_workers=True`` (each worker's dataset then continues after
  its own last batch), or call ``dp.reset_consumption`` between passes (which forgets them).
* **Taking is at most once.** Rows a batch took are taken for the task even if the iterator is
  dropped before handing them over. An early ``break`` inside a batch's micro-batches leaves the
  rest of that batch unread for this task (``dp.reset_consumption`` reads everything again);
  whole batches prefetched but not handed over come back on the next pass, as said above.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar, TypedDict, TypeVar

from tensordict import TensorDict
from torch.utils.data import IterableDataset

from dataplane import api as _api
from dataplane import stream as _stream
from dataplane.errors import (
    ArgumentTypeError,
    BatchTimeoutError,
    InvalidArgumentError,
    PartitionNotFoundError,
    StoreNotInitializedError,
)
from dataplane.meta import KVBatchMeta, check_partition
from dataplane.samplers import Sampler

logger = logging.getLogger(__name__)

T = TypeVar("T")

WAIT_SLICE_S = 0.5  # the background thread waits for rows at most this long per call, then re-checks
_THREAD_NAME = "dataplane-stream"


# ---- fork detection --------------------------------------------------------------------------------

_inherited_by_fork = False  # this process is a fork of one that used Ray or the store: neither works here


def _after_fork_in_child() -> None:
    global _inherited_by_fork
    ray = sys.modules.get("ray")
    if _api.is_initialized() or (ray is not None and ray.is_initialized()):
        _inherited_by_fork = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---- the background thread ------------------------------------------------------------------------


class _End:
    """Posted by the thread when the partition is drained."""


class _Pipe:
    """What the background thread and its iterator share (never the iterator itself, so that dropping
    the iterator collects it and stops the thread)."""

    def __init__(self, ahead: int) -> None:
        self.cond = threading.Condition()
        self.items: deque[tuple[int, list[StreamBatch]] | _End | BaseException] = deque()
        self.free = ahead  # batches the thread may still fetch before the consumer takes one
        self.stop = False
        self.thread: threading.Thread | None = None

    def shut(self, join_s: float) -> None:
        with self.cond:
            self.stop = True
            self.items.clear()
            self.cond.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)
            if thread.is_alive():
                logger.warning(
                    "StreamingDataset: the prefetch thread is still in a store call after %.1fs; it "
                    "ends when that call returns",
                    join_s,
                )


_live_pipes: weakref.WeakSet[_Pipe] = weakref.WeakSet()
_atexit_registered = False
_atexit_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    for pipe in list(_live_pipes):
        pipe.shut(join_s=WAIT_SLICE_S + 1.0)


def _register_atexit() -> None:
    # Registered on first use, so after ``dp.init``'s own hook: atexit runs it first (last in, first
    # out) and the threads stop before the client they use is closed.
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_stop_all_at_exit)
            _atexit_registered = True


def _run(ds: StreamingDataset, pipe: _Pipe, start: int, stride: int) -> None:
    index = start
    try:
        while True:
            with pipe.cond:
                while pipe.free <= 0 and not pipe.stop:
                    pipe.cond.wait()
                if pipe.stop:
                    return
                pipe.free -= 1
            parts = ds._fetch(index, pipe)
            if parts is None:  # stopped while waiting for rows
                return
            with pipe.cond:
                if pipe.stop:
                    return
                pipe.items.append((index, parts) if parts else _End())
                pipe.cond.notify_all()
            if not parts:
                return
            index += stride
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
        with pipe.cond:
            if not pipe.stop:
                pipe.items.append(exc)
                pipe.cond.notify_all()


# ---- the dataset ----------------------------------------------------------------------------------


class StreamBatch(TensorDict):  # type: ignore[no-untyped-call]  # (tensordict's __init_subclass__)
    """The TensorDict a ``StreamingDataset`` yields: a ``TensorDict`` whose iteration yields its keys,
    as the mapping it is, so that torch's ``default_convert`` (what ``DataLoader(ds, batch_size=None)``
    applies to each item) walks it key by key and hands back the same entries. Rows: ``td.unbind(0)``.

    Example:
        >>> import torch
        >>> from torch.utils.data._utils.collate import default_convert
        >>> td = StreamBatch({"x": torch.zeros(2, 3)}, batch_size=[2])
        >>> list(td), default_convert(td)["x"] is td["x"]
        (['x'], True)
    """

    __slots__ = ()  # the same layout as TensorDict: a got TensorDict becomes one in place

    def __iter__(self) -> Any:
        return iter(self.keys())


def _as_stream_batch(td: Any) -> Any:
    """``td`` (a TensorDict a get returned) as a ``StreamBatch``, in place (no copy)."""
    if type(td) is TensorDict:
        td.__class__ = StreamBatch
    return td


class _Attach(TypedDict):
    """How a spawned DataLoader worker reaches the store of the process that made the dataset."""

    address: str  # the Ray cluster's GCS address
    name: str  # the store's name
    allow_pickle: bool


class StreamingDataset(IterableDataset):
    """Iterate over the rows of ``partition_id`` that consumer task ``task_name`` takes, as TensorDicts.

    Each batch is taken with ``dp.next_batch`` (so every row goes to one consumer of the task, once)
    and read with one get; it is yielded whole, or in micro-batches of ``micro_batch_size`` rows.
    Iteration ends when the partition is finished (``dp.finish_partition``) and drained. See the
    module docstring for prefetching, peers, DataLoader workers and what happens on an early break.

    Args:
        partition_id: the partition to read.
        task_name: the consumer task; different tasks each see every row.
        batch_size: rows per ``next_batch`` call (whole batches except the last).
        fields: the fields a row must hold to be ready, and that are read.
        dp_rank / dp_size: this consumer's data-parallel rank and the number of ranks (passed to
            ``next_batch``; iterators of one ``dp_rank`` get the same batches).
        sampler: a ``dp.Sampler`` choosing the rows of each batch (default: in ready order).
        micro_batch_size: yield slices of this many rows of each batch (None: whole batches).
        prefetch: batches fetched ahead on a background thread (0: no thread).
        timeout_s: the longest one batch may take to become ready (None: wait as long as it takes).

    Yields:
        ``TensorDict`` of up to ``micro_batch_size`` (or ``batch_size``) rows: the ``fields`` plus
        ``td["meta"]``, the ``KVBatchMeta`` of exactly these rows in row order.

    Raises:
        BatchTimeoutError: (from the iterator) a batch was not ready within ``timeout_s``; also when
            the partition was never created within it. Nothing of that batch was taken.
        StoreNotInitializedError: (from the iterator) ``dp.init()`` was not called in this process, or
            it is a forked DataLoader worker (use ``multiprocessing_context="spawn"``).
        ValueError / TypeError: (from the constructor) bad arguments, e.g. ``batch_size < 1``, a
            sampler that does not fit them, or a field named ``"meta"``.
        Any error of ``next_batch`` or ``kv_batch_get_by_meta`` (from the iterator), e.g.
        ``KeyNotFoundError`` if rows were cleared between being taken and being read.

    Example:
        >>> ds = dp.StreamingDataset("step0", "train", 8, ["responses", "rewards"], micro_batch_size=4)
        >>> for td in DataLoader(ds, batch_size=None):
        ...     print(td.batch_size, td["meta"].keys)
        torch.Size([4]) ['s0', 's1', 's2', 's3']
        torch.Size([4]) ['s4', 's5', 's6', 's7']
        torch.Size([2]) ['s8', 's9']
    """

    meta_key: ClassVar[str] = "meta"  # the non-tensor entry holding each TensorDict's KVBatchMeta

    def __init__(
        self,
        partition_id: str,
        task_name: str,
        batch_size: int,
        fields: list[str] | str,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        sampler: Sampler | None = None,
        micro_batch_size: int | None = None,
        prefetch: int = 1,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        check_partition(partition_id, "StreamingDataset")
        if not isinstance(task_name, str):
            raise ArgumentTypeError(
                "task_name", f"StreamingDataset: task_name must be a str, not {type(task_name).__name__}"
            )
        fields = (
            [fields] if isinstance(fields, str) else list(fields) if isinstance(fields, Iterable) else fields
        )
        if not isinstance(fields, list) or not fields or not all(isinstance(f, str) for f in fields):
            raise ArgumentTypeError(
                "fields", f"StreamingDataset: fields must be a non-empty list of str, got {fields!r}"
            )
        if self.meta_key in fields:
            raise InvalidArgumentError(
                "fields",
                f"StreamingDataset: a field is named {self.meta_key!r}, the entry that carries each "
                "TensorDict's KVBatchMeta; subclass StreamingDataset with another meta_key",
            )
        _check_int("batch_size", batch_size, 1)
        _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise InvalidArgumentError(
                "dp_rank", f"StreamingDataset: dp_rank {dp_rank} is not below dp_size {dp_size}"
            )
        if micro_batch_size is not None:
            _check_int("micro_batch_size", micro_batch_size, 1)
        _check_int("prefetch", prefetch, 0)
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s
        ):
            raise InvalidArgumentError(
                "timeout_s", f"StreamingDataset: timeout_s must be None or a number >= 0, got {timeout_s!r}"
            )
        if sampler is not None:
            if not isinstance(sampler, Sampler):
                raise ArgumentTypeError(
                    "sampler",
                    f"StreamingDataset: sampler must be a dataplane Sampler, not {type(sampler).__name__}",
                )
            sampler.check(batch_size, dp_rank, dp_size, 0)
        self.partition_id = partition_id
        self.task_name = task_name
        self.batch_size = batch_size
        self.fields = fields
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self._next_index = 0  # the batch index the next pass starts at (in this process)
        self._attach: _Attach | None = None  # how a spawned DataLoader worker reaches the store

    def __repr__(self) -> str:
        return (
            f"StreamingDataset(partition_id={self.partition_id!r}, task_name={self.task_name!r}, "
            f"batch_size={self.batch_size}, fields={self.fields}, dp_rank={self.dp_rank}, "
            f"dp_size={self.dp_size}, micro_batch_size={self.micro_batch_size}, prefetch={self.prefetch})"
        )

    @staticmethod
    def collate(item: T) -> T:
        """A DataLoader ``collate_fn`` that hands each item over as it is (the default one, with
        ``batch_size=None``, does too for the ``StreamBatch`` items of this dataset)."""
        return item

    def reset(self) -> None:
        """Start the next pass at batch index 0 again: it is handed the batches the index service
        remembers for those indexes (as TransferQueue's ``reset`` replays its buffer), then new ones."""
        self._next_index = 0

    def step(self, partition_id: str) -> None:
        """Read ``partition_id`` from now on, from its first batch (TransferQueue's ``step``)."""
        self.partition_id = check_partition(partition_id, "StreamingDataset.step")
        self._next_index = 0

    # -- the one store call per wait slice; a hook for subclasses -----------------------------------

    def next_meta(self, batch_index: int, timeout_s: float) -> KVBatchMeta:
        """Ask for batch ``batch_index``, waiting at most ``timeout_s`` (one wait slice).

        Runs on the background thread (or the iterating one with ``prefetch=0``), once per slice until
        the batch is ready; override it to instrument or adapt how batches are taken.
        """
        return _stream.next_batch(
            self.partition_id,
            self.task_name,
            self.batch_size,
            self.fields,
            sampler=self.sampler,
            timeout_s=timeout_s,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            batch_index=batch_index,
        )

    # -- iteration ----------------------------------------------------------------------------------

    def __iter__(self) -> _StreamIterator:
        self._ensure_store()
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        offset, stride = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return _StreamIterator(self, self._next_index, offset, stride)

    def _ensure_store(self) -> None:
        if _inherited_by_fork:
            raise StoreNotInitializedError(
                "StreamingDataset cannot be iterated in a forked process (a DataLoader worker started "
                "with fork): it inherited Ray and the store's sockets, which do not work after a fork. "
                "Pass multiprocessing_context='spawn' to the DataLoader, or num_workers=0"
            )
        if _api.is_initialized():
            return
        attach = self._attach
        if attach is None:
            raise StoreNotInitializedError(
                "the store is not initialised in this process: call dp.init() first (for DataLoader "
                "workers: in the main process, before the DataLoader starts them)"
            )
        import ray

        if not ray.is_initialized():
            ray.init(address=attach["address"], logging_level=logging.WARNING, log_to_driver=False)
        _api.init(name=attach["name"], attach_only=True, allow_pickle=attach["allow_pickle"])

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a spawned DataLoader worker: tell it which Ray cluster and store to attach to.
        state = self.__dict__.copy()
        if _api.is_initialized() and not _inherited_by_fork:
            import ray

            client = _api.current_client()
            state["_attach"] = {
                "address": ray.get_runtime_context().gcs_address,
                "name": client.config.name,
                "allow_pickle": client.allow_pickle,
            }
        return state

    def _fetch(self, index: int, pipe: _Pipe | None) -> list[StreamBatch] | None:
        """The micro-batches of batch ``index`` ([] when drained), or None if ``pipe`` was stopped."""
        meta = self._take(index, pipe)
        if meta is None:
            return None
        if meta.size == 0:
            return []
        if pipe is not None and pipe.stop:
            return None
        td = _as_stream_batch(_api.kv_batch_get_by_meta(meta))
        step = self.micro_batch_size or meta.size
        parts: list[StreamBatch] = []
        for lo in range(0, meta.size, step):
            part = td[lo : lo + step] if step < meta.size else td
            part.set_non_tensor(self.meta_key, meta.select_keys(meta.keys[lo : lo + step]))
            parts.append(part)
        return parts

    def _take(self, index: int, pipe: _Pipe | None) -> KVBatchMeta | None:
        """``next_batch`` for ``index`` in wait slices (a stop is seen within one), up to ``timeout_s``."""
        start = time.monotonic()
        while True:
            if pipe is not None and pipe.stop:
                return None
            if self.timeout_s is None:
                wait = WAIT_SLICE_S
            else:
                wait = max(0.0, min(WAIT_SLICE_S, self.timeout_s - (time.monotonic() - start)))
            try:
                return self.next_meta(index, wait)
            except (BatchTimeoutError, PartitionNotFoundError) as exc:
                waited = time.monotonic() - start
                if self.timeout_s is not None and waited >= self.timeout_s:
                    raise BatchTimeoutError(
                        self.partition_id,
                        f"StreamingDataset: batch {index} of task {self.task_name!r} ({self.batch_size} "
                        f"rows of {self.fields} from partition {self.partition_id!r}) was not ready "
                        f"within timeout_s={self.timeout_s} (last check: {exc})",
                    ) from exc


def _check_int(what: str, value: object, low: int) -> None:
    if type(value) is not int:
        raise ArgumentTypeError(what, f"StreamingDataset: {what} must be an int, not {type(value).__name__}")
    if value < low:
        raise InvalidArgumentError(what, f"StreamingDataset: {what} must be >= {low}, got {value}")


class _StreamIterator:
    """One pass over a ``StreamingDataset``; ``close()`` (or ``with``) stops its prefetch thread."""

    def __init__(self, ds: StreamingDataset, base: int, offset: int, stride: int) -> None:
        start = base + offset
        self._ds = ds
        self._index = start  # the next batch to fetch without a thread
        self._offset = offset
        self._stride = stride
        self._threaded = ds.prefetch > 0
        self._parts: deque[StreamBatch] = deque()
        self._done = False
        self._pipe: _Pipe | None = None
        if self._threaded:
            pipe = _Pipe(ds.prefetch)
            pipe.thread = threading.Thread(
                target=_run,
                args=(ds, pipe, start, stride),
                name=f"{_THREAD_NAME}-{ds.task_name}",
                daemon=True,
            )
            _register_atexit()
            _live_pipes.add(pipe)
            self._pipe = pipe
            pipe.thread.start()

    def __iter__(self) -> _StreamIterator:
        return self

    def __next__(self) -> StreamBatch:
        if self._parts:
            return self._parts.popleft()
        if self._done:
            raise StopIteration
        try:
            item = self._next_batch()
        except BaseException:
            self.close()
            raise
        if item is None:
            self.close()
            raise StopIteration
        index, parts = item
        # handed over: a later pass of this dataset (in this process) continues after it
        self._ds._next_index = index + self._stride - self._offset
        self._parts.extend(parts)
        return self._parts.popleft()

    def _next_batch(self) -> tuple[int, list[StreamBatch]] | None:
        if not self._threaded:  # prefetch=0: fetch here
            parts = self._ds._fetch(self._index, None)
            if not parts:
                return None
            self._index += self._stride
            return self._index - self._stride, parts
        pipe = self._pipe
        assert pipe is not None
        with pipe.cond:
            while not pipe.items:
                if pipe.thread is None or not pipe.thread.is_alive():
                    raise RuntimeError("StreamingDataset: the prefetch thread ended without a result")
                pipe.cond.wait(1.0)
            item = pipe.items.popleft()
            pipe.free += 1  # a batch taken: the thread may fetch the next while this one is processed
            pipe.cond.notify_all()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _End):
            return None
        return item

    def close(self) -> None:
        """Stop the prefetch thread (waits for a store call in flight) and end the iteration."""
        self._done = True
        self._parts.clear()
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.shut(join_s=WAIT_SLICE_S + _rpc_timeout_s() + 1.0)
            _live_pipes.discard(pipe)

    def __enter__(self) -> _StreamIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass


def _rpc_timeout_s() -> float:
    client = _api._state.client
    return float(client.config.rpc_timeout_s) if client is not None else 60.0


__all__ = ["WAIT_SLICE_S", "StreamBatch", "StreamingDataset"]
