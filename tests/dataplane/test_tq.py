"""``dataplane.tq``: TransferQueue's module API (names, keywords, error contract) on this store."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
import dataplane.tq as tq

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
    assert isinstance(meta, tq.KVBatchMeta) and meta.fields == ["prompt", "text"]
    one = tq.kv_put(key="k2", partition_id=pid, fields={"prompt": torch.arange(4)}, tag={"s": 3})
    assert one.keys == ["k2"] and one.tags == [{"s": 3}]
    tq.kv_put(key="k2", partition_id=pid, tag={"t": 1})  # tag only
    assert tq.kv_list(partition_id=pid)[pid]["k2"] == {"s": 3, "t": 1}
    got = tq.kv_batch_get(keys=["k0", "k1"], partition_id=pid, select_fields="prompt")
    assert list(got.keys()) == ["prompt"] and got["prompt"].tolist() == [[0, 1, 2], [3, 4, 5]]
    rows = tq.kv_batch_get(keys=["k1", "k2"], partition_id=pid)  # the fields both hold
    assert list(rows.keys()) == ["prompt"] and [t.tolist() for t in rows["prompt"].unbind()] == [
        [3, 4, 5],
        [0, 1, 2, 3],
    ]
    by_meta = tq.kv_batch_get_by_meta(meta=meta, select_fields=["text"])
    assert by_meta.get("text").tolist() == ["a", "b"]
    tq.kv_clear(keys=["k0", "nope"], partition_id=pid)
    assert sorted(tq.kv_list(pid)[pid]) == ["k1", "k2"]


def test_transferqueue_error_contract(attached, pid):
    tq.kv_put("a", pid, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(["a", "missing"], pid)
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(["a"], "no-such-partition")
    meta = tq.kv_batch_put(["b"], pid, TensorDict({"x": torch.zeros(1, 2)}, [1]))
    with pytest.raises(ValueError, match="select_fields entry 'nope' not found"):
        tq.kv_batch_get_by_meta(meta, select_fields=["x", "nope"])
    with pytest.raises(ValueError, match="at least one parameter"):
        tq.kv_put("c", pid)
    with pytest.raises(ValueError, match="at least one parameter"):
        tq.kv_batch_put(["c"], pid)
    with pytest.raises(NotImplementedError, match="data_parser"):
        tq.kv_put("c", pid, {"x": torch.zeros(2)}, data_parser=lambda d: d)
    assert "c" not in tq.kv_list(pid)[pid]


def test_async_variants(attached, pid):
    async def main():
        await tq.async_kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 2)}, [2]))
        await tq.async_kv_put("c", pid, {"x": torch.ones(3)})
        got = await tq.async_kv_batch_get(["a", "c"], pid, select_fields=["x"])
        listed = await tq.async_kv_list(pid)
        meta = tq.KVBatchMeta(keys=["a"], partition_id=pid, fields=["x"])
        by_meta = await tq.async_kv_batch_get_by_meta(meta)
        await tq.async_kv_clear(["a", "b", "c"], pid)
        return got, listed, by_meta, await tq.async_kv_list(pid)

    got, listed, by_meta, after = asyncio.run(main())
    assert [t.tolist() for t in got["x"].unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]
    assert sorted(listed[pid]) == ["a", "b", "c"] and by_meta["x"].tolist() == [[1.0, 1.0]]
    assert after == {pid: {}} or after == {}


def test_controller_actor_answers_transferqueue_introspection(attached, pid):
    import ray

    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.zeros(2, 2)}, [2]), tags=[{"i": 0}, {"i": 1}])
    tq.kv_batch_put(["b"], pid, TensorDict({"y": torch.ones(1)}, [1]))
    controller = ray.get_actor("TransferQueueController")  # in the caller's namespace
    assert ray.get_actor("TransferQueueController", namespace="transfer_queue")  # and TransferQueue's
    assert pid in ray.get(controller.list_partitions.remote())
    snap = ray.get(controller.get_partition_snapshot.remote(pid))
    a, b = snap.keys_mapping["a"], snap.keys_mapping["b"]
    assert {a, b} == snap.global_indexes and snap.custom_meta[b] == {"i": 1}
    assert snap.production_status[a, snap.field_name_mapping["x"]] == 1
    assert snap.production_status[a, snap.field_name_mapping["y"]] == 0
    assert snap.production_status[b, snap.field_name_mapping["y"]] == 1
    ray.get(controller.clear_partition.remote(pid))
    assert tq.kv_list(pid) == {}


def test_low_level_client_streams(attached, pid):
    client = tq.get_client()
    data = TensorDict({"prompt": torch.arange(8).view(4, 2)}, [4])
    meta = client.put(data, partition_id=pid)  # new rows under fresh keys
    assert meta.size == 4 and meta.fields == ["prompt"]
    assert not client.check_production_status(["prompt", "response"], pid)
    client.put(TensorDict({"response": torch.ones(4, 3)}, [4]), metadata=meta)
    assert client.check_production_status(["prompt", "response"], pid)
    first = client.get_meta(["prompt", "response"], 3, pid, task_name="train")
    assert first.size == 3 and client.get_data(first)["response"].shape == (3, 3)
    assert (
        first.is_ready and first.global_indexes == first.keys and first.field_names == ["prompt", "response"]
    )
    # polling mode (the module's config): too few ready rows give an empty meta at once
    empty = client.get_meta(["prompt", "response"], 3, pid, task_name="train")
    assert empty.size == 0 and empty.global_indexes == [] and not empty.is_ready
    idx, status = client.get_consumption_status("train", pid)
    assert int(status.sum()) == 3 and len(idx) == 4
    assert not client.check_consumption_status("train", pid)
    rest = client.get_meta(["prompt"], 1, pid, task_name="train")
    assert rest.size == 1 and client.check_consumption_status("train", pid)
    assert client.reset_consumption(pid, "train") and not client.check_consumption_status("train", pid)
    everything = client.get_meta(["prompt"], 0, pid, mode="force_fetch")
    assert sorted(everything.keys) == sorted(meta.keys)
    fresh = client.get_meta(["z"], 2, pid, mode="insert")
    assert fresh.size == 2 and client.get_data(KVBatchMeta.empty(pid)).batch_size == torch.Size([0])
    client.clear_partition(pid)
    assert pid not in client.get_partition_list()


KVBatchMeta = dp.KVBatchMeta
