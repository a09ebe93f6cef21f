"""Accelerators: which Ray resource a device name requests, and ``LOCAL_RANK`` as verl sets it.

``LOCAL_RANK`` is the index of the device a worker should use among the devices it can see,
so ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` is right on every rank:

* Ray normally narrows ``CUDA_VISIBLE_DEVICES`` (``ASCEND_RT_VISIBLE_DEVICES`` for NPUs) to the
  devices of the actor, so the index is 0; the group sets that before the actor starts;
* with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` the actor sees every device of its node
  and the index is the position of its assigned device; only the actor itself knows which one
  it got, so :func:`apply_local_rank` (called at the start of ``Worker.__init__``) fixes it up.

A worker without an accelerator (a CPU-only pool) gets the index of its rank among the group's
ranks on the same node (as ``torchrun`` numbers them), unique per node even when several
placement groups of one pool land on one node.

Example:
    >>> accelerator_resource("npu")
    'NPU'
    >>> device_index(["5"], "4,5,6,7")       # RAY_EXPERIMENTAL_NOSET_...: position among visible
    1
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

from controlplane import _config

logger = logging.getLogger(__name__)


class Accelerator(NamedTuple):
    """How Ray names and exposes one kind of accelerator."""

    resource: str  # the Ray resource an actor requests
    visible_env: str  # what Ray narrows to the actor's devices (unless RAY_EXPERIMENTAL_NOSET_<it>)


_ACCELERATORS: dict[str, Accelerator | None] = {
    "cuda": Accelerator("GPU", "CUDA_VISIBLE_DEVICES"),
    "npu": Accelerator("NPU", "ASCEND_RT_VISIBLE_DEVICES"),
    "cpu": None,
}
_ALIASES = {"gpu": "cuda"}


def accelerator(device_name: str) -> Accelerator | None:
    """The accelerator behind a verl device name (``"cuda"``, ``"npu"``, ``"cpu"``: ``None``).

    Raises:
        ValueError: an unknown device name (the message lists the known ones).
    """
    key = str(device_name).lower()
    key = _ALIASES.get(key, key)
    if key not in _ACCELERATORS:
        raise ValueError(f"unknown device_name {device_name!r}; known: {sorted(_ACCELERATORS)}")
    return _ACCELERATORS[key]


def accelerator_resource(device_name: str) -> str | None:
    """The Ray resource a device name requests (``"GPU"``, ``"NPU"``), or ``None`` for ``"cpu"``.

    Example:
        >>> accelerator_resource("cuda"), accelerator_resource("cpu")
        ('GPU', None)
    """
    acc = accelerator(device_name)
    return acc.resource if acc is not None else None


def device_index(assigned: Sequence[str], visible: str | None) -> int:
    """Index of the first assigned device among the visible ones.

    Args:
        assigned: the device ids Ray assigned to this actor (``get_accelerator_ids()``).
        visible: the visible-devices variable as this process sees it (``None`` if unset: every
            device is visible, so the index is the id).

    Raises:
        ValueError: nothing assigned, or an id that is neither visible nor a number.
    """
    if not assigned:
        raise ValueError("no device is assigned to this worker")
    first = str(assigned[0]).strip()
    if visible is not None and visible.strip():
        listed = [d.strip() for d in visible.split(",")]
        if first in listed:
            return listed.index(first)
    if first.isdigit():
        return int(first)
    raise ValueError(f"device {first!r} is not among the visible devices {visible!r}")


def local_ranks_by_node(node_ids: Sequence[str]) -> list[tuple[int, int]]:
    """For every rank (in rank order), its index among the ranks on its node and their count.

    Example:
        >>> local_ranks_by_node(["a", "b", "a"])
        [(0, 2), (0, 1), (1, 2)]
    """
    seen: dict[str, int] = {}
    positions = []
    for node in node_ids:
        positions.append(seen.get(node, 0))
        seen[node] = positions[-1] + 1
    return [(pos, seen[node]) for pos, node in zip(positions, node_ids, strict=True)]


def assigned_devices() -> tuple[Accelerator, list[str]] | None:
    """The accelerator kind and the device ids Ray assigned to the calling actor, if any."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        ids = ray.get_runtime_context().get_accelerator_ids()
    except Exception as exc:  # not inside a Ray worker, or a Ray without the API
        logger.debug("accelerator ids unavailable: %s", exc)
        return None
    for acc in _ACCELERATORS.values():
        if acc is not None and ids.get(acc.resource):
            return acc, list(ids[acc.resource])
    return None


def apply_local_rank() -> int | None:
    """Set ``LOCAL_RANK`` to this actor's device index among the devices it sees (see module doc).

    Call it first thing in a worker's constructor, before reading ``LOCAL_RANK``. It changes
    nothing for a worker without an assigned accelerator (CPU pools, ``sharing_with`` actors)
    and returns ``None`` there; otherwise it returns the index it set.

    Example:
        >>> apply_local_rank()          # in an actor given GPU 2 of 0-3, with NOSET set
        2
    """
    found = assigned_devices()
    if found is None:
        return None
    acc, ids = found
    index = device_index(ids, _config.env_text(acc.visible_env))
    os.environ["LOCAL_RANK"] = str(index)  # written for the worker's own code (torch.cuda.set_device)
    return index
