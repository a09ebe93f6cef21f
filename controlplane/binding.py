"""Turning ``@register`` methods into worker-group methods.

A bound method runs on the driver: dispatch -> execute -> wait -> collect -> unpad.

* dispatch: the mode's ``dispatch_fn`` makes per-rank argument lists (and may report padding);
* execute: ``execute_all_async`` / ``execute_rank_zero_async`` on the group (``ObjectRef``s);
* wait: ``wg._wait`` (a dead worker raises an error naming it), only when ``blocking``;
* collect: the mode's ``collect_fn`` (over ``ObjectRef``s when not blocking: a concat mode
  then returns a ``BatchFuture``, or the batch class's own future type, e.g. verl's
  ``DataProtoFuture`` for a ``DataProto``: see ``future.future_maker``); with rank-zero
  execution the single result is returned as is;
* unpad: padded samples are removed from the result, whatever its type.

Example:
    >>> names = bind_worker_methods(wg, MyWorker)   # done by RayWorkerGroup.__init__
    >>> wg.compute(batch)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from controlplane.decorator import MAGIC_ATTR, Execute, get_dispatch_fn, get_execute_fn_name
from controlplane.dispatch import CHUNK_INFO_KWARG, PADDING_KWARG, ChunkInfo, unpad_result
from controlplane.future import BatchFuture, wrap_future
from controlplane.per_rank import mark_dispatched

if TYPE_CHECKING:
    from ray import ObjectRef

logger = logging.getLogger(__name__)


class BindableGroup(Protocol):
    """What a group method needs of its group: its size and a wait for per-rank refs (the execute
    method, ``execute_all_async`` or ``execute_rank_zero_async``, is looked up by name)."""

    @property
    def world_size(self) -> int: ...

    def _wait(
        self, refs: ObjectRef | Sequence[ObjectRef], timeout: float | None = None, method: str | None = None
    ) -> Any: ...


class GroupMethod:
    """A group-level method: one call fans out to the workers (see the module docstring)."""

    def __init__(
        self,
        worker_group: BindableGroup,
        method_name: str,
        *,
        dispatch_fn: Callable[..., Any],
        collect_fn: Callable[..., Any],
        execute_fn_name: str,
        blocking: bool,
    ) -> None:
        execute = getattr(worker_group, execute_fn_name, None)
        if not callable(execute):
            raise AttributeError(
                f"{type(worker_group).__name__} has no method {execute_fn_name!r} "
                f"needed to run {method_name!r}"
            )
        self.worker_group = worker_group
        self.method_name = method_name
        self.dispatch_fn = dispatch_fn
        self.collect_fn = collect_fn
        self.execute_fn_name = execute_fn_name
        self.blocking = blocking
        self._execute = execute
        self._rank_zero = "rank_zero" in execute_fn_name

    def __repr__(self) -> str:
        return f"<group method {self.method_name} ({self.execute_fn_name}, blocking={self.blocking})>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        launched = self.launch(*args, **kwargs)
        output = launched.refs
        if self.blocking:
            output = self.worker_group._wait(output, method=self.method_name)
        return self.finish(launched, output)

    def launch(self, *args: Any, **kwargs: Any) -> Launched:
        """Dispatch and start the call on the ranks, without waiting (the first half of a call)."""
        wg = self.worker_group
        args, kwargs = self.dispatch_fn(wg, *args, **kwargs)
        pad = kwargs.pop(PADDING_KWARG, 0)
        info: ChunkInfo | None = kwargs.pop(CHUNK_INFO_KWARG, None)
        if not isinstance(pad, int) or pad < 0:
            raise TypeError(f"{self.method_name}: dispatch reported padding {pad!r}; expected an int >= 0")
        args, kwargs = mark_dispatched(args, kwargs)  # per_rank: scatter dispatch output exactly, no guess
        return Launched(self._execute(self.method_name, *args, **kwargs), pad, info)

    def finish(self, launched: Launched, output: Any) -> Any:
        """Collect and unpad ``output`` (values, or the launched refs when not waiting): the second half."""
        if self._rank_zero:
            return output
        pad, info = launched.pad, launched.info
        result = self.collect_fn(self.worker_group, output)
        if isinstance(result, BatchFuture) and info is not None:
            _size_future(result, info)
            if info.future_maker is not None:
                own = wrap_future(info.future_maker, result, pad)  # already without padding
                if own is not None:
                    return own
        return unpad_result(self.collect_fn, result, pad, None if info is None else info.sizes)


class Launched(NamedTuple):
    """A started group call: ``refs`` (a list per rank, or rank 0's single ref), the samples
    padding added, and what the dispatch chunked."""

    refs: ObjectRef | list[ObjectRef]
    pad: int
    info: ChunkInfo | None


def _size_future(future: BatchFuture, info: ChunkInfo) -> None:
    """Record the expected part sizes so consumers can fetch only the parts they need."""
    future.allows_uneven_chunks = info.uneven
    if future.part_sizes is None and info.sizes is not None and future.source_ranks is not None:
        future.part_sizes = [info.sizes[r] for r in future.source_ranks]


def bind_group_method(
    worker_group: BindableGroup,
    method_name: str,
    *,
    dispatch_fn: Callable[..., Any],
    collect_fn: Callable[..., Any],
    execute_fn_name: str,
    blocking: bool,
) -> GroupMethod:
    """Build the driver-side callable for one worker method.

    Args:
        worker_group: provides ``world_size``, ``_wait(refs, timeout=None, method=None)`` and the
            ``execute_fn_name`` method.
        method_name: the actor method each rank runs.
        dispatch_fn, collect_fn: the mode's functions (see ``controlplane.dispatch``).
        execute_fn_name: ``"execute_all_async"`` or ``"execute_rank_zero_async"``.
        blocking: wait and return values; otherwise ``ObjectRef``s / a ``BatchFuture``.

    ``@register``'s ``materialize_futures`` is not an argument here: the wrapper on the worker
    applies it.

    Example:
        >>> wg.ping = bind_group_method(wg, "ping", dispatch_fn=dispatch_one_to_all,
        ...     collect_fn=collect_all, execute_fn_name="execute_all_async", blocking=True)
    """
    return GroupMethod(
        worker_group,
        method_name,
        dispatch_fn=dispatch_fn,
        collect_fn=collect_fn,
        execute_fn_name=execute_fn_name,
        blocking=blocking,
    )


def registered_methods(user_cls: type) -> dict[str, dict[str, Any]]:
    """``{name: register settings}`` for every ``@register`` method of ``user_cls`` (incl. inherited)."""
    found: dict[str, dict[str, Any]] = {}
    for name in dir(user_cls):
        try:
            attr = getattr(user_cls, name)
        except Exception:  # a descriptor that fails on the class is simply not a method
            continue
        attrs = getattr(attr, MAGIC_ATTR, None) if callable(attr) else None
        if isinstance(attrs, dict):
            found[name] = attrs
    return found


def missing_method_hint(user_cls: type, name: str) -> str:
    """Why ``wg.<name>`` is not a group method of a group of ``user_cls``, and what to do.

    Example:
        >>> missing_method_hint(MyWorker, "helper")
        "MyWorker.helper is not decorated with @register, so the group has no method for it: ..."
    """
    import difflib

    cls_name = user_cls.__name__
    if callable(getattr(user_cls, name, None)):
        return (
            f"{cls_name}.{name} is not decorated with @register, so the group has no method for it: "
            f"decorate it (@register(dispatch_mode=Dispatch.ONE_TO_ALL), or the mode it needs), or call "
            f"it on every worker as wg.execute_all_sync({name!r}, ...)"
        )
    from controlplane.worker import Worker

    base = registered_methods(Worker)  # the Worker base's own (execute_func_rank_zero, ...) are noise here
    registered = sorted(n for n in registered_methods(user_cls) if n not in base and not n.startswith("_"))
    close = difflib.get_close_matches(name, registered, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{cls_name} has no method {name!r}{hint}; its @register methods: {registered}"


def bind_worker_methods(worker_group: BindableGroup, user_cls: type, prefix: str = "") -> list[str]:
    """Set ``worker_group.<prefix><name>`` for every ``@register`` method of ``user_cls``.

    The remote method called on each actor is ``<prefix><name>`` too (a colocated class
    exposes role methods under a prefix).

    Returns:
        The bound attribute names.

    Raises:
        ValueError: a method name clashes with an attribute of the group's class.
    """
    bound = []
    for name, attrs in registered_methods(user_cls).items():
        full = f"{prefix}{name}"
        if hasattr(type(worker_group), full):
            raise ValueError(
                f"{user_cls.__name__}.{name} cannot be bound: {type(worker_group).__name__} already has "
                f"an attribute {full!r}; rename the worker method"
            )
        fns = get_dispatch_fn(attrs["dispatch_mode"])
        execute_mode = attrs.get("execute_mode", Execute.ALL)
        method = bind_group_method(
            worker_group,
            full,
            dispatch_fn=fns["dispatch_fn"],
            collect_fn=fns["collect_fn"],
            execute_fn_name=get_execute_fn_name(execute_mode),
            blocking=attrs.get("blocking", True),
        )
        setattr(worker_group, full, method)
        bound.append(full)
    logger.debug("bound %d methods of %s: %s", len(bound), user_cls.__name__, bound)
    return bound
