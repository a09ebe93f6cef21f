"""The batch protocol: what the PROTO dispatch modes can chunk, concatenate, pad and trim.

A *batch* is a sequence of samples along dim 0. Supported, without this package knowing them:

* ``TensorDict`` with at least one batch dimension (tensor, jagged and non-tensor entries);
* ``list`` and ``tuple``;
* any object whose class has a ``chunk(n)`` method and a ``concat`` classmethod and which
  supports ``len()`` (for example ``dataplane.KVBatchMeta`` or verl's ``DataProto``). Optional
  extras such a class may offer:

  - ``allows_uneven_chunks = True`` (class attribute: chunks may differ in size, so it is never
    padded);
  - ``is_padding_enabled()`` (verl's name): the batch asks for auto padding; a batch without
    it may instead carry verl's flag ``meta_info["_verl_auto_padding"] = True``;
  - ``pad(k)`` (returns a padded copy) or verl's ``padding(k)`` (pads in place: it is called on
    a shallow copy, so the caller's batch keeps its size), and ``trim(k)``;
  - ``__getitem__`` with a slice (used to trim padding and to take rows);
  - a future type for non-blocking calls (see ``controlplane.future.future_maker``).

Nothing here mutates its input: chunks are views or new objects, padding builds a new batch.
Padding repeats the last sample (whole samples, never partial rows).

Example:
    >>> from controlplane import batch
    >>> batch.chunk([1, 2, 3, 4], 2)
    [[1, 2], [3, 4]]
    >>> batch.concat([[1, 2], [3]])
    [1, 2, 3]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from controlplane import _config

if TYPE_CHECKING:
    from tensordict import TensorDictBase

# Attribute set by enable_auto_padding on objects that take attributes (TensorDict, user classes).
AUTO_PADDING_ATTR = "_controlplane_auto_padding"
# verl's per-batch padding flag, kept in DataProto.meta_info (DataProtoConfig.auto_padding_key).
VERL_AUTO_PADDING_KEY = "_verl_auto_padding"


class AutoPadList(list[Any]):
    """A ``list`` marked for auto padding; returned by ``enable_auto_padding`` for lists and tuples."""

    _controlplane_auto_padding = True


def is_tensordict(x: object) -> TypeGuard[TensorDictBase]:
    """True if ``x`` is a TensorDict.

    Checked through ``sys.modules``: a TensorDict can only exist once tensordict is imported, and
    workers that never see one skip importing torch and tensordict (seconds per actor on 2 cores).
    """
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(x, td.TensorDictBase)


def enable_auto_padding(batch: Any) -> Any:
    """Mark ``batch`` so the PROTO modes pad it when its size does not divide the ranks.

    The mark lives on this Python object only (copies and slices do not inherit it). Lists
    and tuples cannot carry a mark, so for them a marked copy is returned: use the return value.

    Example:
        >>> batch = enable_auto_padding(batch)
        >>> out = wg.compute(batch)   # 10 rows on 4 ranks: padded to 12, 10 rows come back
    """
    if isinstance(batch, list | tuple) and not isinstance(batch, AutoPadList):
        return AutoPadList(batch)
    try:
        object.__setattr__(batch, AUTO_PADDING_ATTR, True)
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"cannot mark a {type(batch).__name__} for auto padding: {exc}") from exc
    return batch


def auto_padding_requested(batch: object) -> bool:
    """True if padding ``batch`` to a multiple of the ranks was asked for, by any of:

    * ``enable_auto_padding(batch)`` (or the class attribute ``_controlplane_auto_padding = True``);
    * the batch itself: ``batch.is_padding_enabled()`` (verl's ``DataProto``: its own flag or
      ``DataProtoConfig.auto_padding``), or ``batch.meta_info["_verl_auto_padding"]``;
    * the environment: ``CONTROLPLANE_AUTO_PADDING=1`` or ``VERL_AUTO_PADDING=1``.

    Example:
        >>> auto_padding_requested(DataProto.from_dict({"a": torch.zeros(3)}, auto_padding=True))
        True
    """
    if getattr(batch, AUTO_PADDING_ATTR, False) or _config.auto_padding_enabled():
        return True
    if is_tensordict(batch) or isinstance(batch, list | tuple):
        return False
    return _batch_wants_padding(batch)


def _batch_wants_padding(batch: object) -> bool:
    """The batch's own say (duck typing verl's ``DataProto``, which is never imported here)."""
    ask = getattr(batch, "is_padding_enabled", None)
    if callable(ask):
        return bool(ask())
    meta = getattr(batch, "meta_info", None)
    return isinstance(meta, dict) and bool(meta.get(VERL_AUTO_PADDING_KEY, False))


def _is_generic_batch(x: object) -> bool:
    cls = type(x)
    return callable(getattr(cls, "chunk", None)) and callable(getattr(cls, "concat", None))


def is_batch(x: object) -> bool:
    """True if ``x`` follows the batch protocol (can be chunked along its first dimension)."""
    if is_tensordict(x):
        return len(x.batch_size) > 0
    return isinstance(x, list | tuple) or _is_generic_batch(x)


def length(x: Any) -> int | None:
    """Number of samples in ``x``; ``None`` when not known yet (an unresolved future)."""
    if is_tensordict(x):
        return _tensordict_length(x)
    try:
        return len(x)
    except TypeError:
        return None


def _tensordict_length(td: TensorDictBase) -> int:
    if not td.batch_size:
        raise TypeError("a TensorDict with an empty batch_size has no samples to count")
    return int(td.batch_size[0])


def allows_uneven(x: object) -> bool:
    """True if ``x`` accepts chunks of different sizes (so it never needs padding)."""
    if is_tensordict(x) or isinstance(x, list | tuple):
        return False
    return bool(getattr(x, "allows_uneven_chunks", False))


def chunk_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``n`` consecutive chunks of ``total`` samples, the first ones larger by one if uneven."""
    if n < 1:
        raise ValueError(f"number of chunks must be >= 1, got {n}")
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def take(x: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``x`` (a view where the type allows)."""
    if is_tensordict(x) or isinstance(x, list | tuple):
        return x[start:stop]
    try:
        return x[start:stop]
    except TypeError as exc:
        raise TypeError(
            f"cannot take samples {start}:{stop} of a {type(x).__name__}: it does not support "
            "slicing (implement __getitem__ with a slice)"
        ) from exc


def chunk(x: Any, n: int, *, name: str = "batch") -> list[Any]:
    """Split ``x`` into ``n`` consecutive chunks.

    Args:
        x: a batch (see the module docstring).
        n: number of chunks.
        name: how to call ``x`` in error messages (e.g. the argument name).

    Returns:
        A list of ``n`` batches of the same type.

    Raises:
        TypeError: ``x`` is not a batch.
        ValueError: the size does not divide by ``n`` and the type does not allow uneven chunks.
    """
    if not is_batch(x):
        raise TypeError(f"{name} of type {type(x).__name__} is not a batch: it cannot be chunked")
    size = length(x)
    uneven_ok = allows_uneven(x)
    if size is not None and size % n and not uneven_ok:
        raise ValueError(
            f"{name} has {size} samples, which does not divide into {n} equal chunks; make the "
            f"size a multiple of {n} or enable auto padding (enable_auto_padding(batch), "
            f"{_config.AUTO_PADDING_ENV}=1 or {_config.VERL_AUTO_PADDING_ENV}=1)"
        )
    bounds = _bounds(chunk_sizes(size, n)) if size is not None else []
    if is_tensordict(x) and n > 1:
        # A slice of a tensor pickles its whole storage, so Ray would ship the entire batch to
        # every rank; a compact copy per chunk ships each sample once.
        return [x[a:b].clone() for a, b in bounds]
    if is_tensordict(x) or isinstance(x, list | tuple):
        return [x[a:b] for a, b in bounds]
    parts = list(x.chunk(n))
    if len(parts) != n:
        raise ValueError(f"{type(x).__name__}.chunk({n}) of {name} returned {len(parts)} chunks, not {n}")
    return parts


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate batches of one type, in order.

    Raises:
        ValueError: ``parts`` is empty.
        TypeError: mixed types, or a type that cannot be concatenated.
    """
    if not parts:
        raise ValueError("cannot concatenate an empty list of batches")
    first = parts[0]
    if is_tensordict(first):
        for i, p in enumerate(parts):
            if not is_tensordict(p):
                raise TypeError(f"cannot concatenate TensorDict with {type(p).__name__} (part {i})")
            if not p.batch_size:
                raise TypeError(
                    f"part {i} is a TensorDict with an empty batch_size (metrics?); it cannot be "
                    "concatenated along samples: use Dispatch.DP_COMPUTE_METRIC to get one result per rank"
                )
        import torch

        return torch.cat(list(parts), dim=0)
    kinds = {type(p) for p in parts}
    if isinstance(first, list | tuple):
        if not all(isinstance(p, list | tuple) for p in parts):
            raise TypeError(f"cannot concatenate sequences with {sorted(k.__name__ for k in kinds)}")
        joined = [item for p in parts for item in p]
        return tuple(joined) if isinstance(first, tuple) else joined
    if len(kinds) > 1:
        raise TypeError(f"cannot concatenate mixed types {sorted(k.__name__ for k in kinds)}")
    concat_fn = getattr(type(first), "concat", None)
    if not callable(concat_fn):
        raise TypeError(
            f"{type(first).__name__} cannot be concatenated (it has no concat classmethod): the ranks "
            "returned one each, which a concatenating mode (DP_COMPUTE_PROTO) cannot join; a method "
            "returning one value per rank (a dict of metrics) belongs under Dispatch.DP_COMPUTE_METRIC "
            "or ONE_TO_ALL, which give the caller every rank's result as a list"
        )
    return concat_fn(list(parts))


def pad(x: Any, k: int, *, name: str = "batch") -> Any:
    """A new batch: ``x`` followed by ``k`` copies of its last sample (``x`` is not modified)."""
    if k < 0:
        raise ValueError(f"padding count must be >= 0, got {k}")
    if k == 0:
        return x
    if is_tensordict(x):
        import torch

        size = _tensordict_length(x)
        if size == 0:
            raise ValueError(f"cannot pad {name}: it has no samples to repeat")
        index = torch.cat([torch.arange(size), torch.full((k,), size - 1, dtype=torch.long)])
        return x[index]
    if isinstance(x, list | tuple):
        if not x:
            raise ValueError(f"cannot pad {name}: it has no samples to repeat")
        padded = list(x) + [x[-1]] * k
        return tuple(padded) if isinstance(x, tuple) and not isinstance(x, list) else padded
    pad_fn = getattr(x, "pad", None)
    if callable(pad_fn):
        return pad_fn(k)
    if callable(getattr(x, "padding", None)):
        return _pad_in_place_on_copy(x, k, name)
    raise TypeError(
        f"{name} of type {type(x).__name__} cannot be padded (it has neither pad(k) nor padding(k)); "
        "make its size divisible by the number of ranks"
    )


def _pad_in_place_on_copy(x: Any, k: int, name: str) -> Any:
    """verl's ``DataProto.padding(k)`` pads in place by rebinding its fields; doing it on a shallow
    copy leaves the caller's batch as it was (checked: a class that mutates shared state fails)."""
    before = length(x)
    if before is None:
        raise TypeError(f"cannot pad {name}: a {type(x).__name__} of unknown length")
    padded = copy.copy(x)
    padded.padding(k)
    if length(x) != before:
        raise TypeError(
            f"{type(x).__name__}.padding({k}) changed the caller's {name} through a shallow copy; "
            "give the class a pad(k) method that returns a new batch"
        )
    if length(padded) != before + k:
        raise ValueError(
            f"{type(x).__name__}.padding({k}) gave {length(padded)} samples, expected {before + k}"
        )
    return padded


def trim(x: Any, k: int) -> Any:
    """A batch without its last ``k`` samples (used to undo padding)."""
    if k <= 0:
        return x
    trim_fn = getattr(x, "trim", None)
    if not (is_tensordict(x) or isinstance(x, list | tuple)) and callable(trim_fn):
        return trim_fn(k)
    size = length(x)
    if size is None:
        raise TypeError(f"cannot remove padding from a {type(x).__name__} of unknown length")
    if k > size:
        raise ValueError(f"cannot remove {k} padded samples from a batch of {size}")
    return take(x, 0, size - k)
