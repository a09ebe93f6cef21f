"""Worker classes shared by the group tests (a module, so Ray workers can import them)."""

from __future__ import annotations

import os
import time

from controlplane import Dispatch, Execute, Worker, make_nd_compute_dispatch_fn, register


class EnvWorker(Worker):
    """Reports what the group told it; can join a gloo process group from the environment."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        return {**self.get_env(), "pid": os.getpid(), "attr_rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return self.rank + x + self.offset

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def scatter(self, x: int) -> int:
        return x * 10

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_zero(self, x: int) -> tuple:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gloo_all_gather(self) -> list[int]:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # everything from RANK / WORLD_SIZE / MASTER_* env
        try:
            mine = torch.tensor([self.rank, self.rank], dtype=torch.int64)
            out = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(out, mine)
            return torch.cat(out).tolist()
        finally:
            dist.destroy_process_group()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_if(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)  # a hard crash, not an exception
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)  # a busy worker, for the aliveness tests
        return self.rank

    def plain(self, x: int) -> int:
        return x + 1


class FailingWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            raise RuntimeError("constructor of rank 1 refuses")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


class MeshWorker(Worker):
    """Registers two meshes: infer (dp x tp) and train (pp x dp x tp)."""

    def __init__(self, infer_tp: int = 4, train_pp: int = 2, train_tp: int = 2) -> None:
        super().__init__()
        r = self.rank
        self._register_dispatch_collect_info("infer", dp_rank=r // infer_tp, is_collect=r % infer_tp == 0)
        train_dp = self.world_size // (train_pp * train_tp)
        pp, rem = divmod(r, train_dp * train_tp)
        dp, tp = divmod(rem, train_tp)
        self._register_dispatch_collect_info("train", dp_rank=dp, is_collect=tp == 0 and pp == train_pp - 1)

    @register(dispatch_mode=make_nd_compute_dispatch_fn("infer"))
    def infer(self, batch: list) -> list:
        return [(x, self.rank) for x in batch]

    @register(dispatch_mode=make_nd_compute_dispatch_fn("train"))
    def train(self, batch: list) -> list:
        return [(x, self.rank) for x in batch]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen(self) -> int:
        return self.rank


def add_one(x: int) -> int:
    return x + 1


def tag_with_rank(worker: Worker, batch: list) -> list:
    return [(v, worker.rank) for v in batch]


class FlakyWorker(Worker):
    """Fails on the ranks it is told to: for the error-report tests (one error naming the ranks)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, ranks: list[int], tag: str = "") -> int:
        if self.rank in ranks:
            raise KeyError(f"no key on rank {self.rank}{tag}")
        return self.rank

    def forgot_register(self) -> int:  # not decorated: the group must say so when it is called
        return self.rank


class MeshCopyWorker(Worker):
    """Registers mesh ``own`` as (rank, rank == 0); copies meshes from info it is handed.

    For test_verl_proto, but kept out of _dataproto: it sees plain dicts only, so its actors need not
    import torch and tensordict (seconds of CPU each)."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("own", dp_rank=self.rank, is_collect=self.rank == 0)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def info(self) -> dict:
        return self.get_dispatch_collect()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def adopt(self, mesh_name: str, info: dict) -> tuple:
        try:
            self.set_dispatch_collect(mesh_name, **info)
        except AssertionError as exc:  # verl code catches this; ours is a MeshConflictError too
            return ("refused", type(exc).__name__)
        return (self.query_dispatch_info(mesh_name), self.query_collect_info(mesh_name))
