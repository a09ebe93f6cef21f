"""Faults the store must survive or report exactly: a dead shard during a clear, a dead index, no fds.

Real actors are killed with ``ray.kill`` and real processes run out of real file descriptors; each
test waits for the fault to be visible (the process gone), never for a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import time

import pytest
import ray
import torch

import dataplane as dp
from dataplane.config import NAMESPACE, StoreConfig
from dataplane.service import launch as _service
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import reply as read_reply
from tests.forkserver import run_python, start_python

from .conftest import (
    keys_on_shards,
    own_store,
    process_exited,
    raw_unix_socket,
    request,
    start_store,
    thread_states,
    wait_for,
)

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kill(name: str, pid: int) -> None:
    """Kill the store actor ``name`` and wait until its process is gone."""
    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    wait_for(lambda: process_exited(pid), 30, f"process {pid} of {name} to exit")


def test_clear_partition_with_a_dead_shard_names_what_is_left(ray_cluster, pid):
    with own_store("t-fault-clear", num_shards=2, rpc_timeout_s=60) as (cfg, registry):
        keys = keys_on_shards(pid, 2)
        dp.kv_batch_put(keys, pid, {"x": torch.ones(2, 70_000)})
        _kill(cfg.shard_name(1), registry["shards"][1]["pid"])
        with pytest.raises(dp.ShardUnavailableError) as err:
            dp.clear_partition(pid)
        msg = str(err.value)
        assert err.value.shard == cfg.shard_name(1)
        assert "shards [0] freed their rows" in msg and "the index forgot them" in msg
        assert "is dead" in msg, msg
        assert dp.kv_list(pid) == {}  # the index forgot the partition
        shard0 = ray.get_actor(cfg.shard_name(0), namespace=NAMESPACE)
        assert pid not in ray.get(shard0.stats.remote(), timeout=30)["partitions"]
        with pytest.raises(dp.ShardUnavailableError, match="is dead"):  # known dead: fails at once
            dp.kv_batch_get([keys[1]], pid)


def test_dead_index_store_is_stopped_and_started_afresh(ray_cluster, pid):
    with own_store("t-fault-index", num_shards=2, rpc_timeout_s=60) as (cfg, registry):
        keys = keys_on_shards(pid, 2)
        dp.kv_batch_put(keys, pid, {"x": torch.full((2, 4), 3.0)})
        _kill(cfg.index_name(), registry["index"]["pid"])
        # an attached client: gets go straight to the shards and still work; puts need the index
        assert dp.kv_batch_get(keys, pid)["x"].tolist() == [[3.0] * 4] * 2
        with pytest.raises(dp.ShardUnavailableError, match=f"{cfg.index_name()}.*is dead"):
            dp.kv_batch_put(keys, pid, {"y": torch.zeros(2)})
        dp.close()
        # a new process can neither attach to nor be confused by the remnants: they are named
        with pytest.raises(dp.StoreNotInitializedError, match="broken.*rlplane store stop"):
            dp.init(name=cfg.name, attach_only=True)
        assert _service.stop_named(StoreConfig(name=cfg.name)) is True
        assert _service.store_actor_names(StoreConfig(name=cfg.name)) == []
        info = dp.init(name=cfg.name, num_shards=1)  # a fresh store under the same name
        assert info.owned and info.num_shards == 1
        dp.kv_batch_put(["a"], pid, {"x": torch.zeros(1, 2)})
        assert dp.kv_batch_get(["a"], pid)["x"].shape == (1, 2)


def test_a_one_round_trip_put_names_a_dead_index_within_seconds(ray_cluster, pid):
    # A small put of a confirmed schema goes to its shard only, which commits it in the index itself
    # (``server.shard.actor``): with the index dead, the shard finds out at once (its Unix-lane
    # connection to the index is closed, so the commit cannot have been delivered) and takes the row
    # back; the writer learns exactly that: the index is dead and nothing was written.
    with own_store("t-fault-put-ready", num_shards=1, rpc_timeout_s=60) as (cfg, registry):
        dp.kv_put("a", pid, {"x": torch.tensor(1)})  # x confirmed: the next put takes one round trip
        _kill(cfg.index_name(), registry["index"]["pid"])
        for key in ("b", "c"):
            started = time.monotonic()
            with pytest.raises(dp.ShardUnavailableError) as err:
                dp.kv_put(key, pid, {"x": torch.tensor(2)})
            took = time.monotonic() - started
            msg = str(err.value)
            assert err.value.shard == cfg.index_name() and "is dead" in msg, msg
            assert "committed only in part" not in msg, msg
            assert took < 15, f"took {took:.1f}s: the shard waited for its deadline instead of probing"
            # Taken back from its shard, as said: a get of a stored key needs only its shard (see "a"
            # below), so the get turns to the index, to explain a missing key, and finds it dead.
            with pytest.raises(dp.ShardUnavailableError, match="index.*is dead"):
                dp.kv_batch_get([key], pid)
        assert dp.kv_batch_get(["a"], pid)["x"].tolist() == [1]  # what was committed before stays


def test_init_clears_a_broken_store_before_starting_one(ray_cluster):
    dp.close()
    cfg, registry, handle = start_store(name="t-fault-broken", num_shards=1)
    try:
        _kill(cfg.index_name(), registry["index"]["pid"])
        info = dp.init(name=cfg.name, num_shards=2)
        assert info.owned and info.num_shards == 2
        assert _service.store_actor_names(cfg) == sorted(
            [cfg.index_name(), cfg.shard_name(0), cfg.shard_name(1)]
        )
    finally:
        dp.close()
        handle.stop()


def _sigkill(pid: int) -> None:
    """Kill process ``pid`` the way the OS does (not ``ray.kill``) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: process_exited(pid), 30, f"process {pid} to exit after SIGKILL")


def _init_in_another_process(address: str, name: str, num_shards: int, first: str = "") -> str:
    """Run ``first`` then ``dp.init(name=...)`` and a put and get in a new process attached to the
    cluster (the store's owner, this process, stays alive); its output (``INIT <seconds>`` on success)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import ray, torch, dataplane as dp
        from dataplane.config import StoreConfig
        from dataplane.service import launch
        ray.init(address={address!r}, logging_level="ERROR")
        {first}
        started = time.monotonic()
        info = dp.init(name={name!r}, num_shards={num_shards})
        took = time.monotonic() - started
        assert info.owned and info.num_shards == {num_shards}, info
        dp.kv_batch_put(["a", "b"], "p", {{"x": torch.ones(2, 3)}})
        assert dp.kv_batch_get(["a", "b"], "p")["x"].sum().item() == 6
        print(f"INIT {{took:.2f}}")
        """
    )
    out = run_python(["-c", code], timeout=300)
    return out.stdout + out.stderr[-3000:]


def test_a_sigkilled_index_is_recovered_by_init_in_another_process(ray_cluster):
    # The index dies by an OS kill while its owner (this process) lives: Ray keeps such an owned
    # actor registered, DEAD, and its name taken, until the owner lets go of it. dp.init() in any
    # other process must still clear the broken store and start a fresh one under the same name.
    dp.close()
    cfg, registry, handle = start_store(name="t-fault-sigkill-index", num_shards=2)
    try:
        _sigkill(registry["index"]["pid"])
        out = _init_in_another_process(ray_cluster.address, cfg.name, 1)
        assert "INIT" in out, out
    finally:
        handle.stop()


def test_sigkilled_shards_do_not_block_a_new_store(ray_cluster):
    # Every actor of the store killed by the OS (nothing of it is listed any more, yet every name is
    # taken), then one shard of another store killed and the store stopped as `rlplane store stop`
    # does: either way a new store of the same name starts in another process.
    dp.close()
    cfg, registry, handle = start_store(name="t-fault-sigkill-all", num_shards=2)
    try:
        for actor in [registry["index"], *registry["shards"]]:
            _sigkill(actor["pid"])
        wait_for(lambda: _service.store_actor_names(cfg) == [], 30, "Ray to see the store's actors dead")
        out = _init_in_another_process(ray_cluster.address, cfg.name, 2)
        assert "INIT" in out, out
    finally:
        handle.stop()
    cfg, registry, handle = start_store(name="t-fault-sigkill-shard", num_shards=2)
    try:
        _sigkill(registry["shards"][1]["pid"])
        stop = f"assert launch.stop_named(StoreConfig(name={cfg.name!r}))"
        out = _init_in_another_process(ray_cluster.address, cfg.name, 2, first=stop)
        assert "INIT" in out, out
    finally:
        handle.stop()


def _all_threads_stopped(pid: int) -> bool:
    """Whether a SIGSTOP has taken effect: every thread of process ``pid`` is in state T."""
    states = thread_states(pid)
    return bool(states) and all(state == "T" for state in states)


@contextlib.contextmanager
def _stopped(pid: int):
    """Process ``pid`` stopped (SIGSTOP, and every thread seen stopped) for the block, then resumed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _all_threads_stopped(pid), 30, f"process {pid} to stop")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _index_stats(registry: dict) -> _protocol.IndexStatsReply:
    """The index's own ``stats`` (a raw request: no shard is asked, so a stopped shard does not matter)."""
    sock = raw_unix_socket(registry, "index")
    try:
        reply = request(sock, "stats", {}, timeout_ms=30_000)
    finally:
        sock.close()
    assert reply is not None and reply[0].error is None, reply
    return read_reply(reply[0].body, _protocol.IndexStatsReply)


def _put_once_accepted(pid: str, what: str) -> None:
    """Put an int64 ``f`` to key "late" until the index stops refusing its dtype (SchemaError)."""

    def accepted() -> bool:
        try:
            dp.kv_batch_put(["late"], pid, {"f": torch.arange(2).view(1, 2)})
        except dp.SchemaError:
            return False
        return True

    wait_for(accepted, 60, what, interval=0.2)
    assert dp.kv_batch_get(["late"], pid)["f"].tolist() == [[0, 1]]


def test_a_put_that_failed_on_a_stalled_index_decides_no_schema(ray_cluster, pid):
    # A put creating field f waits for its prepare while the index is stopped longer than
    # rpc_timeout_s: the put fails. The prepare, and the abort the writer sent after it, reach the
    # index once it runs again (in either order): the prepare must decide nothing, so a put of
    # another dtype is accepted. It cannot have expired instead: reservation_timeout_s is 600 s.
    options = {"num_shards": 1, "rpc_timeout_s": 5, "reservation_timeout_s": 600}
    with own_store("t-fault-stalled-prepare", **options) as (cfg, registry):
        with _stopped(registry["index"]["pid"]):
            with pytest.raises(dp.ShardUnavailableError, match="did not answer") as err:
                dp.kv_batch_put(["a"], pid, {"f": torch.zeros(1, 2)})
        assert err.value.shard == cfg.index_name()
        _put_once_accepted(pid, "the failed put's prepare to let go of field f")
        assert dp.kv_list(pid) == {pid: {"late": {}}}  # the failed put recorded nothing
        puts = _index_stats(registry).puts
        assert puts["open"] == 0 and puts["expired"] == 0, puts


def test_a_writer_killed_between_prepare_and_commit_decides_no_schema(ray_cluster, pid):
    # A writer's put of a new field f is prepared in the index, while its reservation waits on a
    # stopped shard; then the writer is killed. Its prepare must not decide f's dtype for ever: it
    # expires with the reservation (reservation_timeout_s), and a put of another dtype is accepted.
    options = {"num_shards": 1, "rpc_timeout_s": 120, "reservation_timeout_s": 3}
    with own_store("t-fault-dead-writer", **options) as (cfg, registry):
        code = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {ROOT!r})
            import ray, torch, dataplane as dp
            ray.init(address={ray_cluster.address!r}, logging_level="ERROR")
            dp.init(name={cfg.name!r})
            print("ATTACHED", flush=True)
            sys.stdin.readline()
            dp.kv_batch_put(["w"], {pid!r}, {{"f": torch.zeros(1, 2)}})
            print("PUT RETURNED", flush=True)
            """
        )
        writer = start_python(["-c", code], stdin=True, stdout=True)
        try:
            assert writer.stdout.readline().strip() == "ATTACHED"
            with _stopped(registry["shards"][0]["pid"]):
                writer.stdin.write("go\n")
                writer.stdin.flush()
                wait_for(lambda: _index_stats(registry).puts["open"] == 1, 60, "the writer's prepare")
                _sigkill(writer.pid)
        finally:
            if writer.poll() is None:
                writer.kill()
            writer.wait(timeout=60)
        _put_once_accepted(pid, "the dead writer's prepare to expire")
        puts = _index_stats(registry).puts
        assert puts["open"] == 0 and puts["expired"] == 1, puts
        wait_for(
            lambda: dp.stats()["shards"][0]["reservations_expired"] == 1,
            60,
            "the shard to fence the dead writer's reservation",
        )
        assert dp.kv_list(pid) == {pid: {"late": {}}}


def test_running_out_of_fds_is_a_typed_error_naming_the_limit(ray_cluster, pid):
    dp.close()
    cfg, registry, handle = start_store(name="t-fault-fds", num_shards=1)
    try:
        dp.init(name=cfg.name)
        dp.kv_batch_put(["small"], pid, {"x": torch.zeros(1, 4)})
        dp.kv_batch_put(["big"], pid, {"y": torch.ones(1, 64_000)})  # a segment the child never mapped
        code = textwrap.dedent(
            f"""
            import os, resource, sys
            sys.path.insert(0, {ROOT!r})
            import ray, dataplane as dp
            ray.init(address={ray_cluster.address!r}, logging_level="ERROR")
            dp.init(name={cfg.name!r})
            assert dp.stats()["shards"][0]["transport"] == "shm"
            dp.kv_batch_get(["small"], {pid!r})  # sockets are open and pooled now
            # No descriptor can be opened: the limit is below every free number. (Filling the table
            # up to a limit was not enough: Ray's threads close descriptors of their own at any time,
            # and the get took a freed one.)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
            try:
                os.close(os.open("/dev/null", os.O_RDONLY))
                print("AN FD WAS OPENED")
            except OSError:
                pass
            try:
                dp.kv_batch_get(["big"], {pid!r})
                print("NO ERROR")
            except dp.ResourceLimitError as exc:
                assert isinstance(exc, OSError)
                print("TYPED", exc)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            print("AFTER", float(dp.kv_batch_get(["big"], {pid!r})["y"].min()))
            """
        )
        out = run_python(["-c", code], timeout=120)
        assert "TYPED" in out.stdout and "AN FD" not in out.stdout, out.stdout + out.stderr[-3000:]
        assert "ran out of file descriptors" in out.stdout and "limit is" in out.stdout
        assert "AFTER 1.0" in out.stdout, "the client did not recover once descriptors were free"
    finally:
        dp.close()
        handle.stop()


def test_an_index_that_does_not_answer_ray_for_a_while_is_not_broken(ray_cluster, monkeypatch):
    """A live index whose Ray call fails as unavailable (a busy node: ``ActorUnavailableError``, a
    ``RayActorError``) is asked again, not taken for dead: the old code called the store broken and
    the next ``dp.init`` stopped it. (Ray's unavailability cannot be caused on demand: the first
    ``ray.get`` of the lookup raises it, the rest is real.)"""
    cfg, _, handle = start_store(name="t-busy-index", num_shards=1)
    real_get, calls = ray.get, []

    def flaky_get(refs, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ray.exceptions.ActorUnavailableError("the node did not answer in time", None)
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", flaky_get)
    try:
        found = _service.find_service(cfg, timeout=30)
        assert found is not None and found[0]["shards"] and len(calls) >= 2
    finally:
        monkeypatch.undo()
        handle.stop()
