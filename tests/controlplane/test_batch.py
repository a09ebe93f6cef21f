"""The batch protocol (pure) and BatchFuture (real Ray object refs)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import ClassVar

import pytest
import torch
from tensordict import TensorDict

from controlplane import batch
from controlplane.future import BatchFuture


def make_td(n: int) -> TensorDict:
    td = TensorDict(
        {
            "x": torch.arange(n, dtype=torch.float32).unsqueeze(1),
            "ids": torch.nested.nested_tensor([torch.arange(i + 1) for i in range(n)], layout=torch.jagged),
        },
        batch_size=[n],
    )
    td.set_non_tensor("tag", "batch-level")
    return td


@dataclasses.dataclass
class Meta:
    """A stand-in for dataplane.KVBatchMeta: chunk/concat, uneven chunks allowed, no padding."""

    keys: list[str]
    allows_uneven_chunks: ClassVar[bool] = True

    def __len__(self) -> int:
        return len(self.keys)

    def chunk(self, n: int) -> list[Meta]:
        sizes = batch.chunk_sizes(len(self.keys), n)
        out, start = [], 0
        for s in sizes:
            out.append(Meta(self.keys[start : start + s]))
            start += s
        return out

    @classmethod
    def concat(cls, parts: list[Meta]) -> Meta:
        return cls([k for p in parts for k in p.keys])


class Even:
    """A user batch type that needs even chunks."""

    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def chunk(self, n: int) -> list[Even]:
        k = len(self.items) // n
        return [Even(self.items[i * k : (i + 1) * k]) for i in range(n)]

    @classmethod
    def concat(cls, parts: list[Even]) -> Even:
        return cls([i for p in parts for i in p.items])


# ----------------------------------------------------------------------------- protocol
def test_tensordict_chunk_concat_roundtrip_keeps_jagged_and_non_tensor() -> None:
    td = make_td(6)
    parts = batch.chunk(td, 3)
    assert [batch.length(p) for p in parts] == [2, 2, 2]
    assert parts[1]["ids"][1].tolist() == [0, 1, 2, 3]
    assert parts[2].get_non_tensor("tag") == "batch-level"
    back = batch.concat(parts)
    assert torch.equal(back["x"], td["x"])
    assert [t.tolist() for t in back["ids"].unbind()] == [t.tolist() for t in td["ids"].unbind()]


def test_tensordict_chunks_own_their_storage() -> None:
    # Ray pickles a tensor view with its whole storage: a chunk that shared the batch's storage
    # would ship the entire batch to every rank.
    td = TensorDict({"x": torch.arange(64.0).reshape(16, 4)}, batch_size=[16])
    parts = batch.chunk(td, 4)
    for part in parts:
        assert part["x"].untyped_storage().nbytes() == 4 * 4 * 4
        assert part["x"].untyped_storage().data_ptr() != td["x"].untyped_storage().data_ptr()
    assert torch.equal(batch.concat(parts)["x"], td["x"])


def test_list_and_tuple_chunk_concat() -> None:
    assert batch.chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
    assert batch.chunk((1, 2, 3, 4), 4) == [(1,), (2,), (3,), (4,)]
    assert batch.concat([[1], [2, 3]]) == [1, 2, 3]
    assert batch.concat([(1,), (2,)]) == (1, 2)


def test_generic_class_uses_its_own_chunk_and_concat() -> None:
    meta = Meta([f"k{i}" for i in range(5)])
    parts = batch.chunk(meta, 2)  # uneven is fine for this type
    assert [len(p) for p in parts] == [3, 2]
    assert batch.concat(parts).keys == meta.keys
    with pytest.raises(ValueError, match="5 samples.*2 equal chunks"):
        batch.chunk(Even([1, 2, 3, 4, 5]), 2)
    assert batch.concat(batch.chunk(Even([1, 2, 3, 4]), 2)).items == [1, 2, 3, 4]


def test_non_divisible_without_padding_names_sizes() -> None:
    with pytest.raises(ValueError, match=r"data has 10 samples.*4 equal chunks"):
        batch.chunk(make_td(10), 4, name="data")


def test_not_a_batch_is_rejected() -> None:
    assert not batch.is_batch(3)
    assert not batch.is_batch({"a": 1})
    assert not batch.is_batch(TensorDict({"m": torch.tensor(1.0)}, batch_size=[]))
    with pytest.raises(TypeError, match="int is not a batch"):
        batch.chunk(3, 2)


def test_concat_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        batch.concat([])
    with pytest.raises(TypeError, match="mixed types"):
        batch.concat([Meta(["a"]), Even([1])])
    metric = TensorDict({"loss": torch.tensor(1.0)}, batch_size=[])
    with pytest.raises(TypeError, match="DP_COMPUTE_METRIC"):
        batch.concat([metric, metric])


def test_pad_repeats_last_sample_and_never_mutates() -> None:
    td = make_td(3)
    padded = batch.pad(td, 2)
    assert batch.length(td) == 3 and batch.length(padded) == 5
    assert padded["x"].squeeze(1).tolist() == [0, 1, 2, 2, 2]
    assert padded["ids"][4].tolist() == [0, 1, 2]
    items = [1, 2]
    assert batch.pad(items, 2) == [1, 2, 2, 2] and items == [1, 2]
    assert batch.trim(padded, 2)["x"].squeeze(1).tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="cannot be padded"):
        batch.pad(Even([1]), 1)
    with pytest.raises(ValueError, match="no samples"):
        batch.pad([], 1)


def test_enable_auto_padding_marks_object_and_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTROLPLANE_AUTO_PADDING", raising=False)
    td = make_td(2)
    assert not batch.auto_padding_requested(td)
    assert batch.enable_auto_padding(td) is td and batch.auto_padding_requested(td)
    marked = batch.enable_auto_padding([1, 2])
    assert marked == [1, 2] and batch.auto_padding_requested(marked)
    assert not batch.auto_padding_requested([1, 2])
    monkeypatch.setenv("CONTROLPLANE_AUTO_PADDING", "1")
    assert batch.auto_padding_requested([1, 2])


# ----------------------------------------------------------------------------- BatchFuture
def test_future_rejects_non_refs() -> None:
    with pytest.raises(TypeError, match="not a ray.ObjectRef"):
        BatchFuture([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        BatchFuture([])


@pytest.mark.ray
def test_future_get_concats_in_order(ray_session) -> None:
    import ray

    parts = [make_td(2), make_td(3)]
    fut = BatchFuture([ray.put(p) for p in parts], [2, 3])
    assert len(fut) == 5
    got = fut.get(timeout=30)
    assert got["x"].squeeze(1).tolist() == [0, 1, 0, 1, 2]


@pytest.mark.ray
def test_future_chunks_fetch_only_their_parts(ray_session) -> None:
    """A chunk whose rows live in a ready part resolves while another part is still pending."""
    import ray

    @ray.remote(num_cpus=0.1)
    class Gate:
        def __init__(self) -> None:
            import asyncio

            self.event = asyncio.Event()

        async def wait_then(self, value):
            await self.event.wait()
            return value

        def open(self) -> None:
            self.event.set()

    gate = Gate.remote()
    try:
        pending = gate.wait_then.remote([10, 11])
        fut = BatchFuture([ray.put([0, 1]), pending], [2, 2])
        first, second = fut.chunk(2)
        assert first.get(timeout=30) == [0, 1]  # does not wait for the pending part
        with pytest.raises(TimeoutError, match="not ready"):
            second.get(timeout=0.5)
        assert asyncio.run(first.get_async(timeout=30)) == [0, 1]
        with pytest.raises(TimeoutError, match="not ready"):
            asyncio.run(second.get_async(timeout=0.5))
        ray.get(gate.open.remote(), timeout=30)
        assert second.get(timeout=30) == [10, 11]
        assert asyncio.run(second.get_async(timeout=30)) == [10, 11]
    finally:
        ray.kill(gate)


@pytest.mark.ray
def test_future_padding_trim_and_uneven_windows(ray_session) -> None:
    import ray

    fut = BatchFuture([ray.put([0, 1, 2]), ray.put([3, 4])], [3, 2])
    padded = fut.pad(3)  # 8 rows -> 4 chunks of 2
    chunks = padded.chunk(4)
    assert [c.get(timeout=30) for c in chunks] == [[0, 1], [2, 3], [4, 4], [4, 4]]
    assert fut.trim(2).get(timeout=30) == [0, 1, 2]
    with pytest.raises(ValueError, match="5 samples.*2 equal chunks"):
        fut.chunk(2)
    fut.allows_uneven_chunks = True
    assert [c.get(timeout=30) for c in fut.chunk(2)] == [[0, 1, 2], [3, 4]]


@pytest.mark.ray
def test_future_wrong_size_hint_falls_back_to_full_fetch(ray_session) -> None:
    import ray

    fut = BatchFuture([ray.put([0, 1, 2]), ray.put([3])], [2, 2])  # the hint is wrong
    first, second = fut.chunk(2)
    assert first.get(timeout=30) == [0, 1]
    assert second.get(timeout=30) == [2, 3]


@pytest.mark.ray
def test_future_unknown_sizes_chunk_on_resolution(ray_session) -> None:
    import ray

    fut = BatchFuture([ray.put([0, 1, 2]), ray.put([3, 4, 5])])
    with pytest.raises(TypeError, match="unknown"):
        len(fut)
    assert [c.get(timeout=30) for c in fut.chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    assert BatchFuture.concat([fut, fut]).get(timeout=30) == [0, 1, 2, 3, 4, 5] * 2
