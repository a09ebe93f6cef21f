"""Role classes for the colocation tests (a module, so Ray workers can import them)."""

from __future__ import annotations

import os

from controlplane import Dispatch, Worker, register


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
