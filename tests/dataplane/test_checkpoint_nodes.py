"""Checkpoints of stores spanning two nodes of the session's cluster.

A second node joins the session's cluster for each test: a plain one (``ray_cluster.add_node``), or one
started in a mount namespace of its own where the directory holding the checkpoints is hidden under
an empty tmpfs: on that node the directory does not exist, as on a node that does not mount the
shared filesystem. Its processes are real, and so is what they cannot see. Each test removes its node
before it ends, so no other test's store is placed on it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import ray
import torch

import dataplane as dp

from .conftest import own_store, wait_for
from .test_checkpoint import capture

pytestmark = pytest.mark.ray

# A node joining the session's cluster, as `ray start --address=... --block` does, on loopback: the
# session keeps Ray there with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (conftest), under which `ray start`
# refuses to join a cluster, while Ray's own node class (what `Cluster.add_node` runs) does not.
_JOIN = """
import signal, sys
import ray._private.node
from ray._private.parameter import RayParams
params = RayParams(gcs_address=sys.argv[1], num_cpus=2, object_store_memory=100_000_000,
                   include_log_monitor=False, node_manager_port=0, min_worker_port=0, max_worker_port=0)
ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
signal.sigwait([signal.SIGTERM, signal.SIGINT])
"""


def _alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _fill(pid: str) -> None:
    keys = [f"k{i}" for i in range(32)]
    dp.kv_batch_put(
        keys,
        pid,
        {"f32": torch.randn(32, 3), "wide": torch.randn(32, 4096)},
        tags=[{"i": i} for i in range(32)],
    )
    dp.next_batch(pid, "reward", 5, ["f32"])


@pytest.mark.slow
def test_save_and_load_across_two_nodes(ray_cluster, tmp_path):
    node = ray_cluster.add_node(num_cpus=2)
    try:
        with own_store("t-ckpt-two-nodes", num_shards=2) as (_, registry):
            assert len({s["node_id"] for s in registry["shards"]}) == 2
            _fill("p")
            before, progress = capture(["p"]), dp.consumption("p", "reward")
            dp.save_checkpoint(tmp_path / "c")
        with own_store("t-ckpt-two-nodes-3", num_shards=3) as (_, registry):
            assert len({s["node_id"] for s in registry["shards"]}) == 2
            dp.load_checkpoint(tmp_path / "c")
            assert capture(["p"]) == before and dp.consumption("p", "reward") == progress
    finally:
        ray_cluster.remove_node(node)


def _can_hide_directories() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_hide_directories(), reason="needs unshare -m and mount (root or CAP_SYS_ADMIN)")
def test_a_node_that_cannot_see_the_directory_fails_the_save_by_name(ray_cluster, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "ckpt"
    with own_store("t-ckpt-hidden-a", num_shards=1):  # the previous checkpoint, saved from the head
        _fill("p")
        first = capture(["p"])
        dp.save_checkpoint(target, metadata={"step": 1})
    before = _alive()
    join = f'mount -t tmpfs tmpfs "{shared}" && exec "{sys.executable}" -c "$0" "$1"'
    node = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", join, _JOIN, ray_cluster.address],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    hidden: set[str] = set()
    try:
        hidden = wait_for(lambda: _alive() - before, 120, "the node in its own mount namespace to join")
        (hidden_id,) = hidden
        with own_store("t-ckpt-hidden-b", num_shards=2) as (_, registry):
            assert hidden_id in {s["node_id"] for s in registry["shards"]}
            _fill("p2")
            with pytest.raises(dp.CheckpointError) as err:
                dp.save_checkpoint(target, metadata={"step": 2})
            message = str(err.value)  # the shard there, or the index if Ray placed it there
            assert f"Ray node {hidden_id[:12]}" in message and f"{target}.tmp" in message, message
            assert "cannot reach the checkpoint directory" in message
        assert sorted(os.listdir(shared)) == ["ckpt"]  # the previous checkpoint, nothing else
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        wait_for(
            lambda: not (_alive() & hidden if "hidden" in dir() else set()), 120, "the hidden node to leave"
        )
    with own_store("t-ckpt-hidden-c", num_shards=1):
        assert dp.load_checkpoint(target).metadata == {"step": 1}
        assert capture(["p"]) == first
