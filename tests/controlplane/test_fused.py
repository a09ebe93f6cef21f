"""Fused workers (verl's FusedWorker): roles in one process that call each other."""

from __future__ import annotations

import pytest

from controlplane import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from tests.controlplane._colocated_roles import FUSED_ROLES, HybridWorker, PolicyRole, ValueRole

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def hybrid(ray_session):
    """verl's test_fused_workers layout: a subclass of the raw fused class, two ranks."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    spec = RayClassWithInitArgs(HybridWorker)
    spec.fused_worker_used = True  # what verl users set; not needed here, but accepted
    wg = RayWorkerGroup(pool, spec)
    yield wg
    wg.kill()
    pool.remove()


def test_verl_fused_flow(hybrid: RayWorkerGroup) -> None:
    hybrid.fuse(FUSED_ROLES.keys())
    x = hybrid.policy.add(0.1)
    assert x == pytest.approx([0.1, 1.1])
    y = hybrid.value.sub(x)  # ALL_TO_ALL: rank i gets x[i]
    assert y == pytest.approx([-9.9, -8.9])
    assert hybrid.foo(0.1) == pytest.approx(y)  # the subclass combines both roles in-process


def test_role_calls_its_sibling_in_process(hybrid: RayWorkerGroup) -> None:
    views = hybrid.spawn_fused({"policy", "value"})
    assert views["policy"].add_then_sub(1.0) == pytest.approx([-9.0, -8.0])
    for mine, sibling in views["policy"].sibling_pid():
        assert mine == sibling
    assert hybrid.shares_dict() == [True, True]
    # the sibling is the very instance the value view drives, not a copy
    before = views["value"].n_calls()
    views["policy"].add_then_sub(0.0)
    assert views["value"].n_calls() == [n + 1 for n in before]


def test_prefixed_and_async_role_methods(hybrid: RayWorkerGroup) -> None:
    assert hybrid.policy_add(1.0) == pytest.approx([1.0, 2.0])
    assert hybrid.value_sub([11.0, 12.0]) == pytest.approx([1.0, 2.0])
    assert hybrid.value_ascore(12.0) == ["async-0:2.0", "async-1:2.0"]
    views = hybrid.spawn_fused(["value"])
    assert views["value"].ascore(11.0) == ["async-0:1.0", "async-1:1.0"]
    assert not hasattr(views["value"], "foo") and not hasattr(views["value"], "add")
    assert len(set(views["value"].pid())) == 2


def test_fuse_adds_roles_later_on_an_attached_group(hybrid: RayWorkerGroup) -> None:
    group = RayWorkerGroup.from_detached(
        worker_handles=hybrid.workers, ray_cls_with_init=RayClassWithInitArgs(HybridWorker)
    )
    group.fuse(["policy"])
    assert not hasattr(group, "value")
    group.fuse(["policy", "value"])  # verl would keep the first wg_dict and never set `value`
    assert group.value.sub([11.0, 12.0]) == pytest.approx([1.0, 2.0])
    assert group.foo(0.0) == pytest.approx([-10.0, -9.0])


def test_fuw_execute(hybrid: RayWorkerGroup) -> None:
    assert hybrid.execute_all_sync("_fuw_execute", ["policy_fwmn_add"] * 2, [1.0, 1.0]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="not of the form"):
        hybrid.execute_rank_zero_sync("_fuw_execute", "policy_add")
    with pytest.raises(ValueError, match="no role 'ref'"):
        hybrid.execute_rank_zero_sync("_fuw_execute", "ref_fwmn_add")


def test_spawn_fused_needs_a_fused_group(hybrid: RayWorkerGroup) -> None:
    plain = RayWorkerGroup.from_detached(
        worker_handles=hybrid.workers, ray_cls_with_init=RayClassWithInitArgs(PolicyRole)
    )
    with pytest.raises(TypeError, match="not PolicyRole"):
        plain.spawn_fused({"policy"})
    with pytest.raises(ValueError, match="role 'ref' is not in this colocated group"):
        hybrid.spawn_fused({"ref"})


def test_create_colocated_worker_cls_fused(ray_session) -> None:
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    spec = create_colocated_worker_cls_fused(FUSED_ROLES)
    assert spec.fused_worker_used and spec.user_cls.__name__ == "FusedWorker_policy_value"
    wg = RayWorkerGroup(pool, spec)
    try:
        views = wg.spawn(FUSED_ROLES)  # spawn on a fused group = spawn_fused, as in verl
        assert views["policy"].add_then_sub(2.0) == pytest.approx([-8.0, -7.0])
        assert wg.policy_add_then_sub(2.0) == pytest.approx([-8.0, -7.0])
    finally:
        wg.kill()
        pool.remove()


def test_raw_cls_locally() -> None:
    """Without Ray: the raw class is a plain Worker subclass holding the roles."""
    raw = create_colocated_worker_raw_cls(FUSED_ROLES)
    assert raw.is_fused_worker and raw.raw_cls_dict == {"policy": PolicyRole, "value": ValueRole}
    worker = raw()
    assert worker.policy is worker.fused_worker_dict["policy"] is worker.get_fused_worker_by_name("policy")
    assert worker.policy.add_then_sub(1.0) == -9.0
    assert worker.value.fused_worker_dict is worker.fused_worker_dict


def test_bad_fused_roles() -> None:
    with pytest.raises(ValueError, match="role 'rank' clashes with attribute FusedWorker.rank"):
        create_colocated_worker_raw_cls({"rank": RayClassWithInitArgs(PolicyRole)})
    with pytest.raises(TypeError, match="role 'a'"):
        create_colocated_worker_raw_cls({"a": PolicyRole})
    with pytest.raises(ValueError, match="at least one role"):
        create_colocated_worker_raw_cls({})
