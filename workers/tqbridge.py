"""``tqbridge``: worker methods that take ``KVBatchMeta`` (or ``dp.StreamRequest``) for their data.

Since ``@register`` itself bridges (as verl's ``register`` wraps every method with the
TransferQueue bridge), a worker needs nothing more than::

    class Actor(Worker):
        @register(dispatch_mode=make_nd_compute_dispatch_fn("actor"))
        def compute_log_prob(self, batch: TensorDict) -> TensorDict:
            return TensorDict({"old_log_probs": ...}, batch.batch_size)

    meta = actor_wg.compute_log_prob(meta)   # a KVBatchMeta in, a KVBatchMeta out

On each rank the method receives the ``TensorDict`` of its shard's rows (with ``extra_info`` as
non-tensor entries), and its per-row outputs (tensors and ``NonTensorStack`` columns) are written
back under the same keys from the *collect ranks* of the dispatch mode only: the registered
collect ranks of a mesh, rank 0 under ``ONE_TO_ALL``, every rank otherwise. Batch-level
``NonTensorData`` outputs land in the returned meta's ``extra_info``. A ``dp.StreamRequest``
makes each rank pull its own ready batch and return a :class:`StreamReport`. The full contract is
in ``dataplane._worker_bridge``; the protocol in ``controlplane.bridge``.

``tqbridge(dispatch_mode)`` and ``bridged_register(dispatch_mode)`` are kept as aliases:
``tqbridge`` alone bridges a method that is not registered (a local object), and under
``@register`` it only contributes its ``call_on_empty`` option; the collect ranks always come from
``register``'s dispatch mode, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane import Dispatch, register
from controlplane.bridge import bridged
from dataplane._worker_bridge import BridgeError, StreamReport, count, nbytes_of, reset_traffic, traffic

__all__ = [
    "BridgeError",
    "StreamReport",
    "bridged_register",
    "count",
    "nbytes_of",
    "reset_traffic",
    "tqbridge",
    "traffic",
]


def tqbridge(
    dispatch_mode: Any = None, *, call_on_empty: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Let a method take a ``KVBatchMeta`` or a ``dp.StreamRequest`` in place of its data.

    Under ``@register`` this is redundant (``register`` bridges with its own dispatch mode) except
    for ``call_on_empty``; alone, it bridges a method of a plain local object.

    Args:
        dispatch_mode: decides the collect ranks when not under ``@register`` (None: every rank
            writes back).
        call_on_empty: for a ``StreamRequest`` whose batch is empty (partition finished and
            drained), still call the method with an empty ``TensorDict`` (a method that must join
            a collective on every rank); default: skip it and report ``finished=True``.

    Raises:
        TypeError: ``call_on_empty`` is not a bool.

    Example:
        >>> class Scorer(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
        ...     @tqbridge(call_on_empty=True)      # join the collective even when drained
        ...     def update(self, batch): ...
    """
    if not isinstance(call_on_empty, bool):
        raise TypeError(f"call_on_empty must be a bool, got {call_on_empty!r}")

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return bridged(func, dispatch_mode, call_on_empty=call_on_empty)

    return decorator


def bridged_register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL, *, call_on_empty: bool = False, **register_kwargs: Any
) -> Callable[..., Any]:
    """``@register(dispatch_mode=M, ...)`` with the bridge's ``call_on_empty`` option in one decorator.

    Args:
        dispatch_mode: the dispatch mode.
        call_on_empty: see :func:`tqbridge`.
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
