"""Which arguments each rank gets: verl's broadcast rule, PerRank / Broadcast, rank zero."""

from __future__ import annotations

import pickle

import pytest

from controlplane import (
    Broadcast,
    Dispatch,
    Execute,
    PerRank,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)
from controlplane.per_rank import for_rank_zero, mark_dispatched, split_for_ranks


# ---- pure --------------------------------------------------------------------------------------
def test_verl_rule_scatters_only_when_every_argument_is_per_rank() -> None:
    assert split_for_ranks(([1, 2],), {"y": [3, 4]}, 2) == [((1,), {"y": 3}), ((2,), {"y": 4})]
    assert split_for_ranks(([1, 2],), {"y": 7}, 2) == [(([1, 2],), {"y": 7})] * 2  # one is not
    assert split_for_ranks(([1, 2, 3],), {}, 2) == [(([1, 2, 3],), {})] * 2  # wrong length
    assert split_for_ranks(((1, 2),), {}, 2) == [(((1, 2),), {})] * 2  # tuples never scatter
    assert split_for_ranks((), {}, 3) == [((), {})] * 3


def test_wrappers_make_the_call_explicit() -> None:
    # a broadcast list of world_size items: verl would scatter it; Broadcast keeps it whole
    assert split_for_ranks((Broadcast([1, 2]),), {}, 2) == [(([1, 2],), {})] * 2
    # once anything is wrapped, unwrapped lists are broadcast and only PerRank scatters
    calls = split_for_ranks((PerRank([1, 2]), [5, 6]), {"z": Broadcast("s")}, 2)
    assert calls == [((1, [5, 6]), {"z": "s"}), ((2, [5, 6]), {"z": "s"})]
    with pytest.raises(ValueError, match=r"m: keyword argument 'x' is PerRank with 3 values.*world_size 2"):
        split_for_ranks((), {"x": PerRank([1, 2, 3])}, 2, "m")
    with pytest.raises(TypeError, match="contradictory"):
        PerRank(Broadcast([1]))


def test_rank_zero_passes_lists_whole() -> None:
    assert for_rank_zero(([7, 8],), {"k": [1, 2]}, 2) == (([7, 8],), {"k": [1, 2]})
    assert for_rank_zero((PerRank([7, 8]), Broadcast([1, 2])), {}, 2) == ((7, [1, 2]), {})


def test_mark_dispatched_wraps_lists_and_resolves_replicated_wrappers() -> None:
    args, kwargs = mark_dispatched(([1, 2], (3, 4)), {"x": 5, "y": [PerRank([8, 9])] * 2})
    assert type(args[0]) is PerRank and args[1] == (3, 4) and kwargs["x"] == 5
    # ONE_TO_ALL replicated a caller's PerRank: each rank still gets its own entry
    assert split_for_ranks(args, kwargs, 2) == [
        ((1, (3, 4)), {"x": 5, "y": 8}),
        ((2, (3, 4)), {"x": 5, "y": 9}),
    ]
    assert for_rank_zero(args, kwargs, 2) == ((1, (3, 4)), {"x": 5, "y": 8})


def test_wrappers_pickle_and_compare() -> None:
    assert pickle.loads(pickle.dumps(PerRank([1, 2]))) == PerRank([1, 2])
    assert type(pickle.loads(pickle.dumps(PerRank([1])))) is PerRank
    assert pickle.loads(pickle.dumps(Broadcast({"a": 1}))) == Broadcast({"a": 1})
    assert repr(PerRank([1])) == "PerRank([1])" and repr(Broadcast(2)) == "Broadcast(2)"


# ---- with Ray ----------------------------------------------------------------------------------
class ArgWorker(Worker):
    """verl's test actor: ``foo(y) = x + y``; the registered methods echo what they received."""

    def __init__(self, x: int = 2) -> None:
        super().__init__()
        self._x = x

    def foo(self, y):
        return self._x + y if not isinstance(y, list) else ("list", y)

    def got(self, *args, **kwargs):
        return self.rank, args, kwargs

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + y + x

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def all_to_all(self, *args, **kwargs):
        return self.rank, args, kwargs

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def one_to_all(self, *args, **kwargs):
        return self.rank, args, kwargs

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def one_to_zero(self, value):
        return self.rank, value


@pytest.fixture(scope="module")
def wg2(ray_session):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ArgWorker, x=2))
    yield wg
    wg.kill()
    pool.remove()


def test_seed_example_broadcasts_a_plain_argument(wg2: RayWorkerGroup) -> None:
    import ray

    assert wg2.execute_all_sync("foo", y=3) == [5, 5]
    assert ray.get(wg2.execute_all_async("foo", 4)) == [6, 6]
    assert wg2.execute_all("foo", [1, 2]) and wg2.execute_all_sync("foo", [1, 2]) == [3, 4]  # scattered
    assert wg2.execute_all_sync("foo", Broadcast([1, 2])) == [("list", [1, 2])] * 2
    assert wg2.execute_all_sync("got", PerRank(["a", "b"]), [1, 2], k=Broadcast(0)) == [
        (0, ("a", [1, 2]), {"k": 0}),
        (1, ("b", [1, 2]), {"k": 0}),
    ]


def test_rank_zero_direct_call_gets_the_list_whole(wg2: RayWorkerGroup) -> None:
    assert wg2.execute_rank_zero_sync("got", [10, 20], k=[1, 2]) == (0, ([10, 20],), {"k": [1, 2]})
    assert wg2.execute_rank_zero_sync("got", PerRank([10, 20])) == (0, (10,), {})
    assert wg2.execute_rank_zero_sync("foo", 40) == 42


def test_bound_methods_scatter_dispatch_output_exactly(wg2: RayWorkerGroup) -> None:
    assert wg2.foo_rank_zero(x=1, y=2) == 5  # verl's test: ALL_TO_ALL + RANK_ZERO, plain arguments
    assert wg2.one_to_zero([7, 8]) == (0, [7, 8])  # replicated by dispatch, rank 0 gets its copy
    assert wg2.one_to_all([7, 8]) == [(0, ([7, 8],), {}), (1, ([7, 8],), {})]
    assert wg2.all_to_all([7, 8], y=[1, 2]) == [(0, (7,), {"y": 1}), (1, (8,), {"y": 2})]
    assert wg2.all_to_all([7, 8], y=3) == [(0, ([7, 8],), {"y": 3}), (1, ([7, 8],), {"y": 3})]
    # a caller's wrappers survive dispatch: PerRank scatters, Broadcast stays whole
    assert wg2.one_to_all(PerRank(["a", "b"]), Broadcast([1, 2])) == [
        (0, ("a", [1, 2]), {}),
        (1, ("b", [1, 2]), {}),
    ]
    assert wg2.all_to_all(PerRank(["a", "b"]), y=Broadcast([1, 2])) == [
        (0, ("a",), {"y": [1, 2]}),
        (1, ("b",), {"y": [1, 2]}),
    ]
