"""KVBatchMeta: validation, the batch protocol, selection and serialization (pure: no Ray)."""

from __future__ import annotations

import copy
import pickle

import msgspec
import numpy as np
import pytest
import torch

from dataplane.errors import KeyNotFoundError
from dataplane.meta import KVBatchMeta, StoreInfo, check_partition


def make(n: int = 5, **kw) -> KVBatchMeta:
    keys = [f"k{i}" for i in range(n)]
    tags = [{"i": i} for i in range(n)]
    kw.setdefault("fields", ["a", "b"])
    kw.setdefault("extra_info", {"temperature": 0.7})
    return KVBatchMeta(keys, tags, "train", **kw)


# -- validation ---------------------------------------------------------------------------------


def test_defaults_give_one_empty_tag_per_key():
    meta = KVBatchMeta(["a", "b"], partition_id="p")
    assert meta.tags == [{}, {}]
    assert meta.fields is None and meta.extra_info == {}
    assert meta.size == len(meta) == 2


def test_duplicate_keys_rejected():
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        KVBatchMeta(["a", "b", "a"], partition_id="p")


def test_tags_length_mismatch_rejected():
    with pytest.raises(ValueError, match="2 keys but 1 tags"):
        KVBatchMeta(["a", "b"], [{}], "p")


def test_duplicate_fields_rejected():
    with pytest.raises(ValueError, match="duplicate field 'x'"):
        KVBatchMeta(["a"], None, "p", ["x", "y", "x"])


def test_keys_must_be_str():
    with pytest.raises(TypeError, match=r"keys\[1\] is a int"):
        KVBatchMeta(["a", 1], partition_id="p")


def test_partition_required():
    with pytest.raises(TypeError, match="partition_id must be a str"):
        KVBatchMeta(["a"])


def test_one_partition_check_names_its_caller():
    """``KVBatchMeta``, ``StreamingDataset`` and the client's operations share ``check_partition``: the
    message names who was given the bad value, and a str subclass (which msgpack cannot carry) is refused."""
    from dataplane.dataset import StreamingDataset

    with pytest.raises(TypeError, match=r"^KVBatchMeta: partition_id must be a str, not NoneType$"):
        KVBatchMeta(["a"])
    with pytest.raises(TypeError, match=r"^StreamingDataset: partition_id must be a str, not int$"):
        StreamingDataset(3, "t", 1, ["x"])  # type: ignore[arg-type]

    class Name(str):
        pass

    with pytest.raises(TypeError, match=r"^clear_partition: partition_id must be a str, not Name$"):
        check_partition(Name("p"), "clear_partition")
    assert check_partition("p", "anyone") == "p"


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2), np.zeros(2), np.float64(1.0), object()],
    ids=["tensor", "ndarray", "numpy-scalar", "object"],
)
def test_non_plain_values_raise_type_error_naming_where(bad):
    with pytest.raises(TypeError, match=r"tags\[1\] \(key 'b'\)\['x'\]"):
        KVBatchMeta(["a", "b"], [{}, {"x": bad}], "p")
    with pytest.raises(TypeError, match=r"extra_info\['deep'\]\[0\]"):
        KVBatchMeta(["a"], partition_id="p", extra_info={"deep": [bad]})


def test_tensor_as_key_or_tags_raises_type_error():
    with pytest.raises(TypeError):
        KVBatchMeta([torch.tensor(1)], partition_id="p")
    with pytest.raises(TypeError, match="tags must be a list"):
        KVBatchMeta(["a"], torch.zeros(1), "p")


def test_meta_copies_tags_and_extra_info():
    tag = {"score": [1, 2]}
    meta = KVBatchMeta(["a"], [tag], "p", extra_info={"x": [1]})
    tag["score"].append(3)
    assert meta.tags == [{"score": [1, 2]}]
    chunk = meta.chunk(1)[0]
    chunk.tags[0]["score"].append(9)
    assert meta.tags == [{"score": [1, 2]}]


# -- batch protocol -----------------------------------------------------------------------------


def test_protocol_flag():
    assert KVBatchMeta.allows_uneven_chunks is True


def test_chunk_uneven_keeps_order_and_metadata():
    meta = make(7)
    chunks = meta.chunk(3)
    assert [c.keys for c in chunks] == [["k0", "k1", "k2"], ["k3", "k4"], ["k5", "k6"]]
    assert [c.tags[0]["i"] for c in chunks] == [0, 3, 5]
    assert all(c.fields == ["a", "b"] and c.extra_info == {"temperature": 0.7} for c in chunks)
    assert all(c.partition_id == "train" for c in chunks)


def test_chunk_more_than_size_gives_empty_chunks():
    chunks = make(2).chunk(4)
    assert [c.size for c in chunks] == [1, 1, 0, 0]
    assert KVBatchMeta.concat(chunks) == make(2)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2"])
def test_chunk_rejects_bad_n(n):
    with pytest.raises(ValueError, match="n >= 1"):
        make(3).chunk(n)


def test_concat_round_trips_chunk():
    meta = make(10)
    assert KVBatchMeta.concat(meta.chunk(4)) == meta


def test_concat_unions_fields_in_first_seen_order():
    a = KVBatchMeta(["a"], None, "p", ["x", "y"])
    b = KVBatchMeta(["b"], None, "p", ["z", "x"])
    assert KVBatchMeta.concat([a, b]).fields == ["x", "y", "z"]
    c = KVBatchMeta(["c"], None, "p", None)
    assert KVBatchMeta.concat([a, c]).fields is None


def test_concat_rejects_mixed_partitions():
    with pytest.raises(ValueError, match="'p'.*'q'"):
        KVBatchMeta.concat([KVBatchMeta(["a"], partition_id="p"), KVBatchMeta(["b"], partition_id="q")])


def test_concat_merges_extra_info_and_rejects_conflicts():
    a = KVBatchMeta(["a"], partition_id="p", extra_info={"t": 1, "u": 2})
    b = KVBatchMeta(["b"], partition_id="p", extra_info={"t": 1, "v": 3})
    assert KVBatchMeta.concat([a, b]).extra_info == {"t": 1, "u": 2, "v": 3}
    c = KVBatchMeta(["c"], partition_id="p", extra_info={"t": 5})
    with pytest.raises(ValueError, match=r"extra_info\['t'\]"):
        KVBatchMeta.concat([a, c])


def test_concat_rejects_duplicate_keys_and_empty_list():
    a = KVBatchMeta(["a"], partition_id="p")
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        KVBatchMeta.concat([a, a])
    with pytest.raises(ValueError, match="at least one"):
        KVBatchMeta.concat([])


# -- selection ----------------------------------------------------------------------------------


def test_select_keys_keeps_given_order_and_tags():
    sub = make(5).select_keys(["k3", "k0"])
    assert sub.keys == ["k3", "k0"] and sub.tags == [{"i": 3}, {"i": 0}]


def test_select_keys_missing_names_key_and_partition():
    with pytest.raises(KeyNotFoundError, match="'nope'.*'train'") as info:
        make(3).select_keys(["k1", "nope"])
    assert info.value.key == "nope" and info.value.partition_id == "train"


def test_select_fields():
    meta = make(3)
    assert meta.select_fields(["b"]).fields == ["b"]
    assert meta.select_fields(["b"]).keys == meta.keys
    with pytest.raises(ValueError, match=r"\['c'\]"):
        meta.select_fields(["a", "c"])
    assert KVBatchMeta(["a"], partition_id="p").select_fields(["anything"]).fields == ["anything"]


def test_reorder_accepts_ints_numpy_and_tensors():
    assert make(4).reorder([3, 1, 0, 2]).keys == ["k3", "k1", "k0", "k2"]
    assert make(4).reorder(np.array([1, 0, 3, 2])).tags[0] == {"i": 1}
    assert make(4).reorder(torch.argsort(torch.tensor([4, 3, 2, 1]))).keys == ["k3", "k2", "k1", "k0"]


def test_reorder_is_in_place_as_in_verl_and_transferqueue():
    """verl trainers call ``batch.reorder(idx)`` and ignore the result (sequence balancing)."""
    meta = make(4)
    meta.reorder([3, 1, 0, 2])
    assert meta.keys == ["k3", "k1", "k0", "k2"] and [t["i"] for t in meta.tags] == [3, 1, 0, 2]
    assert meta.reorder([1, 0, 2, 3]) is meta and meta.keys[:2] == ["k1", "k3"]


@pytest.mark.parametrize("bad", [[0, 1, 2], [0, 0, 1, 2], [0, 1, 2, 4]])
def test_reorder_needs_a_permutation(bad):
    meta = make(4)
    with pytest.raises(ValueError, match="permutation of range"):
        meta.reorder(bad)
    assert meta == make(4)


def test_empty():
    meta = KVBatchMeta.empty("p")
    assert meta.size == 0 and meta.partition_id == "p"
    assert [c.size for c in meta.chunk(2)] == [0, 0]


# -- serialization ------------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip_through_msgpack():
    meta = make(3)
    wire = msgspec.msgpack.encode(meta.to_dict())
    assert KVBatchMeta.from_dict(msgspec.msgpack.decode(wire)) == meta


def test_msgspec_encodes_the_dataclass_directly_and_validates_on_decode():
    meta = make(3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=KVBatchMeta) == meta
    bad = msgspec.msgpack.encode({"keys": ["a", "a"], "partition_id": "p"})
    with pytest.raises(msgspec.ValidationError, match="duplicate key"):
        msgspec.msgpack.decode(bad, type=KVBatchMeta)


def test_pickle_and_deepcopy():
    meta = make(3)
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert copy.deepcopy(meta) == meta


def test_serialized_size_is_small():
    meta = KVBatchMeta([f"sample-{i}" for i in range(1024)], partition_id="train", fields=["a", "b"])
    assert len(msgspec.msgpack.encode(meta)) < 20 * 1024


def test_store_info_is_plain():
    info = StoreInfo("rlplane", 2, ("n0", "n1"), owned=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=StoreInfo) == info
