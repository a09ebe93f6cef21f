"""The bridge contract: fetch, write-back on collect ranks only, passthroughs, async, tags."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
from tests.workers._bridge_workers import BridgeWorker
from workers import BridgeError
from workers.bridge import traffic

pytestmark = pytest.mark.ray

ROWS = 6


@pytest.fixture
def meta(store) -> dp.KVBatchMeta:
    """Six rows with fields x (int64) and w (float32) in a partition of their own, tagged."""
    pid = f"bridge-{uuid.uuid4().hex[:8]}"
    keys = [f"k{i}" for i in range(ROWS)]
    data = TensorDict({"x": torch.arange(ROWS), "w": torch.ones(ROWS, 3)}, [ROWS])
    dp.kv_batch_put(keys, pid, fields=data, tags=[{"i": i} for i in range(ROWS)])
    yield dp.KVBatchMeta(keys, [{"i": i} for i in range(ROWS)], pid, ["x", "w"], {"scale": 3})
    dp.clear_partition(pid)


def _stored(meta: dp.KVBatchMeta, field: str) -> torch.Tensor:
    return dp.kv_batch_get(meta.keys, meta.partition_id, [field])[field]


# ---- on a local worker object (rank 0 of 1), in this process ---------------------------------


def test_fetches_only_the_meta_fields_and_passes_extra_info(meta) -> None:
    out = BridgeWorker().seen(meta.select_fields(["x"]))
    assert out == {"tensors": ["x"], "extra": {"scale": 3}, "rows": ROWS}
    assert BridgeWorker().seen(meta)["tensors"] == ["w", "x"]


def test_writes_new_fields_back_and_keeps_tags(meta) -> None:
    out = BridgeWorker().add_one(meta)
    assert isinstance(out, dp.KVBatchMeta)
    assert out.keys == meta.keys and out.tags == meta.tags and out.partition_id == meta.partition_id
    assert out.fields == ["x", "w", "y"] and out.extra_info == meta.extra_info
    assert torch.equal(_stored(meta, "y"), torch.arange(ROWS) + 1)


def test_keyword_meta_is_bridged_too(meta) -> None:
    out = BridgeWorker().add_one(batch=meta)
    assert "y" in out.fields


def test_non_collect_rank_writes_nothing(meta) -> None:
    out = BridgeWorker(collect=False).double(meta)
    assert out == dp.KVBatchMeta.empty(meta.partition_id)
    with pytest.raises(dp.KeyNotFoundError):
        _stored(meta, "y2")


def test_metrics_pass_through_unchanged(meta) -> None:
    assert BridgeWorker().metrics(meta) == {"rows": ROWS, "sum": float(sum(range(ROWS)))}


def test_plain_data_runs_the_method_without_the_store(meta) -> None:
    before = traffic()
    td = TensorDict({"x": torch.arange(4)}, [4])
    out = BridgeWorker().add_one(td)
    assert isinstance(out, TensorDict) and torch.equal(out["y"], torch.arange(4) + 1)
    assert traffic() == before


def test_sync_calls_open_no_threads(meta) -> None:
    worker = BridgeWorker()
    worker.add_one(meta.select_fields(["x"]))  # first call: the client is already attached
    before = threading.active_count()
    for _ in range(3):
        worker.metrics(meta)
    assert threading.active_count() == before


def test_async_method(meta) -> None:
    out = asyncio.run(BridgeWorker().async_scale(meta))
    assert isinstance(out, dp.KVBatchMeta) and out.tags == meta.tags
    assert torch.equal(_stored(meta, "z"), torch.arange(ROWS).float() * 3)


def test_extra_info_may_not_hide_a_field(meta) -> None:
    clash = dp.KVBatchMeta(meta.keys, meta.tags, meta.partition_id, ["x"], {"x": 1})
    with pytest.raises(ValueError, match=r"extra_info\['x'\]"):
        BridgeWorker().seen(clash)


def test_wrong_batch_size_names_the_method(meta) -> None:
    with pytest.raises(BridgeError, match="wrong_size"):
        BridgeWorker().wrong_size(meta)


def test_stale_meta_is_one_short_error(meta) -> None:
    dp.kv_clear(meta.keys[:1], meta.partition_id)
    with pytest.raises(dp.StaleMetaError, match=r"add_one got a stale KVBatchMeta: key 'k0' is") as info:
        BridgeWorker().add_one(meta)
    assert isinstance(info.value, dp.KeyNotFoundError) and info.value.key == "k0"
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no store internals chained
    dp.clear_partition(meta.partition_id)
    with pytest.raises(dp.PartitionNotFoundError, match=rf"partition '{meta.partition_id}' was cleared"):
        BridgeWorker().add_one(meta)


def test_empty_meta_gives_an_empty_batch_without_a_store_read(store) -> None:
    before = traffic()["read_bytes"]
    empty = dp.KVBatchMeta([], partition_id="nowhere", extra_info={"scale": 2})
    assert BridgeWorker().seen(empty) == {"tensors": [], "extra": {"scale": 2}, "rows": 0}
    assert traffic()["read_bytes"] == before


# ---- through a real two-worker group -----------------------------------------------------------


def test_group_mesh_writes_from_the_collect_rank_only(pair, meta) -> None:
    out = pair.double(meta)
    assert out.keys == meta.keys and out.tags == meta.tags and "y2" in out.fields
    # rank 1 saw the same shard and computed x*2 + 1000, but must not have written it
    assert torch.equal(_stored(meta, "y2"), torch.arange(ROWS) * 2)


def test_group_dp_compute_writes_each_shard(pair, meta) -> None:
    out = pair.async_scale(meta)
    assert out.keys == meta.keys and out.tags == meta.tags
    assert _stored(meta, "rank").tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(_stored(meta, "z"), torch.arange(ROWS).float() * 3)


def test_group_one_to_all_writes_once(pair, meta) -> None:
    full, empty = pair.stamp(meta)
    assert full.keys == meta.keys and empty.size == 0
    assert _stored(meta, "stamp").tolist() == [0] * ROWS


def test_group_metrics_per_rank(pair, meta) -> None:
    assert pair.metrics(meta) == [{"rows": 3, "sum": 3.0}, {"rows": 3, "sum": 12.0}]


def test_group_error_reaches_the_driver(pair, meta) -> None:
    import pickle

    with pytest.raises(BridgeError, match=r"wrong_size returned a TensorDict of batch size 4 for a") as info:
        pair.wrong_size(meta)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)  # the message, not the args


def test_group_call_with_a_stale_meta_reports_one_line(pair, meta) -> None:
    from controlplane import WorkerCallError

    dp.clear_partition(meta.partition_id)
    with pytest.raises(WorkerCallError) as info:
        pair.add_one(meta)
    err = info.value
    assert isinstance(err, dp.StaleMetaError) and err.failed_ranks == [0, 1]
    assert str(err).startswith("BridgeWorker.add_one failed on ranks 0, 1 of 2; rank 0 raised StaleMetaError")
    assert "\n" not in str(err) and err.__cause__ is None  # the worker's traceback is not chained
    assert "pass the meta a put returned after the clear" in str(err)


# ---- @register alone bridges (verl's register wraps every method with the bridge) --------------


def test_register_alone_round_trips_a_meta_through_a_dp_group(pair, meta) -> None:
    out = pair.add_one(meta)  # only @register(DP_COMPUTE_PROTO) on the method
    assert isinstance(out, dp.KVBatchMeta) and out.keys == meta.keys and "y" in out.fields
    assert torch.equal(_stored(meta, "y"), torch.arange(ROWS) + 1)


def test_register_and_bridge_modes_cannot_disagree(pair, meta) -> None:
    """The bridge says DP_COMPUTE_PROTO (every rank writes), register says the mesh (rank 0 only):
    both ranks got all rows; rank 1's values would differ, and the old code let it write them."""
    out = pair.mismatched(meta)
    assert "m" in out.fields
    assert _stored(meta, "m").tolist() == list(range(ROWS))


def test_register_bridge_false_hands_over_the_meta(pair, meta) -> None:
    assert pair.raw(meta) == ["KVBatchMeta", 3, "KVBatchMeta", 3]


def test_non_tensor_outputs_are_kept(pair, meta) -> None:
    out = pair.decode(meta)
    stored = dp.kv_batch_get(meta.keys, meta.partition_id, ["text", "chat"])
    assert stored["text"].tolist() == [f"row {x}" for x in range(ROWS)]
    assert stored["chat"].tolist()[4] == [{"role": "user", "content": "4"}]
    # batch-level values go to extra_info
    assert out.extra_info == {"scale": 3, "temperature": 0.5}
    assert {"text", "chat"} <= set(out.fields)


def test_conflicting_batch_level_outputs_are_named(pair, meta) -> None:
    """Ranks that return different batch-level values cannot be merged into one meta (as in
    TransferQueue's concat); the rows are written, and the error names the entry."""
    with pytest.raises(ValueError, match=r"extra_info\['temperature'\] conflicts"):
        pair.decode(meta, vary=True)
    assert _stored(meta, "text").tolist()[0] == "row 0"


def test_local_non_tensor_output_and_passthrough_extra_info(meta) -> None:
    out = BridgeWorker().decode(meta)
    assert out.extra_info == {"scale": 3, "temperature": 0.5}
