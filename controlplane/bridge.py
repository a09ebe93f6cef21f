"""Arguments that bridge themselves: how ``@register`` lets a method take metadata for its data.

verl's ``register`` wraps every method with the TransferQueue bridge: called with batch metadata,
the method receives its rows and its per-row outputs are written back. The controller must not
know any store, so the bridge is a protocol: an argument whose *class* has a
``__worker_bridge__`` attribute takes over the call on the worker. That object has

* ``run(call: BridgedCall) -> Any`` for ``def`` methods, and
* ``async arun(call: BridgedCall) -> Any`` for ``async def`` methods,

and does the data movement (``dataplane.KVBatchMeta`` and ``dataplane.StreamRequest`` implement
it). What the controller contributes is what only it knows: whether this rank is a *collect rank*
of the method's dispatch mode (so exactly one rank per data-parallel replica writes back), and
whether every rank received the same argument (``ONE_TO_ALL`` / ``ALL_TO_ALL``).

A call whose arguments carry no such object runs the method unchanged.

Example:
    >>> class Meta:                      # a store's metadata class
    ...     __worker_bridge__ = MyBridge()  # run(call) / arun(call)
    >>> class Scorer(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    ...     def score(self, batch): ...  # wg.score(meta) -> MyBridge.run(BridgedCall(...))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from controlplane.modes import Dispatch

BRIDGE_ATTR = "__worker_bridge__"
# Set on a function by ``bridged``: its bridge options, and the function it wraps.
OPTIONS_ATTR = "__bridge_options__"


@dataclasses.dataclass(frozen=True)
class BridgedCall:
    """One call of a bridged method on one worker, as the argument's bridge sees it.

    Attributes:
        func: the undecorated method (``self`` is ``args[0]`` for a method).
        args, kwargs: the arguments as received (metadata, not data yet).
        collect: this rank writes per-row outputs back (a collect rank of the dispatch mode).
        replicated: every rank of the group received the same arguments.
        call_on_empty: call ``func`` even for an empty streamed batch (a collective on every rank).
        name: the method's qualified name, for error messages.
    """

    func: Callable[..., Any]
    args: tuple[object, ...]
    kwargs: dict[str, object]
    collect: bool
    replicated: bool
    call_on_empty: bool
    name: str


class WorkerBridge(Protocol):
    """What a class's ``__worker_bridge__`` is: it takes over a call of a bridged method."""

    def run(self, call: BridgedCall) -> Any: ...

    async def arun(self, call: BridgedCall) -> Any: ...


def find_bridge(args: tuple[object, ...], kwargs: dict[str, object]) -> WorkerBridge | None:
    """The bridge of the first argument whose class implements the protocol, else ``None``."""
    for value in (*args, *kwargs.values()):
        bridge: WorkerBridge | None = getattr(type(value), BRIDGE_ATTR, None)
        if bridge is not None:
            return bridge
    return None


def collect_rule(dispatch_mode: object) -> Callable[[object], bool]:
    """``worker -> bool``: does this worker write per-row outputs back under ``dispatch_mode``?

    A mesh dispatch (``make_nd_compute_dispatch_fn``): the ranks registered as collect ranks of
    the mesh. ``ONE_TO_ALL`` (every rank got the same batch): rank 0 only, so the same rows are
    not written ``world_size`` times. Every other mode: every rank (each got its own rows).
    """
    if isinstance(dispatch_mode, dict):
        mesh = getattr(dispatch_mode.get("collect_fn"), "mesh_name", None)
        if mesh is None:
            return lambda _worker: True

        def on_mesh(worker: object) -> bool:
            query = getattr(worker, "query_collect_info", None)
            return True if query is None else bool(query(mesh))

        return on_mesh
    if dispatch_mode is Dispatch.ONE_TO_ALL:
        return lambda worker: getattr(worker, "rank", 0) == 0
    return lambda _worker: True


def _replicated(dispatch_mode: object) -> bool:
    return dispatch_mode is Dispatch.ONE_TO_ALL or dispatch_mode is Dispatch.ALL_TO_ALL


def unwrap(func: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(original function, bridge options)`` of a function wrapped by :func:`bridged`."""
    options = getattr(func, OPTIONS_ATTR, None)
    if options is None:
        return func, {}
    return options["wrapped"], {k: v for k, v in options.items() if k != "wrapped"}


def bridged(
    func: Callable[..., Any], dispatch_mode: object = None, *, call_on_empty: bool = False
) -> Callable[..., Any]:
    """``func`` wrapped so that a call with a bridging argument goes through that argument's bridge.

    ``dispatch_mode`` decides the collect ranks (None: every rank writes back). A function
    wrapped here and then by ``@register`` is unwrapped by ``register``, which bridges with its
    own dispatch mode: a method's bridge and its dispatch can never disagree.

    Raises:
        TypeError: ``call_on_empty`` is not a bool.
    """
    if not isinstance(call_on_empty, bool):
        raise TypeError(f"call_on_empty must be a bool, got {call_on_empty!r}")
    func, _ = unwrap(func)
    is_collect = collect_rule(dispatch_mode)
    replicated = _replicated(dispatch_mode)
    name = getattr(func, "__qualname__", repr(func))

    def make_call(args: tuple[object, ...], kwargs: dict[str, object]) -> BridgedCall:
        collect = is_collect(args[0]) if args else True
        return BridgedCall(func, args, kwargs, collect, replicated, call_on_empty, name)

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            bridge = find_bridge(args, kwargs)
            if bridge is None:
                return await func(*args, **kwargs)
            return await bridge.arun(make_call(args, kwargs))

        wrapper = async_wrapper
    else:

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bridge = find_bridge(args, kwargs)
            if bridge is None:
                return func(*args, **kwargs)
            return bridge.run(make_call(args, kwargs))

    setattr(
        wrapper,
        OPTIONS_ATTR,
        {"wrapped": func, "dispatch_mode": dispatch_mode, "call_on_empty": call_on_empty},
    )
    return wrapper
