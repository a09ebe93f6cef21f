"""Integrity under races and failures: regression tests, each written against a bug the store had.

What a reader may rely on (docs/reliability.md, "What a reader can and cannot observe"): a get
returns exactly the bytes some completed put wrote for those keys, never bytes of another partition
or of freed memory; a put commits on every shard and the index or on none; a field's schema is
decided once; a dead shard raises within a bounded time instead of hanging; and a client's resources
(sockets, file descriptors) do not grow with the threads it has run or the segments it has touched.

Every test uses real Ray actors or real subprocesses as the concurrent parties, and natural timing:
nothing is synchronised by sleeping. Each assertion names the bug it guards against.
"""

from __future__ import annotations

import asyncio
import gc
import os
import textwrap
import threading
import time

import pytest
import ray
import torch

import dataplane as dp
from dataplane.config import NAMESPACE
from tests.forkserver import run_python

from .conftest import keys_on_shards, own_store, store_fixtures, wait_for

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORE = "t-race"
MISSING = (dp.KeyNotFoundError, dp.PartitionNotFoundError)


# ---- stores ---------------------------------------------------------------------------------------


store, attached = store_fixtures(STORE, num_shards=2, rpc_timeout_s=30)


# ---- helper actors (each a separate process attached to a store) ----------------------------------


@ray.remote(num_cpus=0.1)
class Client:
    """A process of the cluster using the store through the public API."""

    def __init__(self, name: str) -> None:
        import dataplane as dp

        dp.init(name=name)

    def where(self) -> str:
        """The dataplane package this process imported (to check which code a run tests)."""
        import dataplane as dp

        return dp.__file__

    def put_full(self, key: str, pid: str, value: float, numel: int) -> bool:
        import dataplane as dp

        dp.kv_batch_put([key], pid, {"x": torch.full((1, numel), value)})
        return True

    def recreate(self, pid: str, key: str) -> bool:
        """Drop ``pid``, then create it again with field x as float32 (one row, ``key``)."""
        import dataplane as dp

        dp.clear_partition(pid)
        dp.kv_put(key, pid, {"x": torch.tensor(0.5)})
        return True

    def cycle(self, rounds: int, numel: int, pid_a: str, pid_b: str) -> int:
        """Put 'k' (1.0) to ``pid_a``, clear it, put 's' (2.0) to ``pid_b``, clear it; ``rounds`` times."""
        import dataplane as dp

        for _ in range(rounds):
            dp.kv_batch_put(["k"], pid_a, {"x": torch.full((1, numel), 1.0)})
            dp.kv_clear(["k"], pid_a)
            dp.kv_batch_put(["s"], pid_b, {"x": torch.full((1, numel), 2.0)})
            dp.kv_clear(["s"], pid_b)
        return rounds

    def put_at(self, barrier, trial: int, key: str, pid: str, dtype: str) -> str:
        """Wait for the other party at ``barrier``, then put field 'f' of ``dtype``: 'ok' or the error."""
        import dataplane as dp

        value = torch.zeros(1, 4, dtype=getattr(torch, dtype))
        ray.get(barrier.wait.remote(trial), timeout=60)
        try:
            dp.kv_batch_put([key], pid, {"f": value})
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
            return type(exc).__name__
        return "ok"

    def timed_get(self, keys: list[str], pid: str) -> tuple[str, float]:
        """A sync get: ('returned' or the error class name, seconds it took)."""
        import dataplane as dp

        t0 = time.monotonic()
        try:
            dp.kv_batch_get(keys, pid)
            outcome = "returned"
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
            outcome = type(exc).__name__
        return outcome, time.monotonic() - t0


@ray.remote(num_cpus=0.1, max_concurrency=2)
class Reader:
    """Reads one key in a loop until told to stop; counts reads that are not the value written."""

    def __init__(self, name: str) -> None:
        import dataplane as dp

        dp.init(name=name)
        self._stop = threading.Event()

    def read(self, key: str, pid: str, expect: float, max_s: float) -> dict:
        import dataplane as dp

        counts = {"reads": 0, "good": 0, "missing": 0, "raced": 0, "bad": 0, "bad_examples": []}
        deadline = time.monotonic() + max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            counts["reads"] += 1
            try:
                x = dp.kv_batch_get([key], pid)["x"]
            except (dp.KeyNotFoundError, dp.PartitionNotFoundError):
                counts["missing"] += 1
                continue
            except dp.DataplaneError as exc:  # a read that lost the race every time: typed, not wrong
                if "raced with clears" not in str(exc):
                    raise
                counts["raced"] += 1
                continue
            lo, hi = x.min().item(), x.max().item()
            if lo == hi == expect:
                counts["good"] += 1
            else:
                counts["bad"] += 1
                if len(counts["bad_examples"]) < 5:
                    counts["bad_examples"].append((lo, hi))
        return counts

    def stop(self) -> None:
        self._stop.set()


@ray.remote(num_cpus=0)
class Barrier:
    """Releases the callers of ``wait(trial)`` together once ``parties`` of them have arrived."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived: dict[int, int] = {}
        self.events: dict[int, asyncio.Event] = {}

    async def wait(self, trial: int) -> bool:
        event = self.events.setdefault(trial, asyncio.Event())
        self.arrived[trial] = self.arrived.get(trial, 0) + 1
        if self.arrived[trial] >= self.parties:
            event.set()
        await asyncio.wait_for(event.wait(), 60)
        return True


# ---- 1. a reader never gets foreign bytes -----------------------------------------------------------


@pytest.mark.slow
def test_reader_never_gets_bytes_of_a_recycled_segment(ray_cluster):
    """A get racing a clear + put of another partition must return the key's bytes or "missing".

    One shard, so the segment freed by clearing 'k' in P1 is the one the put of 's' in P2 reuses.
    Bug: the shard answered a get with a reference to the segment and the reader copied from it
    afterwards, by which time the segment could hold P2's 2.0s.
    """
    rounds, numel = 500, 2 * 2**20  # 8 MiB of float32 per put: the shared-memory path
    with own_store("t-race-recycle", num_shards=1, rpc_timeout_s=30):
        writer, reader = Client.remote("t-race-recycle"), Reader.remote("t-race-recycle")
        try:
            ray.get([writer.where.remote(), reader.read.remote("k", "P1", 1.0, 0.0)], timeout=120)
            reading = reader.read.remote("k", "P1", 1.0, 120.0)
            assert ray.get(writer.cycle.remote(rounds, numel, "P1", "P2"), timeout=180) == rounds
            reader.stop.remote()
            counts = ray.get(reading, timeout=60)
        finally:
            ray.kill(writer)
            ray.kill(reader)
    print(f"reader counts: {counts}")
    assert counts["good"] > 0, f"the reader never saw the key while the writer ran: {counts}"
    assert counts["bad"] == 0, (
        f"{counts['bad']} of {counts['reads']} reads of P1/k returned bytes that are not all 1.0 "
        f"(min, max): {counts['bad_examples']}; counts {counts}"
    )


# ---- 2. an expired reservation cannot be written into ------------------------------------------------


def paused_put(keys: list[str], pid: str, fields: dict):
    """Start a put and pause it after its reservation, before the client writes its rows.

    Uses the internal sans-IO operation (``ops.put`` on the client's route, driven by hand through
    ``client.sync.call_many``): the first step (schema check + reservation on the shard) runs now.
    Returns ``(reply bodies of that step, resume)``; ``resume()`` runs the rest of the put (copy the
    rows into the reserved memory, commit) and returns the exception it ended with, or None.
    """
    from dataplane.client import ops
    from dataplane.codec.columns import encode_fields

    client = dp.api.current_client()
    op = ops.put(client.route, keys, pid, encode_fields(fields, len(keys)), None)
    results = client.sync.call_many(next(op))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"the first step of the put failed: {errors}"

    def resume() -> BaseException | None:
        try:
            calls = op.send(results)
            while True:
                calls = op.send(client.sync.call_many(calls))
        except StopIteration:
            return None
        except Exception as exc:  # noqa: BLE001 - returned to the test
            return exc

    return results, resume


@pytest.mark.slow
def test_expired_reservation_cannot_overwrite_committed_data(ray_cluster):
    """A writer that resumes after its reservation expired must not write into memory now owned by others.

    Bug: the shard undid the expired reservation and recycled its segment for the next put, but the
    late client still held the segment's address and copied its rows over the new owner's data.
    """
    numel = 2**18  # 1 MiB of float32: above shm_min_bytes
    name = "t-race-resv"
    with own_store(name, num_shards=1, rpc_timeout_s=30, reservation_timeout_s=1.0, warm_idle_s=60.0):
        other = Client.remote(name)
        try:
            ray.get(other.where.remote(), timeout=120)
            _, resume = paused_put(["late"], "P", {"x": torch.full((1, numel), 1.0)})
            assert dp.stats()["shards"][0]["bytes_reserved"] > 0
            wait_for(lambda: dp.stats()["shards"][0]["bytes_reserved"] == 0, 30, "the reservation to expire")
            assert ray.get(other.put_full.remote("other", "Q", 2.0, numel), timeout=60)
            before = dp.kv_batch_get(["other"], "Q")["x"]
            assert before.min().item() == before.max().item() == 2.0
            ended = resume()
            print(f"the late put ended with {ended!r}")
            x = dp.kv_batch_get(["other"], "Q")["x"]
            assert x.min().item() == x.max().item() == 2.0, (
                f"Q/other was overwritten by a put whose reservation had expired (late put ended with "
                f"{ended!r}): its values now range {x.min().item()}..{x.max().item()}, expected all 2.0"
            )
            try:
                late = dp.kv_batch_get(["late"], "P")["x"]
            except MISSING:
                late = None
            if late is not None:
                assert ended is None and late.min().item() == late.max().item() == 1.0, (
                    f"P/late is readable with values {late.min().item()}..{late.max().item()} "
                    f"after the put ended with {ended!r}"
                )
        finally:
            ray.kill(other)


def test_a_writer_whose_reservation_expired_gets_reservation_expired_error(ray_cluster):
    """The documented error, not the ``OSError`` of a segment the shard has closed meanwhile: a put
    paused between reserve and copy until its reservation expired raises ``ReservationExpiredError``
    and writes nothing (the old code raised ``ShmUnavailable``, an ``OSError``)."""
    numel = 2**18  # 1 MiB of float32: above shm_min_bytes, so it is copied into a reserved segment
    with own_store("t-race-expired", num_shards=1, rpc_timeout_s=30, reservation_timeout_s=1.0):
        if not all(dp.api.current_client().route.shm):
            pytest.skip("this client has no shared-memory path to the shard")
        _, resume = paused_put(["late"], "P", {"x": torch.full((1, numel), 1.0)})
        wait_for(lambda: dp.stats()["shards"][0]["bytes_reserved"] == 0, 30, "the reservation to expire")
        ended = resume()
        assert isinstance(ended, dp.ReservationExpiredError), f"the late put ended with {ended!r}"
        assert "reservation_timeout_s" in str(ended) and "nothing was written" in str(ended), ended
        assert dp.kv_list("P") == {}
        dp.kv_batch_put(["next"], "P", {"x": torch.full((1, numel), 2.0)})  # the store still works
        assert dp.kv_batch_get(["next"], "P")["x"].min().item() == 2.0


# ---- 3. a new field's schema is decided once, across shards -------------------------------------------


@pytest.mark.slow
def test_new_field_dtype_cannot_split_across_shards(attached):
    """Two clients creating the same new field with different dtypes on different shards: one wins.

    Bug: the index checked a put's schema before any put recorded it, and each shard only checked its
    own rows, so two simultaneous first puts both succeeded and the field held two dtypes.
    """
    trials = 40
    a, b = Client.remote(STORE), Client.remote(STORE)
    barrier = Barrier.remote(2)
    bad: list[str] = []
    pids = [f"race-schema-{t}" for t in range(trials)]
    try:
        ray.get([a.where.remote(), b.where.remote()], timeout=120)
        for t, pid in enumerate(pids):
            ka, kb = keys_on_shards(pid, 2)
            outcomes = ray.get(
                [
                    a.put_at.remote(barrier, t, ka, pid, "float32"),
                    b.put_at.remote(barrier, t, kb, pid, "int64"),
                ],
                timeout=120,
            )
            if sorted(outcomes) != ["SchemaMismatchError", "ok"]:
                bad.append(f"trial {t}: outcomes (float32 on shard 0, int64 on shard 1) = {outcomes}")
                continue
            winner, loser = (ka, kb) if outcomes[0] == "ok" else (kb, ka)
            dtype = torch.float32 if winner == ka else torch.int64
            try:
                td = dp.kv_batch_get([ka, kb], pid)
                bad.append(f"trial {t}: the loser's key {loser!r} is readable: f has dtype {td['f'].dtype}")
            except dp.KeyNotFoundError as exc:
                if exc.key != loser:
                    bad.append(f"trial {t}: a get of both keys names {exc.key!r}, not the loser {loser!r}")
            got = dp.kv_batch_get([winner], pid)["f"].dtype
            if got != dtype:
                bad.append(f"trial {t}: the winner's key {winner!r} reads back as {got}, not {dtype}")
    finally:
        for actor in (a, b, barrier):
            ray.kill(actor)
        for pid in pids:
            dp.clear_partition(pid)
    shown = "\n".join(bad[:10]) + ("\n..." if len(bad) > 10 else "")
    assert not bad, f"{len(bad)} of {trials} trials let the field's dtype split:\n{shown}"


# ---- 4. a put that fails does not half-commit ----------------------------------------------------------


def test_a_refused_one_round_trip_put_leaves_nothing_behind(attached, pid):
    """A small put of a schema this client has seen confirmed is one round trip: its shard stores the
    row, then commits it in the index. When the index refuses (another process dropped the partition
    and created it again with another dtype), the shard takes the row back before answering: the put
    leaves nothing, and the shard then takes the dtype the index decided.
    Bug guarded: the row stayed on its shard, readable but never listed nor ready."""
    a, b = keys_on_shards(pid, 2)
    dp.kv_put(a, pid, {"x": torch.tensor(1)})  # x confirmed as int64 for this client
    other = Client.remote(STORE)
    try:
        assert ray.get(other.recreate.remote(pid, b), timeout=60)  # x is float32 now, on b's shard
    finally:
        ray.kill(other)
    with pytest.raises(dp.SchemaError) as err:
        dp.kv_put(a, pid, {"x": torch.tensor(2)})
    assert err.value.field == "x" and "float32" in str(err.value)
    with pytest.raises(dp.KeyNotFoundError, match=repr(a)):
        dp.kv_batch_get([a], pid)
    assert list(dp.kv_list(pid)[pid]) == [b]
    dp.kv_put(a, pid, {"x": torch.tensor(3.0)})  # the index's dtype, on the shard that refused int64
    assert dp.kv_batch_get([a, b], pid)["x"].tolist() == [3.0, 0.5]


@pytest.mark.parametrize("numel", [4, 300_000], ids=["inline", "shared-memory"])
def test_put_with_unencodable_tags_commits_nothing(attached, pid, numel):
    """Tags that cannot be encoded fail the put with TypeError, and no row of it is stored.

    Bug: the tags were encoded only when the index's commit was sent, after the shards' commits had
    gone out, so the rows were readable but not listed.
    """
    import numpy as np

    tags = [{"score": np.float32(1.0)}, {"t": torch.tensor(1)}]
    with pytest.raises(TypeError):
        dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2, numel)}, tags=tags)
    try:
        listed = dp.kv_list(pid).get(pid, {})
        assert not listed, f"the failed put listed keys {sorted(listed)}"
        for key in ("a", "b"):
            try:
                td = dp.kv_batch_get([key], pid)
            except MISSING:
                continue
            pytest.fail(
                f"the failed put left key {key!r} readable (fields {sorted(td.keys())}), but not listed"
            )
    finally:
        dp.clear_partition(pid)


# ---- 5. a dead shard is reported quickly ---------------------------------------------------------------


@pytest.mark.slow
def test_dead_shard_is_detected_quickly_sync_and_async(ray_cluster):
    """A killed shard raises ShardUnavailableError within seconds, not after rpc_timeout_s (60 s).

    Bug: a request to a dead shard waited the whole rpc_timeout_s, so every sync and async call to it
    hung for a minute; the other shard kept working.
    """
    name, pid = "t-race-dead", "P"
    with own_store(name, num_shards=2, rpc_timeout_s=60) as (cfg, registry):
        k0, k1 = keys_on_shards(pid, 2)
        dp.kv_batch_put([k0, k1], pid, {"x": torch.ones(2, 4)})
        prober = Client.remote(name)
        try:
            before = ray.get(prober.timed_get.remote([k1], pid), timeout=120)  # attached, and reads it
            assert before[0] == "returned", before
            victim = registry["shards"][1]["pid"]
            ray.kill(ray.get_actor(cfg.shard_name(1), namespace=NAMESPACE), no_restart=True)
            wait_for(lambda: not os.path.exists(f"/proc/{victim}"), 30, "the killed shard to exit")

            fired = time.monotonic()
            probing = prober.timed_get.remote([k1], pid)  # sync, in another process, meanwhile:
            dp.kv_batch_put([k0], pid, {"x": torch.full((1, 4), 3.0)})  # the live shard works
            assert dp.kv_batch_get([k0], pid)["x"].tolist() == [[3.0] * 4]

            async def one() -> str:
                try:
                    await asyncio.wait_for(dp.async_kv_batch_get([k1], pid), 30)
                except dp.ShardUnavailableError:
                    return "ShardUnavailableError"
                except TimeoutError:
                    return "hung 30 s"
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
                    return type(exc).__name__
                return "returned"

            async def storm() -> list[str]:
                return await asyncio.gather(*(one() for _ in range(200)))

            t0 = time.monotonic()
            outcomes = asyncio.run(storm())
            async_s = time.monotonic() - t0
            try:
                sync = ray.get(probing, timeout=max(0.1, fired + 15 - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                sync = ("no answer", time.monotonic() - fired)
        finally:
            ray.kill(prober)
    tally = {o: outcomes.count(o) for o in set(outcomes)}
    problems = []
    if not (sync[0] == "ShardUnavailableError" and sync[1] < 10):
        problems.append(f"sync get of a key on the dead shard: {sync[0]} after {sync[1]:.1f}s")
    if tally != {"ShardUnavailableError": 200} or async_s >= 15:
        problems.append(f"200 async gets of the dead shard: {tally} after {async_s:.1f}s")
    assert not problems, "; ".join(problems)


# ---- 6. sockets do not grow with threads ----------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_client_sockets_do_not_grow_with_threads(attached, pid):
    """200 short-lived threads, each making one get, leave at most a few descriptors behind.

    Bug: each thread got its own sockets, kept for the life of the client after the thread ended
    (two descriptors per socket), so a process serving requests on fresh threads ran out of fds.
    """
    dp.kv_batch_put(["a"], pid, {"x": torch.ones(1, 4)})
    try:
        dp.kv_batch_get(["a"], pid)
        gc.collect()
        before = _open_fds()
        failures: list[BaseException] = []

        def one() -> None:
            try:
                assert dp.kv_batch_get(["a"], pid)["x"].tolist() == [[1.0] * 4]
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        for _ in range(10):
            threads = [threading.Thread(target=one) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a get did not finish within 60 s"
        gc.collect()
        grown = _open_fds() - before
    finally:
        dp.clear_partition(pid)
    assert not failures, f"gets failed: {failures[:3]}"
    assert grown <= 64, f"200 finished threads left {grown} more open file descriptors in the client"


# ---- 7. live segments do not cost descriptors in the client -----------------------------------------------


@pytest.mark.slow
def test_live_segments_do_not_hold_client_fds(attached, ray_cluster, pid):
    """700 live shared-memory segments must not need 700 descriptors in a client limited to 600.

    Bug: every mapping of a shard's segment kept a descriptor open in the client (mmap dup()s it), so
    a client touching many live segments hit EMFILE.
    """
    code = f"""
        import resource, sys, ray, torch
        import dataplane as dp
        print("dataplane from", dp.__file__)
        ray.init(address={ray_cluster.address!r}, logging_level="ERROR", log_to_driver=False)
        info = dp.init(name={STORE!r})
        assert info.transport == "shm", info
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
        keys = [f"k{{i}}" for i in range(700)]
        i = -1
        try:
            for i, key in enumerate(keys):  # 128 KiB each: one live segment per put
                dp.kv_batch_put([key], {pid!r}, {{"x": torch.full((1, 32768), float(i))}})
            i = len(keys)
            x = dp.kv_batch_get(keys, {pid!r})["x"]
            assert x[:, 0].tolist() == [float(j) for j in range(700)]
            assert bool((x == x[:, :1]).all())
        except BaseException as exc:
            print(f"FAILED at put {{i}}: {{type(exc).__name__}}: {{exc}}")
            sys.exit(1)
        print("OK")
    """
    try:
        proc = run_python(["-c", textwrap.dedent(code)], timeout=240, cwd=ROOT)
    finally:
        dp.clear_partition(pid)
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
