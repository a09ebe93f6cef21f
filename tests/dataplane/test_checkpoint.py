"""Checkpoint and restore of the store (``dp.save_checkpoint`` / ``dp.load_checkpoint``), end to end.

Every test saves a store, loads the checkpoint (into the same store after clearing it, or into a
store of another number of shards) and checks that what the store answers afterwards (``kv_list``,
gets of every field, ``next_batch``, ``consumption``) is exactly what it answered at the save. The
faults (a killed save, corrupted files, concurrent writers) are in ``test_checkpoint_faults.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import dataplane as dp

from .conftest import store_fixtures

pytestmark = pytest.mark.ray

NAME = "t-ckpt"


store, _ = store_fixtures(NAME, num_shards=2, rpc_timeout_s=20, warm_idle_s=0.5)


@pytest.fixture
def kv(store):
    """Attached to the module's store, emptied first (a checkpoint holds every partition)."""
    dp.close()
    dp.init(name=NAME, allow_pickle=True)
    clear_all()
    yield
    dp.close()


def clear_all() -> None:
    for pid in dp.kv_list():
        dp.clear_partition(pid)


def _rows_of(value):
    """A field of a get, as plain comparable values: kind, dtype, every row's shape and values."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = value.unbind()
            return (
                "nested",
                str(value.dtype),
                [tuple(r.shape) for r in rows],
                [r.float().tolist() for r in rows],
            )
        return ("dense", str(value.dtype), tuple(value.shape), value.float().tolist())
    return ("plain", value.tolist())


def capture(pids: list[str], tags_only: tuple[str, ...] = ("tag-only",)) -> dict:
    """What the store answers about ``pids``: the listing (keys in order, tags), each key's get (all
    its fields: kind, dtype, shape and values of its row) and one get of every key's ``f32`` at once."""
    out = {}
    listing = dp.kv_list()
    for pid in pids:
        keys = [k for k in listing.get(pid, {}) if k not in tags_only]
        alone = {k: {n: _rows_of(v) for n, v in _items(dp.kv_batch_get([k], pid))} for k in keys}
        batch = _rows_of(dp.kv_batch_get(keys, pid, ["f32"])["f32"]) if keys else None
        out[pid] = {
            "list": listing.get(pid, {}),
            "order": list(listing.get(pid, {})),
            "alone": alone,
            "f32": batch,
        }
    return out


def _items(td):
    return [(name, td.get(name)) for name in td.keys()]


def _fill(pid: str) -> None:
    """A partition with every column kind, several segments per field, overwritten and cleared rows."""
    n = 40
    keys = [f"k{i}" for i in range(n)]
    g = torch.Generator().manual_seed(7)
    fields = {
        "f32": torch.randn(n, 3, generator=g),
        "bf16": torch.randn(n, 2, 2, generator=g).to(torch.bfloat16),
        "flag": torch.rand(n, generator=g) > 0.5,
        "i64": torch.arange(n, dtype=torch.int64) * 7,
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 5, dtype=torch.float32) for i in range(n)], layout=torch.jagged
        ),
        "pix": [torch.full((1 + i % 3, 1 + i % 2), float(i)) for i in range(n)],  # ragged: any dim differs
        "text": [f"row-{i}" * (i % 4) for i in range(n)],
        "blob": [bytes([i]) * (i % 5) for i in range(n)],
        "ints": [list(range(i % 6)) for i in range(n)],
        "chat": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "n": i}] for i in range(n)],
        "obj": [{"i": i, "s": {i}} for i in range(n)],  # pickled: opaque bytes to the store
        "np": np.arange(n * 2, dtype=np.int32).reshape(n, 2),
    }
    dp.kv_batch_put(keys, pid, fields, tags=[{"uid": i // 4, "status": "pending"} for i in range(n)])
    big = [f"big{i}" for i in range(24)]  # 128 KiB rows: segments of more than 1 MiB per shard
    dp.kv_batch_put(
        big, pid, {"f32": torch.randn(24, 3, generator=g), "wide": torch.randn(24, 32768, generator=g)}
    )
    dp.kv_batch_put(
        keys[::3], pid, {"f32": torch.zeros(len(keys[::3]), 3)}
    )  # overwrite: part of a segment dies
    dp.kv_clear(keys[5:9] + big[:2], pid)  # and cleared rows
    for i in range(5):  # one-row puts (inline segments)
        dp.kv_put(f"one{i}", pid, {"f32": torch.full((3,), float(i)), "text": f"t{i}"}, tag={"uid": 99})
    dp.kv_batch_put(keys[20:24], pid, tags=[{"status": "running"}] * 4)  # tags only
    dp.kv_batch_put(["tag-only"], pid, tags=[{"note": 1}])


def test_round_trip_of_every_column_kind(kv, pid, tmp_path):
    _fill(pid)
    before = capture([pid])
    info = dp.save_checkpoint(tmp_path / "ckpt", metadata={"global_steps": 3})
    assert info.partitions[pid] == len(before[pid]["list"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .tmp or .old left behind
    dp.clear_partition(pid)
    assert dp.kv_list(pid) == {}
    loaded = dp.load_checkpoint(tmp_path / "ckpt")
    assert loaded.metadata == {"global_steps": 3} and loaded.partitions == info.partitions
    assert capture([pid]) == before
    # the loaded rows live like any other: counted in their partition, overwritten, cleared
    assert sum(s["partition_bytes"].get(pid, 0) for s in dp.stats()["shards"]) > 0
    dp.kv_batch_put(["k0"], pid, {"f32": torch.ones(1, 3)})
    assert dp.kv_batch_get(["k0"], pid, ["f32"])["f32"].tolist() == [[1.0, 1.0, 1.0]]
    dp.kv_clear(["k1"], pid)
    assert "k1" not in dp.kv_list(pid)[pid]
    dp.clear_partition(pid)  # (a loaded segment had no partition to uncount its bytes from)
    assert all(pid not in s["partition_bytes"] for s in dp.stats()["shards"])


def test_async_save_and_load(kv, pid, tmp_path):
    import asyncio

    dp.kv_batch_put(["a", "b"], pid, {"f32": torch.arange(2.0)}, tags=[{"t": 1}, {"t": 2}])
    before = capture([pid])

    async def main():
        await dp.async_save_checkpoint(tmp_path / "c")
        await dp.async_clear_partition(pid)
        return await dp.async_load_checkpoint(tmp_path / "c")

    info = asyncio.run(main())
    assert info.partitions == {pid: 2}
    assert capture([pid]) == before


def _streams(pid: str, other: str, empty: str) -> None:
    """Consumers at work: tasks that took rows (plain, whole groups, rank-aware, leased), one reset,
    a finished partition partly drained, a finished empty one."""
    keys = [f"r{i}" for i in range(24)]
    tags = [{"uid": i // 4, "length": i} for i in range(24)]
    dp.kv_batch_put(keys[:16], pid, {"a": torch.arange(16.0)}, tags=tags[:16])
    dp.kv_batch_put(keys[:12], pid, {"b": torch.arange(12.0)})  # rows 12-15 hold "a" only
    dp.kv_batch_put(keys[16:], pid, {"a": torch.arange(8.0), "b": torch.arange(8.0)}, tags=tags[16:])
    dp.next_batch(pid, "reward", 5, ["a"])
    dp.next_batch(pid, "train", 8, ["a", "b"], sampler=dp.GroupSampler("uid", 4))
    dp.next_batch(pid, "actor", 4, ["a"], dp_rank=0, dp_size=2, batch_index=0)
    dp.next_batch(pid, "old", 6, ["a"])
    dp.reset_consumption(pid, "old")
    dp.kv_batch_put(["x0", "x1", "x2"], other, {"a": torch.arange(3.0)})
    dp.finish_partition(other)
    dp.next_batch(other, "reward", 2, ["a"])
    dp.kv_batch_put(["gone"], empty, {"a": torch.zeros(1)})
    dp.kv_clear(["gone"], empty)
    dp.finish_partition(empty)
    leased = dp.next_batch(pid, "lease", 3, ["a"], lease_s=600)
    dp.ack(leased.select_keys(leased.keys[:1]))  # two rows stay leased through the save and load


def _probe(pid: str, other: str, empty: str) -> list:
    """What consumers see next (this takes rows: run it once per store state)."""
    out: list = [dp.kv_list()]
    for task in ("reward", "train", "actor", "old", "lease", "never"):
        out.append(dp.consumption(pid, task))
    out.append(dp.consumption(other, "reward"))
    out.append(dp.consumption(empty, "reward"))
    out.append(dp.next_batch(pid, "reward", 3, ["a"]).keys)
    out.append(dp.next_batch(pid, "train", 4, ["a", "b"], sampler=dp.GroupSampler("uid", 4)).keys)
    out.append(dp.next_batch(pid, "actor", 4, ["a"], dp_rank=0, dp_size=2, batch_index=0).keys)  # remembered
    out.append(dp.next_batch(pid, "actor", 4, ["a"], dp_rank=1, dp_size=2, batch_index=0).keys)
    out.append(dp.next_batch(pid, "old", 16, ["a"]).keys)
    out.append([dp.next_batch(other, "reward", 2, ["a"]).keys for _ in range(2)])  # the rest, then empty
    out.append(dp.next_batch(empty, "reward", 2, ["a"]).keys)
    out.append(dp.next_batch(pid, "lease", 2, ["a"]).keys)  # after the leased rows
    return out


def test_round_trip_of_consumption_state(kv, pid, tmp_path):
    other, empty = pid + "-done", pid + "-empty"
    _streams(pid, other, empty)
    dp.save_checkpoint(tmp_path / "c")
    expected = _probe(pid, other, empty)  # what the store at the save answers next
    clear_all()
    dp.load_checkpoint(tmp_path / "c")
    assert _probe(pid, other, empty) == expected


def test_restore_onto_other_numbers_of_shards(ray_cluster, tmp_path):
    from dataplane.client.sharding import HashPlacement

    from .conftest import own_store

    pid = "resharded"
    with own_store("t-ckpt-one", num_shards=1):
        dp.close()
        dp.init(name="t-ckpt-one", allow_pickle=True)
        _fill(pid)
        dp.next_batch(pid, "reward", 6, ["f32"])
        before, progress = capture([pid]), dp.consumption(pid, "reward")
        dp.save_checkpoint(tmp_path / "one")
    for name, shards, src, dst in (
        ("t-ckpt-three", 3, "one", "three"),
        ("t-ckpt-one-again", 1, "three", None),
    ):
        with own_store(name, num_shards=shards):
            dp.close()
            dp.init(name=name, allow_pickle=True)
            dp.load_checkpoint(tmp_path / src)
            assert capture([pid]) == before and dp.consumption(pid, "reward") == progress
            placement = HashPlacement(shards)
            rows = [k for k in before[pid]["list"] if k != "tag-only"]
            per_shard = [s["partitions"].get(pid, 0) for s in dp.stats()["shards"]]
            assert per_shard == [sum(placement.shard_of(pid, k) == i for k in rows) for i in range(shards)]
            if dst:
                dp.save_checkpoint(tmp_path / dst)


def _other_rows() -> dict:
    dp.kv_batch_put(["o1", "o2"], "other", {"f32": torch.ones(2, 3)}, tags=[{"o": 1}, {"o": 2}])
    return capture(["other"])


DAMAGE = [
    "flip shard-0.bin",
    "flip shard-1.bin",
    "truncate shard-1.bin",
    "flip index.msgpack",
    "flip shard-0.msgpack",
    "flip manifest.json",
    "remove shard-0.bin",
    "truncate index.msgpack",
]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_loads_nothing(kv, pid, tmp_path, damage):
    _fill(pid)
    dp.save_checkpoint(tmp_path / "c")
    clear_all()
    untouched = _other_rows()
    used = [(s["bytes_used"], s["bytes_reserved"]) for s in dp.stats()["shards"]]
    how, name = damage.split()
    path = tmp_path / "c" / name
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 3]))
    else:
        path.unlink()
    expected = dp.CheckpointNotFoundError if how == "remove" else dp.CheckpointError
    with pytest.raises(expected) as err:
        dp.load_checkpoint(tmp_path / "c")
    assert name in str(err.value) and err.value.path.endswith(name)
    assert capture(["other"]) == untouched and pid not in dp.kv_list()
    assert [(s["bytes_used"], s["bytes_reserved"]) for s in dp.stats()["shards"]] == used  # nothing held


def test_partitions_of_the_same_names_are_refused_unless_overwrite(kv, pid, tmp_path):
    from dataplane.client.sharding import HashPlacement

    on = HashPlacement(2).shard_of  # "a" and "b" on one shard, "c" on the other
    a, b = [k for k in (f"k{i}" for i in range(64)) if on(pid, k) == 0][:2]
    c = next(k for k in (f"k{i}" for i in range(64)) if on(pid, k) == 1)
    dp.kv_batch_put([a, b], pid, {"f32": torch.zeros(2, 3)}, tags=[{"v": 0}, {"v": 0}])
    dp.next_batch(pid, "reward", 1, ["f32"])
    saved = capture([pid])
    dp.save_checkpoint(tmp_path / "c")
    dp.kv_batch_put([a, c], pid, {"f32": torch.ones(2, 3)}, tags=[{"v": 1}, {"v": 1}])
    changed, progress = capture([pid]), dp.consumption(pid, "reward")
    with pytest.raises(dp.CheckpointError, match=pid) as err:
        dp.load_checkpoint(tmp_path / "c")
    assert "overwrite=True" in str(err.value)
    assert capture([pid]) == changed and dp.consumption(pid, "reward") == progress  # nothing changed
    dp.load_checkpoint(tmp_path / "c", overwrite=True)
    assert capture([pid]) == saved and dp.consumption(pid, "reward")["consumed"] == 1
    # replaced whole on every shard: c (written after the save, on a shard the checkpoint has no row
    # of this partition on) is gone too
    assert [s["partitions"].get(pid, 0) for s in dp.stats()["shards"]] == [2, 0]
    with pytest.raises(dp.KeyNotFoundError):
        dp.kv_batch_get([c], pid)


def test_loaded_rows_count_in_their_partition_and_clear(kv, pid, tmp_path):
    """A load's rows count in their partition's bytes, as a put's do, and a clear frees them (after a
    load, kv_clear failed on the shard: the loaded rows had no partition to count in)."""

    def partition_bytes() -> list[int]:
        return [s["partition_bytes"].get(pid, 0) for s in dp.stats()["shards"]]

    keys = [f"k{i}" for i in range(8)]
    dp.kv_batch_put(keys, pid, {"f32": torch.ones(8, 5), "s": [str(i) for i in range(8)]})
    put = partition_bytes()
    dp.save_checkpoint(tmp_path / "c")
    dp.load_checkpoint(tmp_path / "c", overwrite=True)  # replaces the partition: its old rows are freed
    assert partition_bytes() == put and sum(put) > 0
    dp.kv_clear(keys[:3], pid)
    dp.kv_clear(keys[3:], pid)
    assert partition_bytes() == [0, 0] and sum(s["bytes_used"] for s in dp.stats()["shards"]) == 0


def test_save_replaces_the_previous_checkpoint_atomically(kv, pid, tmp_path):
    target = tmp_path / "c"
    dp.kv_batch_put(["a"], pid, {"f32": torch.zeros(1, 3)})
    dp.save_checkpoint(target, metadata={"step": 1})
    (target / "metadata.json").write_text("{}")  # a caller's file beside ours: replaced with the rest
    dp.kv_batch_put(["b"], pid, {"f32": torch.ones(1, 3)})
    second = capture([pid])
    dp.save_checkpoint(target, metadata={"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["c"] and not (target / "metadata.json").exists()
    clear_all()
    assert dp.load_checkpoint(target).metadata == {"step": 2} and capture([pid]) == second


def test_an_interrupted_swap_is_rolled_back(kv, pid, tmp_path):
    target = tmp_path / "c"
    dp.kv_batch_put(["a"], pid, {"f32": torch.zeros(1, 3)})
    first = capture([pid])
    dp.save_checkpoint(target, metadata={"step": 1})
    # what a save killed between its two renames leaves: the previous checkpoint at .old, the new
    # one (here: half written) at .tmp, nothing at the path itself
    os.rename(target, tmp_path / "c.old")
    (tmp_path / "c.tmp").mkdir()
    (tmp_path / "c.tmp" / "shard-0.bin").write_bytes(b"partial")
    clear_all()
    assert dp.load_checkpoint(target).metadata == {"step": 1} and capture([pid]) == first
    assert (target / "manifest.json").exists() and not (tmp_path / "c.old").exists()
    dp.save_checkpoint(target, metadata={"step": 2})  # the next save clears the stale .tmp
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(kv, pid, tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    dp.kv_batch_put(["a"], pid, {"f32": torch.zeros(1, 3)})
    with pytest.raises(dp.CheckpointError, match="not a checkpoint"):
        dp.save_checkpoint(target)
    assert (target / "notes.txt").read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["mine"]
    with pytest.raises(dp.CheckpointNotFoundError, match="manifest.json"):
        dp.load_checkpoint(target)
    with pytest.raises(TypeError, match="JSON"):
        dp.save_checkpoint(tmp_path / "x", metadata={"t": torch.zeros(1)})


def test_driver_bytes_do_not_grow_with_the_payload(kv, pid, tmp_path):
    keys = [f"k{i}" for i in range(64)]
    infos = []
    for width in (16, 65536):  # 64 B and 256 KiB per row
        clear_all()
        dp.kv_batch_put(keys, pid, {"x": torch.zeros(64, width)}, tags=[{"i": i} for i in range(64)])
        infos.append(dp.save_checkpoint(tmp_path / f"w{width}"))
    small, large = infos
    assert large.data_bytes > 1000 * small.data_bytes // 2
    assert large.driver_bytes < small.driver_bytes + 256  # the same metadata, a few more digits


def test_a_checkpoint_larger_than_the_store_loads_nothing(kv, pid, tmp_path):
    from .conftest import own_store

    dp.kv_batch_put([f"k{i}" for i in range(8)], pid, {"f32": torch.ones(8, 65536)})  # 2 MiB
    dp.save_checkpoint(tmp_path / "c")
    with own_store("t-ckpt-small", num_shards=2, capacity_bytes=1 << 20):  # 512 KiB a shard
        dp.kv_batch_put(["x"], "other", {"f32": torch.ones(1, 3)})
        with pytest.raises(dp.StoreFullError, match="nothing was loaded"):
            dp.load_checkpoint(tmp_path / "c")
        assert list(dp.kv_list()) == ["other"]
        assert all(s["bytes_reserved"] == 0 for s in dp.stats()["shards"])
