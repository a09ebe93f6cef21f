"""nd mesh dispatch end to end through a real 8-worker group.

Layouts (verl's usual pair): infer = dp 2 x tp 4; train = pp 2 x dp 2 x tp 2 with collect only on
tp == 0 of the last pp stage.
"""

from __future__ import annotations

import pytest

from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from tests.controlplane._group_workers import MeshWorker

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def wg8(ray_session):
    pool = RayResourcePool([8], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(MeshWorker))
    yield wg
    wg.kill()
    pool.remove()


def test_mesh_info_is_discovered_and_cached(wg8: RayWorkerGroup) -> None:
    assert wg8._get_dispatch_info("infer") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert wg8._get_collect_info("infer") == [True, False, False, False, True, False, False, False]
    assert wg8._get_dispatch_info("train") == [0, 0, 1, 1, 0, 0, 1, 1]
    assert wg8._get_collect_info("train") == [False] * 4 + [True, False, True, False]
    assert set(wg8._dispatch_info) == {"infer", "train"}
    wg8.invalidate_mesh_cache()  # what a change of members does
    assert wg8._dispatch_info == {}


def test_unknown_mesh_is_named(wg8: RayWorkerGroup) -> None:
    with pytest.raises(ValueError, match="mesh 'nope' is not registered"):
        wg8._get_dispatch_info("nope")


def test_dp2_tp4(wg8: RayWorkerGroup) -> None:
    out = wg8.infer(list(range(6)))
    # two dp shards of 3; only rank 0 (dp 0) and rank 4 (dp 1) contribute
    assert out == [(0, 0), (1, 0), (2, 0), (3, 4), (4, 4), (5, 4)]


def test_pp2_dp2_tp2_collects_last_stage_tp0(wg8: RayWorkerGroup) -> None:
    out = wg8.train(batch=list(range(4)))  # as a keyword argument too
    assert out == [(0, 4), (1, 4), (2, 6), (3, 6)]


def test_membership_change_drops_the_cache(wg8: RayWorkerGroup) -> None:
    view = RayWorkerGroup(worker_handles=wg8.workers[:4], ray_cls_with_init=RayClassWithInitArgs(MeshWorker))
    assert view._get_dispatch_info("infer") == [0, 0, 0, 0]
    view._set_workers(wg8.workers, wg8.worker_names)
    assert view._dispatch_info == {}
    assert view._get_dispatch_info("infer") == [0, 0, 0, 0, 1, 1, 1, 1]
