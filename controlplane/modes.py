"""``Dispatch`` and ``Execute``: the modes a ``@register`` method names.

The enums live here, below both ``controlplane.decorator`` (which maps each ``Dispatch`` member
to its functions) and ``controlplane.bridge`` (which derives a bridged call's collect ranks
from the mode), so neither of those has to import the other. ``controlplane.decorator`` and
the package re-export them; import them from ``controlplane``.

Example:
    >>> Dispatch.ONE_TO_ALL in Dispatch, Execute.RANK_ZERO.name
    (True, 'RANK_ZERO')
"""

from __future__ import annotations

from typing import ClassVar

from controlplane._enum import DynamicEnum


class Dispatch(DynamicEnum):
    """How arguments are split over ranks and outputs gathered (see ``controlplane.dispatch``).

    * ``ONE_TO_ALL``: every rank gets the arguments whole; a list of every rank's result. With a
      ``KVBatchMeta`` (any bridging argument) every rank gets the *whole* meta: each reads all of
      its rows and runs the method on them, rank 0 alone writes per-row outputs back (not
      ``world_size`` times), and the caller gets rank 0's meta with the new fields followed by an
      empty meta of the same partition from each other rank. To give each rank its own share of
      the rows, use ``DP_COMPUTE_PROTO``.
    * ``ALL_TO_ALL``: arguments as given (a list of ``world_size`` items gives rank i item i).
    * ``DP_COMPUTE_PROTO``: each batch argument (a list, TensorDict, ``KVBatchMeta``, ...) is *split*
      into ``world_size`` chunks along dim 0, one per rank, and the results are concatenated. A
      rank sees only its chunk: a statistic over a whole group of rows (a GRPO advantage) needs
      ``RANK_ZERO``, or a sampler that keeps groups whole (``dp.GroupSampler``).
    * ``DP_COMPUTE_METRIC``: split like ``DP_COMPUTE_PROTO``; a list of every rank's result.
    * ``DP_COMPUTE``: arguments already per rank (lists of ``world_size``); a list of results.
    * ``DP_COMPUTE_PROTO_WITH_FUNC``: the first argument (a function) goes whole, the rest are split.
    * ``RANK_ZERO``: the arguments whole (only rank 0 runs under ``Execute.RANK_ZERO``); rank 0's
      result alone.

    ``make_nd_compute_dispatch_fn(mesh)`` splits by data-parallel rank of a mesh instead;
    ``register_dispatch_mode`` adds members.

    Example (``ONE_TO_ALL`` with a meta: what each rank receives, and which ranks write back):
        >>> import dataplane as dp
        >>> from controlplane.bridge import collect_rule
        >>> from controlplane.dispatch import dispatch_one_to_all, dispatch_dp_compute_proto
        >>> class Group:                           # a worker group of 2 ranks
        ...     world_size = 2
        >>> meta = dp.KVBatchMeta(["s0", "s1", "s2", "s3"], partition_id="step0")
        >>> (per_rank,), _ = dispatch_one_to_all(Group(), meta)
        >>> [m.keys for m in per_rank]             # ONE_TO_ALL: the whole meta for every rank
        [['s0', 's1', 's2', 's3'], ['s0', 's1', 's2', 's3']]
        >>> class Rank:
        ...     def __init__(self, rank):
        ...         self.rank = rank
        >>> writes_back = collect_rule(Dispatch.ONE_TO_ALL)
        >>> [writes_back(Rank(r)) for r in range(2)]
        [True, False]
        >>> (split,), _ = dispatch_dp_compute_proto(Group(), meta)
        >>> [m.keys for m in split]                # DP_COMPUTE_PROTO: a share of the rows each
        [['s0', 's1'], ['s2', 's3']]
    """

    # The members registered below, declared for type checkers (``register_dispatch_mode`` adds more).
    RANK_ZERO: ClassVar[Dispatch]
    ONE_TO_ALL: ClassVar[Dispatch]
    ALL_TO_ALL: ClassVar[Dispatch]
    DP_COMPUTE: ClassVar[Dispatch]
    DP_COMPUTE_PROTO: ClassVar[Dispatch]
    DP_COMPUTE_PROTO_WITH_FUNC: ClassVar[Dispatch]
    DP_COMPUTE_METRIC: ClassVar[Dispatch]


class Execute(DynamicEnum):
    """Which ranks run the method: ``ALL`` or ``RANK_ZERO``."""

    ALL: ClassVar[Execute]
    RANK_ZERO: ClassVar[Execute]


for _name in (
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
):
    Dispatch.register(_name)
for _name in ("ALL", "RANK_ZERO"):
    Execute.register(_name)
del _name


__all__ = ["Dispatch", "Execute"]
