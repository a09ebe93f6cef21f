"""verl 0.9.1's ``tqbridge`` across a verl ``RayWorkerGroup``, driven unchanged over ``transfer_queue``.

Run by ``scripts/tq_compat.sh`` against the real TransferQueue 0.1.11 and against ``dataplane.tq``
(``transfer_queue`` is then a shim onto it). Everything below the driver is verl's own code: its
``register`` applies ``tqbridge`` to the worker methods; its n-d dispatch (the one verl's engine
workers use) turns a ``KVBatchMeta`` into ``BatchMeta`` chunks (``kv_batch_meta2batch_meta``);
each worker reads its chunk (``async_get_data``) and writes its output back (``async_put``), only
on collect ranks; the driver's collect joins the chunks (``BatchMeta.concat``) and turns them into
a ``KVBatchMeta`` again (``async_kv_retrieve_keys``). A method called with a ``KVBatchMeta``
directly (``ONE_TO_ALL``) goes through ``async_kv_retrieve_meta`` on the worker.

The worker methods compute on the layout TransferQueue returns: tensor fields as jagged nested
tensors (``.values()``, ``.offsets()``), which verl's padding helpers rely on.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.single_controller.base.worker import Worker
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.transferqueue_utils import tqbridge

CONF = {
    "controller": {"polling_mode": True},
    "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2}},
}


def _plus(td: TensorDict, field: str, out: str, add: float) -> TensorDict:
    """``out = field + add`` computed on the jagged values, returned jagged with the same offsets."""
    x = td[field]
    values = x.values() + add
    return TensorDict(
        {out: torch.nested.nested_tensor_from_jagged(values, x.offsets())}, batch_size=td.batch_size
    )


@ray.remote
class BridgeWorker(Worker):
    def __init__(self):
        super().__init__()
        # "dp": two data-parallel ranks, each writes its own rows back;
        # "replica": one replica of two ranks, both get every row, only rank 0 writes back
        self._register_dispatch_collect_info(mesh_name="dp", dp_rank=self.rank, is_collect=True)
        self._register_dispatch_collect_info(mesh_name="replica", dp_rank=0, is_collect=self.rank == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="dp"))
    def plus_rank(self, data: TensorDict) -> TensorDict:
        return _plus(data, "x", "y", 10.0 * (self.rank + 1))

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="dp"))
    async def async_plus_one(self, data: TensorDict) -> TensorDict:
        await asyncio.sleep(0)
        return _plus(data, "x", "z", 1.0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="dp"))
    def ids_plus_three(self, data: TensorDict) -> TensorDict:
        return _plus(data, "input_ids", "ids3", 3.0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="replica"))
    def replica_plus_two(self, data: TensorDict) -> TensorDict:
        return _plus(data, "x", "w", 2.0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rows_seen(self, data: TensorDict) -> int:
        return int(data.batch_size[0])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def async_rows_seen(self, data: TensorDict) -> int:
        await asyncio.sleep(0)
        return int(data.batch_size[0])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def plain(self, value: str) -> str:  # plain data: tqbridge leaves it alone
        return type(value).__name__


@pytest.fixture(scope="module")
def group():
    ray.init(num_cpus=8)
    tq.init(CONF)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(
        pool, RayClassWithInitArgs(cls=BridgeWorker), name_prefix=f"bridge{uuid.uuid4().hex[:6]}"
    )
    yield wg
    tq.close()
    ray.shutdown()


def _put_rows(n: int, pid: str) -> KVBatchMeta:
    keys = [f"k{i}" for i in range(n)]
    x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)  # same-length rows
    return tq.kv_batch_put(
        keys=keys, partition_id=pid, fields=TensorDict({"x": x}, batch_size=[n]), tags=[{}] * n
    )


def _dense(td: TensorDict, field: str) -> torch.Tensor:
    value = td[field]
    return torch.stack(list(value.unbind())) if value.is_nested else value


def test_sync_method_reads_chunks_and_writes_back(group):
    pid = f"p{uuid.uuid4().hex[:8]}"
    meta = _put_rows(4, pid)
    out = group.plus_rank(meta)
    assert isinstance(out, KVBatchMeta) and out.keys == meta.keys and out.partition_id == pid
    assert "y" in out.fields
    got = tq.kv_batch_get(keys=meta.keys, partition_id=pid, select_fields="y")
    expect = torch.arange(12, dtype=torch.float32).view(4, 3) + torch.tensor([10.0, 10, 20, 20]).view(4, 1)
    assert torch.equal(_dense(got, "y"), expect)


@pytest.mark.parametrize(
    "method, field, add",
    [("async_plus_one", "z", 1.0), ("replica_plus_two", "w", 2.0)],
    ids=["async-method", "only-collect-ranks-write"],
)
def test_method_reads_its_rows_and_writes_back(group, method, field, add):
    pid = f"p{uuid.uuid4().hex[:8]}"
    meta = _put_rows(3, pid)
    out = getattr(group, method)(meta)
    assert isinstance(out, KVBatchMeta) and out.keys == meta.keys and field in out.fields
    got = tq.kv_batch_get(keys=out.keys, partition_id=pid, select_fields=["x", field])
    assert torch.equal(_dense(got, field), _dense(got, "x") + add)


def test_a_kv_meta_naming_its_field_as_a_str(group):
    """verl's bridge takes ``KVBatchMeta.fields`` as a str too (``kv_batch_meta2batch_meta``)."""
    pid = f"p{uuid.uuid4().hex[:8]}"
    keys = _put_rows(2, pid).keys
    tq.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict({"input_ids": torch.ones(2, 3)}, [2]))
    out = group.ids_plus_three(KVBatchMeta(keys=keys, tags=[{}, {}], partition_id=pid, fields="input_ids"))
    got = tq.kv_batch_get(keys=keys, partition_id=pid, select_fields="ids3")
    assert "ids3" in out.fields and torch.equal(_dense(got, "ids3"), torch.full((2, 3), 4.0))


def test_outputs_chain_into_the_next_call(group):
    pid = f"p{uuid.uuid4().hex[:8]}"
    out = group.async_plus_one(group.plus_rank(_put_rows(2, pid)))
    assert {"x", "y", "z"} <= set(out.fields)
    # ONE_TO_ALL: each worker gets the KVBatchMeta itself and reads the whole batch
    assert group.rows_seen(out) == [2, 2] and group.async_rows_seen(out) == [2, 2]
    assert group.plain("not a meta") == ["str", "str"]


def test_bridge_in_this_process_on_a_kv_meta(group):
    """The worker-side path without a group: a KVBatchMeta goes through async_kv_retrieve_meta,
    the output through async_put and async_kv_retrieve_keys, tags kept."""
    pid = f"p{uuid.uuid4().hex[:8]}"
    meta = _put_rows(2, pid)
    meta.tags = [{"s": 1}, {"s": 2}]

    @tqbridge()
    def fn(data):
        return _plus(data, "x", "v", 5.0)

    @tqbridge()
    async def afn(data):
        return _plus(data, "x", "u", 6.0)

    out = fn(meta)
    assert isinstance(out, KVBatchMeta) and out.keys == meta.keys and out.tags == meta.tags
    aout = asyncio.run(afn(meta))
    assert isinstance(aout, KVBatchMeta) and aout.keys == meta.keys
    got = tq.kv_batch_get(keys=meta.keys, partition_id=pid, select_fields=["x", "v", "u"])
    assert torch.equal(_dense(got, "v"), _dense(got, "x") + 5)
    assert torch.equal(_dense(got, "u"), _dense(got, "x") + 6)
