"""verl behaviours with a DataProto-shaped batch (tests/controlplane/_dataproto.py), without verl.

Auto padding asked for by the batch or by ``VERL_AUTO_PADDING``, padding through the batch's own
in-place ``padding(n)``, the batch class's own future type for non-blocking calls (also passed on
to another group), every dispatch mode, and verl's dispatch-info API between workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, batch
from controlplane import dispatch as d
from controlplane.errors import ControlPlaneError, MeshConflictError
from controlplane.future import BatchFuture, future_maker, is_batch_future
from tests.controlplane._dataproto import (
    HookedBatch,
    ProtoBatch,
    ProtoFuture,
    ProtoWorker,
    TaggedFuture,
    rows,
    tag_with_rank,
)
from tests.controlplane._group_workers import MeshCopyWorker
from tests.controlplane._groups import started_groups


@pytest.fixture(autouse=True)
def _no_padding_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTROLPLANE_AUTO_PADDING", raising=False)
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)


class FakeGroup:
    world_size = 4


def texts(data: ProtoBatch) -> list[str]:
    return list(data.non_tensor_batch["text"])


# ---------------------------------------------------------------------------------- no Ray
def test_padding_is_asked_for_by_the_batch_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert batch.auto_padding_requested(rows(3, auto_padding=True))  # is_padding_enabled()
    assert not batch.auto_padding_requested(rows(3))

    @dataclass
    class MetaOnly:  # no is_padding_enabled: verl's meta_info flag is read directly
        meta_info: dict = field(default_factory=dict)

    assert batch.auto_padding_requested(MetaOnly({"_verl_auto_padding": True}))
    assert not batch.auto_padding_requested(MetaOnly())
    monkeypatch.setenv("VERL_AUTO_PADDING", "true")
    assert batch.auto_padding_requested(rows(3)) and batch.auto_padding_requested([1, 2])
    monkeypatch.setenv("VERL_AUTO_PADDING", "0")
    monkeypatch.setenv("CONTROLPLANE_AUTO_PADDING", "1")
    assert batch.auto_padding_requested(rows(3))


def test_pad_calls_in_place_padding_on_a_copy() -> None:
    data = rows(3)
    padded = batch.pad(data, 2)
    assert len(padded) == 5 and texts(padded) == ["s0", "s1", "s2", "s2", "s2"]
    assert len(data) == 3 and texts(data) == ["s0", "s1", "s2"]  # the caller's batch is untouched

    class SharedState:  # pads by mutating an object the shallow copy shares with the original
        def __init__(self) -> None:
            self.items = [1, 2]

        def __len__(self) -> int:
            return len(self.items)

        def padding(self, k: int) -> None:
            self.items.extend([self.items[-1]] * k)

    with pytest.raises(TypeError, match="changed the caller's batch"):
        batch.pad(SharedState(), 2)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_proto_dispatch_pads_positional_and_keyword(by_keyword: bool) -> None:
    data = rows(10, auto_padding=True)
    args, kwargs = (
        d.dispatch_dp_compute_proto(FakeGroup(), **{"data": data})
        if by_keyword
        else (d.dispatch_dp_compute_proto(FakeGroup(), data))
    )
    pieces = kwargs["data"] if by_keyword else args[0]
    assert [len(p) for p in pieces] == [3, 3, 3, 3] and kwargs[d.PADDING_KWARG] == 2
    assert kwargs[d.CHUNK_INFO_KWARG].future_maker is not None
    assert len(data) == 10
    with pytest.raises(ValueError, match="10 samples.*4 equal chunks.*VERL_AUTO_PADDING=1"):
        d.dispatch_dp_compute_proto(FakeGroup(), rows(10))


class Widget:
    """verl's naming convention: a ``<Name>Future`` next to the class names its future."""

    def __len__(self) -> int:
        return 1

    def chunk(self, n: int) -> list:
        return [self] * n

    @classmethod
    def concat(cls, parts: list) -> Widget:
        return parts[0]


@dataclass
class WidgetFuture:
    collect_fn: object
    futures: list

    def get(self) -> None:
        return None


@pytest.mark.ray
def test_future_maker_lookup_order(ray_session) -> None:
    import ray

    ref = ray.put(1)
    built = future_maker(rows(2))([ref], ProtoBatch.concat)
    assert type(built) is ProtoFuture and built.futures == [ref]  # future_type
    assert type(future_maker(rows(2, cls=HookedBatch))([ref], ProtoBatch.concat)) is TaggedFuture  # hook
    assert type(future_maker(built)([ref], ProtoBatch.concat)) is ProtoFuture  # a future passed on
    assert isinstance(future_maker(Widget())([ref], list), WidgetFuture)  # sibling name
    for plain in ([1], (1,), TensorDict({"x": torch.zeros(2)}, batch_size=[2]), BatchFuture([ref]), None):
        assert future_maker(plain) is None
    assert is_batch_future(built) and is_batch_future(BatchFuture([ref]))
    assert not is_batch_future(rows(2)) and not is_batch_future(ProtoFuture(list, []))


def test_dispatch_info_copy_and_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ref, actor, fused = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info("ref", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    info = actor.get_dispatch_collect()
    assert info == {"dispatch_dp_rank": {"actor": 1}, "collect_dp_rank": {"actor": False}}
    assert info["dispatch"] == {"actor": 1}  # the earlier keys still read
    fused.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    fused.set_dispatch_collect(mesh_name="actor", **info)
    assert (fused.query_dispatch_info("ref"), fused.query_collect_info("ref")) == (0, True)
    assert (fused._query_dispatch_info("actor"), fused._query_collect_info("actor")) == (1, False)
    info["dispatch_dp_rank"]["actor"] = 7  # a copy: the source worker is unchanged
    assert actor.query_dispatch_info("actor") == 1

    with pytest.raises(MeshConflictError, match="mesh 'actor' is already registered") as caught:
        fused.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())  # same info too
    assert isinstance(caught.value, AssertionError | ControlPlaneError | ValueError)
    assert caught.value.mesh_name == "actor"
    with pytest.raises(AssertionError):
        fused._register_dispatch_collect_info("ref", dp_rank=3, is_collect=False)

    both = Worker()
    both._register_dispatch_collect_info("a", dp_rank=0, is_collect=True)
    both._register_dispatch_collect_info("b", dp_rank=1, is_collect=False)
    with pytest.raises(ValueError, match="different info.*source_mesh"):
        fused.set_dispatch_collect("two", **both.get_dispatch_collect())
    fused.set_dispatch_collect("two", **both.get_dispatch_collect(), source_mesh="b")
    assert fused.query_dispatch_info("two") == 1
    fused.set_dispatch_collect("plain", 2, True)
    assert fused.query_dispatch_info("plain") == 2


# ---------------------------------------------------------------------------------- with Ray
@pytest.fixture(scope="module")
def groups(ray_session):
    with started_groups((4, ProtoWorker), (2, ProtoWorker)) as (four, two):
        yield four, two


def expected(n: int, ranks_of_rows: list[int]) -> list[float]:
    return [float(i + 100 * r) for i, r in zip(range(n), ranks_of_rows, strict=True)]


@pytest.mark.ray
@pytest.mark.parametrize("n", [10, 1, 8])
def test_padded_proto_calls_positional_and_keyword(groups, n: int) -> None:
    wg, _ = groups
    per_rank = -(-n // 4)
    ranks = [i // per_rank for i in range(n)]
    for call in (lambda b: wg.stamp(b), lambda b: wg.stamp(data=b)):
        data = rows(n, auto_padding=True)
        out = call(data)
        assert isinstance(out, ProtoBatch) and len(out) == n
        assert out.batch["a"].tolist() == expected(n, ranks)
        assert texts(out) == [f"s{i}" for i in range(n)] and list(out.non_tensor_batch["rank"]) == ranks
        assert out.meta_info == {"step": 3, "_verl_auto_padding": True, "seen_by": "proto"}
        assert len(data) == n and data.batch["a"].tolist() == list(map(float, range(n)))


@pytest.mark.ray
def test_padding_switches(groups, monkeypatch: pytest.MonkeyPatch) -> None:
    wg, _ = groups
    with pytest.raises(ValueError, match="10 samples.*4 equal chunks"):
        wg.stamp(rows(10))
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert len(wg.stamp(rows(10))) == 10 and len(wg.stamp(data=rows(1))) == 1


@pytest.mark.ray
def test_every_dispatch_mode(groups) -> None:
    wg, _ = groups
    described = wg.describe(rows(3))
    assert described == [(r, "ProtoBatch", 3, ["s0", "s1", "s2"], {"step": 3}) for r in range(4)]
    assert wg.first_text(rows(2)) == ["s0"] * 4
    assert wg.first_text([rows(4)[i : i + 1] for i in range(4)]) == ["s0", "s1", "s2", "s3"]
    assert wg.total(rows(4)) == (0, 6.0)
    assert wg.per_rank([rows(k) for k in (1, 2, 3, 4)]) == [1, 2, 3, 4]
    per_rank = wg.metrics(rows(10, auto_padding=True))
    assert [len(p) for p in per_rank] == [3, 3, 3, 1]  # rank 3's two padded rows removed
    assert texts(per_rank[3]) == ["s9"]
    tagged = wg.execute_with_func_generator(tag_with_rank, rows(6, auto_padding=True))
    assert list(tagged.non_tensor_batch["rank"]) == [0, 0, 1, 1, 2, 2]
    mesh = wg.mesh_stamp(rows(3, auto_padding=True))  # dp=2: rows 0-1 on dp 0, row 2 on dp 1
    assert mesh.batch["a"].tolist() == [0.0, 1.0, 202.0] and list(mesh.non_tensor_batch["rank"]) == [0, 0, 2]
    assert len(wg.mesh_stamp(data=rows(5, auto_padding=True))) == 5


@pytest.mark.ray
def test_non_blocking_returns_the_batch_classes_future(groups) -> None:
    wg, two = groups
    fut = wg.stamp_later(rows(10, auto_padding=True))
    assert isinstance(fut, ProtoFuture) and not isinstance(fut, BatchFuture)
    got = fut.get()
    assert len(got) == 10 and got.batch["a"].tolist() == expected(10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    assert isinstance(wg.stamp_later_async(data=rows(4)), ProtoFuture)
    assert isinstance(wg.stamp_later(rows(4, cls=HookedBatch)), TaggedFuture)
    one = wg.stamp_later(rows(1, auto_padding=True))
    assert len(one.futures) == 1 and texts(one.get()) == ["s0"]
    mesh = wg.mesh_stamp_later(rows(3, auto_padding=True))
    assert isinstance(mesh, ProtoFuture) and mesh.get().batch["a"].tolist() == [0.0, 1.0, 202.0]


@pytest.mark.ray
def test_future_passed_to_another_group(groups) -> None:
    wg, two = groups
    fut = wg.stamp_later(rows(10, auto_padding=True))
    assert two.arrived(fut) == ["ProtoFuture", "ProtoFuture"]  # the driver fetched nothing
    out = two.stamp(fut)
    first = expected(10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    assert out.batch["a"].tolist() == [a + 100 * (i // 5) for i, a in enumerate(first)]
    assert texts(out) == [f"s{i}" for i in range(10)]
    again = two.stamp_later(fut)  # a future in, a future of the same type out
    assert isinstance(again, ProtoFuture) and len(again.get()) == 10


@pytest.mark.ray
def test_dispatch_info_copied_between_workers(ray_session) -> None:
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(MeshCopyWorker))
    try:
        infos = wg.info()
        assert infos[1] == {"dispatch_dp_rank": {"own": 1}, "collect_dp_rank": {"own": False}}
        assert wg.adopt(["peer", "peer"], infos[::-1]) == [(1, False), (0, True)]
        assert wg.adopt(["peer", "peer"], infos) == [("refused", "MeshConflictError")] * 2
    finally:
        wg.kill()
        pool.remove()


@pytest.mark.ray
def test_unpadded_refs_drop_and_trim(ray_session) -> None:
    import ray

    from controlplane.future import unpadded_refs

    parts = [ray.put(rows(3)[i : i + 1]) for i in range(3)]
    assert unpadded_refs(parts, [1, 1, 1], 2) == parts[:1]  # parts holding only padding are dropped
    refs = [ray.put(rows(3)), ray.put(rows(3))]
    kept = unpadded_refs(refs, [3, 3], 2)
    assert kept[0] is refs[0] and len(ray.get(kept[1], timeout=60)) == 1
    bad = unpadded_refs([ray.put(rows(2))], [3], 1)
    with pytest.raises(ValueError, match="returned 2 samples for the 3"):
        ray.get(bad[0], timeout=60)
    trimmed = ray.get(kept[1], timeout=60).non_tensor_batch["text"]
    assert np.array_equal(trimmed, np.array(["s0"], dtype=object))
