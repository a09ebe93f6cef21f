"""Dispatch and collect functions, auto padding and nd-mesh dispatch, against a plain fake group."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from controlplane import batch
from controlplane import dispatch as d


class FakeGroup:
    """Just what dispatch functions read from a group."""

    def __init__(self, world_size: int, dp=None, collect=None) -> None:
        self.world_size = world_size
        self.dp = dp
        self.collect = collect
        self.queries = 0

    def _get_dispatch_info(self, mesh_name):
        self.queries += 1
        return list(self.dp)

    def _get_collect_info(self, mesh_name):
        return list(self.collect)


def td(n: int) -> TensorDict:
    out = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    out.set_non_tensor("temperature", 0.7)
    return out


def xs(t: TensorDict) -> list[int]:
    return t["x"].tolist()


def test_one_to_all_replicates() -> None:
    args, kwargs = d.dispatch_one_to_all(FakeGroup(3), 1, b=[1, 2, 3])
    assert args == ([1, 1, 1],) and kwargs == {"b": [[1, 2, 3]] * 3}


def test_all_to_all_scatters_only_when_every_arg_is_per_rank() -> None:
    g = FakeGroup(2)
    assert d.dispatch_all_to_all(g, [1, 2], k=[3, 4]) == (([1, 2],), {"k": [3, 4]})
    assert d.dispatch_all_to_all(g, [1, 2], k=5) == (([[1, 2], [1, 2]],), {"k": [5, 5]})
    assert d.dispatch_all_to_all(g, (1, 2)) == (([(1, 2), (1, 2)],), {})


def test_dp_compute_requires_per_rank_lists_and_scatters_tuples() -> None:
    g = FakeGroup(2)
    assert d.dispatch_dp_compute(g, (1, 2), k=[3, 4]) == (([1, 2],), {"k": [3, 4]})
    with pytest.raises(ValueError, match="keyword argument 'k' is a list of length 3"):
        d.dispatch_dp_compute(g, [1, 2], k=[1, 2, 3])
    with pytest.raises(ValueError, match="argument 0 is a int"):
        d.dispatch_dp_compute(g, 5)
    with pytest.raises(ValueError, match="expected 2 outputs"):
        d.collect_dp_compute(g, [1])


def test_proto_chunks_batches_and_replicates_the_rest() -> None:
    g = FakeGroup(2)
    args, kwargs = d.dispatch_dp_compute_proto(g, td(4), 0.5, extra=[10, 11, 12, 13])
    assert [xs(t) for t in args[0]] == [[0, 1], [2, 3]]
    assert args[1] == [0.5, 0.5]
    assert kwargs["extra"] == [[10, 11], [12, 13]]
    assert args[0][1].get_non_tensor("temperature") == 0.7
    assert kwargs[d.CHUNK_INFO_KWARG] == d.ChunkInfo([2, 2], False)
    assert d.PADDING_KWARG not in kwargs
    assert xs(d.collect_dp_compute_proto(g, args[0])) == [0, 1, 2, 3]


def test_proto_errors_name_the_culprit() -> None:
    g = FakeGroup(4)
    with pytest.raises(ValueError, match="argument 0 has 10 samples.*4 equal chunks"):
        d.dispatch_dp_compute_proto(g, td(10))
    with pytest.raises(ValueError, match="argument 0 has 4, keyword argument 'b' has 8"):
        d.dispatch_dp_compute_proto(g, td(4), b=td(8))
    with pytest.raises(ValueError, match="at least one batch argument"):
        d.dispatch_dp_compute_proto(g, 1, k="s")
    empty = TensorDict({"m": torch.tensor(1.0)}, batch_size=[])
    with pytest.raises(TypeError, match="keyword argument 'm' is a TensorDict with an empty batch_size"):
        d.dispatch_dp_compute_proto(g, td(4), m=empty)


@pytest.mark.parametrize("as_kwarg", [False, True])
@pytest.mark.parametrize("size", [1, 5, 10, 8])
def test_auto_padding_per_batch_round_trip(size: int, as_kwarg: bool) -> None:
    g = FakeGroup(4)
    data = batch.enable_auto_padding(td(size))
    if as_kwarg:
        args, kwargs = d.dispatch_dp_compute_proto(g, data=data)
        pieces = kwargs["data"]
    else:
        args, kwargs = d.dispatch_dp_compute_proto(g, data)
        pieces = args[0]
    pad = kwargs.get(d.PADDING_KWARG, 0)
    assert pad == (-size) % 4
    assert len({batch.length(p) for p in pieces}) == 1  # every rank gets the same number
    assert len(pieces) == 4  # no rank is dropped
    out = d.unpad_result(d.collect_dp_compute_proto, d.collect_dp_compute_proto(g, pieces), pad, None)
    assert xs(out) == list(range(size))
    assert xs(data) == list(range(size)), "the caller's batch must not change"


def test_auto_padding_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTROLPLANE_AUTO_PADDING", "1")
    args, kwargs = d.dispatch_dp_compute_proto(FakeGroup(4), [1, 2, 3, 4, 5, 6])
    assert args[0] == [[1, 2], [3, 4], [5, 6], [6, 6]] and kwargs[d.PADDING_KWARG] == 2


def test_uneven_types_are_chunked_unevenly_not_padded() -> None:
    from tests.controlplane.test_batch import Meta

    args, kwargs = d.dispatch_dp_compute_proto(FakeGroup(2), Meta(["a", "b", "c"]))
    assert [p.keys for p in args[0]] == [["a", "b"], ["c"]]
    assert kwargs[d.CHUNK_INFO_KWARG] == d.ChunkInfo([2, 1], True)


def test_with_func_replicates_the_function() -> None:
    def fn(worker, data):
        return data

    args, _ = d.dispatch_dp_compute_proto_with_func(FakeGroup(2), fn, [1, 2, 3, 4])
    assert args[0] == [fn, fn] and args[1] == [[1, 2], [3, 4]]
    with pytest.raises(TypeError, match="callable as the first argument"):
        d.dispatch_dp_compute_proto_with_func(FakeGroup(2), [1, 2])


def test_metric_unpad_trims_per_sample_outputs_and_keeps_every_rank() -> None:
    g = FakeGroup(4)
    args, kwargs = d.dispatch_dp_compute_metric(g, batch.enable_auto_padding(list(range(5))))
    pad, info = kwargs[d.PADDING_KWARG], kwargs[d.CHUNK_INFO_KWARG]
    outputs = [{"loss": 1.0}, list(args[0][1]), list(args[0][2]), list(args[0][3])]
    collected = d.collect_dp_compute_metric(g, outputs)
    result = d.unpad_result(d.collect_dp_compute_metric, collected, pad, info.sizes)
    assert result == [{"loss": 1.0}, [2, 3], [4], []]


def test_nd_collect_orders_by_dp_and_checks_one_collect_rank_per_replica() -> None:
    # pp=2 x dp=2 x tp=2: dp rank per global rank, collect only tp==0 on the last pp stage
    g = FakeGroup(8, dp=[0, 0, 1, 1, 0, 0, 1, 1], collect=[False] * 4 + [True, False, True, False])
    collect = d.make_nd_compute_dispatch_fn("train")["collect_fn"]
    assert collect(g, [[r] for r in range(8)]) == [4, 6]
    reordered = FakeGroup(2, dp=[1, 0], collect=[True, True])
    assert collect(reordered, [["from-dp1"], ["from-dp0"]]) == ["from-dp0", "from-dp1"]
    with pytest.raises(ValueError, match="ranks 0 and 1 are both collect ranks of dp rank 0"):
        collect(FakeGroup(2, dp=[0, 0], collect=[True, True]), [[1], [2]])
    with pytest.raises(ValueError, match=r"no collect rank for dp ranks \[1\]"):
        collect(FakeGroup(2, dp=[0, 1], collect=[True, False]), [[1], [2]])
    with pytest.raises(ValueError, match="without gaps"):
        collect(FakeGroup(2, dp=[0, 2], collect=[True, True]), [[1], [2]])


def test_make_nd_compute_dispatch_fn_validates_name() -> None:
    with pytest.raises(ValueError, match="mesh_name"):
        d.make_nd_compute_dispatch_fn("")
    pair = d.make_nd_compute_dispatch_fn("infer")
    assert pair["dispatch_fn"].mesh_name == "infer" and pair["collect_fn"].mesh_name == "infer"


@pytest.mark.ray
def test_nd_dispatch_puts_each_shard_once_and_shares_it(ray_session) -> None:
    import ray

    g = FakeGroup(8, dp=[0, 0, 0, 0, 1, 1, 1, 1], collect=[True, False, False, False] * 2)
    dispatch = d.make_nd_compute_dispatch_fn("infer")["dispatch_fn"]
    args, kwargs = dispatch(g, td(4), scale=2, labels=[0, 1, 2, 3])
    refs = args[0]
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert len({r.hex() for r in refs}) == 2  # one object per dp shard
    assert refs[0] is refs[3] and refs[4] is refs[7]
    assert [xs(t) for t in ray.get([refs[0], refs[4]], timeout=30)] == [[0, 1], [2, 3]]
    assert kwargs["scale"] == [2] * 8
    assert ray.get(kwargs["labels"][5], timeout=30) == [2, 3]  # data as a kwarg works too
    assert kwargs[d.CHUNK_INFO_KWARG].sizes == [2] * 8


@pytest.mark.ray
def test_nd_dispatch_pads_by_dp_size(ray_session) -> None:
    import ray

    g = FakeGroup(4, dp=[0, 0, 1, 1], collect=[True, False, True, False])
    pair = d.make_nd_compute_dispatch_fn("m")
    args, kwargs = pair["dispatch_fn"](g, batch.enable_auto_padding(td(3)))
    assert kwargs[d.PADDING_KWARG] == 1
    shards = ray.get([args[0][0], args[0][2]], timeout=30)
    assert [xs(s) for s in shards] == [[0, 1], [2, 2]]
    collected = pair["collect_fn"](g, [shards[0], None, shards[1], None])
    out = d.unpad_result(pair["collect_fn"], collected, 1, None)
    assert xs(out) == [0, 1, 2]


@pytest.mark.ray
def test_collect_over_refs_gives_a_future(ray_session) -> None:
    import ray

    from controlplane.future import BatchFuture

    refs = [ray.put([0, 1]), ray.put([2, 3])]
    fut = d.collect_dp_compute_proto(FakeGroup(2), refs)
    assert isinstance(fut, BatchFuture) and fut.source_ranks == [0, 1]
    assert d.unpad_result(d.collect_dp_compute_proto, fut, 1, None).get(timeout=30) == [0, 1, 2]


@pytest.mark.ray
def test_nd_dispatch_of_a_future_ships_chunks_not_data(ray_session) -> None:
    import ray

    from controlplane.future import BatchFuture

    fut = BatchFuture([ray.put([0, 1]), ray.put([2, 3])], [2, 2], allows_uneven_chunks=True)
    g = FakeGroup(4, dp=[0, 0, 1, 1], collect=[True, False, True, False])
    args, kwargs = d.make_nd_compute_dispatch_fn("m")["dispatch_fn"](g, fut)
    shards = ray.get([args[0][0], args[0][2]], timeout=30)
    assert all(isinstance(s, BatchFuture) for s in shards)
    assert [s.get(timeout=30) for s in shards] == [[0, 1], [2, 3]]
    assert kwargs[d.CHUNK_INFO_KWARG] == d.ChunkInfo([2, 2, 2, 2], True)


def test_a_dict_where_a_batch_belongs_is_named_with_the_fix() -> None:
    with pytest.raises(ValueError, match="argument 0 is a dict") as err:
        d.split_batches(2, ({"x": [1, 2]},), {}, mode="DP_COMPUTE_PROTO")
    assert "TensorDict(d, batch_size=[n])" in str(err.value) and "ONE_TO_ALL" in str(err.value)
    with pytest.raises(ValueError, match="keyword argument 'lr' is a float"):
        d.split_batches(2, (), {"lr": 0.1}, mode="DP_COMPUTE")
