"""Checkpoints under faults, with real processes and natural timing: a saving process killed with
SIGKILL in the middle of its save, and saves racing writers and clears in other processes.

Nothing is synchronised by sleeping: the tests wait (with deadlines) for conditions such as a file
appearing, or a writer's call finishing.
"""

from __future__ import annotations

import random

import pytest
import ray
import torch

import dataplane as dp
from tests.forkserver import start_python

from .conftest import store_fixtures, wait_for
from .test_checkpoint import capture, clear_all

pytestmark = pytest.mark.ray

NAME = "t-ckpt-faults"


store, _ = store_fixtures(NAME, num_shards=2, rpc_timeout_s=20)


@pytest.fixture
def kv(store):
    dp.close()
    dp.init(name=NAME)
    clear_all()
    yield
    dp.close()


_SAVER = """
import sys
import dataplane as dp
dp.init(name=sys.argv[1], address=sys.argv[2], attach_only=True)
dp.save_checkpoint(sys.argv[3], metadata={"step": 2})
"""


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(kv, pid, tmp_path, ray_cluster):
    target = tmp_path / "c"
    dp.kv_batch_put(["a", "b"], pid, {"f32": torch.arange(6.0).reshape(2, 3)}, tags=[{"v": 1}, {"v": 2}])
    first = capture([pid])
    dp.save_checkpoint(target, metadata={"step": 1})
    # 256 MiB more: the next save writes long enough to be killed while its shards write
    dp.kv_batch_put([f"big{i}" for i in range(64)], pid, {"f32": torch.ones(64, 1 << 20)})
    saver = start_python(["-c", _SAVER, NAME, ray_cluster.address, str(target)])
    try:
        wait_for(
            lambda: (tmp_path / "c.tmp" / "shard-0.bin").exists() or saver.poll() is not None,
            120,
            "the save in the child process to start writing its rows",
        )
        assert saver.poll() is None, "the save finished before it could be killed: make the store larger"
    finally:
        saver.kill()
        saver.wait()
    assert (target / "manifest.json").exists()
    clear_all()
    assert dp.load_checkpoint(target).metadata == {"step": 1}
    assert capture([pid]) == first
    # the next save replaces it, whatever the killed one left behind (its shards may still be writing)
    dp.kv_batch_put(["c"], pid, {"f32": torch.ones(1, 3)})
    third = capture([pid])
    assert dp.save_checkpoint(target, metadata={"step": 3}).partitions == {pid: 3}
    clear_all()
    assert dp.load_checkpoint(target).metadata == {"step": 3} and capture([pid]) == third


@ray.remote(num_cpus=0.1)
class Writer:
    """A process of the cluster overwriting and clearing rows of a partition as fast as it can."""

    def __init__(self, name: str) -> None:
        import dataplane as dp

        dp.init(name=name)

    def churn(self, pid: str, prefix: str, rounds: int, width: int, seed: int) -> int:
        """Each round: put 6 of 16 keys with both fields holding the round number everywhere (and the
        tag ``v`` = round); every 2nd round, clear 3 keys."""
        rng = random.Random(seed)
        keys = [f"{prefix}{i}" for i in range(16)]
        for v in range(1, rounds + 1):
            batch = rng.sample(keys, 6)
            rows = torch.full((6, width), float(v))
            dp.kv_batch_put(batch, pid, {"a": rows, "b": rows.clone()}, tags=[{"v": v}] * 6)
            if v % 2 == 0:
                dp.kv_clear(rng.sample(keys, 3), pid)
        return rounds


@pytest.mark.slow
def test_saves_racing_writers_and_clears_load_whole_rows(kv, pid, tmp_path):
    writers = [Writer.remote(NAME) for _ in range(2)]
    ray.get([w.__ray_ready__.remote() for w in writers])
    calls = [w.churn.remote(pid, f"w{i}-", 150, 131072, i) for i, w in enumerate(writers)]
    saves = []
    while ray.wait(calls, num_returns=len(calls), timeout=0)[1] and len(saves) < 12:
        saves.append(dp.save_checkpoint(tmp_path / f"s{len(saves)}"))
    assert ray.get(calls) == [150, 150]
    assert len(saves) >= 2, "the writers finished before two saves ran beside them"
    for info in saves:
        clear_all()
        loaded = dp.load_checkpoint(info.path)  # every row the metadata lists is in the files
        listing = dp.kv_list(pid).get(pid, {})
        assert len(listing) == loaded.partitions.get(pid, 0) == info.partitions.get(pid, 0)
        for key, tag in listing.items():
            row = dp.kv_batch_get([key], pid)
            a, b = row["a"][0], row["b"][0]
            assert bool(torch.all(a == a[0])) and torch.equal(a, b), f"{info.path}: row {key} is torn"
            assert tag["v"] <= a[0].item(), f"{info.path}: row {key} has a tag newer than its values"
    print(
        f"{len(saves)} saves beside the writers; keys left out as cleared meanwhile: "
        f"{[s.left_out for s in saves]}"
    )
