"""The worker side of a bridged call: metadata in, rows to the method, per-row outputs back.

``KVBatchMeta`` and ``StreamRequest`` carry ``__worker_bridge__`` (the protocol of
``controlplane.bridge``, implemented here without importing the controller): when a worker method
decorated with ``@register`` is called with one, this module, on the worker,

1. attaches the process to the store on first use (``dp.init(attach_only=True)``);
2. replaces every ``KVBatchMeta`` argument by the ``TensorDict`` of its rows (only the meta's
   ``fields`` when set), each ``extra_info`` item added as a non-tensor entry
   (``batch.get_non_tensor("temperature")``); an empty meta becomes an empty TensorDict without a
   store round trip. A ``StreamRequest`` first takes its batch with ``next_batch``;
3. calls the method;
4. splits a ``TensorDict`` output whose batch size is the meta's: per-row entries (tensors, and
   ``NonTensorStack`` columns such as decoded strings or chat messages) are written back under the
   same keys, on collect ranks only, except entries the method handed back unchanged; batch-level
   ``NonTensorData`` entries (a metric, a temperature) go into the returned meta's ``extra_info``.
   A collect rank returns the first meta with the new fields; another rank writes nothing and
   returns an empty meta of the same partition. Anything else (a dict of metrics, a TensorDict with
   an empty batch size, ``None``) is returned unchanged; a TensorDict of another batch size raises
   :class:`BridgeError`. A stream call returns a :class:`StreamReport` (counts and timings, no keys).

Which rows a streamed rank takes: a request chunked by a DP or mesh dispatch has ``dp_rank`` set;
the peers of one mesh replica (TP/PP ranks) receive the same chunk, so the bridge gives it a
``batch_index`` of its own, a per-group call counter hashed with the group's name (``WG_PREFIX``),
the partition and the task. Every rank of a group receives the same calls in the same order, so
peers compute the same index and the store's rank-aware cache hands them the same keys (and a
sampler that splits one batch over the DP ranks gets the same index from every rank). (An async
actor running calls of one task concurrently should pass ``batch_index`` itself.) An unchunked
request that every rank received (``ONE_TO_ALL`` / ``ALL_TO_ALL``) is one batch for the whole group
(``dp_rank=0``). An empty streamed batch does not call the method unless ``call_on_empty``.

``def`` methods use the store's blocking client (no loop, thread or socket per call); ``async def``
methods await the ``async_`` functions on the caller's loop. Every process counts the bytes its
bridge moved (:func:`traffic`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict, cast

import torch
from tensordict import TensorDict, TensorDictBase

from dataplane import api
from dataplane import stream as _stream
from dataplane.errors import (
    ArgumentTypeError,
    BridgeError,
    FieldNotFoundError,
    InvalidArgumentError,
    KeyNotFoundError,
    PartitionNotFoundError,
    StaleMetaError,
)
from dataplane.meta import KVBatchMeta
from dataplane.stream import StreamRequest, StreamResult


class BridgedCall(Protocol):
    """A bridged method's call as the controller hands it over (``controlplane.bridge.BridgedCall``:
    this package never imports the controller, so it names what it reads)."""

    @property
    def func(self) -> Callable[..., Any]: ...  # the user's method: returns whatever it returns
    @property
    def args(self) -> tuple[object, ...]: ...
    @property
    def kwargs(self) -> dict[str, object]: ...
    @property
    def collect(self) -> bool: ...  # this rank writes per-row outputs back
    @property
    def replicated(self) -> bool: ...  # every rank received the same arguments
    @property
    def call_on_empty(self) -> bool: ...
    @property
    def name(self) -> str: ...


# ---------------------------------------------------------------------------- byte counters

_counter_lock = threading.Lock()
_traffic = {"read_bytes": 0, "written_bytes": 0, "calls": 0}


def traffic() -> dict[str, int]:
    """Bytes this process's bridge read from and wrote to the store, and bridged calls made.

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


def count(key: str, nbytes: int) -> None:
    """Add ``nbytes`` to counter ``key`` (``read_bytes``, ``written_bytes`` or ``calls``)."""
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


# ---------------------------------------------------------------------------- arguments


def _first_meta(args: tuple[object, ...], kwargs: dict[str, object]) -> KVBatchMeta | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, KVBatchMeta):
            return value
    return None


def _meta_arg(args: tuple[object, ...], kwargs: dict[str, object]) -> KVBatchMeta:
    meta = _first_meta(args, kwargs)
    if meta is None:  # not reached: find_bridge picks this bridge for a KVBatchMeta or StreamRequest
        raise ArgumentTypeError("args", "a bridged call takes a KVBatchMeta or a StreamRequest")
    return meta


def _first_request(args: tuple[object, ...], kwargs: dict[str, object]) -> StreamRequest | None:
    found = [v for v in (*args, *kwargs.values()) if isinstance(v, StreamRequest)]
    if not found:
        return None
    if len(found) > 1 or _first_meta(args, kwargs) is not None:
        raise ArgumentTypeError(
            "args",
            "a bridged call takes one StreamRequest and no KVBatchMeta beside it (the method gets one batch)",
        )
    return found[0]


def _with_extra(td: TensorDictBase, meta: KVBatchMeta) -> TensorDictBase:
    for key, value in meta._extra.items():
        if key in td.keys():
            raise InvalidArgumentError(
                "extra_info",
                f"extra_info[{key!r}] has the name of a stored field of partition {meta._pid!r}; "
                "rename the extra_info entry (it would hide the field)",
            )
        td.set_non_tensor(key, value)
    return td


def _ensure_store() -> None:
    if not api.is_initialized():
        # A worker attaches to the driver's store; it must never start one of its own.
        api.init(attach_only=True)


def _stale(meta: KVBatchMeta, exc: KeyNotFoundError | PartitionNotFoundError, name: str) -> StaleMetaError:
    """The short error for a meta whose rows are gone: no store internals, says what to pass instead."""
    if isinstance(exc, KeyNotFoundError):
        return StaleMetaError(exc.key, meta._pid, name)
    return StaleMetaError(
        meta.keys[0],
        meta._pid,
        name,
        f"{name} got a stale KVBatchMeta: partition {meta._pid!r} was cleared (or never "
        "written), so its keys have no data; pass the meta a put returned after the clear",
    )


def _fetch(meta: KVBatchMeta, name: str) -> TensorDictBase:
    if meta.size == 0:
        return _with_extra(TensorDict({}, batch_size=[0]), meta)
    try:
        td = api.kv_batch_get(meta.keys, meta._pid, meta.fields)
    except FieldNotFoundError:
        raise  # the rows exist; a field is missing (its own clear message)
    except (KeyNotFoundError, PartitionNotFoundError) as exc:
        raise _stale(meta, exc, name) from None  # the store's internals add nothing for the caller
    count("read_bytes", nbytes_of(td))
    return _with_extra(td, meta)


async def _async_fetch(meta: KVBatchMeta, name: str) -> TensorDictBase:
    if meta.size == 0:
        return _with_extra(TensorDict({}, batch_size=[0]), meta)
    try:
        td = await api.async_kv_batch_get(meta.keys, meta._pid, meta.fields)
    except FieldNotFoundError:
        raise
    except (KeyNotFoundError, PartitionNotFoundError) as exc:
        raise _stale(meta, exc, name) from None
    count("read_bytes", nbytes_of(td))
    return _with_extra(td, meta)


def _replace(
    args: tuple[object, ...], kwargs: dict[str, object], kind: type, value_of: Callable[[Any], object]
) -> tuple[list[object], dict[str, object]]:
    new_args = [value_of(a) if isinstance(a, kind) else a for a in args]
    return new_args, {k: value_of(v) if isinstance(v, kind) else v for k, v in kwargs.items()}


async def _async_swap(
    args: tuple[object, ...], kwargs: dict[str, object], name: str
) -> tuple[list[object], dict[str, object]]:
    new_args = [await _async_fetch(a, name) if isinstance(a, KVBatchMeta) else a for a in args]
    new_kwargs = {
        k: await _async_fetch(v, name) if isinstance(v, KVBatchMeta) else v for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _inputs_of(args: list[object], kwargs: dict[str, object]) -> dict[str, list[Any]]:
    """The entries the method is given, by name (taken before the call: it may mutate them)."""
    seen: dict[str, list[Any]] = {}
    for td in (v for v in (*args, *kwargs.values()) if isinstance(v, TensorDictBase)):
        for key, value in td.items():
            seen.setdefault(key, []).append(value)
    return seen


# ---------------------------------------------------------------------------- outputs


@dataclasses.dataclass
class _Output:
    """A per-row output split: ``rows`` to write (None when the output is not per-row data) and
    batch-level ``extra`` values (``NonTensorData`` entries) for the result's ``extra_info``."""

    rows: TensorDict | None
    extra: dict[str, Any]


def _is_non_tensor(value: Any, kind: str) -> bool:
    return type(value).__name__ == kind and hasattr(value, "tolist")


def _split(output: Any, meta: KVBatchMeta, inputs: dict[str, list[Any]], name: str) -> _Output:
    if not isinstance(output, TensorDictBase) or not output.batch_size:
        return _Output(None, {})
    if output.batch_size[0] != meta.size:
        raise BridgeError(name, int(output.batch_size[0]), meta.size)
    rows, extra = {}, {}
    for key, value in output.items():
        if any(value is given for given in inputs.get(key, ())):
            continue  # an input handed back untouched: it is in the store (or in extra_info) already
        if _is_non_tensor(value, "NonTensorData"):
            data = value.data
            if key not in meta._extra or meta._extra[key] != data:
                extra[key] = data
        elif isinstance(value, torch.Tensor) or _is_non_tensor(value, "NonTensorStack"):
            rows[key] = value
    return _Output(TensorDict(rows, batch_size=[meta.size]), extra)


def _result_meta(
    meta: KVBatchMeta, written: list[str], stored: list[str] | None, extra: dict[str, Any]
) -> KVBatchMeta:
    if meta.fields is None:
        fields = stored
    else:
        fields = list(meta.fields) + [f for f in written if f not in meta.fields]
    return KVBatchMeta(list(meta.keys), meta.tags, meta._pid, fields, {**meta._extra, **extra})


def _plan(out: _Output, output: Any, meta: KVBatchMeta, collect: bool) -> tuple[Any, TensorDict | None]:
    """What a finished call returns: ``(result, None)`` when nothing is written, else ``(None, rows)``."""
    if out.rows is None:
        return output, None
    if not collect:
        return KVBatchMeta.empty(meta._pid), None
    if meta.size == 0 or not out.rows.keys():
        return _result_meta(meta, [], meta.fields, out.extra), None
    return None, out.rows


def _written(meta: KVBatchMeta, rows: TensorDict, extra: dict[str, Any], stored: KVBatchMeta) -> KVBatchMeta:
    count("written_bytes", nbytes_of(rows))
    written = cast("list[str]", list(rows.keys()))  # top-level keys (not include_nested): all str
    return _result_meta(meta, written, stored.fields, extra)


def _run_meta(call: BridgedCall, meta: KVBatchMeta) -> Any:
    new_args, new_kwargs = _replace(call.args, call.kwargs, KVBatchMeta, lambda m: _fetch(m, call.name))
    inputs = _inputs_of(new_args, new_kwargs)
    output = call.func(*new_args, **new_kwargs)
    out = _split(output, meta, inputs, call.name)
    result, rows = _plan(out, output, meta, call.collect)
    if rows is None:
        return result
    return _written(meta, rows, out.extra, api.kv_batch_put(meta.keys, meta._pid, fields=rows))


async def _arun_meta(call: BridgedCall, meta: KVBatchMeta) -> Any:
    new_args, new_kwargs = await _async_swap(call.args, call.kwargs, call.name)
    inputs = _inputs_of(new_args, new_kwargs)
    output = await call.func(*new_args, **new_kwargs)
    out = _split(output, meta, inputs, call.name)
    result, rows = _plan(out, output, meta, call.collect)
    if rows is None:
        return result
    return _written(meta, rows, out.extra, await api.async_kv_batch_put(meta.keys, meta._pid, fields=rows))


# ---------------------------------------------------------------------------- streaming


class Span(TypedDict):
    """One batch a collect rank processed; times are wall-clock (``time.time()``) seconds."""

    task: str
    method: str
    partition: str
    rank: int
    rows: int
    called: float  # the call began
    start: float  # the batch was taken
    end: float  # its outputs were written


@dataclasses.dataclass
class StreamReport(StreamResult):
    """What a bridged method called with a ``StreamRequest`` returns: a ``StreamResult`` (``rows``
    and ``batches`` this rank processed, counted on collect ranks only, ``finished`` when its batch
    was empty) plus what the driver may see of the work, never keys or tensors.

    Attributes:
        spans: one dict per batch processed on a collect rank: ``task``, ``method``,
            ``partition``, ``rank``, ``rows`` and wall-clock times (``time.time()``): ``called``
            (the call began), ``start`` (the batch was taken) and ``end`` (outputs written).
        outputs: the method's non-row outputs (a dict of metrics, ...), one per rank that
            returned one; per-row outputs are written to the store instead.

    Concatenating reports (the controller's collect) adds the counts and joins the lists.
    """

    spans: list[Span] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def concat(cls, parts: Sequence[StreamResult]) -> StreamReport:
        total = StreamResult.concat(parts)
        return cls(
            total.partition_id,
            total.task_name,
            total.rows,
            total.batches,
            total.finished,
            [span for p in parts for span in getattr(p, "spans", ())],
            [out for p in parts for out in getattr(p, "outputs", ())],
        )


_index_lock = threading.Lock()
_call_counts: OrderedDict[tuple[object, ...], int] = OrderedDict()
_COUNTS_KEPT = 4096  # (partition, task) call counters kept; the oldest are forgotten


def _auto_batch_index(request: StreamRequest, dp_size: int | None) -> int:
    """The ``batch_index`` of this call: the same on every rank of one group for its n-th call of a
    (partition, task), different across groups and calls (see the module docstring). Not per DP
    rank: a sampler that splits one global batch over the ranks needs every rank of a call to pass
    the same index; the store keys its cache by rank as well."""
    group = os.environ.get("WG_PREFIX") or f"pid{os.getpid()}"
    stream = (group, request.partition_id, request.task_name, dp_size, tuple(request.fields))
    with _index_lock:
        n = _call_counts.pop(stream, 0)
        _call_counts[stream] = n + 1
        while len(_call_counts) > _COUNTS_KEPT:
            _call_counts.popitem(last=False)
    digest = hashlib.blake2b(repr((*stream, n)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: a non-negative int the index accepts


def _effective_request(request: StreamRequest, replicated: bool) -> StreamRequest:
    """The request this rank sends: DP rank / size and a batch index settled (module docstring)."""
    dp_rank, dp_size, batch_index = request.dp_rank, request.dp_size, request.batch_index
    if dp_rank is None and replicated:
        dp_rank, dp_size = 0, 1  # every rank received the same request: one batch for the group
    if dp_rank is not None and batch_index is None:
        batch_index = _auto_batch_index(request, dp_size)
    return dataclasses.replace(request, dp_rank=dp_rank, dp_size=dp_size, batch_index=batch_index)


class _StreamCall:
    """One stream call on one rank: the batch taken, the timings, and the report."""

    def __init__(self, call: BridgedCall, request: StreamRequest) -> None:
        self.called = time.time()
        self.call = call
        self.request = _effective_request(request, call.replicated)
        self.rank = int(getattr(call.args[0], "rank", 0) or 0) if call.args else 0
        self.meta = KVBatchMeta.empty(request.partition_id)
        self.start = self.called

    def took(self, meta: KVBatchMeta) -> bool:
        """Record the batch; True when the method is to be called with it."""
        self.meta, self.start = meta, time.time()
        return meta.size > 0 or self.call.call_on_empty

    @property
    def leased(self) -> bool:
        """The batch is leased and this rank answers for it (a collect rank: the one that writes)."""
        return self.call.collect and "lease" in self.meta._extra

    def rows_to_write(self, output: Any, inputs: dict[str, list[Any]]) -> TensorDict | None:
        out = _split(output, self.meta, inputs, self.call.name)
        self.per_row = out.rows is not None
        if out.rows is None or not self.call.collect or self.meta.size == 0 or not out.rows.keys():
            return None
        return out.rows

    def wrote(self, rows: TensorDict | None) -> None:
        if rows is not None:
            count("written_bytes", nbytes_of(rows))

    def report(self, output: Any = None) -> StreamReport:
        meta, req, collect = self.meta, self.request, self.call.collect
        report = StreamReport(req.partition_id, req.task_name, finished=meta.size == 0)
        if output is not None and not getattr(self, "per_row", False):
            report.outputs.append(output)
        if collect and meta.size:
            report.rows, report.batches = meta.size, 1
            report.spans.append(
                {
                    "task": req.task_name,
                    "method": self.call.name.rsplit(".", 1)[-1],
                    "partition": req.partition_id,
                    "rank": self.rank,
                    "rows": meta.size,
                    "called": self.called,
                    "start": self.start,
                    "end": time.time(),
                }
            )
        return report


def _run_stream(call: BridgedCall, request: StreamRequest) -> StreamReport:
    stream = _StreamCall(call, request)
    if not stream.took(stream.request.next_batch()):
        return stream.report()
    try:
        new_args, new_kwargs = _replace(
            call.args, call.kwargs, StreamRequest, lambda _r: _fetch(stream.meta, call.name)
        )
        inputs = _inputs_of(new_args, new_kwargs)
        output = call.func(*new_args, **new_kwargs)
        rows = stream.rows_to_write(output, inputs)
        if rows is not None:
            api.kv_batch_put(stream.meta.keys, stream.meta._pid, fields=rows)
    except BaseException:
        if stream.leased:  # not done with: another consumer of the task gets it at once
            _stream.release(stream.meta)
        raise
    if stream.leased:
        _stream.ack(stream.meta)
    stream.wrote(rows)
    return stream.report(output)


async def _arun_stream(call: BridgedCall, request: StreamRequest) -> StreamReport:
    stream = _StreamCall(call, request)
    if not stream.took(await stream.request.async_next_batch()):
        return stream.report()
    try:
        td = await _async_fetch(stream.meta, call.name)
        new_args, new_kwargs = _replace(call.args, call.kwargs, StreamRequest, lambda _r: td)
        inputs = _inputs_of(new_args, new_kwargs)
        output = await call.func(*new_args, **new_kwargs)
        rows = stream.rows_to_write(output, inputs)
        if rows is not None:
            await api.async_kv_batch_put(stream.meta.keys, stream.meta._pid, fields=rows)
    except BaseException:
        if stream.leased:
            _stream.release(stream.meta)  # blocking: a cancelled coroutine may not get to run it
        raise
    if stream.leased:
        await _stream.async_ack(stream.meta)
    stream.wrote(rows)
    return stream.report(output)


# ---------------------------------------------------------------------------- the protocol


class WorkerBridge:
    """``__worker_bridge__`` of ``KVBatchMeta`` and ``StreamRequest`` (see ``controlplane.bridge``):
    ``call`` has ``func``, ``args``, ``kwargs``, ``collect``, ``replicated``, ``call_on_empty``
    and ``name``."""

    def run(self, call: BridgedCall) -> Any:
        request = _first_request(call.args, call.kwargs)
        _ensure_store()
        count("calls", 1)
        if request is not None:
            return _run_stream(call, request)
        return _run_meta(call, _meta_arg(call.args, call.kwargs))

    async def arun(self, call: BridgedCall) -> Any:
        request = _first_request(call.args, call.kwargs)
        _ensure_store()
        count("calls", 1)
        if request is not None:
            return await _arun_stream(call, request)
        return await _arun_meta(call, _meta_arg(call.args, call.kwargs))
