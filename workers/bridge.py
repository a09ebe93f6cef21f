"""The bridge: worker methods that take ``KVBatchMeta`` (or ``dp.StreamRequest``) for their data.

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
in ``dataplane.bridge``; the protocol in ``controlplane.bridge``.

Two more decorators: ``tqbridge(dispatch_mode)`` alone bridges a method that is not registered (a
local object), and under ``@register`` it only contributes its ``call_on_empty`` option;
``bridged_register(dispatch_mode)`` is ``register`` with that option in one decorator. The collect
ranks always come from ``register``'s dispatch mode, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane import Dispatch, register
from controlplane.bridge import bridged

# The bridge's counters and a streamed call's report, for the roles and the benchmarks in this
# repository (the public decorators are the three names in __all__).
from dataplane.bridge import StreamReport as StreamReport
from dataplane.bridge import count as count
from dataplane.bridge import nbytes_of as nbytes_of
from dataplane.bridge import reset_traffic as reset_traffic
from dataplane.bridge import traffic as traffic
from dataplane.errors import BridgeError

__all__ = [BridgeError.__name__, "bridged_register", "tqbridge"]  # (named once, in dataplane.errors)


def tqbridge(
    dispatch_mode: object = None, *, call_on_empty: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Let a method take a ``KVBatchMeta`` or a ``dp.StreamRequest`` in place of its data.

    A bridged method called with a ``KVBatchMeta`` receives, on the worker, the ``TensorDict`` of
    that meta's rows (fetched from the store; ``extra_info`` items as non-tensor entries). If it
    returns a ``TensorDict`` with one row per key, the new fields are written back under the same
    keys (from collect ranks only) and the caller gets the meta with those fields added; any other
    return value (a dict of metrics, ``None``) comes back unchanged. Called with ordinary data, the
    method runs unchanged. ``def`` and ``async def`` methods are both supported.

    ``@register`` already bridges every method with its own dispatch mode, so under ``@register``
    this decorator only adds ``call_on_empty``; alone, it bridges a method of a plain local object.
    (The docstring of this module, ``workers.bridge``, has the full contract.)

    Args:
        dispatch_mode: decides the collect ranks when not under ``@register`` (None: every rank
            writes back).
        call_on_empty: for a ``StreamRequest`` whose batch is empty (partition finished and
            drained), still call the method with an empty ``TensorDict`` (a method that must join
            a collective on every rank); default: skip it and report ``finished=True``.

    Raises:
        TypeError: ``call_on_empty`` is not a bool.

    Example:
        A worker method bridged by ``@register`` alone; the driver holds metadata only:

        >>> class Scorer(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)   # each rank gets its chunk
        ...     def score(self, batch):                              # a TensorDict of its rows
        ...         return TensorDict({"rewards": batch["responses"].float().mean(-1)},
        ...                           batch.batch_size)
        >>> meta = dp.kv_batch_put(keys, "step0", TensorDict({"responses": responses}, [len(keys)]))
        >>> meta = scorer_wg.score(meta)           # a KVBatchMeta in, a KVBatchMeta out
        >>> meta.fields
        ['responses', 'rewards']

        ``tqbridge`` itself, for a streamed method that must join a collective on every rank:

        >>> class Trainer(Worker):
        ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
        ...     @tqbridge(call_on_empty=True)      # called even when the stream is drained
        ...     def update(self, batch): ...

        Bridging a method of a plain local object (no group):

        >>> class Local:
        ...     @tqbridge()
        ...     def double(self, batch):
        ...         return TensorDict({"y": batch["x"] * 2}, batch.batch_size)
        >>> Local().double(meta).fields          # read from and written to the store in-process
        ['x', 'y']
    """
    if not isinstance(call_on_empty, bool):
        raise TypeError(f"call_on_empty must be a bool, got {call_on_empty!r}")

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return bridged(func, dispatch_mode, call_on_empty=call_on_empty)

    return decorator


def bridged_register(
    dispatch_mode: Dispatch | dict[str, Callable[..., Any]] = Dispatch.ALL_TO_ALL,
    *,
    call_on_empty: bool = False,
    **register_kwargs: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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
