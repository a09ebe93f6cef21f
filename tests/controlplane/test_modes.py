"""Every dispatch mode end to end through a real RayWorkerGroup (CPU workers)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from controlplane import (
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dispatch_fn,
    register,
    register_dispatch_mode,
)
from controlplane import decorator as _decorator
from controlplane.batch import enable_auto_padding
from controlplane.dispatch import collect_all
from controlplane.future import BatchFuture
from tests.controlplane._groups import started_groups

pytestmark = pytest.mark.ray


def _two_to_all(worker_group, pair):
    """A custom mode: a 2-list is spread over 4 ranks as [a, b, a, b]."""
    return ([pair[i % 2] for i in range(worker_group.world_size)],), {}


TWO_TO_ALL = register_dispatch_mode("TEST_MODES_TWO_TO_ALL", _two_to_all, collect_all)


class ModeWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        # dp=2 x tp=2; the tp==0 rank of each replica is the collect rank
        self._register_dispatch_collect_info("pair", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def ping_later(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def times(self, x: int) -> int:
        return x * 10

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def first_only(self, x: int) -> tuple:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def leader(self, x: int) -> tuple:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp(self, x: int) -> int:
        return x + 1

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def plus(self, data: TensorDict) -> TensorDict:
        return TensorDict({"x": data["x"], "y": data["x"] + 10 + self.rank}, batch_size=data.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def plus_async(self, data: TensorDict) -> TensorDict:
        return TensorDict({"x": data["x"], "y": data["x"] * 2 + 5 + self.rank}, batch_size=data.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: TensorDict) -> dict:
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=make_nd_compute_dispatch_fn("pair"))
    def nd(self, data: TensorDict) -> TensorDict:
        ranks = torch.full((len(data),), self.rank)
        return TensorDict({"x": data["x"], "rank": ranks}, batch_size=data.batch_size)

    @register(dispatch_mode=make_nd_compute_dispatch_fn("pair"), blocking=False)
    def nd_later(self, data: TensorDict) -> TensorDict:
        return self.nd(data)

    @register(dispatch_mode=TWO_TO_ALL)
    def custom(self, x: int) -> int:
        return x + self.rank


class Consumer(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data: TensorDict) -> TensorDict:
        ranks = torch.full((len(data),), self.rank)
        return TensorDict({"y": data["y"], "by": ranks}, batch_size=data.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def what_arrived(self, data) -> list:
        return [(type(data).__name__, len(data))]


def rows(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


@pytest.fixture(scope="module")
def groups(ray_session):
    try:
        with started_groups((4, ModeWorker), (2, Consumer)) as (producer, consumer):
            yield producer, consumer
    finally:
        _decorator._DISPATCH_REGISTRY.pop(TWO_TO_ALL, None)
        Dispatch.remove(TWO_TO_ALL.name)


def test_replicating_and_scattering_modes(groups) -> None:
    wg, _ = groups
    import ray

    assert wg.ping(1) == [1, 2, 3, 4]
    assert ray.get(wg.ping_later(1), timeout=120) == [1, 2, 3, 4]
    assert wg.times(2) == [20] * 4
    assert wg.times([1, 2, 3, 4]) == [10, 20, 30, 40]
    assert wg.dp([0, 1, 2, 3]) == [1, 2, 3, 4]
    assert wg.custom([100, 200]) == [100, 201, 102, 203]


def test_rank_zero_modes(groups) -> None:
    wg, _ = groups
    assert wg.leader(5) == (0, 5)
    assert wg.first_only(6) == (0, 6)


def test_dp_compute_proto_and_padding(groups) -> None:
    wg, _ = groups
    out = wg.plus(rows(4))
    assert out["y"].tolist() == [10, 12, 14, 16]  # row i on rank i: i + 10 + i
    for n in (1, 6, 9):
        data = enable_auto_padding(rows(n))
        assert wg.plus(data)["x"].tolist() == list(range(n))
        assert data["x"].tolist() == list(range(n))
    with pytest.raises(ValueError, match="6 samples.*4 equal chunks"):
        wg.plus(rows(6))
    metrics = wg.metric(enable_auto_padding(rows(5)))
    assert [m["rank"] for m in metrics] == [0, 1, 2, 3]


def test_worker_builtins_with_func_and_rank_zero_func(groups) -> None:
    wg, _ = groups

    def count_rows(worker, data):
        return TensorDict({"r": torch.full((len(data),), worker.rank)}, batch_size=data.batch_size)

    assert wg.execute_with_func_generator(count_rows, rows(8))["r"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert wg.execute_func_rank_zero(lambda a, b: a + b, 2, 3) == 5


def test_nd_mesh(groups) -> None:
    wg, _ = groups
    out = wg.nd(rows(6))
    assert out["x"].tolist() == list(range(6))
    assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]
    assert wg.nd(data=enable_auto_padding(rows(3)))["x"].tolist() == [0, 1, 2]


def test_futures_chain_across_groups(groups) -> None:
    producer, consumer = groups
    fut = producer.plus_async(rows(8))
    assert isinstance(fut, BatchFuture) and len(fut) == 8
    assert consumer.what_arrived(fut) == [("BatchFuture", 4), ("BatchFuture", 4)]
    out = consumer.consume(fut)
    assert out["y"].tolist() == [x * 2 + 5 + x // 2 for x in range(8)]
    assert out["by"].tolist() == [0] * 4 + [1] * 4
    nd_fut = producer.nd_later(enable_auto_padding(rows(3)))
    assert len(nd_fut) == 3  # unpadded
    assert nd_fut.get(timeout=120)["rank"].tolist() == [0, 0, 2]
    padded_again = consumer.consume  # 3 rows on 2 ranks needs padding again
    with pytest.raises(ValueError, match="3 samples.*2 equal chunks"):
        padded_again(TensorDict({"y": torch.arange(3)}, batch_size=[3]))
