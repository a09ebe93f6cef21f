"""Colocation: several roles in one actor process; spawn / fuse views over the same actors."""

from __future__ import annotations

import pytest

from controlplane import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from tests.controlplane._colocated_roles import ActorRole, CriticRole

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def colocated(ray_session):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    spec = create_colocated_worker_cls({
        "actor": RayClassWithInitArgs(ActorRole, scale=10),
        "critic": RayClassWithInitArgs(CriticRole, name="v"),
    })
    wg = RayWorkerGroup(pool, spec)
    yield wg
    wg.kill()
    pool.remove()


def test_spawn_views_share_processes(colocated: RayWorkerGroup) -> None:
    views = colocated.spawn({"actor", "critic"})
    assert set(views) == {"actor", "critic"}
    actor_pids, critic_pids = views["actor"].pid(), views["critic"].pid()
    assert actor_pids == critic_pids and len(set(actor_pids)) == 2
    assert colocated.execute_all_sync("get_pid") == actor_pids
    # same method name on both roles: each view reaches its own role
    assert views["actor"].step(3) == ["actor0:30", "actor1:30"]
    assert views["critic"].step(3) == ["v0:3", "v1:3"]
    assert views["critic"].astep(4) == ["async-v0:4", "async-v1:4"]
    assert views["actor"].double([1, 2, 3, 4]) == [2, 4, 6, 8]
    assert not hasattr(views["actor"], "astep")


def test_role_mesh_info_is_per_view(colocated: RayWorkerGroup) -> None:
    views = colocated.spawn(["actor", "critic"])
    assert views["actor"]._get_dispatch_info("actor") == [0, 1]
    assert views["critic"]._get_collect_info("critic") == [True, False]
    with pytest.raises(ValueError, match="mesh 'actor' is not registered"):
        views["critic"]._get_dispatch_info("actor")


def test_fuse_and_user_classes_untouched(colocated: RayWorkerGroup) -> None:
    colocated.fuse(["actor", "critic"])
    assert colocated.actor.step(1) == ["actor0:10", "actor1:10"]
    assert colocated.critic.step(1) == ["v0:1", "v1:1"]
    assert ActorRole.__dict__.keys().isdisjoint({"_colocated_call", "actor_step"})
    assert CriticRole.__dict__.keys().isdisjoint({"_colocated_call", "critic_step"})


def test_bad_roles() -> None:
    with pytest.raises(ValueError, match="identifier"):
        create_colocated_worker_cls({"not a name": RayClassWithInitArgs(ActorRole)})
    with pytest.raises(TypeError, match="role 'a'"):
        create_colocated_worker_cls({"a": ActorRole})


def test_spawn_unknown_role(colocated: RayWorkerGroup) -> None:
    with pytest.raises(ValueError, match="role 'ref' is not in this colocated group"):
        colocated.spawn({"ref"})
