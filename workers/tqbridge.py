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

A call without a ``KVBatchMeta`` runs the method unchanged and never touches the store.
``def`` methods use the store's blocking client (no event loop, thread or socket is created per
call; the client's sockets are opened once per process); ``async def`` methods await the
store's ``async_`` functions on the caller's own loop.

Every process keeps counters of the bytes its bridge moved (:func:`traffic`); the trainer
reports them as the bytes that went through the store rather than through the driver.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

import dataplane as dp
from controlplane import Dispatch, register

logger = logging.getLogger(__name__)

__all__ = ["BridgeError", "bridged_register", "reset_traffic", "tqbridge", "traffic"]


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


# ---------------------------------------------------------------------------- the decorator


def tqbridge(dispatch_mode: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a worker method accept ``KVBatchMeta`` in place of data (see the module docstring).

    Place it under ``@register`` with the same dispatch mode, so the bridge knows which ranks
    write back.

    Args:
        dispatch_mode: the method's dispatch mode (a ``Dispatch`` member or a
            ``{dispatch_fn, collect_fn}`` dict); None: every rank writes back.

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

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(func, "__qualname__", repr(func))

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
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

            async_wrapper.__tqbridge__ = {"dispatch_mode": dispatch_mode}  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
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

        wrapper.__tqbridge__ = {"dispatch_mode": dispatch_mode}  # type: ignore[attr-defined]
        return wrapper

    return decorator


def bridged_register(dispatch_mode: Any = Dispatch.ALL_TO_ALL, **register_kwargs: Any) -> Callable[..., Any]:
    """``@register(dispatch_mode=M, ...)`` over ``@tqbridge(dispatch_mode=M)`` in one decorator.

    Args:
        dispatch_mode: the dispatch mode for both.
        **register_kwargs: ``execute_mode``, ``blocking``, ``materialize_futures`` for ``register``.

    Example:
        >>> class Scorer(Worker):
        ...     @bridged_register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        ...     def score(self, batch): ...
    """
    outer = register(dispatch_mode=dispatch_mode, **register_kwargs)
    inner = tqbridge(dispatch_mode=dispatch_mode)

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return outer(inner(func))

    return decorator
