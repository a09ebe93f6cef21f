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
