"""Shape belongs to the row, dtype to the column; gets over keys with different fields; error contracts.

Over both data paths (shared memory, and zmq frames where the shard assembles rows of several
segments itself), with rows small enough to travel inline and large enough for shared memory.
"""

from __future__ import annotations

import pytest
import torch

import dataplane as dp

from .conftest import start_store

pytestmark = pytest.mark.ray

NAME = "t-shapes"
BIG = 20_000  # int64 elements per row: 160 KB, above shm_min_bytes, so the put goes through shared memory


@pytest.fixture(scope="module")
def store(ray_cluster):
    cfg, registry, handle = start_store(name=NAME, num_shards=2, rpc_timeout_s=20)
    yield cfg
    dp.close()
    handle.stop()


@pytest.fixture(params=["shm", "zmq"])
def kv(store, request):
    dp.close()
    dp.init(name=NAME, transport=request.param)
    yield request.param
    dp.close()


@pytest.mark.parametrize("scale", [1, BIG], ids=["inline", "shared-memory"])
def test_rows_of_any_length_one_key_at_a_time(kv, pid, scale):
    # a streaming rollout: each response finishes with its own length, and is written alone
    rows = {f"s{n}": torch.arange(n * scale) for n in (3, 5, 1, 5)}
    for key, row in rows.items():
        dp.kv_put(key, pid, {"responses": row, "reward": torch.tensor(float(len(row)))})
    got = dp.kv_batch_get(list(rows), pid)
    assert got["responses"].is_nested  # lengths differ: jagged
    assert [t.tolist() for t in got["responses"].unbind()] == [r.tolist() for r in rows.values()]
    assert got["reward"].tolist() == [float(len(r)) for r in rows.values()]  # rows of one shape: dense
    same = dp.kv_batch_get(["s5"], pid)["responses"]
    assert not same.is_nested and same.shape == (1, 5 * scale)
    # rows of one length from different puts come back dense
    dp.kv_put("t5", pid, {"responses": torch.arange(5 * scale) + 1})
    dense = dp.kv_batch_get(["s5", "t5"], pid)["responses"]
    assert not dense.is_nested and dense.shape == (2, 5 * scale)
    assert torch.equal(dense[1], torch.arange(5 * scale) + 1)


def test_a_jagged_column_takes_later_rows_of_other_lengths(kv, pid):
    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(4)], layout=torch.jagged)
    dp.kv_batch_put(["a", "b"], pid, {"tok": nested})
    dp.kv_batch_put(["c"], pid, {"tok": torch.arange(7)[None]})  # a dense row of yet another length
    dp.kv_put("d", pid, {"tok": torch.arange(1)})
    got = dp.kv_batch_get(["d", "c", "b", "a"], pid)["tok"]
    assert [t.tolist() for t in got.unbind()] == [[0], list(range(7)), [0, 1, 2, 3], [0, 1]]


def test_rows_that_differ_beyond_their_first_dim(kv, pid):
    dp.kv_put("img0", pid, {"pix": torch.zeros(3, 4)})
    dp.kv_put("img1", pid, {"pix": torch.ones(2, 6)})
    dp.kv_batch_put(["img2", "img3"], pid, {"pix": [torch.full((1, 2), 2.0), torch.full((5, 1), 3.0)]})
    got = dp.kv_batch_get(["img0", "img1", "img2", "img3"], pid)["pix"]
    assert got.is_nested and [tuple(t.shape) for t in got.unbind()] == [(3, 4), (2, 6), (1, 2), (5, 1)]
    assert float(got.unbind()[3].sum()) == 15.0


def test_one_dtype_and_one_number_of_dims_per_field(kv, pid):
    dp.kv_put("a", pid, {"x": torch.arange(3)})
    with pytest.raises(dp.SchemaError, match="'x'.*float32 tensors.*int64 tensors"):
        dp.kv_put("b", pid, {"x": torch.zeros(3)})
    with pytest.raises(dp.SchemaError, match="'x'.*2 dims per row"):
        dp.kv_put("b", pid, {"x": torch.zeros(3, 2, dtype=torch.int64)})
    with pytest.raises(dp.SchemaError, match="'x'.*arrow large_string"):
        dp.kv_put("b", pid, {"x": "text"})
    assert list(dp.kv_list(pid)[pid]) == ["a"]


def test_get_without_select_fields_returns_what_every_key_holds(kv, pid):
    dp.kv_batch_put(["a", "b", "c"], pid, {"prompt": torch.zeros(3, 2), "uid": ["u", "u", "v"]})
    dp.kv_batch_put(["a", "b"], pid, {"response": torch.ones(2, 4)})
    dp.kv_batch_put(["a"], pid, {"reward": torch.ones(1)})
    assert sorted(dp.kv_batch_get(["a", "b", "c"], pid).keys()) == ["prompt", "uid"]
    assert sorted(dp.kv_batch_get(["a", "b"], pid).keys()) == ["prompt", "response", "uid"]
    assert sorted(dp.kv_batch_get(["a"], pid).keys()) == ["prompt", "response", "reward", "uid"]
    # naming a field some key lacks raises, naming the key and the field
    with pytest.raises(dp.FieldNotFoundError, match="select_fields entry 'reward' not found.*'b'") as err:
        dp.kv_batch_get(["a", "b"], pid, select_fields=["prompt", "reward"])
    assert err.value.key == "b" and err.value.field == "reward"


def test_errors_satisfy_both_contracts(kv, pid):
    meta = dp.kv_batch_put(["a"], pid, {"x": torch.zeros(1, 2)})
    for call in (
        lambda: dp.kv_batch_get(["a", "nope"], pid),
        lambda: dp.kv_batch_get(["a"], "no-such-partition"),
        lambda: dp.kv_batch_get_by_meta(meta, select_fields=["x", "nope"]),
    ):
        with pytest.raises(ValueError, match="not found") as err:  # what TransferQueue code catches
            call()
        assert isinstance(err.value, KeyError) and isinstance(err.value, dp.DataplaneError)
    with pytest.raises(ValueError, match="select_fields entry 'nope' not found"):
        dp.kv_batch_get_by_meta(meta, select_fields=["x", "nope"])
