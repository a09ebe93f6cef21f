"""Starting the actors of a worker group on a pool's slots, with per-rank environments."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.resource_pool import BundleSlot

logger = logging.getLogger(__name__)

# Environment a group sets for each rank; user-provided worker_env may not override these.
PROTECTED_ENV = (
    "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
    "WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_WORLD_SIZE",
)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs and what it is told about itself."""

    rank: int
    node_index: int
    local_rank: int
    local_world_size: int
    slot: BundleSlot


def places_for(slots: Sequence[BundleSlot]) -> list[RankPlace]:
    """Rank places from slots: consecutive slots on one placement group form one node."""
    groups: list[list[BundleSlot]] = []
    for slot in slots:
        if groups and groups[-1][0].placement_group == slot.placement_group:
            groups[-1].append(slot)
        else:
            groups.append([slot])
    places, rank = [], 0
    for node_index, group in enumerate(groups):
        for local_rank, slot in enumerate(group):
            places.append(RankPlace(rank, node_index, local_rank, len(group), slot))
            rank += 1
    return places


def master_addr_port(slot: BundleSlot) -> tuple[str, int]:
    """Node IP and a free port on the node of ``slot``, found by a zero-CPU task placed there."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from controlplane.worker import get_free_port, get_node_ip

    @ray.remote(num_cpus=0)
    def _probe() -> tuple[str, int]:
        return get_node_ip(), get_free_port()

    strategy = PlacementGroupSchedulingStrategy(
        placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
    )
    return ray.get(_probe.options(scheduling_strategy=strategy).remote(), timeout=120)


def check_worker_env(worker_env: dict[str, str] | None) -> None:
    """Raise ValueError if user-provided ``worker_env`` touches a key the group sets per rank."""
    clash = sorted(set(worker_env or {}) & set(PROTECTED_ENV))
    if clash:
        raise ValueError(f"worker_env may not override the group's environment variables {clash}")


def rank_env(place: RankPlace, world_size: int, master: tuple[str, int], prefix: str,
             worker_env: dict[str, str] | None) -> dict[str, str]:
    """The environment variables of one rank (user ``worker_env`` first, protected keys last)."""
    check_worker_env(worker_env)
    env = {k: str(v) for k, v in (worker_env or {}).items()}
    env.update({
        "WORLD_SIZE": str(world_size),
        "RANK": str(place.rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "LOCAL_RANK": str(place.local_rank),
        "RAY_LOCAL_WORLD_SIZE": str(place.local_world_size),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "WG_PREFIX": prefix,
        "WG_BACKEND": "ray",
    })
    return env


def actor_class_name(ray_cls: Any) -> str:
    """``Foo`` for ``ray.remote(Foo)`` (Ray names the wrapper ``ActorClass(Foo)``)."""
    name = type(ray_cls).__name__
    match = re.fullmatch(r"ActorClass\((.+)\)", name)
    return match.group(1) if match else name


def launch_workers(
    ray_cls_with_init: Any,
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
) -> tuple[list[Any], list[str]]:
    """Start one actor per place (without waiting); returns handles and names in rank order."""
    cls_name = actor_class_name(ray_cls_with_init.cls)
    base_runtime_env = dict(ray_cls_with_init._options.get("runtime_env") or {})
    workers, names = [], []
    for place in places:
        name = f"{prefix}{cls_name}_{place.node_index}:{place.local_rank}"
        env = {**(base_runtime_env.get("env_vars") or {}),
               **rank_env(place, len(places), master, prefix, worker_env)}
        options: dict[str, Any] = {"name": name, "runtime_env": {**base_runtime_env, "env_vars": env}}
        if detached:
            options["lifetime"] = "detached"
        if namespace is not None:
            options["namespace"] = namespace
        handle = ray_cls_with_init(
            placement_group=place.slot.placement_group,
            placement_group_bundle_idx=place.slot.bundle_index,
            use_gpu=use_gpu, num_gpus=num_gpus, num_cpus=num_cpus, options=options,
        )
        workers.append(handle)
        names.append(name)
    return workers, names
