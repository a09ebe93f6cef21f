"""The public KV API end to end, over both data paths (same-host shared memory and zmq frames)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import dataplane as dp

from .conftest import start_store, wait_for

pytestmark = pytest.mark.ray

NAME = "t-api"


@pytest.fixture(scope="module")
def store(ray_cluster):
    cfg, registry, handle = start_store(name=NAME, num_shards=2, rpc_timeout_s=20, warm_idle_s=0.5)
    yield cfg
    dp.close()
    handle.stop()


@pytest.fixture(params=["shm", "zmq"])
def kv(store, request):
    """This process attached to the module's store with the given transport."""
    dp.close()
    info = dp.init(name=NAME, transport=request.param, allow_pickle=True)
    assert info.transport == request.param
    assert not info.owned
    yield request.param
    dp.close()


def _keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _batch(n: int) -> TensorDict:
    g = torch.Generator().manual_seed(n)
    return TensorDict(
        {
            "f32": torch.randn(n, 3, generator=g),
            "bf16": torch.randn(n, 2, 2, generator=g).to(torch.bfloat16),
            "flag": torch.rand(n, generator=g) > 0.5,
            "i64": torch.arange(n, dtype=torch.int64) * 7,
        },
        [n],
    )


def test_every_column_kind_round_trips(kv, pid):
    n = 6
    td = _batch(n)
    lengths = [1, 3, 0, 2, 5, 4]
    rows = [torch.arange(k, dtype=torch.float32) for k in lengths]
    jag = torch.nested.nested_tensor(rows, layout=torch.jagged)
    fields = {
        **{k: td[k] for k in td.keys()},
        "jag": jag,
        "text": [f"row-{i}" * i for i in range(n)],
        "blob": [bytes([i]) * i for i in range(n)],
        "ints": [list(range(i)) for i in range(n)],
        "obj": [{"i": i, "s": {i}} for i in range(n)],
        "np": np.arange(n * 2, dtype=np.int32).reshape(n, 2),
    }
    meta = dp.kv_batch_put(_keys(n), pid, fields)
    assert meta.fields == list(fields)
    out = dp.kv_batch_get_by_meta(meta)
    for k in td.keys():
        assert out[k].dtype == td[k].dtype and torch.equal(out[k], td[k]), k
    for i, k in enumerate(lengths):
        assert torch.equal(out["jag"][i], torch.arange(k, dtype=torch.float32))
    assert out.get("text").tolist() == fields["text"]
    assert out.get("blob").tolist() == fields["blob"]
    assert out.get("ints").tolist() == fields["ints"]
    assert out.get("obj").tolist() == fields["obj"]
    assert torch.equal(out["np"], torch.from_numpy(fields["np"]))


def test_get_in_any_order_and_subset_of_fields(kv, pid):
    n = 40  # spread over both shards
    td = _batch(n)
    dp.kv_batch_put(_keys(n), pid, td)
    order = list(reversed(_keys(n)))[::3]
    out = dp.kv_batch_get(order, pid, select_fields=["f32", "i64"])
    assert set(out.keys()) == {"f32", "i64"}
    idx = [int(k[1:]) for k in order]
    assert torch.equal(out["f32"], td["f32"][idx])
    assert torch.equal(out["i64"], td["i64"][idx])


def test_new_fields_add_columns_and_tags_merge(kv, pid):
    keys = _keys(4)
    m1 = dp.kv_batch_put(keys, pid, {"prompt": torch.ones(4, 2)}, tags=[{"step": 1}] * 4)
    assert m1.fields == ["prompt"]
    m2 = dp.kv_batch_put(keys, pid, {"logp": torch.zeros(4)}, tags=[{"score": i} for i in range(4)])
    assert m2.fields == ["prompt", "logp"]
    assert m2.tags[2] == {"step": 1, "score": 2}
    m3 = dp.kv_batch_put(keys, pid, None, tags=[{"done": True}] * 4)  # tags only
    assert m3.fields == ["prompt", "logp"]
    out = dp.kv_batch_get_by_meta(m3)
    assert torch.equal(out["prompt"], torch.ones(4, 2)) and torch.equal(out["logp"], torch.zeros(4))
    listed = dp.kv_list(pid)
    assert listed == {pid: {k: {"step": 1, "score": i, "done": True} for i, k in enumerate(keys)}}
    assert pid in dp.kv_list()
    assert dp.kv_list("no-such-partition") == {}


def test_overwrite_replaces_values(kv, pid):
    dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2, 3)})
    dp.kv_batch_put(["b"], pid, {"x": torch.ones(1, 3)})
    out = dp.kv_batch_get(["a", "b"], pid)
    assert torch.equal(out["x"], torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_kv_put_one_sample(kv, pid):
    meta = dp.kv_put("s0", pid, {"tokens": torch.arange(5), "text": "hello"}, tag={"len": 5})
    assert meta.keys == ["s0"] and meta.tags == [{"len": 5}] and meta.fields == ["tokens", "text"]
    out = dp.kv_batch_get("s0", pid)
    assert out.batch_size == torch.Size([1])
    assert torch.equal(out["tokens"][0], torch.arange(5))
    assert out.get("text").tolist() == ["hello"]


def test_clear_keys_and_partition(kv, pid):
    keys = _keys(10)
    dp.kv_batch_put(keys, pid, {"x": torch.arange(10)})
    dp.kv_clear(keys[:3], pid)
    dp.kv_clear(["never-written"], pid)  # a no-op
    dp.kv_clear(["x"], "no-such-partition")  # a no-op
    with pytest.raises(dp.KeyNotFoundError):
        dp.kv_batch_get(keys[:1], pid)
    assert sorted(dp.kv_list(pid)[pid]) == sorted(keys[3:])
    # a cleared key written again starts empty: the old field is gone
    dp.kv_batch_put(keys[:1], pid, {"y": torch.ones(1)})
    with pytest.raises(dp.KeyNotFoundError, match="'x'"):
        dp.kv_batch_get(keys[:1], pid, select_fields=["x"])
    assert torch.equal(dp.kv_batch_get(keys[:1], pid)["y"], torch.ones(1))
    dp.clear_partition(pid)
    assert dp.kv_list(pid) == {}
    with pytest.raises(dp.PartitionNotFoundError):
        dp.kv_batch_get(keys[3:], pid)


def test_kv_list_pages_and_kv_iter_keys_walk_them(kv, pid):
    keys = _keys(10)
    dp.kv_batch_put(keys, pid, {"x": torch.arange(10)}, tags=[{"i": i} for i in range(10)])
    page = dp.kv_list(pid, limit=4)
    assert isinstance(page, dp.KVListPage) and page == {pid: {k: {"i": i} for i, k in enumerate(keys[:4])}}
    dp.kv_clear(keys[4:6], pid)  # cleared after the first page: left out of the next
    page = dp.kv_list(pid, limit=4, cursor=page.cursor)
    assert list(page[pid]) == keys[6:] and page.cursor is None
    assert [k for k, _ in dp.kv_iter_keys(pid, page_size=3)] == keys[:4] + keys[6:]
    assert dict(dp.kv_iter_keys(pid))[keys[9]] == {"i": 9}
    assert list(dp.kv_iter_keys("no-such-partition")) == [] and dp.kv_list("no-such", limit=2) == {}
    for bad in ({"limit": 0}, {"cursor": "1.1"}):
        with pytest.raises(dp.InvalidArgumentError):
            dp.kv_list(pid, **bad)
    with pytest.raises(dp.InvalidArgumentError, match="one partition"):
        dp.kv_list(None, limit=3)
    cursor = dp.kv_list(pid, limit=1).cursor
    dp.clear_partition(pid)
    dp.kv_batch_put(keys[:1], pid, {"x": torch.arange(1)})
    with pytest.raises(dp.PartitionNotFoundError, match="cleared since this listing began"):
        dp.kv_list(pid, limit=1, cursor=cursor)


def test_get_with_device(kv, pid):
    dp.kv_batch_put(["a"], pid, {"x": torch.ones(1, 2)})
    out = dp.kv_batch_get(["a"], pid, device="cpu")
    assert out["x"].device.type == "cpu"


def test_empty_get_and_put(kv, pid):
    assert dp.kv_batch_get([], pid).batch_size == torch.Size([0])
    assert dp.kv_batch_put([], pid, None).size == 0


def test_async_variants(kv, pid):
    async def scenario():
        keys = _keys(5)
        meta = await dp.async_kv_batch_put(keys, pid, {"x": torch.arange(5.0)}, tags=[{"t": 1}] * 5)
        m1 = await dp.async_kv_put("solo", pid, {"x": torch.tensor(9.0)})
        assert m1.fields == ["x"]
        got = await asyncio.gather(dp.async_kv_batch_get(keys, pid), dp.async_kv_batch_get_by_meta(meta))
        for td in got:
            assert torch.equal(td["x"], torch.arange(5.0))
        listed = await dp.async_kv_list(pid)
        assert set(listed[pid]) == {*keys, "solo"}
        await dp.async_kv_clear(keys[:2], pid)
        with pytest.raises(dp.KeyNotFoundError):
            await dp.async_kv_batch_get(keys[:2], pid)
        stats = await dp.async_stats()
        assert len(stats["shards"]) == 2
        await dp.async_clear_partition(pid)
        with pytest.raises(dp.PartitionNotFoundError):
            await dp.async_kv_batch_get(keys[2:], pid)

    asyncio.run(scenario())
    asyncio.run(scenario())  # a second event loop gets its own channels


def test_zero_copy_view_survives_clear(kv, pid):
    from dataplane.client.sharding import HashPlacement

    n = 64
    x = torch.arange(n * 4096, dtype=torch.float32).reshape(n, 4096)  # 1 MiB: a shared-memory segment
    keys = _keys(n)
    dp.kv_batch_put(keys, pid, {"x": x})
    # the keys of one shard, in write order, are one contiguous run of its segment: a true view
    pos = HashPlacement(2).group(pid, keys)[0]
    view = dp.kv_batch_get([keys[i] for i in pos], pid, copy=False)["x"]
    expected = x[torch.from_numpy(pos)].clone()
    assert torch.equal(view, expected)
    dp.clear_partition(pid)
    dp.kv_batch_put(keys, pid + "-2", {"x": torch.zeros(n, 4096)})  # would reuse recycled memory
    assert torch.equal(view, expected), "a zero-copy view changed after its keys were cleared"
    dp.clear_partition(pid + "-2")


def test_memory_given_back_after_clear(kv, pid):
    before = dp.stats(trim=True)
    n = 64
    dp.kv_batch_put(_keys(n), pid, {"x": torch.ones(n, 8192)})  # 2 MiB
    held = dp.stats()
    assert held["bytes_used"] - before["bytes_used"] >= n * 8192 * 4
    assert held["bytes_resident"] >= held["bytes_used"]
    for shard in held["shards"]:
        assert {"bytes_used", "bytes_resident", "pid", "node_id"} <= set(shard)
    dp.clear_partition(pid)
    after = dp.stats()
    assert after["bytes_used"] == before["bytes_used"]
    # warm segments are given back after warm_idle_s (0.5 s here)
    wait_for(
        lambda: dp.stats()["bytes_resident"] <= before["bytes_resident"],
        timeout=10,
        what="shards to give freed memory back",
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_put_and_get_to_device(kv, pid):
    x = torch.randn(8, 16, device="cuda")
    meta = dp.kv_batch_put([f"k{i}" for i in range(8)], pid, {"x": x})  # staged through pinned memory
    out = dp.kv_batch_get_by_meta(meta, device="cuda")
    assert out["x"].device.type == "cuda" and torch.equal(out["x"], x)
    assert dp.kv_batch_get_by_meta(meta)["x"].device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("non_blocking", [False, True])
def test_cuda_rows_go_to_shared_memory_and_back_in_one_copy_each_way(kv, pid, non_blocking):
    """Same host, shared memory: the put copies device -> the registered segment, the get the segment
    -> device (registered mappings: ``transport.pinning``); over zmq both are staged, and still exact."""
    from dataplane.transport.pinning import registry

    n = 16
    x = torch.randn(n, 64 << 10, device="cuda")  # 256 KiB a row: shared memory, not inline
    lengths = torch.randint(1, 300, (n,)).tolist()
    jag = torch.nested.nested_tensor([torch.randn(k, 4, device="cuda") for k in lengths], layout=torch.jagged)
    before = registry().stats()
    meta = dp.kv_batch_put(_keys(n), pid, {"x": x, "j": jag})
    order = _keys(n)[::-1]
    out = dp.kv_batch_get(order, pid, ["x", "j"], device="cuda", non_blocking=non_blocking)
    assert out["x"].is_cuda and torch.equal(out["x"], x.flip(0))
    assert out["j"].is_cuda and all(
        torch.equal(a, b) for a, b in zip(out["j"].unbind(), jag.unbind()[::-1], strict=True)
    )
    after = registry().stats()
    if kv == "shm":
        assert after["direct"] > before["direct"] and after["staged"] == before["staged"]
        assert after["pinned_bytes"] > 0
    assert meta.fields == ["x", "j"]


def test_writer_forgets_mappings_of_closed_segments(kv, pid):
    if kv != "shm":
        pytest.skip("mappings exist on the shared-memory path only")
    maps = dp.api.current_client().maps
    keys = _keys(64)
    for _ in range(4):
        dp.kv_batch_put(keys, pid, {"x": torch.ones(64, 4096)})  # 1 MiB: shared-memory segments
        dp.clear_partition(pid)
        dp.stats(trim=True)  # the shards close every freed segment
    dp.kv_batch_put(keys, pid, {"x": torch.ones(64, 4096)})
    live = sum(s["shm_files"] for s in dp.stats()["shards"])
    assert len(maps) <= live, f"the writer still maps {len(maps)} segments, {live} are alive"
    dp.clear_partition(pid)


def test_async_close_closes_the_sockets_its_loop_opened(store) -> None:
    """A real client: async calls open sockets on the loop, async_close (in a thread, with the
    sockets closed on their loop) drops them, and the next init attaches anew."""

    async def main() -> bool:
        await dp.async_init(name=NAME)
        await dp.async_kv_put("closing", "async-close", {"x": torch.ones(2)})
        await dp.async_close()
        return dp.is_initialized()

    dp.close()
    assert asyncio.run(main()) is False
    dp.init(name=NAME)
    try:
        assert "closing" in dp.kv_list("async-close")["async-close"]
        dp.kv_clear(["closing"], "async-close")
    finally:
        dp.close()
