"""``tqbridge``: let worker methods take ``KVBatchMeta`` and do their own data movement.

The driver passes metadata; the bridge, running on the worker, turns it into data and back::

    class Actor(Worker):
        @register(dispatch_mode=make_nd_compute_dispatch_fn("actor"))
        @tqbridge(dispatch_mode=make_nd_compute_dispatch_fn("actor"))
        def compute_log_prob(self, batch: TensorDict) -> TensorDict:
            return TensorDict({"old_log_probs": ...}, batch.batch_size)

    meta = actor_wg.compute_log_prob(meta)   # a KVBatchMeta in, a KVBatchMeta out

or, in one line, ``@bridged_register(dispatch_mode=M)`` (``register(M)`` over ``tqbridge(M)``).

What the wrapper does, on the worker, when an argument (positional or keyword) is a
``KVBatchMeta``:

1. attaches this process to the store on first use (``dp.init(attach_only=True)``);
2. replaces every ``KVBatchMeta`` argument by the ``TensorDict`` of its rows (only the meta's
   ``fields`` when set), with each ``extra_info`` item added as a non-tensor entry
   (``batch.get_non_tensor("temperature")``); an empty meta becomes an empty TensorDict
   without a store round trip;
3. calls the method;
4. if it returns a ``TensorDict`` whose batch size is the first meta's size, writes its tensor
   fields back under the same keys (fields the method passed through unchanged are not
   rewritten), but only on a *collect rank* of the method's dispatch mode, and returns the
   first meta with the new fields added and its tags and ``extra_info`` kept. A rank that is not
   a collect rank writes nothing and returns an empty meta of the same partition.
   Anything else (a dict of metrics, a TensorDict with an empty batch size, ``None``) is
   returned unchanged. A TensorDict of another batch size raises :class:`BridgeError`.

Collect ranks: for a mesh dispatch (``make_nd_compute_dispatch_fn(mesh)``) they are the ranks
that registered ``is_collect=True`` for that mesh (``Worker.query_collect_info``); for
``Dispatch.ONE_TO_ALL`` (every rank receives the same meta) only rank 0 writes, so the same
rows are not written ``world_size`` times; for every other mode every rank is a collect rank.

Streaming: when an argument is a ``dp.StreamRequest`` instead (the method pulls its own ready
rows), the bridge, on each rank:

1. takes the batch with ``next_batch`` (the request that reaches rank ``i`` carries its
   ``dp_rank`` / ``dp_size``, set by ``StreamRequest.chunk`` in the controller's DP dispatch; the
   ranks of one replica share a ``batch_index``, see below, so they get the same keys);
2. fetches those rows and calls the method with their ``TensorDict`` (other arguments unchanged);
3. writes per-row outputs back from collect ranks only, as for a meta;
4. returns a :class:`StreamReport` (a ``dp.StreamResult``: counts, no keys) with the wall-clock
   span of the batch and the method's non-row output (metrics), so the driver never sees keys.

An empty batch (the partition is finished and this task drained it) does not call the method
unless the decorator says ``call_on_empty=True`` (a method that must join a collective, such as a
data-parallel update, on every rank); the report says ``finished=True``.

Which rows a rank gets: a request chunked by a DP or mesh dispatch has ``dp_rank`` set. The peers
of one mesh replica (TP/PP ranks) receive the same chunk, and ``StreamRequest.chunk`` keeps
``batch_index`` (``None`` unless the caller set it), so the bridge gives such a request a
``batch_index`` of its own: a per-group call counter hashed with the group's name (``WG_PREFIX``),
the partition and the task. Every rank of a group receives the same calls in the same order, so
peers compute the same index and the store's rank-aware cache hands them the same keys (and a
sampler that splits one batch over the DP ranks, ``dp.SeqlenBalancedSampler``, gets the same index
from every rank), while other groups and later calls get other indexes. (For an async actor running
calls of one task concurrently, pass ``batch_index`` yourself: the counter assumes calls start in
the order they were sent.) An unchunked request under ``Dispatch.ONE_TO_ALL`` /
``ALL_TO_ALL`` (every rank gets the same request, as it would the same meta) is one batch for the
whole group: every rank takes the same keys (``dp_rank=0``). A request whose ``batch_index`` is
set is used as given (a repeated index returns the same keys again: for retries).

A call without a ``KVBatchMeta`` or ``StreamRequest`` runs the method unchanged and never touches
the store.
``def`` methods use the store's blocking client (no event loop, thread or socket is created per
call; the client's sockets are opened once per process); ``async def`` methods await the
store's ``async_`` functions on the caller's own loop.

Every process keeps counters of the bytes its bridge moved (:func:`traffic`); the trainer
reports them as the bytes that went through the store rather than through the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

import dataplane as dp
from controlplane import Dispatch, register

logger = logging.getLogger(__name__)

__all__ = ["BridgeError", "StreamReport", "bridged_register", "reset_traffic", "tqbridge", "traffic"]


class BridgeError(ValueError):
    """A bridged method returned a TensorDict whose batch size is not the meta's.

    Raised on the worker (and re-raised on the driver by Ray). Not recoverable by retrying:
    the method must return one row per key of the meta it was given (or metrics).
    """

    def __init__(self, method: str, got: int, expected: int) -> None:
        super().__init__(
            f"{method} returned a TensorDict of batch size {got} for a KVBatchMeta of {expected} keys; "
            "a bridged method must return one row per key (or a dict of metrics)"
        )
        self.method, self.got, self.expected = method, got, expected
        self.args = (method, got, expected)

    def __reduce__(self) -> tuple:
        return (BridgeError, (self.method, self.got, self.expected))


_counter_lock = threading.Lock()
_traffic = {"read_bytes": 0, "written_bytes": 0, "calls": 0}


def traffic() -> dict[str, int]:
    """Bytes this process's bridge read from and wrote to the store, bridged calls made, and reads
    of a stream batch that had to be repeated (see :func:`_fetch_taken`).

    Example:
        >>> sorted(traffic())
        ['calls', 'read_bytes', 'written_bytes']
    """
    with _counter_lock:
        return dict(_traffic)


def reset_traffic() -> None:
    """Zero this process's counters."""
    with _counter_lock:
        for k in _traffic:
            _traffic[k] = 0


def _count(key: str, nbytes: int) -> None:
    with _counter_lock:
        _traffic[key] += nbytes


def nbytes_of(td: TensorDictBase) -> int:
    """Bytes of the tensor payload of ``td`` (jagged tensors count their values)."""
    total = 0
    for value in td.values(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                value = value.values()
            total += value.numel() * value.element_size()
    return total


# ---------------------------------------------------------------------------- collect ranks


def _collect_rule(dispatch_mode: Any) -> Callable[[Any], bool]:
    """A function ``self -> bool``: does this worker write back under ``dispatch_mode``?"""
    if dispatch_mode is None:
        return lambda _self: True
    if isinstance(dispatch_mode, dict):
        mesh = getattr(dispatch_mode.get("collect_fn"), "mesh_name", None)
        if mesh is None:
            return lambda _self: True

        def on_mesh(self: Any) -> bool:
            query = getattr(self, "query_collect_info", None)
            return True if query is None else bool(query(mesh))

        return on_mesh
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(
            f"tqbridge dispatch_mode must be a Dispatch member, a {{dispatch_fn, collect_fn}} dict or None, "
            f"got {type(dispatch_mode).__name__}"
        )
    if dispatch_mode is Dispatch.ONE_TO_ALL:
        return lambda self: getattr(self, "rank", 0) == 0
    return lambda _self: True


# ---------------------------------------------------------------------------- argument handling


def _first_meta(args: tuple, kwargs: dict) -> dp.KVBatchMeta | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, dp.KVBatchMeta):
            return value
    return None


def _with_extra(td: TensorDictBase, meta: dp.KVBatchMeta) -> TensorDictBase:
    for key, value in meta.extra_info.items():
        if key in td.keys():
            raise ValueError(
                f"extra_info[{key!r}] has the name of a stored field of partition {meta.partition_id!r}; "
                "rename the extra_info entry (it would hide the field)"
            )
        td.set_non_tensor(key, value)
    return td


def _ensure_store() -> None:
    if not dp.is_initialized():
        # A worker attaches to the driver's store; it must never start one of its own.
        dp.init(attach_only=True)


def _fetch(meta: dp.KVBatchMeta) -> TensorDictBase:
    if meta.size == 0:
        return _with_extra(TensorDict({}, batch_size=[0]), meta)
    td = dp.kv_batch_get(meta.keys, meta.partition_id, meta.fields)
    _count("read_bytes", nbytes_of(td))
    return _with_extra(td, meta)


async def _async_fetch(meta: dp.KVBatchMeta) -> TensorDictBase:
    if meta.size == 0:
        return _with_extra(TensorDict({}, batch_size=[0]), meta)
    td = await dp.async_kv_batch_get(meta.keys, meta.partition_id, meta.fields)
    _count("read_bytes", nbytes_of(td))
    return _with_extra(td, meta)


def _swap(args: tuple, kwargs: dict, convert: Callable[[dp.KVBatchMeta], Any]) -> tuple[list, dict]:
    new_args = [convert(a) if isinstance(a, dp.KVBatchMeta) else a for a in args]
    new_kwargs = {k: convert(v) if isinstance(v, dp.KVBatchMeta) else v for k, v in kwargs.items()}
    return new_args, new_kwargs


async def _async_swap(args: tuple, kwargs: dict) -> tuple[list, dict]:
    new_args = [await _async_fetch(a) if isinstance(a, dp.KVBatchMeta) else a for a in args]
    new_kwargs = {k: await _async_fetch(v) if isinstance(v, dp.KVBatchMeta) else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _inputs_of(args: list, kwargs: dict) -> dict[str, list[Any]]:
    """The tensors the method is given, by field name (taken before the call: it may mutate them)."""
    seen: dict[str, list[Any]] = {}
    for td in (v for v in (*args, *kwargs.values()) if isinstance(v, TensorDictBase)):
        for key, value in td.items():
            seen.setdefault(key, []).append(value)
    return seen


# ---------------------------------------------------------------------------- output handling


def _to_write(
    output: Any, meta: dp.KVBatchMeta, inputs: list[TensorDictBase], name: str
) -> TensorDict | None:
    """The tensor fields to write back, or None when the output is not per-row data."""
    if not isinstance(output, TensorDictBase) or not output.batch_size:
        return None
    if output.batch_size[0] != meta.size:
        raise BridgeError(name, int(output.batch_size[0]), meta.size)
    fields = {}
    for key, value in output.items():
        if not isinstance(value, torch.Tensor):
            continue  # non-tensor entries (extra_info passed through) are not rows to store
        if any(value is given for given in inputs.get(key, ())):
            continue  # an input field handed back untouched: it is in the store already
        fields[key] = value
    return TensorDict(fields, batch_size=[meta.size])


def _result_meta(meta: dp.KVBatchMeta, written: list[str], stored: list[str] | None) -> dp.KVBatchMeta:
    if meta.fields is None:
        fields = stored
    else:
        fields = list(meta.fields) + [f for f in written if f not in meta.fields]
    return dp.KVBatchMeta(list(meta.keys), meta.tags, meta.partition_id, fields, meta.extra_info)


def _plan_write(
    output: Any, meta: dp.KVBatchMeta, inputs: list[TensorDictBase], name: str, collect: bool
) -> tuple[Any, TensorDict | None]:
    """What a finished call returns: ``(result, None)`` when nothing is written, else ``(None, data)``."""
    data = _to_write(output, meta, inputs, name)
    if data is None:
        return output, None
    if not collect:
        return dp.KVBatchMeta.empty(meta.partition_id), None
    if meta.size == 0 or not data.keys():
        return _result_meta(meta, [], meta.fields), None
    return None, data


def _written(meta: dp.KVBatchMeta, data: TensorDict, stored: dp.KVBatchMeta) -> dp.KVBatchMeta:
    _count("written_bytes", nbytes_of(data))
    return _result_meta(meta, list(data.keys()), stored.fields)


def _finish(output: Any, meta: dp.KVBatchMeta, inputs: list[TensorDictBase], name: str, collect: bool) -> Any:
    result, data = _plan_write(output, meta, inputs, name, collect)
    if data is None:
        return result
    return _written(meta, data, dp.kv_batch_put(meta.keys, meta.partition_id, fields=data))


async def _async_finish(
    output: Any, meta: dp.KVBatchMeta, inputs: list[TensorDictBase], name: str, collect: bool
) -> Any:
    result, data = _plan_write(output, meta, inputs, name, collect)
    if data is None:
        return result
    stored = await dp.async_kv_batch_put(meta.keys, meta.partition_id, fields=data)
    return _written(meta, data, stored)


# ---------------------------------------------------------------------------- streaming


@dataclasses.dataclass
class StreamReport(dp.StreamResult):
    """What a bridged method called with a ``dp.StreamRequest`` returns: a ``dp.StreamResult``
    (``rows`` and ``batches`` this rank processed, counted on collect ranks only, ``finished``
    when its batch was empty) plus what the driver may see of the work, never keys or tensors.

    Attributes:
        spans: one dict per batch processed on a collect rank: ``task``, ``method``,
            ``partition``, ``rank``, ``rows`` and wall-clock times (``time.time()``): ``called``
            (the call began), ``start`` (the batch was taken) and ``end`` (outputs written).
        outputs: the method's non-row outputs (a dict of metrics, ...), one per rank that
            returned one; per-row outputs are written to the store instead.

    Concatenating reports (the controller's collect) adds the counts and joins the lists.
    """

    spans: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)

    def chunk(self, n: int) -> list[StreamReport]:
        return [self] + [StreamReport(self.partition_id, self.task_name) for _ in range(n - 1)]

    @classmethod
    def concat(cls, parts: list[StreamReport]) -> StreamReport:
        total = dp.StreamResult.concat(parts)
        return cls(
            total.partition_id,
            total.task_name,
            total.rows,
            total.batches,
            total.finished,
            [span for p in parts for span in getattr(p, "spans", ())],
            [out for p in parts for out in getattr(p, "outputs", ())],
        )


def _first_request(args: tuple, kwargs: dict) -> dp.StreamRequest | None:
    found = [v for v in (*args, *kwargs.values()) if isinstance(v, dp.StreamRequest)]
    if not found:
        return None
    if len(found) > 1 or _first_meta(args, kwargs) is not None:
        raise TypeError(
            "a bridged call takes one StreamRequest and no KVBatchMeta beside it (the method gets one batch)"
        )
    return found[0]


_index_lock = threading.Lock()
_call_counts: OrderedDict[tuple, int] = OrderedDict()
_COUNTS_KEPT = 4096  # (partition, task) call counters kept; the oldest are forgotten


def _auto_batch_index(request: dp.StreamRequest, dp_size: int | None) -> int:
    """The ``batch_index`` of this call: the same on every rank of one group for its n-th call of a
    (partition, task), different across groups and calls (see the module docstring). Not per DP
    rank: a sampler that splits one global batch over the ranks (``SeqlenBalancedSampler``) needs
    every rank of a call to pass the same index; the store keys its cache by rank as well."""
    group = os.environ.get("WG_PREFIX") or f"pid{os.getpid()}"
    stream = (group, request.partition_id, request.task_name, dp_size, tuple(request.fields))
    with _index_lock:
        count = _call_counts.pop(stream, 0)
        _call_counts[stream] = count + 1
        while len(_call_counts) > _COUNTS_KEPT:
            _call_counts.popitem(last=False)
    digest = hashlib.blake2b(repr((*stream, count)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: a non-negative int the index accepts


def _effective_request(request: dp.StreamRequest, replicated: bool) -> dp.StreamRequest:
    """The request this rank sends: DP rank / size and a batch index settled (module docstring)."""
    dp_rank, dp_size, batch_index = request.dp_rank, request.dp_size, request.batch_index
    if dp_rank is None and replicated:
        dp_rank, dp_size = 0, 1  # every rank received the same request: one batch for the group
    if dp_rank is not None and batch_index is None:
        batch_index = _auto_batch_index(request, dp_size)
    return dataclasses.replace(request, dp_rank=dp_rank, dp_size=dp_size, batch_index=batch_index)


def _swap_request(args: tuple, kwargs: dict, td: TensorDictBase) -> tuple[list, dict]:
    new_args = [td if isinstance(a, dp.StreamRequest) else a for a in args]
    new_kwargs = {k: td if isinstance(v, dp.StreamRequest) else v for k, v in kwargs.items()}
    return new_args, new_kwargs


class _StreamCall:
    """One stream call on one rank: the batch taken, the timings, and the report."""

    def __init__(self, request: dp.StreamRequest, replicated: bool, worker: Any, name: str) -> None:
        self.called = time.time()
        self.request = _effective_request(request, replicated)
        self.rank = int(getattr(worker, "rank", 0) or 0)
        self.name = name
        self.meta: dp.KVBatchMeta | None = None
        self.start = self.called

    def took(self, meta: dp.KVBatchMeta) -> None:
        self.meta = meta
        self.start = time.time()

    def report(self, output: Any, per_row: bool, collect: bool) -> StreamReport:
        meta, req = self.meta, self.request
        size = meta.size if meta is not None else 0
        report = StreamReport(req.partition_id, req.task_name, finished=size == 0)
        if output is not None and not per_row:
            report.outputs.append(output)
        if collect and size:
            report.rows, report.batches = size, 1
            report.spans.append(
                {
                    "task": req.task_name,
                    "method": self.name.rsplit(".", 1)[-1],
                    "partition": req.partition_id,
                    "rank": self.rank,
                    "rows": size,
                    "called": self.called,
                    "start": self.start,
                    "end": time.time(),
                }
            )
        return report


def _stream_write(
    output: Any, meta: dp.KVBatchMeta, inputs: dict, name: str, collect: bool
) -> tuple[TensorDict | None, bool]:
    """``(rows to write or None, whether the output is per-row data)`` for one stream batch."""
    data = _to_write(output, meta, inputs, name)
    if data is None:
        return None, False
    if not collect or meta.size == 0 or not data.keys():
        return None, True
    return data, True


def _run_stream(
    func: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    request: dp.StreamRequest,
    replicated: bool,
    call_on_empty: bool,
    collect: bool,
    name: str,
) -> StreamReport:
    call = _StreamCall(request, replicated, args[0] if args else None, name)
    call.took(call.request.next_batch())
    meta = call.meta
    if meta.size == 0 and not call_on_empty:
        return call.report(None, False, collect)
    new_args, new_kwargs = _swap_request(args, kwargs, _fetch(meta))
    inputs = _inputs_of(new_args, new_kwargs)
    output = func(*new_args, **new_kwargs)
    data, per_row = _stream_write(output, meta, inputs, name, collect)
    if data is not None:
        dp.kv_batch_put(meta.keys, meta.partition_id, fields=data)
        _count("written_bytes", nbytes_of(data))
    return call.report(output, per_row, collect)


async def _async_run_stream(
    func: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    request: dp.StreamRequest,
    replicated: bool,
    call_on_empty: bool,
    collect: bool,
    name: str,
) -> StreamReport:
    call = _StreamCall(request, replicated, args[0] if args else None, name)
    call.took(await call.request.async_next_batch())
    meta = call.meta
    if meta.size == 0 and not call_on_empty:
        return call.report(None, False, collect)
    new_args, new_kwargs = _swap_request(args, kwargs, await _async_fetch(meta))
    inputs = _inputs_of(new_args, new_kwargs)
    output = await func(*new_args, **new_kwargs)
    data, per_row = _stream_write(output, meta, inputs, name, collect)
    if data is not None:
        await dp.async_kv_batch_put(meta.keys, meta.partition_id, fields=data)
        _count("written_bytes", nbytes_of(data))
    return call.report(output, per_row, collect)


# ---------------------------------------------------------------------------- the decorator


def tqbridge(
    dispatch_mode: Any = None, *, call_on_empty: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a worker method accept ``KVBatchMeta`` or ``dp.StreamRequest`` in place of data (see
    the module docstring).

    Place it under ``@register`` with the same dispatch mode, so the bridge knows which ranks
    write back.

    Args:
        dispatch_mode: the method's dispatch mode (a ``Dispatch`` member or a
            ``{dispatch_fn, collect_fn}`` dict); None: every rank writes back.
        call_on_empty: for a ``StreamRequest`` whose batch is empty (partition finished and
            drained), still call the method with an empty ``TensorDict`` (a method that must join
            a collective on every rank); default: skip it and report ``finished=True``.

    Raises:
        TypeError: ``dispatch_mode`` is neither (at decoration time).

    Example:
        >>> class Scorer(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     def score(self, batch):
        ...         return TensorDict({"rewards": batch["responses"].float().mean(-1)}, batch.batch_size)
    """
    is_collect = _collect_rule(dispatch_mode)
    replicated = dispatch_mode is Dispatch.ONE_TO_ALL or dispatch_mode is Dispatch.ALL_TO_ALL
    if not isinstance(call_on_empty, bool):
        raise TypeError(f"call_on_empty must be a bool, got {call_on_empty!r}")

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(func, "__qualname__", repr(func))

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                request = _first_request(args, kwargs)
                if request is not None:
                    _ensure_store()
                    _count("calls", 1)
                    collect = is_collect(args[0]) if args else True
                    return await _async_run_stream(
                        func, args, kwargs, request, replicated, call_on_empty, collect, name
                    )
                meta = _first_meta(args, kwargs)
                if meta is None:
                    return await func(*args, **kwargs)
                _ensure_store()
                _count("calls", 1)
                collect = is_collect(args[0]) if args else True
                new_args, new_kwargs = await _async_swap(args, kwargs)
                inputs = _inputs_of(new_args, new_kwargs)
                output = await func(*new_args, **new_kwargs)
                return await _async_finish(output, meta, inputs, name, collect)

            async_wrapper.__tqbridge__ = {  # type: ignore[attr-defined]
                "dispatch_mode": dispatch_mode,
                "call_on_empty": call_on_empty,
            }
            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = _first_request(args, kwargs)
            if request is not None:
                _ensure_store()
                _count("calls", 1)
                collect = is_collect(args[0]) if args else True
                return _run_stream(func, args, kwargs, request, replicated, call_on_empty, collect, name)
            meta = _first_meta(args, kwargs)
            if meta is None:
                return func(*args, **kwargs)
            _ensure_store()
            _count("calls", 1)
            collect = is_collect(args[0]) if args else True
            new_args, new_kwargs = _swap(args, kwargs, _fetch)
            inputs = _inputs_of(new_args, new_kwargs)
            output = func(*new_args, **new_kwargs)
            return _finish(output, meta, inputs, name, collect)

        wrapper.__tqbridge__ = {  # type: ignore[attr-defined]
            "dispatch_mode": dispatch_mode,
            "call_on_empty": call_on_empty,
        }
        return wrapper

    return decorator


def bridged_register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL, *, call_on_empty: bool = False, **register_kwargs: Any
) -> Callable[..., Any]:
    """``@register(dispatch_mode=M, ...)`` over ``@tqbridge(dispatch_mode=M)`` in one decorator.

    Args:
        dispatch_mode: the dispatch mode for both.
        call_on_empty: passed to ``tqbridge``.
        **register_kwargs: ``execute_mode``, ``blocking``, ``materialize_futures`` for ``register``.

    Example:
        >>> class Scorer(Worker):
        ...     @bridged_register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     def score(self, batch): ...
    """
    outer = register(dispatch_mode=dispatch_mode, **register_kwargs)
    inner = tqbridge(dispatch_mode=dispatch_mode, call_on_empty=call_on_empty)

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return outer(inner(func))

    return decorator
