"""The service around the store: actors, attach/close semantics, dead shards, scheduling, nodes, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import ray
import torch

import dataplane as dp
from dataplane.config import NAMESPACE
from tests.forkserver import run_python

from .conftest import raw_socket, request, start_store, wait_for

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _named(prefix: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
    ]


@ray.remote(num_cpus=0.1)
class Worker:
    """A Ray actor that attaches to a running store and uses it."""

    def __init__(self, name: str) -> None:
        import dataplane as dp

        self.info = dp.init(name=name)

    def owned(self) -> bool:
        return self.info.owned

    def put(self, keys: list[str], pid: str, value: float, rounds: int = 1) -> bool:
        import dataplane as dp

        for r in range(rounds):
            dp.kv_batch_put(keys, pid, {"x": torch.full((len(keys), 4), value + r), "id": list(keys)})
        return True

    def get(self, keys: list[str], pid: str) -> tuple[list[float], list[str]]:
        import dataplane as dp

        td = dp.kv_batch_get(keys, pid)
        return td["x"][:, 0].tolist(), td.get("id").tolist()

    def close(self) -> bool:
        import dataplane as dp

        dp.close()
        return True


@pytest.fixture(scope="module")
def shared(ray_cluster):
    dp.close()
    cfg, registry, handle = start_store(name="t-svc", num_shards=2, rpc_timeout_s=20)
    dp.init(name="t-svc")
    yield cfg
    dp.close()
    handle.stop()


@pytest.mark.parametrize("attempt", range(3))  # the stop and the call race: the same answer every time
def test_a_worker_whose_store_was_stopped_is_told_so_and_by_whom(ray_cluster, pid, attempt):
    name = f"t-stopped-{attempt}"
    cfg, registry, handle = start_store(name=name, num_shards=1, rpc_timeout_s=20)
    worker = Worker.remote(name)
    try:
        assert ray.get(worker.put.remote(["a"], pid, 1.0), timeout=120)
        handle.stop()  # what dp.close() does in the process that started an embedded store
        with pytest.raises(dp.ShardUnavailableError) as err:
            ray.get(worker.get.remote(["a"], pid), timeout=120)
    finally:
        handle.stop()
        ray.kill(worker)
    text = str(err.value)
    assert f"the store {name!r} was stopped" in text, text  # what happened, not "did not answer"
    assert f"started by dp.init() in process {os.getpid()}" in text and "dp.close()" in text, text
    assert "rlplane store start" in text, text  # the fix: a store that outlives its starter


def test_a_worker_attaches_to_its_store_started_again_under_the_same_name(ray_cluster, pid):
    """The store a worker attached to is stopped and started again (``rlplane store stop`` then
    ``start``): the call that finds it stopped says so and what to do, and the next call works
    against the new store. Before, every later call failed with ``ShardUnavailableError``."""
    name = "t-restarted"
    _, _, first = start_store(name=name, num_shards=2, rpc_timeout_s=20)
    worker = Worker.remote(name)
    second = None
    try:
        assert ray.get(worker.put.remote(["a"], pid, 1.0), timeout=120)
        first.stop()
        _, _, second = start_store(name=name, num_shards=2, rpc_timeout_s=20)
        with pytest.raises(
            dp.ShardUnavailableError, match="attaches to the new store on its next call|was stopped"
        ):
            ray.get(worker.get.remote(["a"], pid), timeout=120)
        assert ray.get(worker.put.remote(["b"], pid, 2.0), timeout=120)  # the next call: the new store
        assert ray.get(worker.get.remote(["b"], pid), timeout=120) == ([2.0], ["b"])
        with pytest.raises(dp.KeyNotFoundError):  # the old store's rows went with it
            ray.get(worker.get.remote(["a"], pid), timeout=120)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        ray.kill(worker)


def test_round_trips_from_actors_and_concurrent_clients(shared, pid):
    a, b = Worker.remote("t-svc"), Worker.remote("t-svc")
    assert ray.get([a.owned.remote(), b.owned.remote()]) == [False, False]
    ka, kb = [f"a{i}" for i in range(16)], [f"b{i}" for i in range(16)]
    # two clients write different keys at the same time, several rounds each
    assert ray.get([a.put.remote(ka, pid, 1.0, 5), b.put.remote(kb, pid, 100.0, 5)]) == [True, True]
    xs, ids = ray.get(a.get.remote(kb, pid))  # each reads the other's
    assert xs == [104.0] * 16 and ids == kb
    xs, ids = ray.get(b.get.remote(ka, pid))
    assert xs == [5.0] * 16 and ids == ka
    # the driver reads what the actors wrote, and an actor reads what the driver wrote
    assert dp.kv_batch_get(ka[:2], pid)["x"][:, 0].tolist() == [5.0, 5.0]
    dp.kv_batch_put(["d0"], pid, {"x": torch.full((1, 4), 7.0), "id": ["d0"]})
    assert ray.get(a.get.remote(["d0"], pid)) == ([7.0], ["d0"])
    # a worker's close() never stops the shared service
    assert ray.get(a.close.remote())
    ray.kill(a)
    assert dp.kv_batch_get(["d0"], pid)["x"][0, 0].item() == 7.0
    assert ray.get(b.get.remote(["d0"], pid))[0] == [7.0]
    ray.kill(b)


@ray.remote(num_cpus=0.1)
class AsyncWorker:
    """An asyncio Ray actor using the async API (as a rollout server would)."""

    async def run(self, name: str, pid: str) -> list[float]:
        import dataplane as dp

        info = await dp.async_init(name=name)
        assert not info.owned
        await dp.async_kv_batch_put(["x0", "x1"], pid, {"x": torch.ones(2, 3)})
        td = await dp.async_kv_batch_get(["x1", "x0", "d0"], pid)
        return td["x"][:, 0].tolist()


def test_async_api_inside_an_async_actor(shared, pid):
    dp.kv_batch_put(["d0"], pid, {"x": torch.full((1, 3), 2.0)})
    w = AsyncWorker.remote()
    assert ray.get(w.run.remote("t-svc", pid), timeout=120) == [1.0, 1.0, 2.0]
    assert dp.kv_batch_get(["x0"], pid)["x"].tolist() == [[1.0, 1.0, 1.0]]
    ray.kill(w)


def test_index_refuses_tensor_bytes(shared):
    sock = raw_socket(dp.api.current_client().registry, "index")
    reply = request(sock, "commit", {"partition": "p", "keys": ["a"]}, [b"\0" * 64])
    sock.close()
    assert reply is not None, "the index did not answer"
    rep, _ = reply
    assert rep.rid == 7 and rep.error is not None and "metadata only" in rep.error[1]


def test_an_unbounded_stores_shards_on_one_host_share_one_ledger(ray_cluster):
    """Each unbounded shard admits fresh shared memory against the host's available memory less what
    the store's other shards there are allocating (``server.shard.host_memory``): the shards of one host
    share the first one's ledger, which the others hold open through /proc; nothing in /dev/shm."""
    dp.close()
    cfg, registry, handle = start_store(name="t-ledger", num_shards=3)
    try:
        first, *rest = registry["shards"]
        _, _, inode = first["host_ledger"]
        for shard in rest:
            held = set()
            for fd in os.listdir(f"/proc/{shard['pid']}/fd"):
                try:
                    held.add(os.stat(f"/proc/{shard['pid']}/fd/{fd}").st_ino)
                except FileNotFoundError:  # closed since it was listed
                    pass
            assert inode in held, f"shard {shard['shard']} does not hold the host's ledger"
        assert not [f for f in os.listdir("/dev/shm") if "t-ledger" in f]
        dp.init(name="t-ledger")
        dp.kv_batch_put([f"k{i}" for i in range(16)], "p", {"x": torch.ones(16, 8192)})  # fresh segments
        assert dp.kv_batch_get(["k3"], "p")["x"].sum().item() == 8192
    finally:
        dp.close()
        handle.stop()


def test_dead_shard_raises_and_leaves_no_memory(ray_cluster):
    dp.close()
    cfg, registry, handle = start_store(name="t-dead", num_shards=2, rpc_timeout_s=2)
    try:
        dp.init(name="t-dead")
        keys = [f"k{i}" for i in range(32)]
        dp.kv_batch_put(keys, "p", {"x": torch.ones(32, 8192)})  # 1 MiB: shared-memory segments
        dp.kv_batch_get(keys, "p")  # this client now maps the shards' memory
        victim = registry["shards"][0]
        ray.kill(ray.get_actor(cfg.shard_name(0), namespace=NAMESPACE), no_restart=True)
        wait_for(lambda: not os.path.exists(f"/proc/{victim['pid']}"), 30, "the killed shard to exit")
        with pytest.raises(dp.ShardUnavailableError, match="t-dead-shard-0") as err:
            dp.kv_batch_get(keys, "p")
        assert err.value.shard == "t-dead-shard-0"
        with open("/proc/self/maps") as f:
            maps = f.read()
        assert "t-dead-shard-0-seg" not in maps, "the client still maps a dead shard's memory"
        assert not [f for f in os.listdir("/dev/shm") if "t-dead" in f]
    finally:
        dp.close()
        handle.stop()


def test_unschedulable_store_fails_fast(ray_cluster):
    from dataplane.config import StoreConfig
    from dataplane.service.launch import start_service

    cfg = StoreConfig.from_options(name="t-sched", num_cpus=64, schedule_timeout_s=3)
    with pytest.raises(dp.SchedulingError, match="num_cpus=64"):  # infeasible: raised at once
        start_service(cfg)
    # feasible one at a time, but 3 actors of 7.9 CPUs never fit together on the 8-CPU head
    cfg = StoreConfig.from_options(name="t-sched", num_cpus=7.9, num_shards=2, schedule_timeout_s=3)
    with pytest.raises(dp.SchedulingError, match="t-sched") as err:
        start_service(cfg)
    assert "num_cpus=7.9" in str(err.value)
    wait_for(lambda: not _named("t-sched"), 10, "the half-started store's actors to be removed")


def test_two_nodes_shards_on_both_and_zmq_path(ray_cluster):
    dp.close()
    node = ray_cluster.add_node(num_cpus=2, resources={"t_two_node": 1})
    ray_cluster.wait_for_nodes()
    try:
        cfg, registry, handle = start_store(name="t-2n", num_shards=2, rpc_timeout_s=20)
        try:
            nodes = {s["node_id"] for s in registry["shards"]}
            assert len(nodes) == 2, "shards were not spread over both nodes"
            info = dp.init(name="t-2n", transport="zmq")
            assert info.transport == "zmq" and len(set(info.shard_nodes)) == 2
            keys = [f"k{i}" for i in range(64)]
            x = torch.randn(64, 1024)
            dp.kv_batch_put(keys, "p", {"x": x})
            assert torch.equal(dp.kv_batch_get(keys, "p")["x"], x)
            per_shard = dp.stats()["shards"]
            assert all(s["bytes_used"] > 0 for s in per_shard) and all(
                s["transport"] == "zmq" for s in per_shard
            )
            assert all(s["bytes_resident"] == s["bytes_heap"] for s in per_shard)  # frames, no shm
        finally:
            dp.close()
            handle.stop()
    finally:
        ray_cluster.remove_node(node)


def _run(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -c CODE`` from the repository's root (forked by the session's server when it runs)."""
    return run_python(["-c", textwrap.dedent(code)], timeout, cwd=ROOT)


def test_an_embedded_store_serves_a_task_and_leaves_nothing_when_closed(ray_cluster):
    """A driver's ``dp.init()`` starts an embedded store (it owns it), a Ray task's ``dp.init()``
    attaches to it (not its owner), and the driver's close stops it: none of its named actors is left.
    On the session's cluster: the same on a plain ``ray.init()`` of the machine's real cores is the
    first command of examples/README.md (``tests/test_examples.py``)."""
    name = "t-embedded-close"
    code = f"""
        import ray, torch, dataplane as dp
        ray.init(address={ray_cluster.address!r}, logging_level="ERROR", log_to_driver=False)
        info = dp.init(name={name!r})
        assert info.owned, info

        @ray.remote(num_cpus=0.1)
        def worker():
            import dataplane as dp
            got = dp.init(name={name!r})
            x = dp.kv_batch_get(["a"], "p")["x"]
            dp.kv_batch_put(["b"], "p", {{"x": x + 1}})
            dp.close()
            return got.owned

        dp.kv_batch_put(["a"], "p", {{"x": torch.ones(1, 3)}})
        assert ray.get(worker.remote(), timeout=120) is False
        assert dp.kv_batch_get(["b"], "p")["x"].tolist() == [[2.0, 2.0, 2.0]]
        dp.close()  # the store's actors are gone when it returns, while this driver is still here
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if {name!r} in a["name"]]
        print("LEFT", left)
        print("OK")
    """
    proc = _run(code)
    assert "OK" in proc.stdout, proc.stdout + proc.stderr
    assert "LEFT []" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_cli_start_status_stop_and_two_drivers(ray_cluster):
    dp.close()
    addr = ray_cluster.address

    def rl(*args):  # `python -m rlplane store ...` from the repository's root (forked, as _run's are)
        return run_python(["-m", "rlplane", "store", *args], 240, cwd=ROOT)

    started = rl("start", "--shards", "1", "--address", addr, "--capacity", "64M")
    assert started.returncode == 0 and "started store" in started.stdout, started.stdout + started.stderr
    # what it started, and the line that attaches to it
    assert "1 shard on 1 node" in started.stdout and "capacity 64.0 MiB" in started.stdout, started.stdout
    assert f'dp.init(address="{addr}")' in started.stdout, started.stdout
    try:
        again = rl("start", "--shards", "2", "--address", addr)  # other options: named, exit 1
        assert again.returncode == 1, again.stdout + again.stderr
        assert "already running, with other options than asked: --shards 1 (asked 2)" in again.stdout
        other = _run(
            f"""
            import ray, torch, dataplane as dp
            ray.init(address={addr!r})
            assert not dp.init().owned
            dp.kv_batch_put(["from-other"], "shared", {{"x": torch.full((1, 2), 3.0)}})
            dp.close()
            print("OK")
            """
        )
        assert "OK" in other.stdout, other.stdout + other.stderr
        info = dp.init()  # this driver attaches to the same service and sees the other's data
        assert not info.owned and info.capacity_bytes == 64 << 20
        assert dp.kv_batch_get(["from-other"], "shared")["x"].tolist() == [[3.0, 3.0]]
        dp.close()
        status = rl("status", "--address", addr)
        assert status.returncode == 0, status.stdout + status.stderr
        lines = status.stdout.splitlines()
        assert "1 shard(s) on 1 node(s)" in lines[0] and "of 64.0 MiB" in lines[0], status.stdout
        assert lines[1].split()[-1] == "clients" and lines[2].split()[7:9] == ["64.0", "MiB"], status.stdout
        assert "shared (1 keys)" in status.stdout
        machine = json.loads(rl("status", "--address", addr, "--json").stdout)
        assert machine["shards"][0]["capacity_bytes"] == 64 << 20 and machine["address"] == addr
        assert machine["shards"][0]["clients"] == 0 and machine["partitions"] == {"shared": 1}
    finally:
        dp.close()
        stopped = rl("stop", "--address", addr)
    assert stopped.returncode == 0 and "stopped store" in stopped.stdout, stopped.stdout + stopped.stderr
    wait_for(lambda: not _named("dataplane-"), 20, "the service's actors to be gone after stop")
