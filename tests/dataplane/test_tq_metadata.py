"""``dataplane.tq``'s pure parts: TransferQueue's metadata classes and samplers (no Ray)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
from dataplane.tq import BatchMeta, KVBatchMeta
from dataplane.tq.dataloader.streaming_dataset import chunk_batch_fn
from dataplane.tq.sampler import GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler, SequentialSampler
from dataplane.tq.sampler.seqlen_balanced_sampler import PartitionSizeError, get_seqlen_balanced_partitions


def test_kv_batch_meta_takes_transferqueues_constructor():
    empty = KVBatchMeta()
    assert empty.size == 0 and empty.keys == [] and empty.tags == [] and empty.partition_id is None
    meta = KVBatchMeta(
        keys=["a", "b"], partition_id=None, fields="input_ids", extra_info={"t": torch.ones(2)}
    )
    assert meta.fields == ["input_ids"] and meta.tags == [{}, {}] and isinstance(meta, dp.KVBatchMeta)
    tags = [{"data": [1, 2]}]
    kept = KVBatchMeta(keys=["k"], tags=tags)
    kept.tags[0]["data"].append(3)
    assert tags[0]["data"] == [1, 2]  # deep-copied, as TransferQueue does
    with pytest.raises(ValueError, match="keys and tags must have same length"):
        KVBatchMeta(keys=["a", "b"], tags=[{}])
    with pytest.raises(ValueError, match="Got duplicated keys: 'a'"):
        KVBatchMeta(keys=["a", "a"])
    with pytest.raises(ValueError, match="Got duplicated fields"):
        KVBatchMeta(keys=["a"], fields=["f", "f"])
    with pytest.raises(TypeError, match="keys must be str"):
        KVBatchMeta(keys=[1])


def test_kv_batch_meta_methods_follow_transferqueue():
    meta = KVBatchMeta([f"k{i}" for i in range(5)], [{"i": i} for i in range(5)], "p", ["f"], {"s": 1})
    parts = meta.chunk(chunks=2)
    assert [p.keys for p in parts] == [["k0", "k1", "k2"], ["k3", "k4"]] and parts[0].extra_info == {"s": 1}
    assert [p.size for p in KVBatchMeta(["a"]).chunk(3)] == [1, 0, 0]
    assert KVBatchMeta.concat(parts).keys == meta.keys
    assert KVBatchMeta.concat([]).size == 0 and KVBatchMeta.concat([KVBatchMeta(), parts[1]]).keys == [
        "k3",
        "k4",
    ]
    with pytest.raises(ValueError, match="Field names do not match"):
        KVBatchMeta.concat([KVBatchMeta(["a"], fields=["x"]), KVBatchMeta(["b"], fields=["y"])])
    with pytest.raises(ValueError, match="Partition do not match"):
        KVBatchMeta.concat([KVBatchMeta(["a"], partition_id="p"), KVBatchMeta(["b"], partition_id="q")])
    with pytest.raises(ValueError, match="conflicting"):
        KVBatchMeta.concat([KVBatchMeta(["a"], extra_info={"s": 1}), KVBatchMeta(["b"], extra_info={"s": 2})])
    assert meta.select_keys(["k3", "k0"]).tags == [{"i": 3}, {"i": 0}]
    with pytest.raises(RuntimeError, match="not found in current batch"):
        meta.select_keys(["k0", "nope"])
    with pytest.raises(ValueError, match="Contain duplicate keys"):
        meta.select_keys(["k0", "k0"])
    meta.reorder([4, 3, 2, 1, 0])
    assert meta.keys[0] == "k4" and meta.tags[0] == {"i": 4}
    with pytest.raises(ValueError, match="does not match"):
        meta.reorder([0, 1])
    with pytest.raises(ValueError, match="Contain duplicate indexes"):
        meta.reorder([0, 0, 1, 2, 3])


def test_store_kv_batch_meta_keeps_its_own_rules():
    """dp.KVBatchMeta is unchanged: a partition is required and only plain values ride along."""
    with pytest.raises(TypeError, match="partition_id must be a str"):
        dp.KVBatchMeta(["a"])
    with pytest.raises(TypeError, match="plain values"):
        dp.KVBatchMeta(["a"], partition_id="p", extra_info={"t": torch.ones(1)})
    assert [m.keys for m in dp.KVBatchMeta(["a", "b"], partition_id="p").chunk(2)] == [["a"], ["b"]]


def _batch(n: int = 4, **kwargs) -> BatchMeta:
    schema = {"x": {"dtype": torch.float32, "shape": (2,), "is_nested": False, "is_non_tensor": False}}
    return BatchMeta(list(range(n)), ["p"] * n, schema, np.ones(n, dtype=np.int8), **kwargs)


def test_batch_meta_rows_chunks_and_concat():
    meta = _batch(5, custom_meta=[{"i": i} for i in range(5)], _keys=[f"k{i}" for i in range(5)])
    assert BatchMeta().size == 0 and not BatchMeta().is_ready  # verl's tqbridge builds one bare
    parts = meta.chunk(chunks=2)
    assert [p.global_indexes for p in parts] == [[0, 1, 2], [3, 4]] and parts[1].keys == ["k3", "k4"]
    joined = BatchMeta.concat(parts)
    assert joined.global_indexes == meta.global_indexes and joined.keys == meta.keys and joined.is_ready
    picked = meta.select_samples([4, 0])
    assert picked.global_indexes == [4, 0] and picked.custom_meta == [{"i": 4}, {"i": 0}]
    assert picked.keys == ["k4", "k0"] and meta[-1].global_indexes == [4] and meta[1:3].size == 2
    with pytest.raises(ValueError, match="range"):
        meta.select_samples([7])
    only = meta.select_fields(["x", "missing"])
    assert only.field_names == ["x"] and only.extra_info is not meta.extra_info
    meta.reorder([1, 0, 2, 3, 4])
    assert meta.global_indexes[:2] == [1, 0] and meta.keys[:2] == ["k1", "k0"]
    with pytest.raises(ValueError, match="conflicting values"):
        BatchMeta.concat([_batch(1, extra_info={"s": 1}), _batch(1, extra_info={"s": 2})])
    with pytest.raises(ValueError, match="field_names mismatch"):
        BatchMeta.concat([_batch(1), BatchMeta([0], ["p"])])


def test_batch_meta_fields_union_and_pickle():
    meta = BatchMeta([3, 4], ["p", "p"])
    td = TensorDict(
        {
            "ids": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "s": ["a", "b"],
        },
        [2],
    )
    meta.add_fields(td)
    assert meta.is_ready and meta.field_names == ["ids", "s"] and meta.get_shapes("ids") == [(2,), (3,)]
    assert meta.field_schema["s"]["is_non_tensor"] and meta.samples[1].fields["ids"]["shape"] == (3,)
    other = BatchMeta([3, 4], ["p", "p"], {"y": {"dtype": None}}, [1, 0], custom_meta=[{"a": 1}, {}])
    both = meta.union(other)
    assert both.field_names == ["ids", "s", "y"] and both.production_status.tolist() == [1, 0]
    state = list(meta.__getstate__())
    status = BatchMeta.__slots__.index("production_status")
    state[status] = state[status].copy()
    state[status].flags.writeable = False  # what Ray's zero-copy deserialisation hands back
    restored = BatchMeta.__new__(BatchMeta)
    restored.__setstate__(tuple(state))
    assert restored.production_status.flags.writeable and restored.global_indexes == [3, 4]
    assert pickle.loads(pickle.dumps(meta)).field_names == meta.field_names


def test_samplers_keep_transferqueues_contracts():
    assert SequentialSampler()([5, 6, 7], 2) == ([5, 6], [5, 6])
    grpo = GRPOGroupNSampler(n_samples_per_prompt=3)
    assert grpo.sample([0, 1, 3, 4, 6, 7], 6) == ([], [])
    assert grpo.sample([0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6)[0] == [3, 4, 5, 9, 10, 11]
    with pytest.raises(ValueError, match="multiple of n_samples_per_prompt"):
        grpo.sample([0, 1, 2], 4)
    rank = RankAwareSampler()
    first = rank.sample([0, 1, 2], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
    again = rank.sample([2], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
    assert first == again == ([0, 1], [0, 1]) and rank.has_cached_result(
        "p", "t", {"dp_rank": 0, "batch_index": 0}
    )
    rank.clear_cache("p")
    assert rank._states == {}
    balanced = SeqlenBalancedSampler(dp_size=2)

    class Lengths:
        def get_custom_meta(self, indexes):
            return {i: {"total_lengths": [100, 100, 10, 10][i]} for i in indexes}

    kw = {"task_name": "t", "partition_id": "p", "batch_index": 0, "partition": Lengths()}
    r0, _ = balanced.sample([0, 1, 2, 3], 2, dp_rank=0, **kw)
    r1, _ = balanced.sample([], 2, dp_rank=1, **kw)  # cached for every rank by the first call
    assert sorted(r0 + r1) == [0, 1, 2, 3] and {len(r0), len(r1)} == {2}
    assert sum([100, 100, 10, 10][i] for i in r0) == 110


def test_seqlen_partitions_and_their_errors():
    parts = get_seqlen_balanced_partitions([100, 90, 50, 10, 5, 1], k_partitions=2, equal_size=True)
    assert sorted(sum(parts, [])) == list(range(6)) and all(len(p) == 3 for p in parts)
    assert sorted(map(len, get_seqlen_balanced_partitions([100, 10, 10, 10, 10], 2, equal_size=False))) == [
        1,
        4,
    ]
    with pytest.raises(PartitionSizeError, match="k_partitions"):
        get_seqlen_balanced_partitions([1], 3, equal_size=False)
    with pytest.raises(AssertionError):  # TransferQueue asserts there; the error is a ValueError too
        get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)


def test_chunk_batch_fn_keeps_nested_fields_nested():
    nested = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3), torch.ones(1)], layout=torch.jagged)
    td = TensorDict({"a": nested, "b": torch.arange(3)}, [3])
    chunks = chunk_batch_fn(td, BatchMeta([0, 1, 2], ["p"] * 3), micro_batch_size=2)
    assert [c[0].batch_size[0] for c in chunks] == [2, 1] and chunks[0][0]["a"].is_nested
    assert [c[1].global_indexes for c in chunks] == [[0, 1], [2]]
    with pytest.raises(ValueError, match="exceeds"):
        chunk_batch_fn(td, BatchMeta([0, 1, 2], ["p"] * 3), micro_batch_size=4)


def test_the_shared_config_carries_sampler_names_never_code():
    from dataplane.tq.client import sampler_from_spec, sampler_spec

    spec = sampler_spec(GRPOGroupNSampler(n_samples_per_prompt=4))
    assert spec == {"name": "GRPOGroupNSampler", "params": {"n_samples_per_prompt": 4}}
    assert sampler_from_spec(spec).n_samples_per_prompt == 4 and sampler_spec("SequentialSampler")

    class Mine(SequentialSampler):
        pass

    with pytest.raises(ValueError, match="never code"):
        sampler_spec(Mine())
    with pytest.raises(ValueError, match="Could not find sampler"):
        sampler_spec("NoSuchSampler")


def test_storage_unit_data_is_transferqueues_in_memory_table():
    from dataplane.tq.storage import StorageKeyNotFoundError, StorageUnitData
    from dataplane.tq.storage.simple_storage import StorageUnitData as same

    assert same is StorageUnitData
    table = StorageUnitData(storage_size=3)
    row = torch.tensor([1.0, 2.0])
    table.put_data({"x": [row, torch.ones(1)], "y": ["a", "b"]}, global_indexes=[7, 9])
    got = table.get_data(["y", "x"], [9, 7])
    assert got["y"] == ["b", "a"] and got["x"][1] is row  # kept as given, in the order asked
    assert table.active_key_count == 2 and not table.ssd_offload_enabled and table.ssd_active_bytes == 0
    table.put_data({"x": [row]}, global_indexes=[9])  # replacing a held index takes no room
    with pytest.raises(ValueError, match="Storage capacity exceeded"):
        table.put_data({"x": [row, row]}, global_indexes=[1, 2])
    # a length mismatch stores nothing (TransferQueue may have stored the fields before it)
    with pytest.raises(ValueError, match="'b'.*length mismatch"):
        table.put_data({"a": [1], "b": [1, 2]}, global_indexes=[1])
    assert "a" not in table.field_data and table.active_key_count == 2
    table.clear([7, 123])  # an index not held is ignored
    assert 7 not in table.field_data["x"] and 9 in table.field_data["x"] and table.active_key_count == 1
    table.put_data({"x": [row]}, global_indexes=[1])
    with pytest.raises(StorageKeyNotFoundError, match="global index 7 not found in field 'x'"):
        table.get_data(["x"], [7])
    with pytest.raises(ValueError, match="field 'z' not found"):
        table.get_data(["z"], [1])
    assert isinstance(StorageKeyNotFoundError("k", ""), KeyError)


def test_storage_unit_data_never_pickles(tmp_path):
    from dataplane.tq.storage import StorageUnitData

    table = StorageUnitData()
    table.put_data({"x": [1]}, [0])
    with pytest.raises(NotImplementedError, match="tq.save_checkpoint"):
        table.save_checkpoint(tmp_path / "su.pkl", "su-0")
    (tmp_path / "su.pkl").write_bytes(pickle.dumps({"field_data": {}}))
    with pytest.raises(NotImplementedError, match="never unpickles"):
        table.load_checkpoint(tmp_path / "su.pkl")
    table.close()
