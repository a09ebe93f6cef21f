"""bind_worker_methods / bind_group_method through a tiny in-test group of real Ray actors.

The group here implements only the contract the binding relies on (world_size,
execute_all_async, execute_rank_zero_async, _wait, _get_dispatch_info/_get_collect_info), so
these tests do not depend on RayWorkerGroup; tests/controlplane/test_modes.py repeats the
modes through the real group.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from controlplane import batch
from controlplane.binding import bind_group_method, bind_worker_methods, registered_methods
from controlplane.decorator import Dispatch, Execute, register
from controlplane.dispatch import collect_all, dispatch_one_to_all, make_nd_compute_dispatch_fn
from controlplane.future import BatchFuture

pytestmark = pytest.mark.ray

WORLD = 4


class Member:
    """A worker without the Worker base class: rank given explicitly."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.mesh = {"pair": (rank // 2, rank % 2 == 0)}  # dp=2 x tp=2, tp==0 collects

    def _query_dispatch_info(self, mesh: str) -> int:
        return self.mesh[mesh][0]

    def _query_collect_info(self, mesh: str) -> bool:
        return self.mesh[mesh][1]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, x: int) -> int:
        return x * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag(self, data: TensorDict, offset: int = 0) -> TensorDict:
        out = data.clone()
        out["rank"] = torch.full((len(data),), self.rank)
        out["y"] = data["x"] + offset
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def tag_later(self, data: TensorDict) -> TensorDict:
        return self.tag(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def retag(self, data: TensorDict) -> TensorDict:
        # async: this actor is an async actor, so futures are awaited, never block its loop
        return self.tag(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def describe(self, data) -> list:
        return [repr(data.ops) if isinstance(data, BatchFuture) else type(data).__name__]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def count(self, data: TensorDict) -> dict:
        return {"rank": self.rank, "n": len(data)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: list) -> list:
        return fn(self, data)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def leader(self, value: int) -> tuple:
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self, value: int) -> tuple:
        return (self.rank, value)

    @register(dispatch_mode=make_nd_compute_dispatch_fn("pair"))
    def nd(self, data: TensorDict) -> TensorDict:
        return self.tag(data)

    def plain(self) -> str:  # not registered: not bound
        return "plain"


class ActorGroup:
    """The smallest group the binding needs, over real actors."""

    def __init__(self, cls: type, n: int) -> None:
        import ray

        actor_cls = ray.remote(num_cpus=0.1)(cls)
        self.workers = [actor_cls.remote(r) for r in range(n)]
        self._cache: dict[tuple[str, str], list] = {}
        self.bound = bind_worker_methods(self, cls)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def execute_all_async(self, name, *args, **kwargs):
        return [
            getattr(w, name).remote(*[a[r] for a in args], **{k: v[r] for k, v in kwargs.items()})
            for r, w in enumerate(self.workers)
        ]

    def execute_rank_zero_async(self, name, *args, **kwargs):
        first = {k: v[0] for k, v in kwargs.items()}
        return getattr(self.workers[0], name).remote(*[a[0] for a in args], **first)

    def _wait(self, refs, timeout=120, method=None):
        import ray

        return ray.get(refs, timeout=timeout)

    def _query(self, method: str, mesh: str) -> list:
        if (method, mesh) not in self._cache:
            self._cache[(method, mesh)] = self._wait(self.execute_all_async(method, [mesh] * self.world_size))
        return self._cache[(method, mesh)]

    def _get_dispatch_info(self, mesh: str) -> list[int]:
        return self._query("_query_dispatch_info", mesh)

    def _get_collect_info(self, mesh: str) -> list[bool]:
        return self._query("_query_collect_info", mesh)


@pytest.fixture(scope="module")
def group(ray_session):
    import ray

    g = ActorGroup(Member, WORLD)
    yield g
    for w in g.workers:
        ray.kill(w)


def rows(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


def test_binds_exactly_the_registered_methods(group) -> None:
    assert set(group.bound) == set(registered_methods(Member))
    assert "plain" not in group.bound and "whoami" in group.bound
    assert "whoami" in repr(group.whoami)


def test_one_to_all_all_to_all_dp_compute(group) -> None:
    assert group.whoami() == [0, 1, 2, 3]
    assert group.add(10) == [10, 11, 12, 13]  # replicated
    assert group.add([0, 100, 200, 300]) == [0, 101, 202, 303]  # scattered
    assert group.square([1, 2, 3, 4]) == [1, 4, 9, 16]
    with pytest.raises(ValueError, match="argument 0 is a list of length 2"):
        group.square([1, 2])


def test_dp_compute_proto_chunks_and_concats(group) -> None:
    out = group.tag(rows(8), offset=5)
    assert out["x"].tolist() == list(range(8))
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out["y"].tolist() == [x + 5 for x in range(8)]
    with pytest.raises(ValueError, match="6 samples.*4 equal chunks"):
        group.tag(rows(6))


def test_auto_padding_is_undone_and_caller_batch_untouched(group) -> None:
    data = batch.enable_auto_padding(rows(6))
    out = group.tag(data)
    assert out["x"].tolist() == list(range(6))
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2]  # padded to 8: rank 3 held only padding
    assert data["x"].tolist() == list(range(6)) and "rank" not in data.keys()
    metrics = group.count(batch.enable_auto_padding(rows(5)))
    assert [m["rank"] for m in metrics] == [0, 1, 2, 3]  # one entry per rank, none dropped


def test_with_func_replicates_function(group) -> None:
    def scale(worker, data):
        return [v * 10 + worker.rank for v in data]

    assert group.apply(scale, [1, 2, 3, 4]) == [10, 21, 32, 43]


def test_rank_zero_modes_return_one_value(group) -> None:
    assert group.leader(7) == (0, 7)
    assert group.only_rank_zero(8) == (0, 8)


def test_nd_mesh_dispatch_and_collect(group) -> None:
    out = group.nd(rows(4))
    # dp=2: ranks 0,1 get rows 0-1, ranks 2,3 get rows 2-3; only ranks 0 and 2 are collected
    assert out["x"].tolist() == [0, 1, 2, 3]
    assert out["rank"].tolist() == [0, 0, 2, 2]
    assert group.nd(data=rows(2))["rank"].tolist() == [0, 2]


def test_non_blocking_future_chains_into_another_call(group) -> None:
    fut = group.tag_later(batch.enable_auto_padding(rows(6)))
    assert isinstance(fut, BatchFuture)
    assert len(fut) == 6 and fut.part_sizes == [2, 2, 2, 2]  # padded parts, unpadded length
    again = group.retag(batch.enable_auto_padding(fut))  # the same actors produce and consume
    assert again["x"].tolist() == list(range(6))
    ops = group.describe(group.tag_later(rows(8)))
    assert ops == [f"(('window', {2 * r}, {2 * r + 2}),)" for r in range(4)]  # a window, not the whole
    assert fut.get(timeout=60)["rank"].tolist() == [0, 0, 1, 1, 2, 2]


def test_bind_group_method_directly_and_missing_execute(group) -> None:
    method = bind_group_method(
        group,
        "whoami",
        dispatch_fn=dispatch_one_to_all,
        collect_fn=collect_all,
        execute_fn_name="execute_all_async",
        blocking=False,
    )
    import ray

    assert ray.get(method(), timeout=60) == [0, 1, 2, 3]
    with pytest.raises(AttributeError, match="execute_nothing"):
        bind_group_method(
            group,
            "whoami",
            dispatch_fn=dispatch_one_to_all,
            collect_fn=collect_all,
            execute_fn_name="execute_nothing",
            blocking=True,
        )


def test_method_name_clash_with_group_attribute_is_an_error() -> None:
    class Clash:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def world_size(self):
            return 1

    class Bare:
        world_size = 1

        def execute_all_async(self, *a, **k):
            return []

    with pytest.raises(ValueError, match="already has an attribute 'world_size'"):
        bind_worker_methods(Bare(), Clash)
