"""Columns whose bytes are on a device (``codec.device``) and the put and get paths that copy them.

Without a GPU the same code runs on CPU tensors (plain copies, no streams): a put through real shard
cores and real shared memory (memfd files mapped through ``/proc``), with the route's memory
registering mappings through a registry of recording callables, walks the direct path (one copy
into the writer's mapping), the staged one, the split over shards and the cap; a get's device
gather is checked against the host gather, for one run, many runs and jagged rows. The
`gpu`-marked tests do the same with CUDA tensors through ``dp``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from dataplane.client import ops
from dataplane.client.mappings import ShardMemory
from dataplane.client.sharding import HashPlacement
from dataplane.codec.column_types import ColumnSpec
from dataplane.codec.columns import decode_fields, encode_fields, encode_put
from dataplane.codec.device import MAX_DEVICE_RUNS, DeviceColumn, gather_to_device
from dataplane.codec.paths import CopyPath
from dataplane.codec.rows import assemble
from dataplane.transport.pinning import PinRegistry
from tests.dataplane.test_ops import PID, Loopback, keys_on
from tests.dataplane.test_pinning import Recorder

MiB = 1 << 20


class RegisteringMemory(ShardMemory):
    """The shards' real mappings, registered through ``registry`` (recording callables) on a pin."""

    def __init__(self, pids: list[int], tables: list[list[int]], registry: PinRegistry) -> None:
        super().__init__(pids, tables)
        self.registry = registry
        self.pins: list[int] = []

    def pin(self, shard: int, ref: Sequence[int]) -> CopyPath:
        self.pins.append(shard)
        return self.registry.pin(self.view(shard, ref))


@pytest.fixture
def shm_store():
    """Real shard cores in this process, and a route that maps their files through ``/proc``."""
    made: list[Loopback] = []

    def make(num_shards: int, cap: int = 64 * MiB) -> tuple[Loopback, ops.Route, Recorder]:
        store = Loopback(num_shards)
        made.append(store)
        rec = Recorder()
        tables = [shard.pool.table.ref() for shard in store.shards]
        memory = RegisteringMemory(
            [os.getpid()] * num_shards, tables, PinRegistry(cap, (rec.register, rec.unregister))
        )
        route = ops.Route(
            placement=HashPlacement(num_shards),
            shm=[True] * num_shards,
            memory=memory,
            shm_min_bytes=0,
            commit_within_s=60.0,
            rpc_timeout_s=5.0,
        )
        return store, route, rec

    yield make
    for store in made:
        for shard in store.shards:
            shard.close()


def _on_device(t: torch.Tensor) -> DeviceColumn:
    """A dense column whose values stay where ``t`` is (CPU here: the device code with plain copies)."""
    values = t.contiguous().view(-1).view(torch.uint8)
    return DeviceColumn(
        ColumnSpec("dense", str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])), t.shape[0], values
    )


def test_a_device_put_is_copied_once_into_the_registered_segment_and_reads_back(shm_store) -> None:
    store, route, rec = shm_store(1)
    x = torch.randn(8, 1024)
    keys = [f"k{i}" for i in range(8)]
    store.drive(ops.put(route, keys, PID, {"x": _on_device(x)}, None))
    assert route.memory.pins == [0] and [c[0] for c in rec.calls] == ["register"]
    stats = route.memory.registry.stats()
    assert stats["direct"] == 1 and stats["staged"] == 0 and stats["pinned_mappings"] == 1
    got = decode_fields(store.drive(ops.get(route, keys, PID, ["x"], copy=True)), 8)
    assert torch.equal(got["x"], x)


def test_past_the_cap_a_device_put_is_staged_and_still_exact(shm_store) -> None:
    store, route, rec = shm_store(1, cap=4096)  # smaller than any segment: nothing is registered
    x = torch.randn(8, 1024)
    keys = [f"k{i}" for i in range(8)]
    store.drive(ops.put(route, keys, PID, {"x": _on_device(x)}, None))
    assert rec.calls == [] and route.memory.registry.stats()["staged"] == 1
    got = decode_fields(store.drive(ops.get(route, keys, PID, ["x"], copy=True)), 8)
    assert torch.equal(got["x"], x)


def test_a_device_put_split_over_shards_gathers_each_shards_rows(shm_store) -> None:
    store, route, _ = shm_store(2)
    keys = keys_on(route.placement, 0, 3) + keys_on(route.placement, 1, 3)
    keys = [keys[i] for i in (0, 3, 1, 4, 2, 5)]  # interleaved: each shard's rows are not one run
    x = torch.arange(6 * 5, dtype=torch.int64).view(6, 5)
    lengths = [3, 0, 2, 5, 1, 4]
    jag = [torch.full((n, 2), float(i)) for i, n in enumerate(lengths)]
    cols = encode_fields({"j": jag}, 6)
    jagged = DeviceColumn(
        cols["j"].spec, 6, torch.frombuffer(bytearray(cols["j"].data), dtype=torch.uint8), cols["j"].offsets
    )
    store.drive(ops.put(route, keys, PID, {"x": _on_device(x), "j": jagged}, None))
    assert sorted(route.memory.pins) == [0, 0, 1, 1]
    assert route.memory.registry.stats()["staged"] == 0  # each shard's rows gathered, then one copy
    got = decode_fields(store.drive(ops.get(route, keys, PID, None, copy=True)), 6)
    assert torch.equal(got["x"], x)
    assert [r.tolist() for r in got["j"].unbind()] == [r.tolist() for r in jag]


def _pieces(x: torch.Tensor, order: list[int]) -> list:
    col = encode_fields({"x": x}, x.shape[0])["x"]
    src = np.asarray(order, dtype=np.int64)
    return [(col, src, np.arange(len(order)))]


@pytest.mark.parametrize("direct", [True, False])
def test_gather_to_device_equals_the_host_gather(direct: bool) -> None:
    x = torch.randn(10, 7)
    for order in ([2, 3, 4, 5], [9, 0, 4, 4, 1], list(range(10))[::-1] * (MAX_DEVICE_RUNS // 5 + 1)):
        pieces = _pieces(x, order)
        col = gather_to_device(pieces, len(order), "cpu", direct)
        col.sync()
        host = assemble(pieces[0][0].spec, len(order), pieces)
        assert bytes(col.values.numpy()) == bytes(host.data)
        assert torch.equal(col.value(), x[order])


def test_gather_to_device_of_jagged_rows_is_nested_or_dense_by_their_lengths() -> None:
    rows = [torch.arange(n * 2, dtype=torch.float32).view(n, 2) for n in (3, 1, 3, 2)]
    col = encode_fields({"j": rows}, 4)["j"]
    mixed = gather_to_device([(col, np.array([3, 0, 1]), np.arange(3))], 3, "cpu", direct=True)
    value = mixed.value()
    assert value.is_nested and [r.tolist() for r in value.unbind()] == [rows[i].tolist() for i in (3, 0, 1)]
    same = gather_to_device([(col, np.array([0, 2]), np.arange(2))], 2, "cpu", direct=True).value()
    assert not same.is_nested and torch.equal(same, torch.stack([rows[0], rows[2]]))


def test_encode_put_keeps_cpu_tensors_as_host_columns() -> None:
    x = torch.randn(4, 3)
    cols = encode_put({"x": x, "s": ["a", "b", "c", "d"]}, 4)
    assert list(cols) == ["x", "s"]
    assert not any(isinstance(c, DeviceColumn) for c in cols.values())
    assert np.frombuffer(cols["x"].data, np.uint8).ctypes.data == x.data_ptr()  # zero-copy, as before


# ---- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_encode_put_keeps_cuda_tensors_on_their_device() -> None:
    x = torch.randn(4, 3, device="cuda")
    cols = encode_put({"x": x, "y": x.cpu()}, 4)
    assert isinstance(cols["x"], DeviceColumn) and cols["x"].values.data_ptr() == x.data_ptr()
    assert not isinstance(cols["y"], DeviceColumn)
    assert torch.equal(cols["x"].value(), x)


def test_a_device_get_of_many_runs_is_staged_and_registers_nothing(shm_store) -> None:
    """Past ``MAX_DEVICE_RUNS`` runs a get is assembled on the host and copied once: the shards'
    mappings are not registered for it (registering costs, and the copy would not use them). The
    ``meta`` device walks the device path without a GPU."""
    store, route, rec = shm_store(1)
    keys = [f"k{i}" for i in range(2 * MAX_DEVICE_RUNS + 2)]
    x = torch.arange(len(keys) * 256, dtype=torch.float32).view(len(keys), 256)
    store.drive(ops.put(route, keys, PID, encode_fields({"x": x}, len(keys)), None))
    assert route.memory.pins == [] and rec.calls == []  # (a host put registers nothing)
    every_other = keys[::2]  # one run per row
    got = store.drive(ops.get(route, every_other, PID, ["x"], copy=True, device="meta"))
    assert got["x"].values.device.type == "meta" and got["x"].num_rows == len(every_other)
    assert route.memory.pins == [] and rec.calls == []
    store.drive(ops.get(route, keys[:8], PID, ["x"], copy=True, device="meta"))  # one run: direct
    assert route.memory.pins == [0] and [c[0] for c in rec.calls] == ["register"]
