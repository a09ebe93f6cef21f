"""Which arguments each rank receives: verl's broadcast rule, with explicit wrappers.

``RayWorkerGroup.execute_all*`` follows verl's rule: when *every* positional and keyword
argument is a ``list`` of length ``world_size``, rank ``i`` receives element ``i`` of each;
otherwise every rank receives all arguments whole. A broadcast list that happens to have
``world_size`` items is ambiguous under that rule, so two wrappers say what is meant:

* ``PerRank(values)``: rank ``i`` receives ``values[i]`` (``len(values)`` must be ``world_size``);
* ``Broadcast(value)``: every rank receives ``value`` whole, whatever its type or length.

Once any argument of a call is wrapped, nothing is guessed: ``PerRank`` arguments are
scattered and every other argument (wrapped in ``Broadcast`` or not) is broadcast whole.

``execute_rank_zero*`` passes the arguments to rank 0 whole, as verl does (a list of length
``world_size`` is *not* cut to its first element); ``PerRank(values)`` gives rank 0
``values[0]``, ``Broadcast(value)`` gives ``value``.

Bound group methods (``@register``) do not guess either: their dispatch function already made
one entry per rank, and :func:`mark_dispatched` wraps those lists in ``PerRank`` before execution,
so ``Execute.ALL`` scatters them exactly and ``Execute.RANK_ZERO`` takes entry 0. A wrapper that
a dispatch function replicated (``wg.ping(PerRank([...]))`` on a ``Dispatch.ONE_TO_ALL`` method)
is resolved on each rank the same way.

Example:
    >>> wg.execute_all_sync("set_lr", 1e-4)                   # broadcast: every rank gets 1e-4
    >>> wg.execute_all_sync("load", ["a", "b"])               # world_size 2: rank 0 "a", rank 1 "b"
    >>> wg.execute_all_sync("load", Broadcast(["a", "b"]))    # every rank gets ["a", "b"]
    >>> wg.execute_all_sync("step", PerRank([0, 1]), ["a", "b"])  # scatter 0/1, broadcast the list
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

# The positional and keyword arguments of one rank's call (a user's values, passed along).
RankCall = tuple[tuple[object, ...], dict[str, object]]


class PerRank(list[T]):
    """One value per rank: rank ``i`` of a group receives ``self[i]``.

    A ``list`` subclass, so code that indexes per-rank lists keeps working with it.

    Example:
        >>> wg.execute_all_sync("seed", PerRank([11, 12, 13, 14]))   # world_size 4
    """

    def __init__(self, values: Iterable[T] = ()) -> None:
        if isinstance(values, Broadcast):
            raise TypeError("PerRank(Broadcast(...)) is contradictory; pass one or the other")
        super().__init__(values)

    def __repr__(self) -> str:
        return f"PerRank({list.__repr__(self)})"


class Broadcast(Generic[T]):
    """A value every rank receives whole, even a list of ``world_size`` items.

    Example:
        >>> wg.execute_all_sync("set_vocab", Broadcast(["<s>", "</s>"]))   # world_size 2
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Broadcast({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Broadcast) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]  # equal by value, and values may be unhashable

    def __reduce__(self) -> tuple[object, ...]:
        return (Broadcast, (self.value,))


def _is_wrapped(value: object) -> bool:
    return isinstance(value, PerRank | Broadcast)


def _arg_label(key: int | str) -> str:
    return f"positional argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"


def _check_length(value: PerRank[object], world_size: int, where: str) -> None:
    if len(value) != world_size:
        raise ValueError(
            f"{where} is PerRank with {len(value)} values, but the group has world_size {world_size}; "
            "give one value per rank, or wrap a value every rank should get in Broadcast(...)"
        )


def resolve(value: object, rank: int, world_size: int, where: str = "an argument") -> object:
    """What ``rank`` receives for ``value``: unwraps ``PerRank`` (entry ``rank``) and ``Broadcast``.

    Nested wrappers (a dispatch function's per-rank list holding a caller's wrapper) are
    resolved in turn; any other value is returned as is.

    Raises:
        ValueError: a ``PerRank`` whose length is not ``world_size`` (the message names ``where``).
    """
    while True:
        if isinstance(value, Broadcast):
            value = value.value
        elif isinstance(value, PerRank):
            _check_length(value, world_size, where)
            value = value[rank]
        else:
            return value


def _is_per_rank_list(value: object, world_size: int) -> bool:
    return isinstance(value, list) and len(value) == world_size


def split_for_ranks(
    args: tuple[object, ...], kwargs: dict[str, object], world_size: int, method_name: str = "method"
) -> list[RankCall]:
    """The ``(args, kwargs)`` each rank is called with (the rule of this module's docstring).

    Raises:
        ValueError: a ``PerRank`` argument whose length is not ``world_size``.

    Example:
        >>> split_for_ranks(([1, 2], [3, 4]), {}, 2)          # every argument per rank: scatter
        [((1, 3), {}), ((2, 4), {})]
        >>> split_for_ranks(([1, 2], 5), {}, 2)               # not all per rank: broadcast all
        [(([1, 2], 5), {}), (([1, 2], 5), {})]
        >>> split_for_ranks((PerRank([1, 2]), [5, 6]), {}, 2)  # explicit: only PerRank scatters
        [((1, [5, 6]), {}), ((2, [5, 6]), {})]
    """
    values = list(args) + list(kwargs.values())
    explicit = any(_is_wrapped(v) for v in values)
    if not explicit:
        if values and all(_is_per_rank_list(v, world_size) for v in values):
            args = tuple(_mark(a) for a in args)
            kwargs = {k: _mark(v) for k, v in kwargs.items()}
        else:  # verl: not every argument is a per-rank list, so everything is broadcast
            return [(tuple(args), dict(kwargs)) for _ in range(world_size)]
    return [
        (
            tuple(resolve(a, r, world_size, f"{method_name}: {_arg_label(i)}") for i, a in enumerate(args)),
            {k: resolve(v, r, world_size, f"{method_name}: {_arg_label(k)}") for k, v in kwargs.items()},
        )
        for r in range(world_size)
    ]


def for_rank_zero(
    args: tuple[object, ...], kwargs: dict[str, object], world_size: int, method_name: str = "method"
) -> RankCall:
    """The ``(args, kwargs)`` rank 0 is called with: arguments whole, wrappers resolved for rank 0.

    Raises:
        ValueError: a ``PerRank`` argument whose length is not ``world_size``.
    """
    return (
        tuple(resolve(a, 0, world_size, f"{method_name}: {_arg_label(i)}") for i, a in enumerate(args)),
        {k: resolve(v, 0, world_size, f"{method_name}: {_arg_label(k)}") for k, v in kwargs.items()},
    )


def _mark(value: object) -> object:
    """A list as ``PerRank`` (one entry per rank); anything else as it is."""
    return PerRank(value) if isinstance(value, list) and not isinstance(value, PerRank) else value


def mark_dispatched(args: tuple[object, ...], kwargs: dict[str, object]) -> RankCall:
    """Wrap a dispatch function's per-rank lists in ``PerRank`` (the binding calls this).

    A dispatch function returns one list entry per rank for every argument; wrapping them makes
    execution scatter them exactly (and rank-zero execution take entry 0) instead of applying the
    broadcast guess meant for direct calls. A value that is not a list (a custom dispatch
    function that left an argument as is) stays as it is, and is broadcast.

    Example:
        >>> mark_dispatched(([1, 2],), {"x": 3})
        ((PerRank([1, 2]),), {'x': 3})
    """
    return tuple(_mark(a) for a in args), {k: _mark(v) for k, v in kwargs.items()}


__all__ = ["Broadcast", "PerRank"]
