"""register(), the Dispatch/Execute enums and the dispatch-mode registry."""

from __future__ import annotations

import asyncio
import pickle

import cloudpickle
import pytest

from controlplane import decorator
from controlplane.decorator import (
    MAGIC_ATTR,
    Dispatch,
    Execute,
    get_dispatch_fn,
    get_execute_fn_name,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from controlplane.dispatch import collect_all, dispatch_one_to_all


def _d(wg, *args, **kwargs):
    return args, kwargs


def _c(wg, outputs):
    return outputs


@pytest.fixture
def restore_registry():
    saved = dict(decorator._DISPATCH_REGISTRY)
    names = set(Dispatch.names())
    yield
    decorator._DISPATCH_REGISTRY.clear()
    decorator._DISPATCH_REGISTRY.update(saved)
    for name in set(Dispatch.names()) - names:
        Dispatch.remove(name)


def test_members_and_lookup() -> None:
    assert Dispatch.names()[:7] == [
        "RANK_ZERO",
        "ONE_TO_ALL",
        "ALL_TO_ALL",
        "DP_COMPUTE",
        "DP_COMPUTE_PROTO",
        "DP_COMPUTE_PROTO_WITH_FUNC",
        "DP_COMPUTE_METRIC",
    ]
    assert Execute.names() == ["ALL", "RANK_ZERO"]
    assert Dispatch["one_to_all"] is Dispatch.ONE_TO_ALL
    assert "dp_compute" in Dispatch and Dispatch.DP_COMPUTE in Dispatch
    assert Execute.RANK_ZERO is not Dispatch.RANK_ZERO
    with pytest.raises(KeyError, match="nope"):
        Dispatch["nope"]


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_members_keep_identity_through_pickling(dumps) -> None:
    for member in (Dispatch.DP_COMPUTE_PROTO, Execute.RANK_ZERO):
        assert pickle.loads(dumps(member)) is member


@pytest.mark.ray
def test_members_keep_identity_through_ray(ray_session) -> None:
    import ray

    @ray.remote(num_cpus=0.1)
    def echo(mode):
        from controlplane.decorator import Dispatch as D

        return mode, mode is D.ALL_TO_ALL

    mode, same_remote = ray.get(echo.remote(Dispatch.ALL_TO_ALL), timeout=60)
    assert same_remote and mode is Dispatch.ALL_TO_ALL


def test_register_stores_settings_and_runs_locally() -> None:
    class W:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def add(self, x, y=1):
            return x + y

    attrs = getattr(W.add, MAGIC_ATTR)
    assert attrs == {
        "dispatch_mode": Dispatch.ONE_TO_ALL,
        "execute_mode": Execute.ALL,
        "blocking": False,
        "materialize_futures": True,
    }
    assert W().add(2, y=3) == 5
    assert W.add.__name__ == "add"


def test_register_async_method_stays_async() -> None:
    class W:
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        async def double(self, x):
            return [v * 2 for v in x]

    assert asyncio.iscoroutinefunction(W.double)
    assert asyncio.run(W().double([1, 2])) == [2, 4]


def test_rank_zero_dispatch_implies_rank_zero_execution() -> None:
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def f(self):
        return 1

    assert getattr(f, MAGIC_ATTR)["execute_mode"] is Execute.RANK_ZERO
    assert get_execute_fn_name(Execute.RANK_ZERO) == "execute_rank_zero_async"
    assert get_execute_fn_name(Execute.ALL) == "execute_all_async"


def test_register_rejects_bad_modes_at_decoration() -> None:
    with pytest.raises(TypeError, match="Dispatch member or a"):
        register(dispatch_mode="ONE_TO_ALL")
    with pytest.raises(ValueError, match=r"missing \['collect_fn'\]"):
        register(dispatch_mode={"dispatch_fn": _d})
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        register(dispatch_mode={"dispatch_fn": _d, "collect_fn": _c, "extra": 1})
    with pytest.raises(TypeError, match="collect_fn must be callable"):
        register(dispatch_mode={"dispatch_fn": _d, "collect_fn": 3})
    with pytest.raises(TypeError, match="execute_mode"):
        register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Dispatch.ONE_TO_ALL)
    with pytest.raises(TypeError, match="blocking must be a bool"):
        register(blocking="no")


def test_unregistered_member_fails_at_decoration(restore_registry) -> None:
    orphan = Dispatch.register("ORPHAN_MODE")  # an enum member with no functions
    with pytest.raises(ValueError, match="ORPHAN_MODE has no dispatch/collect functions"):
        register(dispatch_mode=orphan)


def test_register_new_dispatch_mode(restore_registry) -> None:
    mode = register_dispatch_mode("test_mode", _d, _c)
    assert mode is Dispatch.TEST_MODE
    assert get_dispatch_fn(mode) == {"dispatch_fn": _d, "collect_fn": _c}
    register(dispatch_mode=mode)  # now valid
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("TEST_MODE", _d, _c)
    with pytest.raises(TypeError, match="dispatch_fn must be callable"):
        register_dispatch_mode("OTHER_MODE", None, _c)
    assert "OTHER_MODE" not in Dispatch


def test_update_existing_dispatch_mode(restore_registry) -> None:
    update_dispatch_mode(Dispatch.ONE_TO_ALL, _d, _c)
    assert get_dispatch_fn(Dispatch.ONE_TO_ALL) == {"dispatch_fn": _d, "collect_fn": _c}
    with pytest.raises(ValueError, match="not a registered dispatch mode"):
        update_dispatch_mode("ONE_TO_ALL", _d, _c)


def test_registry_restored_by_fixture() -> None:
    pair = get_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert pair == {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all}
    assert "TEST_MODE" not in Dispatch


def test_custom_dict_is_returned_as_pair() -> None:
    assert get_dispatch_fn({"dispatch_fn": _d, "collect_fn": _c}) == {"dispatch_fn": _d, "collect_fn": _c}


@pytest.mark.ray
def test_wrapper_materializes_futures_unless_disabled(ray_session) -> None:
    import ray

    from controlplane.future import BatchFuture

    class W:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def total(self, data, *, extra):
            return sum(data) + sum(extra)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, materialize_futures=False)
        def raw(self, data):
            return data

    fut = BatchFuture([ray.put([1, 2]), ray.put([3])], [2, 1])
    assert W().total(fut, extra=fut) == 12
    assert W().raw(fut) is fut
