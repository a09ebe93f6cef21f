"""How the trainer builds its worker groups, as verl's ``RayPPOTrainer`` does.

A :class:`Role` enum names the trainer's roles, a role -> worker class mapping says what runs
each, and a :class:`~controlplane.ResourcePoolManager` maps roles to pools. Roles that share a
pool share its processes: their classes go into one actor class through
``create_colocated_worker_cls`` and each role gets its view with ``spawn`` (verl's "global pool"
layout); a role alone on its pool gets a plain group.

Example:
    >>> manager = pool_manager(dp_size=2, colocate=True, use_gpu=False)
    >>> groups = build_groups(manager, {Role.ActorRolloutRef: actor_spec, Role.Reward: reward_spec})
    >>> groups.views[Role.Reward].compute_reward(meta)   # runs in the actor ranks' processes
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from typing import Any

from controlplane import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
)
from workers.roles import ActorRolloutRefWorker, RewardWorker

__all__ = ["Role", "ROLE_WORKERS", "Groups", "build_groups", "pool_manager"]


class Role(enum.Enum):
    """The trainer's roles (verl has more: Critic, RefPolicy, RewardModel as separate roles)."""

    ActorRolloutRef = "actor_rollout_ref"  # policy, its rollout and the frozen reference: one class
    Reward = "reward"  # prompts, rule-based rewards, GRPO advantages


# Which class runs each role (verl's ``role_worker_mapping``).
ROLE_WORKERS: dict[Role, type] = {Role.ActorRolloutRef: ActorRolloutRefWorker, Role.Reward: RewardWorker}


def pool_manager(dp_size: int, *, colocate: bool, use_gpu: bool) -> ResourcePoolManager[Role]:
    """The trainer's pools: the actor's ``dp_size`` processes and, unless ``colocate``, one more
    process for the reward role (with ``colocate`` the reward role lives in the actor processes).

    Each process gets one bundle (``max_colocate_count=1``); roles that share a pool share its
    processes through colocation, not by packing more actors into a bundle.
    """
    if colocate:
        spec = {"global_pool": [dp_size]}
        mapping = {Role.ActorRolloutRef: "global_pool", Role.Reward: "global_pool"}
    else:
        spec = {"actor_pool": [dp_size], "reward_pool": [1]}
        mapping = {Role.ActorRolloutRef: "actor_pool", Role.Reward: "reward_pool"}
    return ResourcePoolManager(spec, mapping, max_colocate_count=1, use_gpu=use_gpu)


@dataclasses.dataclass
class Groups:
    """The groups built for the roles: ``views`` (role -> the group to call), what to release
    (``groups`` the actors belong to, ``pools``), and ``settings``: what the builder made them for
    (``GRPOTrainer.build_groups`` records the layout and the workers' settings there, and a trainer
    handed the groups checks them; empty otherwise)."""

    views: dict[Role, RayWorkerGroup]
    groups: list[RayWorkerGroup]
    pools: list[RayResourcePool]
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (its actors are gone)."""
        return not self.groups

    def close(self) -> None:
        """Kill every actor and free every placement group (idempotent)."""
        groups, self.groups = self.groups, []
        pools, self.pools = self.pools, []
        for group in groups:
            group.kill()
        for pool in pools:
            pool.remove()


def _actor_prefix(name: str) -> str:
    # Actor (and placement-group) names are unique per namespace: a random part lets trainers follow
    # each other at once, or run side by side.
    return f"{name}-{secrets.token_hex(3)}-"


def build_groups(manager: ResourcePoolManager[Role], specs: dict[Role, RayClassWithInitArgs]) -> Groups:
    """Start one group per pool: colocated roles in one actor class, one view per role.

    Raises:
        KeyError: a role in ``specs`` has no pool in ``manager``.
        ResourceShortageError: the cluster cannot hold the pools.
    """
    manager.create_resource_pool()
    for name, pool in manager.resource_pool_dict.items():
        # Placement-group names are unique per cluster as well, and the manager names them after the pool
        # alone; the pools are placed only when their group starts, so two trainers' pools can coexist.
        pool.name_prefix = _actor_prefix(name)
    built = Groups({}, [], list(manager.resource_pool_dict.values()))
    try:
        by_pool: dict[str, list[Role]] = {}
        for role in specs:
            if role not in manager.mapping:
                raise KeyError(f"role {role} has no resource pool; mapped roles: {list(manager.mapping)}")
            by_pool.setdefault(manager.mapping[role], []).append(role)
        for pool_name, roles in by_pool.items():
            pool = manager.resource_pool_dict[pool_name]
            if len(roles) == 1:
                group = RayWorkerGroup(pool, specs[roles[0]], name_prefix=_actor_prefix(roles[0].value))
                built.groups.append(group)
                built.views[roles[0]] = group
                continue
            colocated = create_colocated_worker_cls({r.value: specs[r] for r in roles})
            group = RayWorkerGroup(pool, colocated, name_prefix=_actor_prefix(pool_name))
            built.groups.append(group)
            views = group.spawn([r.value for r in roles])
            built.views.update({r: views[r.value] for r in roles})
    except BaseException:
        built.close()
        raise
    return built
