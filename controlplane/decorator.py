"""``@register``: how a worker method is dispatched, executed and collected by its group.

``Dispatch`` and ``Execute`` (defined in ``controlplane.modes``, re-exported here) are extensible
enums (members keep their identity after a Ray round trip). The registry maps each ``Dispatch``
member to its ``{dispatch_fn, collect_fn}``; ``register_dispatch_mode`` adds a mode and
``update_dispatch_mode`` replaces one. A custom ``{"dispatch_fn": ..., "collect_fn": ...}`` dict
may be given instead of a member. Everything is validated when the decorator is applied, not at
the first call.

Example:
    >>> class Doubler(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    ...     def double(self, batch):
    ...         return batch * 2
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from controlplane import bridge as _bridge
from controlplane import dispatch as _d
from controlplane.future import BatchFuture, materialize, materialize_async
from controlplane.modes import Dispatch as Dispatch  # re-exported: verl code imports them from here
from controlplane.modes import Execute as Execute

logger = logging.getLogger(__name__)

# Attribute under which @register stores its settings on the wrapper.
MAGIC_ATTR = "_controlplane_register_attrs"


_DISPATCH_KEYS = ("dispatch_fn", "collect_fn")

_DISPATCH_REGISTRY: dict[Dispatch, dict[str, Callable[..., Any]]] = {
    Dispatch.RANK_ZERO: {"dispatch_fn": _d.dispatch_rank_zero, "collect_fn": _d.collect_rank_zero},
    Dispatch.ONE_TO_ALL: {"dispatch_fn": _d.dispatch_one_to_all, "collect_fn": _d.collect_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": _d.dispatch_all_to_all, "collect_fn": _d.collect_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": _d.dispatch_dp_compute, "collect_fn": _d.collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": _d.dispatch_dp_compute_proto,
        "collect_fn": _d.collect_dp_compute_proto,
    },
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {
        "dispatch_fn": _d.dispatch_dp_compute_proto_with_func,
        "collect_fn": _d.collect_dp_compute_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {
        "dispatch_fn": _d.dispatch_dp_compute_metric,
        "collect_fn": _d.collect_dp_compute_metric,
    },
}

# A call's positional and keyword arguments (a user's values, passed to the method).
Arguments = tuple[tuple[object, ...], dict[str, object]]

_EXECUTE_FN_NAMES = {Execute.ALL: "execute_all_async", Execute.RANK_ZERO: "execute_rank_zero_async"}


def _check_fns(dispatch_fn: object, collect_fn: object) -> None:
    for key, fn in (("dispatch_fn", dispatch_fn), ("collect_fn", collect_fn)):
        if not callable(fn):
            raise TypeError(f"{key} must be callable, got {type(fn).__name__}")


def _validate_dispatch_mode(mode: object) -> None:
    if isinstance(mode, Dispatch):
        if mode not in _DISPATCH_REGISTRY:
            raise ValueError(
                f"dispatch mode {mode.name} has no dispatch/collect functions; registered: "
                f"{[m.name for m in _DISPATCH_REGISTRY]} (use register_dispatch_mode)"
            )
        return
    if isinstance(mode, dict):
        missing = [k for k in _DISPATCH_KEYS if k not in mode]
        extra = sorted(set(mode) - set(_DISPATCH_KEYS))
        if missing or extra:
            raise ValueError(
                f"a custom dispatch mode must be a dict with exactly the keys {list(_DISPATCH_KEYS)}; "
                f"missing {missing}, unexpected {extra}"
            )
        _check_fns(mode["dispatch_fn"], mode["collect_fn"])
        return
    raise TypeError(
        "dispatch_mode must be a Dispatch member or a {dispatch_fn, collect_fn} dict, "
        f"got {type(mode).__name__}"
    )


def get_dispatch_fn(mode: Dispatch | dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The ``{dispatch_fn, collect_fn}`` pair for a mode (a ``Dispatch`` member or a custom dict)."""
    _validate_dispatch_mode(mode)
    if isinstance(mode, dict):
        return {k: mode[k] for k in _DISPATCH_KEYS}
    return dict(_DISPATCH_REGISTRY[mode])


def register_dispatch_mode(
    name: str, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> Dispatch:
    """Add a new ``Dispatch`` member with its functions.

    Raises:
        ValueError: the name exists already. TypeError: a function is not callable.

    Example:
        >>> mode = register_dispatch_mode("TWO_TO_ALL", my_dispatch, my_collect)
        >>> mode is Dispatch.TWO_TO_ALL
        True
    """
    _check_fns(dispatch_fn, collect_fn)
    member = Dispatch.register(name)
    _DISPATCH_REGISTRY[member] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return member


def update_dispatch_mode(
    mode: Dispatch, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> None:
    """Replace the functions of an existing mode (methods bound afterwards use the new ones).

    Raises:
        ValueError: ``mode`` is not registered. TypeError: a function is not callable.
    """
    if not isinstance(mode, Dispatch) or mode not in _DISPATCH_REGISTRY:
        raise ValueError(f"cannot update {mode!r}: not a registered dispatch mode")
    _check_fns(dispatch_fn, collect_fn)
    _DISPATCH_REGISTRY[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def get_execute_fn_name(mode: Execute) -> str:
    """Name of the worker-group method that runs an ``Execute`` mode (returns ``ObjectRef``s)."""
    if mode not in _EXECUTE_FN_NAMES:
        raise ValueError(f"unknown execute mode {mode!r}; known: {Execute.names()}")
    return _EXECUTE_FN_NAMES[mode]


def _materialize_args(args: tuple[object, ...], kwargs: dict[str, object]) -> Arguments:
    return tuple(materialize(a) for a in args), {k: materialize(v) for k, v in kwargs.items()}


def _warn_if_blocking_a_loop(
    func: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    """A sync method of an async actor runs on its event loop: waiting there for a future whose
    producer is queued on the same actor would stall until the future's deadline."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: blocking is fine
        return
    if any(isinstance(v, BatchFuture) for v in (*args, *kwargs.values())):
        logger.warning(
            "%s is a sync method running on an event loop (an async actor) and resolves a BatchFuture "
            "there, blocking the loop; declare it `async def` to await the future instead",
            func.__qualname__,
        )


async def _materialize_args_async(args: tuple[object, ...], kwargs: dict[str, object]) -> Arguments:
    args = tuple([await materialize_async(a) for a in args])
    return args, {k: await materialize_async(v) for k, v in kwargs.items()}


def register(
    dispatch_mode: Dispatch | dict[str, Callable[..., Any]] = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    *,
    bridge: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a worker method for binding onto its worker group.

    The method also *bridges* (see ``controlplane.bridge``): called with an argument that
    implements the bridge protocol (``dataplane.KVBatchMeta``, ``dataplane.StreamRequest``), it
    receives that argument's rows, and its per-row outputs are written back from the collect
    ranks of ``dispatch_mode`` only. A call with plain data runs the method unchanged.

    Args:
        dispatch_mode: a ``Dispatch`` member or a ``{"dispatch_fn", "collect_fn"}`` dict.
        execute_mode: ``Execute.ALL`` or ``Execute.RANK_ZERO`` (``Dispatch.RANK_ZERO`` implies it).
        blocking: wait for the result (``False`` returns ``ObjectRef``s or a ``BatchFuture``).
        materialize_futures: resolve ``BatchFuture`` arguments on the worker before the call.
        bridge: ``False`` hands bridging arguments (a ``KVBatchMeta``) to the method as they are,
            for a method that works with the metadata itself (e.g. writes rows for new keys).

    Raises:
        ValueError / TypeError: at decoration time, for an unknown mode or a malformed dict.

    What a bridged method may return: a ``TensorDict`` of one row per key (written back, the caller
    gets the meta with the new fields), or anything else, which is *not* written and comes back as
    it is from each rank, for the dispatch mode to collect. A ``dict`` of metrics is the common
    case: under ``DP_COMPUTE_METRIC`` (or ``ONE_TO_ALL``) the caller gets every rank's dict in a
    list; ``DP_COMPUTE_PROTO`` concatenates the ranks' results, which dicts cannot be, and says so
    (``TypeError``).

    Example:
        >>> @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        ... def init_model(self): ...
        >>> from controlplane.dispatch import collect_dp_compute_metric, collect_dp_compute_proto
        >>> class Group:                                   # a worker group of 2 ranks
        ...     world_size = 2
        >>> returned = [{"loss": 0.5}, {"loss": 0.7}]      # a bridged method's dict, from each rank
        >>> collect_dp_compute_metric(Group(), returned)   # under DP_COMPUTE_METRIC: every rank's
        [{'loss': 0.5}, {'loss': 0.7}]
        >>> collect_dp_compute_proto(Group(), returned)    # under DP_COMPUTE_PROTO: refused
        Traceback (most recent call last):
        ...
        TypeError: dict cannot be concatenated ... belongs under Dispatch.DP_COMPUTE_METRIC ...
    """
    _validate_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute) or execute_mode not in Execute:
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")
    flags = {"blocking": blocking, "materialize_futures": materialize_futures, "bridge": bridge}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    if dispatch_mode is Dispatch.RANK_ZERO:
        execute_mode = Execute.RANK_ZERO
    attrs = {
        "dispatch_mode": dispatch_mode,
        "execute_mode": execute_mode,
        "blocking": blocking,
        "materialize_futures": materialize_futures,
    }

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(func):
            raise TypeError(f"@register must decorate a function, got {type(func).__name__}")
        # A function already wrapped by a bridge decorator is re-bridged with this dispatch mode,
        # so the bridge's collect ranks are always the dispatch's (one writer per replica).
        original, options = _bridge.unwrap(func)
        if bridge:
            func = _bridge.bridged(original, dispatch_mode, call_on_empty=options.get("call_on_empty", False))
        else:
            func = original
        if inspect.iscoroutinefunction(original):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                if materialize_futures:
                    args, kwargs = await _materialize_args_async(args, kwargs)
                return await func(*args, **kwargs)

            wrapper = async_wrapper
        else:

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if materialize_futures:
                    _warn_if_blocking_a_loop(func, args, kwargs)
                    args, kwargs = _materialize_args(args, kwargs)
                return func(*args, **kwargs)

        setattr(wrapper, MAGIC_ATTR, dict(attrs))
        return wrapper

    return decorator


__all__ = ["register", "register_dispatch_mode", "update_dispatch_mode"]
