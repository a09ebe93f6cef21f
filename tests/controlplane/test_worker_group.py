"""RayWorkerGroup: building (pool, sub-pool, handles), env vars, gloo, execution, dead workers."""

from __future__ import annotations

import pytest

from controlplane import (
    ClassWithInitArgs,
    PerRank,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    split_resource_pool,
)
from controlplane._actor_launch import places_for, rank_env
from tests.controlplane._group_workers import EnvWorker, FailingWorker, add_one, tag_with_rank


# ---- pure: no Ray cluster needed ---------------------------------------------------------------
def test_worker_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(key, value)
    w = EnvWorker()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (2, 4, 0, 2)
    assert w.get_master_addr_port() == ("10.0.0.1", "29500")
    assert w.add(1) == 3  # a @register method still works as a plain local call
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        EnvWorker()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        EnvWorker()


def test_worker_alone_and_mesh_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    w = EnvWorker()
    assert (w.rank, w.world_size) == (0, 1)
    w._register_dispatch_collect_info("train", dp_rank=0, is_collect=True)
    assert w.query_collect_info("train") is True and w._query_dispatch_info("train") == 0
    with pytest.raises(ValueError, match="mesh 'train' is already registered"):
        w._register_dispatch_collect_info("train", dp_rank=1, is_collect=False)
    with pytest.raises(ValueError, match="mesh 'infer' is not registered in EnvWorker rank 0"):
        w.query_collect_info("infer")
    copy = w.get_dispatch_collect()
    copy["dispatch"]["train"] = 9  # a copy: the worker's own table is untouched
    assert w.query_dispatch_info("train") == 0


def test_class_with_init_args_options() -> None:
    import ray

    spec = RayClassWithInitArgs(EnvWorker, offset=3)
    assert spec.user_cls is EnvWorker
    assert RayClassWithInitArgs(ray.remote(EnvWorker)).user_cls is EnvWorker
    assert ClassWithInitArgs(EnvWorker, offset=3)().offset == 3
    spec.update_options({"max_concurrency": 2})
    spec.set_additional_resource({"custom_x": 1})  # a single extra resource is applied too
    first = spec.actor_options(None, use_gpu=True, num_gpus=0.5, options={"name": "a"}, num_cpus=0.1)
    assert first == {
        "max_concurrency": 2,
        "resources": {"custom_x": 1},
        "name": "a",
        "num_cpus": 0.1,
        "num_gpus": 0.5,
    }
    second = spec.actor_options(None, use_gpu=False)
    assert "name" not in second and "num_gpus" not in second  # per-call options do not persist
    shared = spec.actor_options(None, use_gpu=True, node_id="ab" * 28)
    assert "num_gpus" not in shared and shared["scheduling_strategy"].node_id == "ab" * 28


# ---- with Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool4(ray_session):
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def wg4(pool4):
    wg = RayWorkerGroup(pool4, RayClassWithInitArgs(EnvWorker, offset=100))
    yield wg
    wg.kill()


def test_env_and_names(wg4: RayWorkerGroup) -> None:
    envs = wg4.env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {(wg4.master_address, wg4.master_port)}
    assert [e["attr_rank"] for e in envs] == [0, 1, 2, 3]
    assert len({e["pid"] for e in envs}) == 4
    assert wg4.world_size == 4 and len(wg4.worker_names) == 4
    assert wg4.worker_names[0].endswith("EnvWorker_0:0")


def test_gloo_all_gather(wg4: RayWorkerGroup) -> None:
    assert wg4.gloo_all_gather() == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4


def test_execute_primitives(wg4: RayWorkerGroup) -> None:
    import ray

    assert wg4.add(1) == [101, 102, 103, 104]
    refs = wg4.execute_all_async("plain", [1, 2, 3, 4])
    assert ray.get(refs) == [2, 3, 4, 5]
    assert wg4.execute_all_sync("plain", x=[0, 0, 0, 0]) == [1, 1, 1, 1]
    assert wg4.execute_rank_zero_sync("plain", 41) == 42
    assert wg4.execute_rank_zero_sync("plain", PerRank([7, 8, 9, 10])) == 8  # explicit: element 0
    assert wg4.only_zero(5) == (0, 5)  # Execute.RANK_ZERO: rank 0 gets its element, not the list
    assert wg4.scatter([1, 2, 3, 4]) == [10, 20, 30, 40]
    assert wg4.execute_func_rank_zero(add_one, 41) == 42  # built-in Worker methods
    assert wg4.execute_with_func_generator(tag_with_rank, [5, 6, 7, 8]) == [(5, 0), (6, 1), (7, 2), (8, 3)]
    assert wg4.execute_all_sync("plain", x=3) == [4] * 4  # not a per-rank list: broadcast (verl)
    with pytest.raises(ValueError, match=r"plain: positional argument 0 is PerRank with 2 values"):
        wg4.execute_all_async("plain", PerRank([1, 2]))


def test_attach_by_handles_shares_actors(wg4: RayWorkerGroup) -> None:
    other = RayWorkerGroup(worker_handles=wg4.workers, ray_cls_with_init=RayClassWithInitArgs(EnvWorker))
    assert [e["pid"] for e in other.env()] == [e["pid"] for e in wg4.env()]
    with pytest.raises(ValueError, match="no live actor named 'nobody'"):
        RayWorkerGroup.from_detached(worker_names=["nobody"])


def test_sharing_with_lands_on_the_same_node(wg4: RayWorkerGroup) -> None:
    import ray

    spec = RayClassWithInitArgs(EnvWorker)
    neighbour = spec(sharing_with=wg4.workers[0], use_gpu=False, num_cpus=0.05)
    try:
        assert ray.get(neighbour.get_node_id.remote(), timeout=120) == ray.get(
            wg4.workers[0].get_node_id.remote(), timeout=60
        )
    finally:
        ray.kill(neighbour)


def test_heterogeneous_nodes_and_spanning_sub_pool(ray_session) -> None:
    # Each node entry is its own placement group (STRICT_PACK); on the one-node test cluster both
    # land on the head, so local ranks count the group's ranks on that node across both groups.
    pool = RayResourcePool([1, 2], use_gpu=False, max_colocate_count=1)
    whole = None
    try:
        whole = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker))
        envs = whole.env()
        assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
            ("0", "3"),
            ("1", "3"),
            ("2", "3"),
        ]
        assert [e["RANK"] for e in envs] == ["0", "1", "2"]
        assert [n.rsplit("EnvWorker_", 1)[1] for n in whole.worker_names] == ["0:0", "1:0", "1:1"]
        # a slice spanning both placement groups: local ranks restart per *node*, not per group
        spanning, _ = split_resource_pool(pool, [2, 1])
        assert spanning.store == [1, 1]
        places = places_for(spanning.bundle_slots(), node_ids=["n0", "n1"])
        assert [(p.rank, p.pg_index, p.local_rank, p.local_world_size) for p in places] == [
            (0, 0, 0, 1),
            (1, 1, 0, 1),
        ]
        env = rank_env(places[1], 2, ("10.0.0.1", 1234), "px", {"EXTRA": "1"})
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        assert [env[k] for k in keys] == ["1", "2", "0", "1"]
        assert env["EXTRA"] == "1" and env["MASTER_PORT"] == "1234"
    finally:
        if whole is not None:
            whole.kill()
        pool.remove()


def test_constructor_failure_names_the_worker(pool4) -> None:
    half = split_resource_pool(pool4, 2)[0]  # shares pool4's bundles with wg4 (fractional CPUs)
    with pytest.raises(WorkerDiedError, match=r"rank 1") as info:
        RayWorkerGroup(half, RayClassWithInitArgs(FailingWorker), ready_timeout_s=120)
    assert info.value.rank == 1
    assert "refuses" in str(info.value.__cause__)


def test_worker_env_cannot_override_rank(pool4) -> None:
    sub = split_resource_pool(pool4, [1, 3])[0]
    with pytest.raises(ValueError, match="RANK"):
        RayWorkerGroup(sub, RayClassWithInitArgs(EnvWorker), worker_env={"RANK": "7"})


def test_watcher_ignores_busy_workers(wg4: RayWorkerGroup) -> None:
    wg4.start_worker_aliveness_check(every_n_seconds=0.1)
    try:
        assert wg4.sleep(1.0) == [0, 1, 2, 3]  # busy for ten watcher periods, still alive
        assert wg4._watcher is not None and wg4._watcher.error is None
    finally:
        wg4.stop_worker_aliveness_check()


def test_wait_deadline(wg4: RayWorkerGroup) -> None:
    refs = wg4.execute_all_async("sleep", [1.0] * 4)
    with pytest.raises(TimeoutError, match="no result within 0.2s"):
        wg4._wait(refs, timeout=0.2)
    assert wg4._wait(refs) == [0, 1, 2, 3]


def test_killed_worker_is_a_clear_error(wg4: RayWorkerGroup) -> None:
    """Runs last: it kills two of the module's workers."""
    import ray

    with pytest.raises(WorkerDiedError, match=r"worker '.*EnvWorker_0:2' \(rank 2\) is dead") as info:
        wg4.die_if(2)  # rank 2 crashes mid-call
    assert info.value.rank == 2
    ray.kill(wg4.workers[1])
    with pytest.raises(WorkerDiedError, match=r"rank [12]"):
        wg4._check_alive()
    # the background watcher reports it too, and later calls fail fast instead of hanging
    seen: list = []
    wg4.start_worker_aliveness_check(every_n_seconds=0.2, on_dead=seen.append)
    with pytest.raises(WorkerDiedError, match=r"rank [12]"):
        wg4.add(1)
    wg4.stop_worker_aliveness_check()
