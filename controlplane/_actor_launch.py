"""Starting a ``RayWorkerGroup``'s actors: one per pool slot, each told its rank.

:func:`launch_group` is what the group calls; it returns the started actors and leaves waiting
for their constructors (and killing them when one fails) to the group, which owns them.

Ranks follow the pool's slot order. Each actor is named ``{prefix}{Class}_{pg}:{i}`` (its
placement group's index in the group and its position there, as verl names them), while
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` describe the *node* the actor landed on: the group's ranks
on one node are counted together even when they come from several placement groups. A worker
with an accelerator gets ``LOCAL_RANK=0`` (Ray narrows its visible devices to its own); see
``controlplane._devices`` for the ``RAY_EXPERIMENTAL_NOSET_*`` case.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from controlplane._config import RANK_ENV_KEYS
from controlplane._devices import accelerator_resource, local_ranks_by_node
from controlplane.resource_pool import BundleSlot, RayResourcePool, ResourcePool
from controlplane.worker import get_free_port, get_node_ip

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from controlplane.class_with_init_args import RayClassWithInitArgs

# Environment a group sets for each rank (what Worker reads, plus verl's extras); user-provided
# worker_env may not override these.
PROTECTED_ENV = (*RANK_ENV_KEYS, "WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs and what it is told about itself.

    ``pg_index`` / ``index_in_pg`` name the actor (consecutive slots of one placement group);
    ``local_rank`` / ``local_world_size`` count the group's ranks on the node ``node_id``.
    """

    rank: int
    pg_index: int
    index_in_pg: int
    local_rank: int
    local_world_size: int
    slot: BundleSlot
    node_id: str = ""


def slot_node_ids(slots: Sequence[BundleSlot]) -> list[str]:
    """The node id each slot's bundle was placed on (placement groups must be ready)."""
    import ray.util

    tables: dict[PlacementGroup, dict[int, str]] = {}
    nodes = []
    for slot in slots:
        pg = slot.placement_group
        if pg not in tables:
            tables[pg] = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
        node = tables[pg].get(slot.bundle_index)
        if node is None:
            raise RuntimeError(f"bundle {slot.bundle_index} of placement group {pg.id.hex()} is not placed")
        nodes.append(str(node))
    return nodes


def places_for(slots: Sequence[BundleSlot], node_ids: Sequence[str] | None = None) -> list[RankPlace]:
    """Rank places from slots, in slot order.

    Args:
        slots: the pool's slots in rank order.
        node_ids: the node of every slot (queried from Ray when omitted).
    """
    node_ids = list(node_ids) if node_ids is not None else slot_node_ids(slots)
    if len(node_ids) != len(slots):
        raise ValueError(f"{len(node_ids)} node ids for {len(slots)} slots")
    local = local_ranks_by_node(node_ids)
    places: list[RankPlace] = []
    pg_index, index_in_pg = -1, 0
    for rank, slot in enumerate(slots):
        if places and places[-1].slot.placement_group == slot.placement_group:
            index_in_pg += 1
        else:
            pg_index, index_in_pg = pg_index + 1, 0
        places.append(
            RankPlace(rank, pg_index, index_in_pg, local[rank][0], local[rank][1], slot, node_ids[rank])
        )
    return places


def master_addr_port(slot: BundleSlot) -> tuple[str, int]:
    """Node IP and a free port on the node of ``slot``, found by a zero-CPU task placed there."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def _probe() -> tuple[str, int]:
        return get_node_ip(), get_free_port()

    probe = ray.remote(num_cpus=0)(_probe)
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
    )
    found: tuple[str, int] = ray.get(probe.options(scheduling_strategy=strategy).remote(), timeout=120)
    return found


def check_worker_env(worker_env: dict[str, str] | None) -> None:
    """Raise ValueError if user-provided ``worker_env`` touches a key the group sets per rank."""
    clash = sorted(set(worker_env or {}) & set(PROTECTED_ENV))
    if clash:
        raise ValueError(f"worker_env may not override the group's environment variables {clash}")


def rank_env(
    place: RankPlace,
    world_size: int,
    master: tuple[str, int],
    prefix: str,
    worker_env: dict[str, str] | None,
    *,
    accelerator: bool = False,
) -> dict[str, str]:
    """The environment variables of one rank (user ``worker_env`` first, protected keys last).

    ``accelerator``: the rank gets a device, so ``LOCAL_RANK`` is its device index among the
    devices Ray lets it see (0), not its position on the node.
    """
    check_worker_env(worker_env)
    env = {k: str(v) for k, v in (worker_env or {}).items()}
    env.update(
        {
            "WORLD_SIZE": str(world_size),
            "RANK": str(place.rank),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
            "LOCAL_RANK": "0" if accelerator else str(place.local_rank),
            "RAY_LOCAL_WORLD_SIZE": str(place.local_world_size),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            "WG_PREFIX": prefix,
            "WG_BACKEND": "ray",
        }
    )
    return env


def actor_class_name(ray_cls: object) -> str:
    """``Foo`` for ``ray.remote(Foo)`` (Ray names the wrapper ``ActorClass(Foo)``)."""
    name = type(ray_cls).__name__
    match = re.fullmatch(r"ActorClass\((.+)\)", name)
    return match.group(1) if match else name


def launch_workers(
    ray_cls_with_init: RayClassWithInitArgs,
    places: Sequence[RankPlace],
    *,
    prefix: str,
    master: tuple[str, int],
    use_gpu: bool,
    num_gpus: float,
    num_cpus: float,
    detached: bool,
    worker_env: dict[str, str] | None,
    namespace: str | None = None,
    device_name: str = "cuda",
) -> tuple[list[ActorHandle], list[str]]:
    """Start one actor per place (without waiting); returns handles and names in rank order.

    The runtime environment of a ``@ray.remote(runtime_env=...)`` class and of
    ``update_options`` is kept; the group's per-rank variables are added to its ``env_vars``.
    """
    cls_name = actor_class_name(ray_cls_with_init.cls)
    base_runtime_env = _base_runtime_env(ray_cls_with_init)
    has_device = use_gpu and accelerator_resource(device_name) is not None
    workers, names = [], []
    for place in places:
        name = f"{prefix}{cls_name}_{place.pg_index}:{place.index_in_pg}"
        env = {
            **(base_runtime_env.get("env_vars") or {}),
            **rank_env(place, len(places), master, prefix, worker_env, accelerator=has_device),
        }
        options: dict[str, Any] = {"name": name, "runtime_env": {**base_runtime_env, "env_vars": env}}
        if detached:
            options["lifetime"] = "detached"
        if namespace is not None:
            options["namespace"] = namespace
        handle = ray_cls_with_init(
            placement_group=place.slot.placement_group,
            placement_group_bundle_idx=place.slot.bundle_index,
            use_gpu=use_gpu,
            num_gpus=num_gpus,
            num_cpus=num_cpus,
            options=options,
            device_name=device_name,
        )
        workers.append(handle)
        names.append(name)
    return workers, names


def _base_runtime_env(ray_cls_with_init: RayClassWithInitArgs) -> dict[str, Any]:
    """The class's ``@ray.remote`` runtime env overlaid with ``update_options``' (env vars merged)."""
    defaults = getattr(ray_cls_with_init.cls, "_default_options", None) or {}  # @ray.remote(...) options
    decorated = dict(defaults.get("runtime_env") or {})
    updated = dict(ray_cls_with_init._options.get("runtime_env") or {})
    env_vars = {**(decorated.get("env_vars") or {}), **(updated.get("env_vars") or {})}
    merged = {**decorated, **updated}
    if env_vars:
        merged["env_vars"] = env_vars
    return merged


@dataclass(frozen=True)
class LaunchedGroup:
    """What :func:`launch_group` started: actors and names in rank order, and the rendezvous."""

    workers: list[ActorHandle]
    names: list[str]
    master_addr: str
    master_port: int


def launch_group(
    pool: ResourcePool,
    ray_cls_with_init: RayClassWithInitArgs,
    *,
    name_prefix: str,
    bin_pack: bool,
    detached: bool,
    master: tuple[str, int] | None,
    use_gpu: bool | None,
    worker_env: dict[str, str] | None,
    num_cpus: float,
    namespace: str | None,
    device_name: str = "cuda",
) -> LaunchedGroup:
    """Start one actor per slot of ``pool`` (placing the pool first if needed), without waiting.

    Args:
        master: ``(addr, port)`` given by the caller, or ``None`` for a free port on the node of
            rank 0.
        use_gpu: None takes the pool's setting.

    Raises:
        TypeError: ``pool`` is not a Ray pool.
        ValueError: the group wants GPUs from a CPU-only pool, a device the pool was not placed
            with, or ``worker_env`` overrides a variable the group sets per rank.
    """
    if not isinstance(pool, RayResourcePool):
        raise TypeError(f"RayWorkerGroup needs a RayResourcePool, got {type(pool).__name__}")
    use_gpu = pool.use_gpu if use_gpu is None else use_gpu
    if use_gpu and not pool.use_gpu:
        raise ValueError(f"the group asks for GPUs but pool {pool.name_prefix} was built with use_gpu=False")
    check_worker_env(worker_env)  # before placement: a typo must not cost a placement wait
    slots = pool.bundle_slots(strategy="STRICT_PACK" if bin_pack else "PACK", device_name=device_name)
    places = places_for(slots)
    addr, port = master if master is not None else master_addr_port(slots[0])
    workers, names = launch_workers(
        ray_cls_with_init,
        places,
        prefix=name_prefix,
        master=(addr, int(port)),
        use_gpu=use_gpu,
        num_gpus=1.0 / pool.max_colocate_count,
        num_cpus=num_cpus,
        detached=detached,
        worker_env=worker_env,
        namespace=namespace,
        device_name=device_name,
    )
    return LaunchedGroup(workers, names, addr, int(port))
