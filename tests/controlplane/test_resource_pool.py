"""Resource pools: counting, placement, split / merge (nested), shortfall errors, the manager."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from controlplane import (
    RayResourcePool,
    ResourcePool,
    ResourcePoolManager,
    ResourceShortageError,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from controlplane._placement_groups import ip_sort_key
from tests.forkserver import run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---- pure -------------------------------------------------------------------------------------
def test_heterogeneous_counts() -> None:
    pool = ResourcePool([2, 3], max_colocate_count=1)
    assert pool.world_size == 5
    assert pool() == [2, 3]
    assert pool.local_world_size_list() == [2, 2, 3, 3, 3]
    assert pool.local_rank_list() == [0, 1, 0, 1, 2]
    pool.add_node(1)
    assert pool.store == [2, 3, 1]


def test_a_group_without_ray_init_says_to_call_it(fork_server) -> None:
    """A script that forgot ray.init(): one line naming the fix, not Ray's "state API" error."""
    code = textwrap.dedent(
        """
        from controlplane import ControlPlaneError, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from controlplane import Worker
        try:
            RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(Worker))
        except ControlPlaneError as exc:
            print("RAISED", exc)
        """
    )
    proc = run_python(["-c", code], timeout=120, cwd=str(ROOT))  # forked by the session's server
    assert "RAISED" in proc.stdout and "call ray.init() first" in proc.stdout, proc.stdout + proc.stderr
    assert "state API" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("bad", [[0], [2, -1], [1.5], [True]])
def test_bad_counts_are_named(bad: list) -> None:
    with pytest.raises(ValueError, match=r"process_on_nodes\[\d\]"):
        ResourcePool(bad)


def test_ip_sort_is_numeric() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "9.255.0.1"]
    assert sorted(ips, key=ip_sort_key) == ["9.255.0.1", "10.0.0.9", "10.0.0.10"]


def test_bundle_spec() -> None:
    assert RayResourcePool([1], use_gpu=False, max_colocate_count=3).bundle_spec() == {"CPU": 3.0}
    assert RayResourcePool([1], use_gpu=True, max_colocate_count=1).bundle_spec() == {"CPU": 1.0, "GPU": 1.0}


# ---- with Ray ---------------------------------------------------------------------------------
@pytest.fixture
def pool22(ray_session):
    pool = RayResourcePool([2, 2], use_gpu=False, max_colocate_count=1)
    yield pool
    pool.remove()


def test_lazy_and_stable_order(pool22: RayResourcePool) -> None:
    assert pool22.pgs is None  # nothing placed until needed
    first = pool22.get_placement_groups()
    assert len(first) == 2 and [pg.bundle_count for pg in first] == [2, 2]
    assert pool22.get_placement_groups() == first  # the same (sorted) order on every call
    slots = pool22.bundle_slots()
    places = [(first.index(s.placement_group), s.bundle_index) for s in slots]
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_split_int_list_and_nested(pool22: RayResourcePool) -> None:
    a, b = split_resource_pool(pool22, 2)
    assert (a.world_size, b.world_size) == (2, 2)
    assert isinstance(a, SubRayResourcePool)
    q, rest = split_resource_pool(pool22, [1, 3])
    assert rest.store == [1, 2]  # the slice's own per-node counts, not the parent's
    assert rest.start_bundle_index == 1
    x, y = split_resource_pool(rest, [2, 1])  # nested split uses the parent's offset
    assert x.start_bundle_index == 1 and y.start_bundle_index == 3
    assert x.bundle_slots() == pool22.bundle_slots()[1:3]
    assert y.bundle_slots() == pool22.bundle_slots()[3:]
    assert x.store == [1, 1]


@pytest.mark.parametrize("sizes, match", [(3, "divisor"), ([1, 2], "sum to 3"), ([0, 4], "positive")])
def test_split_errors(pool22: RayResourcePool, sizes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_resource_pool(pool22, sizes)


def test_merge(pool22: RayResourcePool) -> None:
    a, b = split_resource_pool(pool22, 2)
    merged = merge_resource_pool(b, a)
    assert merged.world_size == 4
    assert merged.bundle_slots() == b.bundle_slots() + a.bundle_slots()
    with pytest.raises(ValueError, match="overlap"):
        merge_resource_pool(a, a)
    other = RayResourcePool([1], use_gpu=False, max_colocate_count=2)
    with pytest.raises(ValueError, match="max_colocate_count"):
        merge_resource_pool(a, other)


def test_merge_two_whole_pools(ray_session) -> None:
    p1 = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
    p2 = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    try:
        merged = merge_resource_pool(p1, p2)
        assert merged.world_size == 3 and merged.store == [1, 2]
    finally:
        p1.remove()
        p2.remove()


def test_never_fits_a_node_fails_fast(ray_session) -> None:
    pool = RayResourcePool([20], use_gpu=False, max_colocate_count=1)
    with pytest.raises(ResourceShortageError, match=r"20 bundles.*short by \{'CPU': 12") as err:
        pool.get_placement_groups()
    assert pool.pgs is None
    # what was asked, what the cluster has, and the fix, in the one message
    text = str(err.value)
    assert "{'CPU': 20.0}" in text and "Ray counts 8 CPUs" in text, text
    assert "ray.init(num_cpus=20)" in text and "ray start --head --num-cpus 20" in text, text
    assert "RayResourcePool([8], ...)" in text, text


def test_never_fits_the_cluster_fails_fast_for_every_strategy(ray_session) -> None:
    for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
        pool = RayResourcePool([9], use_gpu=False, max_colocate_count=1, placement_timeout_s=600)
        with pytest.raises(ResourceShortageError, match="can never place it") as err:
            pool.get_placement_groups(strategy=strategy)  # at once: not after the 600 s deadline
        assert strategy in str(err.value) and "ray.init(num_cpus=" in str(err.value)
        assert pool.pgs is None


def test_no_room_now_fails_after_deadline(ray_session) -> None:
    import ray

    holder = RayResourcePool([6], use_gpu=False, max_colocate_count=1)
    holder.get_placement_groups()
    late = RayResourcePool([6], use_gpu=False, max_colocate_count=1, placement_timeout_s=2.0)
    try:
        with pytest.raises(ResourceShortageError, match=r"not placed within 2.0s.*CPU") as err:
            late.get_placement_groups()
        assert late.pgs is None
        # says what holds the CPUs it waited for: the holder pool's placement group, by name
        assert f"held by: placement group '{holder.name_prefix}rlplane_group_6:0'" in str(err.value), (
            err.value
        )
    finally:
        holder.remove()
    # the failed pool's groups were removed: its CPUs are free again
    deadline_pool = RayResourcePool([6], use_gpu=False, max_colocate_count=1, placement_timeout_s=30.0)
    deadline_pool.get_placement_groups()
    deadline_pool.remove()
    assert ray.is_initialized()


def test_manager(ray_session) -> None:
    mgr = ResourcePoolManager(
        {"global": [2], "reward": [1]},
        {"actor": "global", "rm": "reward"},
        max_colocate_count=1,
        use_gpu=False,
    )
    mgr.create_resource_pool()
    assert mgr.get_resource_pool("actor").world_size == 2
    assert mgr.get_resource_pool("rm").name_prefix == "reward"
    assert mgr.get_n_gpus() == 3
    with pytest.raises(KeyError, match="critic"):
        mgr.get_resource_pool("critic")
    too_big = ResourcePoolManager({"g": [5], "h": [5]}, {"a": "g"}, max_colocate_count=1, use_gpu=False)
    with pytest.raises(ResourceShortageError, match="cannot place"):
        too_big.create_resource_pool()
    with pytest.raises(ValueError, match="unknown pool"):
        ResourcePoolManager({"g": [1]}, {"a": "nope"}, use_gpu=False).create_resource_pool()
    gpu = ResourcePoolManager({"g": [1]}, {"a": "g"}, use_gpu=True)
    with pytest.raises(ResourceShortageError, match="GPU"):
        gpu.create_resource_pool()
