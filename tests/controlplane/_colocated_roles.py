"""Role classes for the colocation tests (a module, so Ray workers can import them)."""

from __future__ import annotations

import os

from controlplane import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    Worker,
    create_colocated_worker_raw_cls,
    make_nd_compute_dispatch_fn,
    register,
)


class ActorRole(Worker):
    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, x: int) -> str:  # same name as CriticRole.step: must not clash
        return f"actor{self.rank}:{x * self.scale}"

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, batch: list) -> list:
        return [2 * v for v in batch]

    @register(dispatch_mode=make_nd_compute_dispatch_fn("actor"))
    def tag_shard(self, batch: list) -> list:  # mesh registered on the role, not on the host
        return [f"r{self.rank}:{v}" for v in batch]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self, x: int) -> tuple:
        return (self.rank, x)


class CriticRole(Worker):
    def __init__(self, name: str = "critic") -> None:
        super().__init__()
        self.name = name
        self._register_dispatch_collect_info("critic", dp_rank=0, is_collect=self.rank == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, x: int) -> str:
        return f"{self.name}{self.rank}:{x}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def astep(self, x: int) -> str:
        return f"async-{self.name}{self.rank}:{x}"

    @register(dispatch_mode=make_nd_compute_dispatch_fn("critic"))
    def count(self, batch: list) -> list:  # one dp replica; only rank 0 is collected
        return [len(batch) * 10 + self.rank]


# ---- fused roles: one process, the roles call each other ---------------------------------------
class PolicyRole(Worker):
    """Calls its sibling ``value`` through ``fused_worker_dict`` (no Ray call)."""

    def __init__(self) -> None:
        super().__init__()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: float) -> float:
        return x + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_then_sub(self, x: float) -> float:
        return self.fused_worker_dict["value"].sub(self.add(x))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sibling_pid(self) -> tuple[int, int]:
        return os.getpid(), self.fused_worker_dict["value"].pid()


class ValueRole(Worker):
    def __init__(self, val: float) -> None:
        super().__init__()
        self.val = val
        self.calls = 0

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def sub(self, x: float) -> float:
        self.calls += 1
        return x - self.val

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def n_calls(self) -> int:
        return self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def ascore(self, x: float) -> str:
        return f"async-{self.rank}:{x - self.val}"


FUSED_ROLES = {
    "policy": RayClassWithInitArgs(PolicyRole),
    "value": RayClassWithInitArgs(ValueRole, val=10),
}
FusedBase = create_colocated_worker_raw_cls(FUSED_ROLES)


class HybridWorker(FusedBase):
    """verl's pattern: subclass the fused class and combine the roles in one method."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def foo(self, x: float) -> float:
        return self.value.sub(self.policy.add(x))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shares_dict(self) -> bool:
        return all(w.fused_worker_dict is self.fused_worker_dict for w in self.fused_worker_dict.values())
