"""``dataplane.tq``: TransferQueue 0.1.11's module API, client, layouts and attach, on this store."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
import dataplane.tq as tq
from dataplane.client import stream_ops
from dataplane.errors import CheckpointError

pytestmark = pytest.mark.ray

CONF = {
    "controller": {"polling_mode": True},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"num_data_storage_units": 2, "total_storage_size": 200},
    },
    "metrics": {"enabled": False},
}


@pytest.fixture(scope="module")
def store(ray_cluster):
    dp.close()
    yield tq.init(CONF)
    tq.close()


@pytest.fixture
def attached(store):
    if not dp.is_initialized():
        tq.init(CONF)
    yield store


def rows(value) -> list:
    return [t.tolist() for t in value.unbind()]


def test_init_honours_what_maps_and_names_what_it_ignores(ray_cluster, caplog):
    dp.close()
    with caplog.at_level(logging.WARNING, logger="dataplane.tq"):
        got = tq.init(config=CONF)
    try:
        assert got["store"] == {"num_shards": 2} and got["polling_mode"] is True
        assert dp.init().num_shards == 2
        warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(warned) == 1 and "backend.SimpleStorage.total_storage_size" in warned[0]
        assert "storage_backend" not in warned[0]  # the default backend needs no warning
    finally:
        tq.close()
    with pytest.raises(TypeError, match="dict or an OmegaConf config"):
        tq.init(["not", "a", "config"])


def test_kv_calls_with_transferqueue_keywords(attached, pid):
    td = TensorDict({"prompt": torch.arange(6).view(2, 3), "text": ["a", "b"]}, batch_size=[2])
    meta = tq.kv_batch_put(keys=["k0", "k1"], partition_id=pid, fields=td, tags=[{"s": 1}, {"s": 2}])
    assert isinstance(meta, tq.KVBatchMeta) and isinstance(meta, dp.KVBatchMeta)
    assert meta.fields == ["prompt", "text"]
    one = tq.kv_put(key="k2", partition_id=pid, fields={"prompt": torch.arange(4)}, tag={"s": 3})
    assert one.keys == ["k2"] and one.tags == [{"s": 3}]
    tq.kv_put(key="k2", partition_id=pid, tag={"t": 1})  # tag only
    assert tq.kv_list(partition_id=pid)[pid]["k2"] == {"s": 3, "t": 1}
    got = tq.kv_batch_get(keys=["k0", "k1"], partition_id=pid, select_fields="prompt")
    assert list(got.keys()) == ["prompt"] and rows(got["prompt"]) == [[0, 1, 2], [3, 4, 5]]
    both = tq.kv_batch_get(keys=["k1", "k2"], partition_id=pid)  # the fields both hold
    assert list(both.keys()) == ["prompt"] and rows(both["prompt"]) == [[3, 4, 5], [0, 1, 2, 3]]
    by_meta = tq.kv_batch_get_by_meta(meta=meta, select_fields=["text"])
    assert by_meta.get("text").tolist() == ["a", "b"]
    tq.kv_clear(keys=["k0", "nope"], partition_id=pid)
    assert sorted(tq.kv_list(pid)[pid]) == ["k1", "k2"]


def test_reads_are_jagged_like_transferqueue_or_dense_on_request(attached, pid):
    """Same-length rows come back jagged (verl calls .offsets() on them); [B] fields stay dense."""
    td = TensorDict({"ids": torch.arange(6).view(2, 3), "score": torch.tensor([0.5, 1.5])}, [2])
    tq.kv_batch_put(["a", "b"], pid, td)
    got = tq.kv_batch_get(["a", "b"], pid)
    ids = got["ids"]
    assert ids.is_nested and ids.layout == torch.jagged
    assert ids.offsets().tolist() == [0, 3, 6] and ids.values().tolist() == list(range(6))
    assert ids.to_padded_tensor(-1).shape == (2, 3)  # the right width: its bounds are set
    assert not got["score"].is_nested and got["score"].tolist() == [0.5, 1.5]
    dense = tq.kv_batch_get(["a", "b"], pid, layout="dense")
    assert not dense["ids"].is_nested and dense["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert dp.kv_batch_get(["a", "b"], pid)["ids"].is_nested is False  # dp keeps its layout
    with pytest.raises(ValueError, match="layout must be one of"):
        tq.kv_batch_get(["a"], pid, layout="padded")


def test_transferqueue_error_contract(attached, pid):
    tq.kv_put("a", pid, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(["a", "missing"], pid)
    with pytest.raises(tq.StorageKeyNotFoundError, match="missing"):
        tq.kv_batch_get(["missing"], pid)
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(["a"], "no-such-partition")
    meta = tq.kv_batch_put(["b"], pid, TensorDict({"x": torch.zeros(1, 2)}, [1]))
    with pytest.raises(ValueError, match="select_fields entry 'nope' not found"):
        tq.kv_batch_get_by_meta(meta, select_fields=["x", "nope"])
    with pytest.raises(ValueError, match="at least one parameter"):
        tq.kv_put("c", pid)
    with pytest.raises(ValueError, match="at least one parameter"):
        tq.kv_batch_put(["c"], pid)
    with pytest.raises(ValueError, match="nested tensor"):
        tq.kv_put("c", pid, {"x": torch.nested.as_nested_tensor([torch.ones(2)], layout=torch.jagged)})
    with pytest.raises(NotImplementedError, match="data_parser"):
        tq.kv_put("c", pid, {"x": torch.zeros(2)}, data_parser=lambda d: d)
    with pytest.raises(NotImplementedError, match="data_parser"):
        tq.get_client().put(TensorDict({"x": torch.zeros(1)}, [1]), partition_id=pid, data_parser=dict)
    assert "c" not in tq.kv_list(pid)[pid]


def test_async_variants(attached, pid):
    async def main():
        await tq.async_kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 2)}, [2]))
        await tq.async_kv_put("c", pid, {"x": torch.ones(3)})
        got = await tq.async_kv_batch_get(["a", "c"], pid, select_fields=["x"])
        listed = await tq.async_kv_list(pid)
        meta = tq.KVBatchMeta(keys=["a"], partition_id=pid, fields="x")
        by_meta = await tq.async_kv_batch_get_by_meta(meta, layout="dense")
        await tq.async_kv_clear(["a", "b", "c"], pid)
        return got, listed, by_meta, await tq.async_kv_list(pid)

    got, listed, by_meta, after = asyncio.run(main())
    assert rows(got["x"]) == [[1.0, 1.0], [1.0, 1.0, 1.0]]
    assert sorted(listed[pid]) == ["a", "b", "c"] and by_meta["x"].tolist() == [[1.0, 1.0]]
    assert after == {pid: {}} or after == {}


def test_numpy_byte_strings_and_objects_without_pickle(attached, pid):
    """A TensorDict keeps numpy byte-string / object arrays as NonTensorData: one value per row."""
    assert not dp.config.env_flag("DATAPLANE_ALLOW_PICKLE")
    td = TensorDict(
        {
            "bs": np.array([b"bs_0", b"bs_1", b"x"], dtype="|S10"),
            "obj": np.array(["o0", "o1", "o2"], dtype=object),
            "f": np.arange(6.0).reshape(3, 2),
        },
        batch_size=3,
    )
    tq.get_client().put(td, partition_id=pid)
    tq.kv_batch_put(["k0", "k1", "k2"], pid, td)
    got = tq.kv_batch_get(["k0", "k1", "k2"], pid)
    assert got.get("bs").tolist() == [b"bs_0", b"bs_1", b"x"]
    assert got.get("obj").tolist() == ["o0", "o1", "o2"]
    assert rows(got["f"]) == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_controller_actor_answers_transferqueue_introspection(attached, pid):
    import ray

    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.zeros(2, 2)}, [2]), tags=[{"i": 0}, {"i": 1}])
    tq.kv_batch_put(["b"], pid, TensorDict({"y": torch.ones(1)}, [1]))
    controller = ray.get_actor("TransferQueueController")  # in the caller's namespace
    assert ray.get_actor("TransferQueueController", namespace="transfer_queue")  # and TransferQueue's
    assert pid in ray.get(controller.list_partitions.remote())
    snap = ray.get(controller.get_partition_snapshot.remote(pid))
    a, b = snap.keys_mapping["a"], snap.keys_mapping["b"]
    assert {a, b} == snap.global_indexes and b == a + 1 and snap.custom_meta[b] == {"i": 1}
    assert snap.production_status[a, snap.field_name_mapping["x"]] == 1
    assert snap.production_status[a, snap.field_name_mapping["y"]] == 0
    assert snap.production_status[b, snap.field_name_mapping["y"]] == 1
    # both actors number keys alike: the one in TransferQueue's namespace hands the indexes out
    primary = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    assert ray.get(primary.get_partition_snapshot.remote(pid)).keys_mapping == snap.keys_mapping
    ray.get(controller.clear_partition.remote(pid))
    assert tq.kv_list(pid) == {}


def test_low_level_client_streams(attached, pid, monkeypatch):
    client = tq.get_client()
    data = TensorDict({"prompt": torch.arange(8).view(4, 2)}, [4])
    meta = client.put(data, partition_id=pid)  # new rows
    assert isinstance(meta, tq.BatchMeta) and meta.size == 4 and meta.field_names == ["prompt"]
    assert meta.is_ready and all(isinstance(g, int) for g in meta.global_indexes)
    assert meta.global_indexes == list(range(meta.global_indexes[0], meta.global_indexes[0] + 4))
    assert not client.check_production_status(["prompt", "response"], pid)
    client.put(TensorDict({"response": torch.ones(4, 3)}, [4]), metadata=meta)
    assert client.check_production_status(["prompt", "response"], pid)
    first = client.get_meta(["prompt", "response"], 3, pid, task_name="train")
    assert first.size == 3 and first.is_ready and first.field_names == ["prompt", "response"]
    assert set(first.global_indexes) <= set(meta.global_indexes)
    assert rows(client.get_data(first)["response"]) == [[1.0] * 3] * 3
    # polling mode (the module's config): too few ready rows give an empty meta at once
    empty = client.get_meta(["prompt", "response"], 3, pid, task_name="train")
    assert empty.size == 0 and empty.global_indexes == [] and not empty.is_ready
    monkeypatch.setattr(stream_ops, "CONSUMED_PAGE", 2)  # (the status asked for in pages of two keys)
    idx, status = client.get_consumption_status("train", pid)
    assert int(status.sum()) == 3 and sorted(idx.tolist()) == sorted(meta.global_indexes)
    assert not client.check_consumption_status("train", pid)
    rest = client.get_meta(["prompt"], 1, pid, task_name="train")
    assert rest.size == 1 and client.check_consumption_status("train", pid)
    assert client.reset_consumption(pid, "train") and not client.check_consumption_status("train", pid)
    everything = client.get_meta(["prompt"], 0, pid, mode="force_fetch")
    assert sorted(everything.global_indexes) == sorted(meta.global_indexes)
    fresh = client.get_meta(["z"], 2, pid, mode="insert")
    assert fresh.size == 2 and min(fresh.global_indexes) > max(meta.global_indexes)
    assert client.get_data(tq.BatchMeta.empty()).batch_size == torch.Size([0])
    client.clear_partition(pid)
    assert pid not in client.get_partition_list()


def test_keys_and_global_indexes_translate_both_ways(attached, pid):
    client = tq.get_client()
    tq.kv_batch_put(["a", "b", "c"], pid, TensorDict({"x": torch.arange(3)}, [3]), tags=[{"t": 0}, {}, {}])
    meta = client.kv_retrieve_meta(keys=["c", "a"], partition_id=pid, create=False)
    assert meta.partition_ids == [pid, pid] and meta.field_names == ["x"] and meta.is_ready
    assert meta.custom_meta == [{}, {"t": 0}] and meta.keys == ["c", "a"]
    assert client.kv_retrieve_keys(global_indexes=meta.global_indexes, partition_id=pid) == ["c", "a"]
    assert client.kv_retrieve_keys(meta.global_indexes[0], pid) == ["c"]
    with pytest.raises(tq.StorageKeyNotFoundError, match="nope"):  # TransferQueue drops it silently
        client.kv_retrieve_meta(["a", "nope"], pid)
    with pytest.raises(RuntimeError, match="no corresponding keys"):
        client.kv_retrieve_keys([10**9], pid)
    with pytest.raises(TypeError):
        client.kv_retrieve_keys(["a"], pid)
    created = client.kv_retrieve_meta(["new"], pid, create=True)
    assert created.size == 1 and not created.is_ready and created.global_indexes[0] > max(meta.global_indexes)
    # tags of a meta go back with set_custom_meta, merged into the stored ones
    meta.update_custom_meta([{"u": 1}, {"u": 2}])
    client.set_custom_meta(meta)
    assert tq.kv_list(pid)[pid]["a"] == {"t": 0, "u": 2}

    async def main():
        m = await client.async_kv_retrieve_meta(keys="b", partition_id=pid)
        return m, await client.async_kv_retrieve_keys(global_indexes=m.global_indexes, partition_id=pid)

    m, keys = asyncio.run(main())
    assert keys == ["b"] and m.keys == ["b"]


def test_client_has_transferqueues_public_methods_and_signatures(attached, pid):
    """Each async twin takes TransferQueue's parameters (``socket`` included where it has one)."""
    client = tq.get_client()
    expected = {
        "async_get_meta": [
            "data_fields",
            "batch_size",
            "partition_id",
            "mode",
            "task_name",
            "sampling_config",
        ],
        "async_put": ["data", "metadata", "partition_id", "data_parser"],
        "async_reset_consumption": ["partition_id", "task_name", "socket"],
        "async_kv_retrieve_meta": ["keys", "partition_id", "create", "socket"],
        "async_kv_retrieve_keys": ["global_indexes", "partition_id", "socket"],
        "async_get_consumption_status": ["task_name", "partition_id", "socket"],
        "async_get_production_status": ["data_fields", "partition_id", "socket"],
        "async_get_partition_list": ["socket"],
        "async_set_custom_meta": ["metadata", "socket"],
        "async_kv_list": ["partition_id", "socket"],
        "put": ["data", "metadata", "partition_id", "data_parser"],
        "kv_retrieve_meta": ["keys", "partition_id", "create"],
        "kv_retrieve_keys": ["global_indexes", "partition_id"],
        "kv_list": ["partition_id"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(client, name)).parameters)[: len(params)] == params, name
    client.put(TensorDict({"x": torch.ones(2, 1)}, [2]), partition_id=pid)

    async def main():
        await client.async_reset_consumption(pid, socket=None)
        parts = await client.async_get_partition_list()
        idx, cons = await client.async_get_consumption_status("t", pid)
        _, prod = await client.async_get_production_status(["x"], pid)
        return parts, idx, cons, prod

    parts, idx, cons, prod = asyncio.run(main())
    assert pid in parts and len(idx) == 2 and cons.tolist() == [0, 0] and prod.tolist() == [[1], [1]]


def test_transferqueue_samplers_choose_in_get_meta(attached, pid):
    """GRPOGroupNSampler (consecutive indexes form a group) runs in this process; rank-aware
    fetches with the same dp_rank and batch_index get the same rows."""
    client = tq.get_client()
    client.put(TensorDict({"x": torch.arange(3)}, [3]), partition_id=pid)  # indexes g..g+2
    client.put(TensorDict({"x": torch.arange(2)}, [2]), partition_id=pid)  # g+3, g+4
    grpo = tq.GRPOGroupNSampler(n_samples_per_prompt=2)
    got = client.get_meta(["x"], 4, pid, task_name="g", sampling_config={"sampler": grpo})
    gis = sorted(got.global_indexes)
    assert got.size == 4 and gis[1] - gis[0] == 1 and gis[3] - gis[2] == 1
    rank = {"sampler": tq.RankAwareSampler(), "dp_rank": 0, "batch_index": 0}
    one = client.get_meta(["x"], 2, pid, task_name="r", sampling_config=dict(rank))
    two = client.get_meta(["x"], 2, pid, task_name="r", sampling_config=dict(rank))
    assert one.global_indexes == two.global_indexes and one.size == 2


def test_a_ray_process_that_never_called_init_attaches_by_itself(attached, pid):
    import ray

    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.arange(2)}, [2]))

    @ray.remote(num_cpus=0)
    def worker(pid: str):
        import dataplane.tq as wtq

        got = wtq.kv_batch_get(["a", "b"], pid)["x"].tolist()
        meta = wtq.get_client().get_meta(["x"], 5, pid, task_name="w")  # polling mode, shared
        return got, meta.size

    got, size = ray.get(worker.remote(pid), timeout=120)
    assert got == [0, 1] and size == 0


def test_machinery_without_an_equivalent_names_the_alternative():
    with pytest.raises(NotImplementedError, match="tq.init"):
        tq.TransferQueueController.remote()
    with pytest.raises(NotImplementedError, match="get_client"):
        tq.process_zmq_server_info(None)
    with pytest.raises(NotImplementedError, match="tq.save_checkpoint"):
        tq.TransferQueueClient().save_controller_checkpoint("/tmp/x")


def test_checkpoints_go_to_the_stores(attached, tmp_path, monkeypatch):
    import dataplane

    ckpt = tmp_path / "ckpt"
    calls = []

    def save(path, *, metadata=None):
        calls.append(("save", path, metadata))
        ckpt.mkdir()
        (ckpt / "manifest.json").write_text("{}")

    def load(path, *, overwrite=False):
        calls.append(("load", path, overwrite))

    monkeypatch.setattr(dataplane, "save_checkpoint", save)
    monkeypatch.setattr(dataplane, "load_checkpoint", load)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        tq.load_checkpoint(ckpt)
    tq.save_checkpoint(ckpt, include_storage=True, metadata={"global_steps": 3})
    tq.load_checkpoint(ckpt)
    # TransferQueue's load replaces its state: partitions of the same names are overwritten
    assert calls == [("save", str(ckpt), {"global_steps": 3}), ("load", str(ckpt), True)]
    # TransferQueue's metadata.json, next to the store's files, for tools that read it
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta == {"storage_saved": True, "user_metadata": {"global_steps": 3}}
    monkeypatch.setattr(tq.interface, "_TQ_CONTROLLER", None)
    with pytest.raises(RuntimeError, match="not initialized"):
        tq.save_checkpoint(ckpt)


def test_checkpoints_have_transferqueues_json_files_and_refuse_one_edited(attached, pid, tmp_path):
    """TransferQueue's metadata.json and simple_storage/storage_unit_info.json are in the checkpoint
    (its pickles are not); a storage_unit_info.json that does not describe the checkpoint's shards is
    refused, whatever the store's own number of shards."""
    ckpt = tmp_path / "ckpt"
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"ids": torch.arange(4).view(2, 2)}, [2]), [{"s": 1}, {}])
    tq.save_checkpoint(ckpt, metadata={"step": 4})
    assert json.loads((ckpt / "metadata.json").read_text()) == {
        "storage_saved": True,
        "user_metadata": {"step": 4},
    }
    info = ckpt / "simple_storage" / "storage_unit_info.json"
    units = json.loads(info.read_text())
    assert [(u["position"], u["storage_unit_id"]) for u in units] == [(0, "shard-0"), (1, "shard-1")]
    assert all((ckpt / name).is_file() for u in units for name in u["files"])
    assert not list(ckpt.rglob("*.pkl"))
    tq.save_checkpoint(ckpt)  # a second save replaces the first, its files too
    assert json.loads((ckpt / "metadata.json").read_text())["user_metadata"] == {}
    assert json.loads(info.read_text()) == units

    info.write_text(json.dumps([*units, {"position": 99, "storage_unit_id": "fake"}]))
    with pytest.raises(CheckpointError, match="count mismatch") as err:
        tq.load_checkpoint(ckpt)
    assert isinstance(err.value, ValueError) and err.value.path == str(info)
    info.write_text(json.dumps(units[::-1]))
    with pytest.raises(CheckpointError, match="does not describe"):
        tq.load_checkpoint(ckpt)
    info.write_text(json.dumps(units))

    # the file describes the checkpoint's shards, not the store's: one of three shards is checked
    # against its own manifest (the load itself places rows by the store's hashing:
    # test_checkpoint.py::test_restore_onto_other_numbers_of_shards)
    three = tmp_path / "three"
    (three / "simple_storage").mkdir(parents=True)
    (three / "manifest.json").write_text(json.dumps({"num_shards": 3}))
    (three / "simple_storage" / "storage_unit_info.json").write_text(
        json.dumps(tq.interface._storage_units(3))
    )
    tq.interface._check_storage_units(three)
    assert [u["storage_unit_id"] for u in tq.interface._storage_units(3)] == ["shard-0", "shard-1", "shard-2"]
    tq.load_checkpoint(ckpt)
    assert rows(tq.kv_batch_get(["a", "b"], pid)["ids"]) == [[0, 1], [2, 3]]
    assert tq.kv_list(pid)[pid] == {"a": {"s": 1}, "b": {}}


def test_selected_fields_no_key_holds_are_left_out_like_transferqueue(attached, pid):
    """verl's trainers ask for optional fields (values, ref_log_prob) that may not exist; a field
    only some keys hold is a real gap and raises."""
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 2)}, [2]))
    tq.kv_put("a", pid, {"y": torch.ones(2)})
    got = tq.kv_batch_get(["a", "b"], pid, select_fields=["x", "values"])
    assert list(got.keys()) == ["x"] and got.batch_size[0] == 2
    assert list(asyncio.run(tq.async_kv_batch_get(["a", "b"], pid, ["values"])).keys()) == []
    with pytest.raises(dp.FieldNotFoundError, match="'y'"):
        tq.kv_batch_get(["a", "b"], pid, select_fields=["x", "y"])


def test_init_in_a_ray_worker_attaches_and_never_starts_a_store(attached, pid):
    import ray

    @ray.remote(num_cpus=0)
    def worker(pid: str):
        import dataplane as wdp
        import dataplane.tq as wtq

        got = wtq.init({"controller": {"polling_mode": False}})  # attaches: the shared config wins
        wtq.kv_put("w", pid, {"x": torch.ones(1)})
        return got["polling_mode"], wdp.init().owned

    polling, owned = ray.get(worker.remote(pid), timeout=120)
    assert polling is True and owned is False and "w" in tq.kv_list(pid)[pid]


def test_global_indexes_are_never_reused(attached, pid):
    """A cleared key written again gets a new index; the old one names nothing any more, so a
    stale BatchMeta can never read another row's data through it."""
    client = tq.get_client()
    tq.kv_batch_put(["a"], pid, TensorDict({"x": torch.zeros(1)}, [1]))
    (old,) = client.kv_retrieve_meta(["a"], pid).global_indexes
    tq.kv_clear(["a"], pid)
    tq.kv_batch_put(["a"], pid, TensorDict({"x": torch.ones(1)}, [1]))
    (new,) = client.kv_retrieve_meta(["a"], pid).global_indexes
    assert new != old and client.kv_retrieve_keys([new], pid) == ["a"]
    with pytest.raises(tq.UnknownIndexError, match=str(old)):
        client.kv_retrieve_keys([old], pid)
    with pytest.raises(tq.UnknownIndexError, match="unknown"):
        client.get_data(tq.BatchMeta([old], [pid], {"x": {"dtype": torch.float32}}))


def test_a_fetch_outside_polling_mode_waits_with_a_deadline(ray_cluster, pid):
    """TransferQueue's controller waits 5 s then errors; so does get_meta here (timeout_s to tune)."""
    tq.close()
    tq.init({"controller": {"polling_mode": False}})
    try:
        client = tq.get_client()
        client.put(TensorDict({"x": torch.zeros(1)}, [1]), partition_id=pid)
        with pytest.raises(tq.GetMetaTimeoutError, match="within 0.2 s") as err:
            client.get_meta(["x"], 2, pid, task_name="t", sampling_config={"timeout_s": 0.2})
        assert isinstance(err.value, TimeoutError) and isinstance(err.value, RuntimeError)
        assert client.get_meta(["x"], 1, pid, task_name="t").size == 1
    finally:
        tq.close()


def test_streaming_dataset_with_transferqueues_constructor(attached, pid):
    """Batches of 4 for dp_rank 0, in micro-batches of 2; a finite partition ends the stream; the
    loader keeps the batches for replay and refuses worker processes (they cannot attach)."""
    tq.get_client().put(TensorDict({"ids": torch.arange(16).view(8, 2)}, [8]), partition_id=pid)
    ds = tq.StreamingDataset(
        None, 4, 2, ["ids"], pid, "train", dp_rank=0, should_check_consumption_status=True
    )
    loader = tq.StreamingDataLoader(ds)
    seen = [(td, meta) for td, meta in loader]
    assert [td.batch_size[0] for td, _ in seen] == [2, 2, 2, 2]
    assert all(isinstance(m, tq.BatchMeta) and m.size == 2 for _, m in seen)
    got = sorted(v for td, _ in seen for row in td["ids"].unbind() for v in row.tolist())
    assert got == list(range(16)) and len(loader.get_buffer()) == 2
    loader.reset()
    assert len(list(loader)) == 4  # replayed from the buffer
    with pytest.raises(NotImplementedError, match="num_workers=2"):
        tq.StreamingDataLoader(ds, num_workers=2)


def _row_dtypes(value) -> list:
    return [r.dtype for r in value.unbind()]


def test_a_field_put_with_other_dtypes_keeps_each_rows_dtype_like_transferqueue(attached, pid):
    """TransferQueue 0.1.11 (run side by side): a field put as float32 for one key and int64, then bool
    for others is accepted; a read of rows of one dtype returns that dtype, a read of several a strided
    nested tensor of the first requested row's dtype. The store keeps one type per column: the field
    holds empty rows in place of the others, whose real rows are in a hidden field."""
    tq.kv_put("f", pid, TensorDict({"mask": torch.ones(1, 3), "ids": torch.arange(3).view(1, 3)}, [1]))
    meta = tq.kv_batch_put(["i0", "i1"], pid, TensorDict({"mask": torch.ones(2, 3, dtype=torch.int64)}, [2]))
    assert meta.fields == ["mask"]  # the hidden field is not listed
    tq.kv_put("b", pid, {"mask": torch.tensor([True, False, True, True])})  # a row, of another length

    ints = tq.kv_batch_get(["i0", "i1"], pid)["mask"]
    assert ints.layout == torch.jagged and ints.dtype == torch.int64 and rows(ints) == [[1, 1, 1]] * 2
    assert tq.kv_batch_get(["b"], pid)["mask"].dtype == torch.bool
    mixed = tq.kv_batch_get(["f", "i0", "b"], pid, select_fields=["mask"])["mask"]
    assert mixed.is_nested and mixed.layout == torch.strided and _row_dtypes(mixed) == [torch.float32] * 3
    assert rows(mixed) == [[1.0] * 3, [1.0] * 3, [1.0, 0.0, 1.0, 1.0]]
    assert _row_dtypes(tq.kv_batch_get(["i1", "f"], pid, "mask")["mask"]) == [torch.int64] * 2
    both = tq.kv_batch_get(["i0", "f"], pid)  # without select_fields: the fields both keys hold
    assert list(both.keys()) == ["mask"] and rows(both["mask"]) == [[1, 1, 1]] * 2
    dense = tq.kv_batch_get(["i0", "i1"], pid, layout="dense")["mask"]
    assert not dense.is_nested and dense.dtype == torch.int64 and dense.shape == (2, 3)
    assert sorted(tq.kv_list(pid)[pid]) == ["b", "f", "i0", "i1"]

    # the low-level client: every row holds the field (ready for get_meta), and reads alike
    client = tq.get_client()
    got = client.get_meta(["mask"], 4, pid, task_name="t", mode="force_fetch")
    assert got.size == 4 and got.is_ready
    data = client.get_data(got)["mask"]
    first = tq.kv_batch_get(client.kv_retrieve_keys(got.global_indexes[:1], pid), pid, "mask")["mask"]
    assert _row_dtypes(data) == [first.dtype] * 4
    written = client.put(TensorDict({"mask": torch.zeros(2, 2, dtype=torch.float64)}, [2]), partition_id=pid)
    assert _row_dtypes(client.get_data(written)["mask"]) == [torch.float64] * 2

    # what dp.* reads: the stored float32 column, empty rows in place of the others
    assert [r.numel() for r in dp.kv_batch_get(["f", "i0"], pid, "mask")["mask"].unbind()] == [3, 0]
    # a partition cleared and written again decides its type afresh: int64 rows go in as they are
    tq.get_client().clear_partition(pid)
    tq.kv_batch_put(["n"], pid, TensorDict({"mask": torch.ones(1, 3, dtype=torch.int64)}, [1]))
    assert dp.kv_batch_get(["n"], pid)["mask"].dtype == torch.int64


def test_empty_rows_and_0_dim_fields_with_other_dtypes(attached, pid):
    """A real empty row is never taken for a placeholder of older rows (its put writes its hidden rows
    too); 0-dim rows keep one dtype, and another names the fix."""
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 2)}, [2]))
    tq.kv_batch_put(["c"], pid, TensorDict({"x": torch.ones(1, 2, dtype=torch.int32)}, [1]))
    tq.kv_batch_put(["c"], pid, TensorDict({"x": torch.ones(1, 0)}, [1]))  # c: a real, empty float32 row
    x = tq.kv_batch_get(["a", "c"], pid, "x")["x"]
    assert [tuple(r.shape) for r in x.unbind()] == [(2,), (0,)] and _row_dtypes(x) == [torch.float32] * 2
    assert tq.kv_batch_get(["c"], pid, "x")["x"].dtype == torch.float32
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"score": torch.tensor([0.5, 1.5])}, [2]))
    with pytest.raises(dp.SchemaError, match=r"'score'.*0-dim rows.*\.to\(torch\.float32\)"):
        tq.kv_batch_put(["c"], pid, TensorDict({"score": torch.tensor([1])}, [1]))
    with pytest.raises(dp.SchemaError, match="'x'"):  # dp.* keeps its schema check
        dp.kv_batch_put(["d"], pid, {"x": torch.ones(1, 2, dtype=torch.int64)})
    with pytest.raises(dp.SchemaMismatchError, match="'x'.*arrow"):  # a field keeps its kind
        tq.kv_batch_put(["d"], pid, {"x": ["a string"]})


def test_async_puts_and_reads_of_other_dtypes(attached, pid):
    async def main():
        await tq.async_kv_put("f", pid, {"m": torch.ones(2)})
        await tq.async_kv_batch_put(["i"], pid, TensorDict({"m": torch.ones(1, 2, dtype=torch.int8)}, [1]))
        one = await tq.async_kv_batch_get(["i"], pid)
        two = await tq.async_kv_batch_get(["i", "f"], pid, select_fields="m")
        return one["m"].dtype, _row_dtypes(two["m"])

    assert asyncio.run(main()) == (torch.int8, [torch.int8, torch.int8])
