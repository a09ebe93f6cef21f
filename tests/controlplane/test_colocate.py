"""Colocation: several roles in one actor process; spawn / fuse views over the same actors."""

from __future__ import annotations

import pytest

from controlplane import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    create_colocated_worker_cls,
    register,
)
from tests.controlplane._colocated_roles import ActorRole, CriticRole

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def colocated(ray_session):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    spec = create_colocated_worker_cls(
        {
            "actor": RayClassWithInitArgs(ActorRole, scale=10),
            "critic": RayClassWithInitArgs(CriticRole, name="v"),
        }
    )
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


# ---- verl's WorkerDict style: the colocated group binds <role>_<method> ------------------------
def test_prefixed_role_methods_on_the_group(colocated: RayWorkerGroup) -> None:
    assert colocated.actor_step(3) == ["actor0:30", "actor1:30"]
    assert colocated.critic_step(3) == ["v0:3", "v1:3"]
    assert colocated.critic_astep(4) == ["async-v0:4", "async-v1:4"]  # async role method
    assert colocated.actor_double([1, 2, 3, 4]) == [2, 4, 6, 8]  # DP_COMPUTE_PROTO chunk + concat
    assert colocated.actor_only_zero(5) == (0, 5)  # the role's Execute.RANK_ZERO
    assert colocated.actor_pid() == colocated.critic_pid() == colocated.execute_all_sync("get_pid")
    # the prefixed names are actor methods too, as in verl
    assert colocated.execute_all_sync("critic_step", [7, 8]) == ["v0:7", "v1:8"]


def test_prefixed_nd_methods_use_the_roles_meshes(colocated: RayWorkerGroup) -> None:
    # the meshes are registered on the role instances; the host answers for them
    assert colocated.actor_tag_shard(["a", "b", "c", "d"]) == ["r0:a", "r0:b", "r1:c", "r1:d"]
    assert colocated.critic_count([1, 2, 3]) == [30]  # one replica, only rank 0 collected


def test_prefixed_names_that_clash() -> None:
    with pytest.raises(ValueError, match="'get_pid', which ColocatedWorker already has"):
        create_colocated_worker_cls({"get": RayClassWithInitArgs(ActorRole)})
    with pytest.raises(ValueError, match="both become 'x_only_zero'"):
        create_colocated_worker_cls(
            {"x": RayClassWithInitArgs(ActorRole), "x_only": RayClassWithInitArgs(_Zero)}
        )


class _Zero(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def zero(self) -> int:
        return 0


class _OtherActorMesh(Worker):
    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=0, is_collect=False)


def test_host_mesh_answers_locally() -> None:
    """The host answers mesh queries for its roles; roles that disagree are named (no Ray)."""
    spec = create_colocated_worker_cls(
        {
            "actor": RayClassWithInitArgs(ActorRole),
            "other": RayClassWithInitArgs(_OtherActorMesh),
        }
    )
    host = spec.user_cls()  # outside a group: rank 0 of 1
    assert host.query_dispatch_info("actor") == 0  # both roles say dp rank 0
    with pytest.raises(ValueError, match="registered differently by roles"):
        host.query_collect_info("actor")
    with pytest.raises(ValueError, match="mesh 'nope' is not registered"):
        host.query_dispatch_info("nope")
    assert set(host.worker_dict) == {"actor", "other"}
