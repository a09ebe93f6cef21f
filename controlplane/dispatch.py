"""The predefined dispatch and collect functions, auto padding, and the nd-mesh dispatch.

A dispatch function runs on the driver: ``dispatch_fn(worker_group, *args, **kwargs) ->
(args, kwargs)`` where every returned positional arg and every kwarg value is a list with one
entry per rank (rank ``i`` gets entry ``i``). A collect function turns the per-rank outputs
(values, or ``ObjectRef``s for ``blocking=False``) into the caller's result.

Two reserved kwargs travel from dispatch to the binding, which pops them before execution:
``PADDING_KWARG`` (an int: samples appended by auto padding) and ``CHUNK_INFO_KWARG`` (a
``ChunkInfo``: per-rank number of samples sent, whether chunks may be uneven and the batch
class's own future type, used to unpad per-rank results and to size or build futures).

Example:
    >>> @register(dispatch_mode=make_nd_compute_dispatch_fn("train"))
    ... def train_step(self, batch): ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import ray

from controlplane import batch
from controlplane.future import BatchFuture, FutureMaker, future_maker
from controlplane.per_rank import Broadcast, PerRank

T = TypeVar("T")

PADDING_KWARG = "_controlplane_pad"
CHUNK_INFO_KWARG = "_controlplane_chunks"


class ChunkInfo(NamedTuple):
    """What a chunking dispatch sent: samples per rank (``None`` if unknown), uneven allowed, and
    how a non-blocking result is wrapped (the batch class's own future; ``None``: ``BatchFuture``)."""

    sizes: list[int] | None
    uneven: bool
    future_maker: FutureMaker | None = None


class Split(NamedTuple):
    """What ``split_batches`` made of the arguments (see there)."""

    args: list[list[object]]
    kwargs: dict[str, list[object]]
    pad: int
    sizes: list[int] | None
    uneven: bool
    future_maker: FutureMaker | None


class Group(Protocol):
    """What a dispatch or collect function reads of the worker group it serves (``RayWorkerGroup``,
    or verl's ``WorkerGroup`` for a function written for verl)."""

    @property
    def world_size(self) -> int: ...


class MeshGroup(Group, Protocol):
    """A group whose ranks report their place on a device mesh (``make_nd_compute_dispatch_fn``)."""

    def _get_dispatch_info(self, mesh_name: str) -> list[int]: ...

    def _get_collect_info(self, mesh_name: str) -> list[bool]: ...


# What a dispatch function returns: the positional and keyword arguments, each a list with one
# entry per rank (the caller's values, passed along).
Dispatched = tuple[tuple[object, ...], dict[str, object]]


def _arg_name(key: int | str) -> str:
    return f"argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"


# ------------------------------------------------------------------ simple modes
def dispatch_one_to_all(worker_group: Group, *args: Any, **kwargs: Any) -> Dispatched:
    """Every rank gets every argument as is."""
    n = worker_group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(worker_group: Group, *args: Any, **kwargs: Any) -> Dispatched:
    """Scatter when *every* argument is a list of ``world_size`` entries, else replicate all.

    With a ``PerRank`` / ``Broadcast`` argument nothing is guessed: the arguments are replicated,
    and each rank then takes its own entry of every ``PerRank`` (see ``controlplane.per_rank``).
    """
    n = worker_group.world_size
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, PerRank | Broadcast) for v in values):
        return dispatch_one_to_all(worker_group, *args, **kwargs)
    if values and all(isinstance(v, list) and len(v) == n for v in values):
        return tuple(args), dict(kwargs)
    return dispatch_one_to_all(worker_group, *args, **kwargs)


def dispatch_dp_compute(worker_group: Group, *args: Any, **kwargs: Any) -> Dispatched:
    """Each argument must already be a list (or tuple) with one entry per rank; it is scattered."""
    n = worker_group.world_size
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    for key, value in items:
        if not isinstance(value, list | tuple) or len(value) != n:
            got = (
                f"{type(value).__name__} of length {len(value)}"
                if isinstance(value, list | tuple)
                else (type(value).__name__)
            )
            raise ValueError(
                f"Dispatch.DP_COMPUTE needs every argument to be a list of world_size={n} entries; "
                f"{_arg_name(key)} is a {got}"
            )
    return tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()}


def dispatch_rank_zero(worker_group: Group, *args: Any, **kwargs: Any) -> Dispatched:
    """Arguments go to rank 0 unchanged (the group's rank-zero execution takes entry 0)."""
    return dispatch_one_to_all(worker_group, *args, **kwargs)


def collect_all(worker_group: Group, outputs: list[T]) -> list[T]:
    """The per-rank outputs as a list in rank order (``ObjectRef``s when not blocking)."""
    return list(outputs)


def collect_dp_compute(worker_group: Group, outputs: list[T]) -> list[T]:
    """The per-rank outputs as a list; checks there is one per rank."""
    if len(outputs) != worker_group.world_size:
        raise ValueError(f"expected {worker_group.world_size} outputs (one per rank), got {len(outputs)}")
    return list(outputs)


def collect_rank_zero(worker_group: Group, output: T) -> T:
    """Rank 0's single output, unchanged."""
    return output


# ------------------------------------------------------------------ chunking
def split_batches(
    n: int, args: Sequence[object], kwargs: dict[str, object], *, mode: str, replicate_first: bool = False
) -> Split:
    """Chunk every batch argument into ``n`` pieces, replicate the others.

    Pads with repeated last samples when the size does not divide ``n`` and padding was
    requested (see ``batch.auto_padding_requested``: a mark or flag on any batch argument,
    ``CONTROLPLANE_AUTO_PADDING=1`` or ``VERL_AUTO_PADDING=1``). The caller's objects are never
    modified.

    Returns:
        A ``Split``: per-argument lists of ``n`` pieces (``args``, ``kwargs``), the number of
        padded samples, the size of each piece (``None`` if unknown), whether every batch
        argument allowed uneven chunks, and the first batch argument's ``future_maker``.

    Raises:
        ValueError: no batch argument, batch arguments of different sizes, or a size that does
            not divide ``n`` without padding (the message names the sizes).
        TypeError: a batch that cannot be chunked or padded.
    """
    items: list[tuple[int | str, object]] = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    if replicate_first:
        items = items[1:]
    batch_keys = [key for key, value in items if _is_batch_arg(key, value)]
    if not batch_keys:
        raise ValueError(_no_batch_message(mode, items))
    values = dict(items)
    maker = future_maker(values[batch_keys[0]])  # from the caller's batch, before any padding
    lengths = {key: batch.length(values[key]) for key in batch_keys}
    known = {key: size for key, size in lengths.items() if size is not None}
    if len(set(known.values())) > 1:
        detail = ", ".join(f"{_arg_name(k)} has {s}" for k, s in known.items())
        raise ValueError(f"Dispatch.{mode}: batch arguments must have the same number of samples; {detail}")
    total = next(iter(known.values()), None)
    uneven = all(batch.allows_uneven(values[key]) for key in batch_keys)
    pad = 0
    if total is not None and total % n and not uneven:
        if any(batch.auto_padding_requested(values[key]) for key in batch_keys):
            pad = (-total) % n
            values = {
                key: batch.pad(v, pad, name=_arg_name(key)) if key in batch_keys else v
                for key, v in values.items()
            }
    chunked = {
        key: batch.chunk(v, n, name=_arg_name(key)) if key in batch_keys else [v] * n
        for key, v in values.items()
    }
    if replicate_first:
        chunked[0] = [args[0]] * n
    sizes = _piece_sizes(chunked[batch_keys[0]])
    args_out = [chunked[i] for i in range(len(args))]
    kwargs_out = {k: chunked[k] for k in kwargs}
    return Split(args_out, kwargs_out, pad, sizes, uneven, maker)


def _no_batch_message(mode: str, items: list[tuple[int | str, object]]) -> str:
    """Why a split mode found nothing to split: what each argument was, and for a dict what to do.

    Example:
        >>> msg = _no_batch_message("DP_COMPUTE_PROTO", [(0, {"x": [1, 2]})])
        >>> "argument 0 is a dict" in msg and "TensorDict(d, batch_size=[n])" in msg
        True
    """
    got = (
        ", ".join(f"{_arg_name(k)} is a {type(v).__name__}" for k, v in items) or "the call has no arguments"
    )
    text = (
        f"Dispatch.{mode} needs at least one batch argument to split over the ranks (a TensorDict, a "
        f"list, a KVBatchMeta, anything with chunk/concat), but {got}"
    )
    if any(isinstance(v, dict) for _, v in items):
        text += (
            ". A dict is not split (which of its entries are rows?): pass TensorDict(d, batch_size=[n]) to "
            "split its columns by row, or @register(dispatch_mode=Dispatch.ONE_TO_ALL) to give every rank "
            "the whole dict"
        )
    return text


def _is_batch_arg(key: int | str, value: object) -> bool:
    if batch.is_tensordict(value) and not value.batch_size:
        raise TypeError(f"{_arg_name(key)} is a TensorDict with an empty batch_size: no samples to chunk")
    return batch.is_batch(value)


def _piece_sizes(pieces: list[object]) -> list[int] | None:
    sizes = [batch.length(p) for p in pieces]
    known = [s for s in sizes if s is not None]
    return known if len(known) == len(sizes) else None


def _proto(mode: str, replicate_first: bool = False) -> Callable[..., Dispatched]:
    def dispatch(worker_group: Group, *args: Any, **kwargs: Any) -> Dispatched:
        if replicate_first and (not args or not callable(args[0])):
            raise TypeError(f"Dispatch.{mode} needs a callable as the first argument")
        n = worker_group.world_size
        args_out, split_kwargs, pad, sizes, uneven, maker = split_batches(
            n, args, kwargs, mode=mode, replicate_first=replicate_first
        )
        kwargs_out: dict[str, object] = {**split_kwargs}  # the per-rank lists, then the reserved kwargs
        kwargs_out[CHUNK_INFO_KWARG] = ChunkInfo(sizes, uneven, maker)
        if pad:
            kwargs_out[PADDING_KWARG] = pad
        return tuple(args_out), kwargs_out

    dispatch.__name__ = f"dispatch_{mode.lower()}"
    dispatch.__qualname__ = dispatch.__name__
    return dispatch


dispatch_dp_compute_proto = _proto("DP_COMPUTE_PROTO")
dispatch_dp_compute_proto_with_func = _proto("DP_COMPUTE_PROTO_WITH_FUNC", replicate_first=True)
dispatch_dp_compute_metric = _proto("DP_COMPUTE_METRIC")


def concat_outputs(outputs: Sequence[Any], ranks: Sequence[int]) -> Any:
    """Concatenate per-rank outputs; ``ObjectRef``s become a ``BatchFuture`` (nothing is fetched)."""
    if not outputs:
        raise ValueError("no outputs to concatenate (no rank was collected)")
    if isinstance(outputs[0], ray.ObjectRef):
        future = BatchFuture(outputs)
        future.source_ranks = list(ranks)
        return future
    return batch.concat(outputs)


def collect_dp_compute_proto(worker_group: Group, outputs: list[Any]) -> Any:
    """Concatenate every rank's output in rank order (a ``BatchFuture`` when not blocking)."""
    collect_dp_compute(worker_group, outputs)
    return concat_outputs(outputs, range(len(outputs)))


def collect_dp_compute_metric(worker_group: Group, outputs: list[T]) -> list[T]:
    """One output per rank, not concatenated (metrics)."""
    return collect_dp_compute(worker_group, outputs)


# unpad each rank's output, never drop ranks (an attribute of the function: mypy cannot see it)
collect_dp_compute_metric.per_rank = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------ unpadding
def unpad_result(collect_fn: Callable[..., object], result: Any, pad: int, sizes: list[int] | None) -> Any:
    """Remove ``pad`` padded samples from a collected result (driver side).

    Concatenated results (batches, lists, futures) lose their last ``pad`` samples. Per-rank
    results (``DP_COMPUTE_METRIC``) keep one entry per rank; a rank's output that is a batch
    of exactly the samples it received loses the padded ones it held, other outputs (scalar
    metrics) are returned as computed.
    """
    if pad <= 0:
        return result
    if not getattr(collect_fn, "per_rank", False):
        return batch.trim(result, pad)
    if sizes is None or not isinstance(result, list) or len(result) != len(sizes):
        return result
    out = list(result)
    real = sum(sizes) - pad
    start = 0
    for rank, size in enumerate(sizes):
        padded_here = max(0, start + size - max(real, start))
        start += size
        value = out[rank]
        if padded_here and batch.is_batch(value) and not isinstance(value, ray.ObjectRef):
            if batch.length(value) == size:
                out[rank] = batch.trim(value, padded_here)
    return out


# ------------------------------------------------------------------ nd mesh
def _mesh_layout(worker_group: MeshGroup, mesh_name: str) -> list[int]:
    """The dp rank of every global rank for ``mesh_name`` (queried lazily, cached by the group)."""
    mapping = list(worker_group._get_dispatch_info(mesh_name))
    n = worker_group.world_size
    if len(mapping) != n:
        raise ValueError(f"mesh {mesh_name!r}: {len(mapping)} dp ranks reported for world_size {n}")
    if not mapping or sorted(set(mapping)) != list(range(max(mapping) + 1)):
        raise ValueError(f"mesh {mesh_name!r}: dp ranks must cover 0..dp_size-1 without gaps, got {mapping}")
    return mapping


class NdComputeDispatch:
    """Dispatch for a device mesh: chunk by dp size, every rank of a replica gets the same shard.

    Each shard of each batch argument is ``ray.put`` once; all ranks of that dp replica get the
    same ``ObjectRef`` (Ray resolves it before the method runs). Data may be passed
    positionally or as keyword arguments; non-batch arguments are replicated.
    """

    def __init__(self, mesh_name: str) -> None:
        self.mesh_name = mesh_name

    def __repr__(self) -> str:
        return f"NdComputeDispatch({self.mesh_name!r})"

    def __call__(self, worker_group: MeshGroup, *args: Any, **kwargs: Any) -> Dispatched:
        dp_of_rank = _mesh_layout(worker_group, self.mesh_name)
        dp_size = max(dp_of_rank) + 1
        args_chunks, kwargs_chunks, pad, sizes, uneven, maker = split_batches(
            dp_size, args, kwargs, mode=f"nd compute (mesh {self.mesh_name!r})"
        )

        def scatter(pieces: list[object]) -> list[object]:
            if all(p is pieces[0] for p in pieces):  # replicated argument: no put needed
                return [pieces[0]] * len(dp_of_rank)
            refs = [ray.put(p) for p in pieces]  # one put per dp shard
            return [refs[d] for d in dp_of_rank]

        args_out = tuple(scatter(p) for p in args_chunks)
        kwargs_out: dict[str, object] = {k: scatter(p) for k, p in kwargs_chunks.items()}
        rank_sizes = None if sizes is None else [sizes[d] for d in dp_of_rank]
        kwargs_out[CHUNK_INFO_KWARG] = ChunkInfo(rank_sizes, uneven, maker)
        if pad:
            kwargs_out[PADDING_KWARG] = pad
        return args_out, kwargs_out


class NdComputeCollect:
    """Collect for a device mesh: keep only collect ranks, one per dp rank, in dp order."""

    def __init__(self, mesh_name: str) -> None:
        self.mesh_name = mesh_name

    def __repr__(self) -> str:
        return f"NdComputeCollect({self.mesh_name!r})"

    def __call__(self, worker_group: MeshGroup, outputs: list[Any]) -> Any:
        dp_of_rank = _mesh_layout(worker_group, self.mesh_name)
        mask = list(worker_group._get_collect_info(self.mesh_name))
        if len(mask) != len(dp_of_rank) or len(outputs) != len(dp_of_rank):
            raise ValueError(
                f"mesh {self.mesh_name!r}: {len(mask)} collect flags and {len(outputs)} outputs "
                f"for world_size {len(dp_of_rank)}"
            )
        chosen: dict[int, int] = {}
        for rank, (dp, keep) in enumerate(zip(dp_of_rank, mask, strict=True)):
            if keep:
                if dp in chosen:
                    raise ValueError(
                        f"mesh {self.mesh_name!r}: ranks {chosen[dp]} and {rank} are both collect ranks of "
                        f"dp rank {dp}; exactly one rank per dp replica may be a collect rank"
                    )
                chosen[dp] = rank
        missing = sorted(set(dp_of_rank) - set(chosen))
        if missing:
            raise ValueError(f"mesh {self.mesh_name!r}: no collect rank for dp ranks {missing}")
        ranks = [chosen[d] for d in sorted(chosen)]
        return concat_outputs([outputs[r] for r in ranks], ranks)


def make_nd_compute_dispatch_fn(mesh_name: str) -> dict[str, Callable[..., Any]]:
    """A ``{dispatch_fn, collect_fn}`` pair for methods that run on a device mesh.

    Workers declare their place with ``self._register_dispatch_collect_info(mesh_name,
    dp_rank, is_collect)``; the group asks them once (lazily) and caches the layout.

    Example:
        >>> class Trainer(Worker):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self._register_dispatch_collect_info("train", dp_rank=self.rank // 2,
        ...                                              is_collect=self.rank % 2 == 0)
        ...     @register(dispatch_mode=make_nd_compute_dispatch_fn("train"))
        ...     def step(self, batch):
        ...         return batch
    """
    if not isinstance(mesh_name, str) or not mesh_name:
        raise ValueError(f"mesh_name must be a non-empty string, got {mesh_name!r}")
    return {"dispatch_fn": NdComputeDispatch(mesh_name), "collect_fn": NdComputeCollect(mesh_name)}


__all__ = ["make_nd_compute_dispatch_fn"]
