"""Resource pools: which processes a worker group gets, and where they run.

A pool is a list of *slots*, one per process, in rank order. ``ResourcePool`` only counts
them; ``RayResourcePool`` backs each node entry with one Ray placement group (one bundle per
process) and hands out ``(placement group, bundle index)`` slots; ``SubRayResourcePool`` is a
contiguous slice of another pool's slots, so a pool can be split (also nested) and merged.

Example:
    >>> pool = RayResourcePool([2, 2], use_gpu=False, max_colocate_count=1)
    >>> first, second = split_resource_pool(pool, [1, 3])
    >>> second.store                      # per-node process counts of the slice
    [1, 2]
"""

from __future__ import annotations

import logging
import secrets
import string
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from controlplane._placement_groups import check_fits, create_placement_groups, remove_placement_groups

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

DEFAULT_PLACEMENT_TIMEOUT_S = 60.0


class BundleSlot(NamedTuple):
    """One process's place: a placement group and the bundle index inside it."""

    placement_group: PlacementGroup
    bundle_index: int


def _random_prefix() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(6))


class ResourcePool:
    """Process counts per node, without any placement.

    Args:
        process_on_nodes: how many processes run on each node, e.g. ``[2, 3]``.
        max_colocate_count: how many worker groups may share one process slot.
        n_gpus_per_node: informational only.

    Example:
        >>> ResourcePool([2, 3]).local_rank_list()
        [0, 1, 0, 1, 2]
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        max_colocate_count: int = 10,
        n_gpus_per_node: int = 8,
    ) -> None:
        counts = list(process_on_nodes or [])
        for i, count in enumerate(counts):
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                raise ValueError(f"process_on_nodes[{i}] must be a positive int, got {count!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count <= 0:
            raise ValueError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        self._store = counts
        self.max_colocate_count = max_colocate_count
        self.n_gpus_per_node = n_gpus_per_node

    def add_node(self, process_count: int) -> None:
        """Append a node running ``process_count`` processes."""
        if not isinstance(process_count, int) or process_count <= 0:
            raise ValueError(f"process_count must be a positive int, got {process_count!r}")
        self._store.append(process_count)

    @property
    def store(self) -> list[int]:
        """Process counts per node (a copy)."""
        return list(self._store)

    @property
    def world_size(self) -> int:
        return sum(self.store)

    def __call__(self) -> list[int]:
        return self.store

    def local_world_size_list(self) -> list[int]:
        """For every process in rank order, the number of processes on its node."""
        return [count for count in self.store for _ in range(count)]

    def local_rank_list(self) -> list[int]:
        """For every process in rank order, its rank among the processes of its node."""
        return [local for count in self.store for local in range(count)]


class RayResourcePool(ResourcePool):
    """A pool backed by Ray placement groups: one per node entry, one bundle per process.

    Each bundle is ``{"CPU": max_colocate_count, "GPU": 1 if use_gpu}`` (plus ``accelerator_type``
    at 1e-4 if given); the accelerator resource follows the ``device_name`` the placement groups
    are first built for (``"cuda"``: ``GPU``, ``"npu"``: ``NPU``, ``"cpu"``: none), as in verl.
    Placement groups are created lazily, on the first call that needs them, and are ordered by
    node IP (numerically, ties kept in creation order) on every call.

    Args:
        process_on_nodes: processes per node, e.g. ``[4]`` or ``[2, 3]``.
        use_gpu: request one GPU per bundle.
        name_prefix: prefix of the placement group names (random if None).
        max_colocate_count: worker groups that may share one bundle.
        detached: placement groups outlive this driver.
        accelerator_type: optional Ray accelerator resource to pin.
        n_gpus_per_node: informational only.
        device_name: the accelerator of the bundles when ``use_gpu`` (``"cuda"``, ``"npu"``,
            ``"cpu"``); an extension of verl's signature, which takes it per
            :meth:`get_placement_groups` call (that argument still wins there).
        placement_timeout_s: how long to wait for placement before raising
            :class:`ResourceShortageError`.

    Example:
        >>> pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
        >>> len(pool.get_placement_groups())
        1
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        n_gpus_per_node: int = 8,
        placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
        device_name: str = "cuda",
    ) -> None:
        from controlplane._devices import accelerator_resource

        super().__init__(process_on_nodes, max_colocate_count, n_gpus_per_node)
        accelerator_resource(device_name)  # an unknown name fails here, not at placement
        self.device_name = device_name
        self.use_gpu = bool(use_gpu)
        self.name_prefix = name_prefix if name_prefix is not None else _random_prefix()
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.placement_timeout_s = placement_timeout_s
        self.pgs: list[PlacementGroup] | None = None
        self._strategy: str | None = None
        self._device_resource: str | None = None  # the accelerator the placement groups hold

    def bundle_spec(self, device_name: str | None = None) -> dict[str, float]:
        """The resources of one bundle (one process slot) for workers on ``device_name``.

        Raises:
            ValueError: an unknown ``device_name``.
        """
        from controlplane._devices import accelerator_resource

        spec: dict[str, float] = {"CPU": float(self.max_colocate_count)}
        resource = accelerator_resource(device_name or self.device_name)
        if self.use_gpu and resource is not None:
            spec[resource] = 1.0
        if self.accelerator_type:
            spec[f"accelerator_type:{self.accelerator_type}"] = 1e-4
        return spec

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str | None = None
    ) -> list[PlacementGroup]:
        """Create (once) and return the placement groups, sorted by node IP.

        ``device_name`` (default: the pool's) picks the accelerator resource of the bundles when
        they are created.

        Raises:
            ResourceShortageError: the cluster cannot place them within ``placement_timeout_s``.
            ValueError: the groups already exist with another accelerator than ``device_name``'s.
        """
        if self.pgs is not None:
            self._check_device(device_name)
            if strategy != self._strategy:
                logger.debug(
                    "pool %s already placed with %s; ignoring %s", self.name_prefix, self._strategy, strategy
                )
            return list(self.pgs)
        prefix = name or f"{self.name_prefix}rlplane_group_{'_'.join(map(str, self._store))}:"
        spec = self.bundle_spec(device_name)
        self.pgs = create_placement_groups(
            self._store,
            spec,
            strategy=strategy,
            name_prefix=prefix,
            detached=self.detached,
            timeout_s=self.placement_timeout_s,
        )
        self._strategy = strategy
        self._device_resource = self._accelerator_of(spec)
        return list(self.pgs)

    def _accelerator_of(self, spec: dict[str, float]) -> str | None:
        return next((k for k in spec if k != "CPU" and not k.startswith("accelerator_type:")), None)

    def _check_device(self, device_name: str | None) -> None:
        """A placed pool serves only workers of the accelerator its bundles hold."""
        from controlplane._devices import accelerator_resource

        if device_name is None or self.pgs is None or not self.use_gpu or self._device_resource is None:
            return  # CPU-only bundles (or adopted placement groups): nothing to mismatch
        wanted = accelerator_resource(device_name)
        if wanted is not None and wanted != self._device_resource:
            raise ValueError(
                f"pool {self.name_prefix} was placed with {self._device_resource} bundles; "
                f"device_name={device_name!r} needs {wanted}"
            )

    def bundle_slots(self, strategy: str = "STRICT_PACK", device_name: str | None = None) -> list[BundleSlot]:
        """Every process slot in rank order (creates the placement groups if needed)."""
        pgs = self.get_placement_groups(strategy=strategy, device_name=device_name)
        return [BundleSlot(pg, i) for pg in pgs for i in range(pg.bundle_count)]

    @property
    def store(self) -> list[int]:
        if self.pgs is not None:  # after sorting, node order follows the placement groups
            return [pg.bundle_count for pg in self.pgs]
        return list(self._store)

    def remove(self) -> None:
        """Remove this pool's placement groups (workers on them die); safe to call twice."""
        remove_placement_groups(self.pgs or [])
        self.pgs = None

    def _compat_key(self) -> tuple[Hashable, ...]:
        return (self.use_gpu, self.max_colocate_count, self.detached, self.accelerator_type, self.device_name)


class SubRayResourcePool(RayResourcePool):
    """A contiguous slice of another pool's slots (what :func:`split_resource_pool` returns).

    Args:
        placement_groups: the parent's placement groups, in the parent's rank order.
        start_bundle_index: first slot of the slice, in the parent's global slot numbering.
        subgroup_world_size: number of slots in the slice.
        **kwargs: the remaining :class:`RayResourcePool` arguments.

    Example:
        >>> half = SubRayResourcePool(pool.get_placement_groups(), 0, 2, use_gpu=False)
    """

    def __init__(
        self,
        placement_groups: Sequence[PlacementGroup],
        start_bundle_index: int,
        subgroup_world_size: int,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("process_on_nodes", None)
        super().__init__(None, **kwargs)
        all_slots = [BundleSlot(pg, i) for pg in placement_groups for i in range(pg.bundle_count)]
        end = start_bundle_index + subgroup_world_size
        if start_bundle_index < 0 or subgroup_world_size <= 0 or end > len(all_slots):
            raise ValueError(f"slice [{start_bundle_index}, {end}) does not fit in {len(all_slots)} bundles")
        self.pgs = list(placement_groups)
        self.start_bundle_index = start_bundle_index
        self.subgroup_world_size = subgroup_world_size
        self._slots = all_slots[start_bundle_index:end]

    @classmethod
    def _from_slots(cls, slots: Sequence[BundleSlot], **kwargs: Any) -> SubRayResourcePool:
        pgs = _unique_pgs(slots)
        pool = cls(pgs, 0, pgs[0].bundle_count if pgs else 1, **kwargs)
        pool._slots = list(slots)
        pool.subgroup_world_size = len(slots)
        pool.start_bundle_index = 0
        return pool

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str | None = None
    ) -> list[PlacementGroup]:
        return list(self.pgs or [])

    def bundle_slots(self, strategy: str = "STRICT_PACK", device_name: str | None = None) -> list[BundleSlot]:
        self._check_device(device_name)
        return list(self._slots)

    @property
    def store(self) -> list[int]:
        return _counts_per_pg(self._slots)

    @property
    def world_size(self) -> int:
        return len(self._slots)

    def remove(self) -> None:
        """A slice does not own its placement groups; remove the parent pool instead."""
        raise TypeError("SubRayResourcePool does not own its placement groups; remove the parent pool")


def _unique_pgs(slots: Sequence[BundleSlot]) -> list[PlacementGroup]:
    seen: dict[PlacementGroup, None] = {}
    for slot in slots:
        seen.setdefault(slot.placement_group, None)
    return list(seen)


def _counts_per_pg(slots: Sequence[BundleSlot]) -> list[int]:
    """Per-node process counts of consecutive slots that share a placement group."""
    counts: list[int] = []
    previous = None
    for slot in slots:
        if counts and slot.placement_group == previous:
            counts[-1] += 1
        else:
            counts.append(1)
        previous = slot.placement_group
    return counts


def _pool_kwargs(pool: RayResourcePool, name_prefix: str) -> dict[str, Any]:
    return {
        "use_gpu": pool.use_gpu,
        "name_prefix": name_prefix,
        "max_colocate_count": pool.max_colocate_count,
        "detached": pool.detached,
        "accelerator_type": pool.accelerator_type,
        "n_gpus_per_node": pool.n_gpus_per_node,
        "placement_timeout_s": pool.placement_timeout_s,
        "device_name": pool.device_name,
    }


def split_resource_pool(pool: RayResourcePool, split_size: int | Sequence[int]) -> list[SubRayResourcePool]:
    """Split a pool into consecutive slices (placement groups are created first if needed).

    Args:
        pool: a :class:`RayResourcePool` or a slice of one (nested splits work).
        split_size: an int that divides ``pool.world_size`` (equal slices), or a list of sizes
            that sums to it.

    Returns:
        The slices in rank order; each shares the parent's placement groups.

    Example:
        >>> a, b = split_resource_pool(RayResourcePool([4], use_gpu=False), 2)
    """
    world_size = pool.world_size
    if isinstance(split_size, int) and not isinstance(split_size, bool):
        if split_size <= 0 or world_size % split_size:
            raise ValueError(f"split_size {split_size} must be a positive divisor of world_size {world_size}")
        sizes = [split_size] * (world_size // split_size)
    else:
        sizes = list(split_size)  # type: ignore[arg-type]  # a bool: list() refuses it (TypeError)
        if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
            raise ValueError(f"split sizes must be positive ints, got {sizes!r}")
        if sum(sizes) != world_size:
            raise ValueError(f"split sizes {sizes} sum to {sum(sizes)}, not world_size {world_size}")
    slots = pool.bundle_slots()
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        kwargs = _pool_kwargs(pool, f"{pool.name_prefix}_split_{i}")
        pieces.append(SubRayResourcePool._from_slots(slots[start : start + size], **kwargs))
        pieces[-1]._device_resource = pool._device_resource
        pieces[-1].start_bundle_index = getattr(pool, "start_bundle_index", 0) + start
        start += size
    return pieces


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> SubRayResourcePool:
    """Join two pools: ranks of ``rp1`` first, then those of ``rp2``.

    Raises:
        ValueError: the pools differ in ``use_gpu``, ``max_colocate_count``, ``detached``,
            ``accelerator_type`` or ``device_name``, or share a slot.

    Example:
        >>> whole = merge_resource_pool(*split_resource_pool(pool, 2))
    """
    if rp1._compat_key() != rp2._compat_key():
        raise ValueError(
            "cannot merge pools with different "
            "(use_gpu, max_colocate_count, detached, accelerator_type, device_name): "
            f"{rp1.name_prefix}={rp1._compat_key()} vs {rp2.name_prefix}={rp2._compat_key()}"
        )
    slots = rp1.bundle_slots() + rp2.bundle_slots()
    if len(set(slots)) != len(slots):
        raise ValueError(f"pools {rp1.name_prefix} and {rp2.name_prefix} overlap; cannot merge")
    kwargs = _pool_kwargs(rp1, f"{rp1.name_prefix}_{rp2.name_prefix}")
    merged = SubRayResourcePool._from_slots(slots, **kwargs)
    merged._device_resource = rp1._device_resource or rp2._device_resource
    return merged


RoleT = TypeVar("RoleT", bound=Hashable)


@dataclass
class ResourcePoolManager(Generic[RoleT]):
    """Role -> pool mapping, with a check that the cluster can hold every pool.

    Args:
        resource_pool_spec: pool name -> processes per node, e.g. ``{"global": [4]}``.
        mapping: role -> pool name, e.g. ``{"actor": "global", "critic": "global"}`` (a role is any
            hashable: a str, or an enum member as verl's ``Role``).
        max_colocate_count: passed to every pool.
        use_gpu: passed to every pool.

    Example:
        >>> mgr = ResourcePoolManager({"g": [2]}, {"actor": "g"}, use_gpu=False)
        >>> mgr.create_resource_pool(); mgr.get_resource_pool("actor").world_size
        2
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[RoleT, str]
    max_colocate_count: int = 3
    use_gpu: bool = True
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)

    def create_resource_pool(self) -> None:
        """Build one (lazy) pool per spec entry, then check that the cluster can hold them."""
        for role, pool_name in self.mapping.items():
            if pool_name not in self.resource_pool_spec:
                raise ValueError(f"role {role!r} maps to unknown pool {pool_name!r}")
        for pool_name, counts in self.resource_pool_spec.items():
            self.resource_pool_dict[pool_name] = RayResourcePool(
                process_on_nodes=counts,
                use_gpu=self.use_gpu,
                max_colocate_count=self.max_colocate_count,
                name_prefix=pool_name,
            )
        self._check_resource_available()

    def get_resource_pool(self, role: RoleT) -> RayResourcePool:
        if role not in self.mapping:
            known = sorted(self.mapping, key=str)
            raise KeyError(f"no pool is mapped to role {role!r}; known roles: {known}")
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_gpus(self) -> int:
        return sum(sum(counts) for counts in self.resource_pool_spec.values())

    def _check_resource_available(self) -> None:
        demands = []
        for pool_name, pool in self.resource_pool_dict.items():
            spec = pool.bundle_spec()
            demands += [(f"{pool_name}[{i}]", count, spec) for i, count in enumerate(pool.store)]
        # Against node totals: deterministic, and what "can this cluster hold the job" means;
        # placement itself reports a shortage of *available* resources with its deadline.
        check_fits(demands, use_available=False)


__all__ = [
    "RayResourcePool",
    "ResourcePool",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "merge_resource_pool",
    "split_resource_pool",
]
