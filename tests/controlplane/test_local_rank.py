"""LOCAL_RANK as verl sets it: the device index among the devices a worker sees; per node, never
per placement group; ``device_name`` picks the accelerator resource (fake GPUs / NPUs on added nodes)."""

from __future__ import annotations

import os

import pytest

from controlplane import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from controlplane._devices import apply_local_rank, device_index, local_ranks_by_node

NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class DeviceWorker(Worker):
    def __init__(self) -> None:
        apply_local_rank()  # what Worker.__init__ is to call first (see controlplane._devices)
        super().__init__()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def devices(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        keys = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
        return {
            **{k: os.environ.get(k) for k in keys},
            "node": ctx.get_node_id(),
            "ids": {k: v for k, v in ctx.get_accelerator_ids().items() if v},
            "attr": self.local_rank,
        }


# ---- pure --------------------------------------------------------------------------------------
def test_device_index() -> None:
    assert device_index(["3"], "3") == 0  # Ray narrowed the visible devices to the actor's own
    assert device_index(["3"], None) == 3  # NOSET, nothing narrowed: every device visible
    assert device_index(["5"], "4,5,6,7") == 1  # NOSET on a node that sees 4-7
    with pytest.raises(ValueError, match="no device"):
        device_index([], "0")
    with pytest.raises(ValueError, match="'GPU-ab' is not among the visible devices '0,1'"):
        device_index(["GPU-ab"], "0,1")


def test_local_ranks_count_per_node_not_per_group() -> None:
    assert local_ranks_by_node(["a", "a", "a", "a"]) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert local_ranks_by_node(["a", "b", "a", "b"]) == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_apply_local_rank_outside_an_accelerator_actor_changes_nothing(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")
    assert apply_local_rank() is None and os.environ["LOCAL_RANK"] == "7"


# ---- with Ray ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _added_node(ray_cluster):
    """Holds the one node this module adds, if added; removed with the module."""
    held: dict = {}
    yield held
    if "node" in held:
        ray_cluster.remove_node(held.pop("node"))


@pytest.fixture
def accelerator_node(ray_cluster, _added_node):
    """A node with 4 (logical) GPUs and 2 NPUs, added on first use and kept for the module's
    accelerator tests: each added node starts a raylet and its agents (seconds of CPU), and each test
    places only on the resource it asks for, so one node serves both."""
    if "node" not in _added_node:
        _added_node["node"] = ray_cluster.add_node(num_cpus=4, num_gpus=4, resources={"NPU": 2})
        ray_cluster.wait_for_nodes()
    return _added_node["node"]


@pytest.fixture
def head_only(ray_cluster, _added_node):
    """Removes the added node, if present: a CPU pool could land on it, and ranks count per node."""
    if "node" in _added_node:
        ray_cluster.remove_node(_added_node.pop("node"))
    return ray_cluster


def _group(pool: RayResourcePool, **kwargs) -> RayWorkerGroup:
    return RayWorkerGroup(pool, RayClassWithInitArgs(DeviceWorker), ready_timeout_s=120, **kwargs)


def test_two_placement_groups_on_one_gpu_node(accelerator_node) -> None:
    pool = RayResourcePool([2, 2], use_gpu=True, max_colocate_count=1, placement_timeout_s=60)
    narrowed = noset = None
    try:
        narrowed = _group(pool)
        got = narrowed.devices()
        assert len({d["node"] for d in got}) == 1  # both placement groups landed on the GPU node
        assert [d["LOCAL_WORLD_SIZE"] for d in got] == ["4"] * 4
        # Ray narrowed CUDA_VISIBLE_DEVICES to one GPU per actor: each uses its device 0
        assert [(d["LOCAL_RANK"], d["attr"]) for d in got] == [("0", 0)] * 4
        assert sorted(d["CUDA_VISIBLE_DEVICES"] for d in got) == ["0", "1", "2", "3"]
        narrowed.kill()
        narrowed = None
        # NOSET: every actor sees all four GPUs, so LOCAL_RANK is its own GPU's index (no duplicates)
        noset = _group(pool, worker_env={NOSET_CUDA: "1"})
        got = noset.devices()
        assert sorted(int(d["LOCAL_RANK"]) for d in got) == [0, 1, 2, 3]
        assert all(d["LOCAL_RANK"] == d["ids"]["GPU"][0] and d["attr"] == int(d["LOCAL_RANK"]) for d in got)
    finally:
        for wg in (narrowed, noset):
            if wg is not None:
                wg.kill()
        pool.remove()


def test_npu_device_name_requests_the_npu_resource(accelerator_node) -> None:
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, placement_timeout_s=60)
    wg = None
    try:
        wg = _group(pool, device_name="npu")
        assert pool.bundle_spec("npu") == {"CPU": 1.0, "NPU": 1.0}
        got = wg.devices()
        assert [sorted(d["ids"]) for d in got] == [["NPU"], ["NPU"]]
        assert sorted(d["ASCEND_RT_VISIBLE_DEVICES"] for d in got) == ["0", "1"]
        assert [d["LOCAL_RANK"] for d in got] == ["0", "0"]
        assert not any(d["CUDA_VISIBLE_DEVICES"] for d in got)
        with pytest.raises(ValueError, match="placed with NPU bundles; device_name='cuda' needs GPU"):
            _group(pool, device_name="cuda")
    finally:
        if wg is not None:
            wg.kill()
        pool.remove()


def test_cpu_groups_number_ranks_per_node(head_only) -> None:
    pool = RayResourcePool([2, 2], use_gpu=False, max_colocate_count=1)
    wg = None
    try:
        wg = _group(pool)
        got = wg.devices()
        assert [(d["LOCAL_RANK"], d["LOCAL_WORLD_SIZE"]) for d in got] == [(str(r), "4") for r in range(4)]
        assert [n.rsplit("DeviceWorker_", 1)[1] for n in wg.worker_names] == ["0:0", "0:1", "1:0", "1:1"]
    finally:
        if wg is not None:
            wg.kill()
        pool.remove()
