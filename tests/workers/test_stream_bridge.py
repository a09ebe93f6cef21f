"""The bridge's stream path: a bridged method called with a ``dp.StreamRequest`` takes its own ready
rows (``next_batch``), writes outputs back from collect ranks, and returns counts (no keys)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
from tests.workers._bridge_workers import BridgeWorker
from workers import MetadataOnlyGroup
from workers.bridge import StreamReport
from workers.driver_guard import DriverDataError, check_metadata

pytestmark = pytest.mark.ray

WAIT_S = 30.0


def _pid() -> str:
    return f"stream-{uuid.uuid4().hex[:8]}"


def _produce(pid: str, start: int, count: int) -> list[str]:
    keys = [f"r{i}" for i in range(start, start + count)]
    dp.kv_batch_put(keys, pid, fields=TensorDict({"x": torch.arange(start, start + count)}, [count]))
    return keys


def _column(pid: str, keys: list[str], field: str) -> torch.Tensor:
    return dp.kv_batch_get(keys, pid, [field])[field]


@pytest.fixture
def pid(store):
    name = _pid()
    yield name
    dp.clear_partition(name)


# ---- on a local worker object (rank 0 of 1), in this process ---------------------------------


def test_local_stream_call_takes_a_batch_writes_it_and_reports_counts(pid) -> None:
    keys = _produce(pid, 0, 6)
    worker = BridgeWorker()
    request = dp.StreamRequest(pid, "inc", 4, ["x"], timeout_s=WAIT_S)
    first = worker.add_one(request)
    assert isinstance(first, dp.StreamResult) and isinstance(first, StreamReport)
    assert (first.rows, first.batches, first.finished, first.outputs) == (4, 1, False, [])
    (span,) = first.spans
    assert span["task"] == "inc" and span["rows"] == 4 and span["called"] <= span["start"] <= span["end"]
    assert torch.equal(_column(pid, keys[:4], "y"), torch.arange(4) + 1)
    dp.finish_partition(pid)
    assert worker.add_one(request).rows == 2  # the short batch left after finish
    # drained: add_one would fail on an empty batch (no "x"), so it must not be called
    last = worker.add_one(request)
    assert (last.rows, last.batches, last.finished, last.spans) == (0, 0, True, [])
    assert torch.equal(_column(pid, keys, "y"), torch.arange(6) + 1)
    assert dp.consumption(pid, "inc")["consumed"] == 6


def test_local_stream_metrics_come_back_as_outputs(pid) -> None:
    _produce(pid, 0, 4)
    report = BridgeWorker().metrics(dp.StreamRequest(pid, "m", 4, ["x"], timeout_s=WAIT_S))
    assert report.rows == 4 and report.outputs == [{"rows": 4, "sum": 6.0}]


def test_local_async_stream_method(pid) -> None:
    keys = _produce(pid, 0, 3)
    report = asyncio.run(BridgeWorker().async_scale(dp.StreamRequest(pid, "z", 3, ["x"], timeout_s=WAIT_S)))
    assert report.rows == 3 and not report.finished
    assert torch.equal(_column(pid, keys, "z"), torch.arange(3).float())


def test_local_stream_timeout_consumes_nothing(pid) -> None:
    _produce(pid, 0, 2)
    with pytest.raises(dp.BatchTimeoutError):
        BridgeWorker().add_one(dp.StreamRequest(pid, "inc", 4, ["x"], timeout_s=0.2))
    assert dp.consumption(pid, "inc")["consumed"] == 0


def test_a_meta_and_a_request_together_are_refused(pid) -> None:
    meta = dp.KVBatchMeta(_produce(pid, 0, 2), partition_id=pid, fields=["x"])
    with pytest.raises(TypeError, match="StreamRequest"):
        BridgeWorker().add_one(meta, dp.StreamRequest(pid, "inc", 2, ["x"]))


def test_driver_guard_takes_stream_requests_and_reports_as_metadata() -> None:
    request = dp.StreamRequest("p", "t", 8, ["x"], sampler=dp.GroupSampler("uid", 4), timeout_s=1.0)
    report = StreamReport("p", "t", 3, 1, spans=[{"start": 1.0}], outputs=[{"a": 1.0}])
    check_metadata([request, report], "g", "args")

    class Mine(dp.Sampler):
        pass

    with pytest.raises(DriverDataError, match="sampler of its own"):
        check_metadata(dp.StreamRequest("p", "t", 8, ["x"], sampler=Mine()), "g", "args")
    with pytest.raises(DriverDataError, match=r"outputs"):
        check_metadata(StreamReport("p", "t", outputs=[torch.zeros(1)]), "g", "result")


# ---- through a real two-worker group -----------------------------------------------------------


def test_group_dp_stream_processes_each_produced_row_once(pair, pid) -> None:
    total, per_put = 24, 4
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            for start in range(0, total, per_put):
                _produce(pid, start, per_put)
            dp.finish_partition(pid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    guard = MetadataOnlyGroup(pair, "pair")
    request = dp.StreamRequest(pid, "inc", 4, ["x"], timeout_s=WAIT_S)
    # two calls in flight before any row exists: each rank waits, woken by the producer's puts
    pending = [guard.submit("add_one", request) for _ in range(2)]
    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    reports = [p.result(timeout=WAIT_S) for p in pending]
    while not reports[-1].finished:  # drain: every call takes up to 4 rows per rank
        reports.append(guard.add_one(request))
        assert len(reports) < 20, "the stream never finished"
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors, errors
    assert all(isinstance(r, dp.StreamResult) for r in reports)
    assert sum(r.rows for r in reports) == total
    spans = [s for r in reports for s in r.spans]
    assert sum(s["rows"] for s in spans) == total and {s["rank"] for s in spans} == {0, 1}
    keys = [f"r{i}" for i in range(total)]
    assert torch.equal(_column(pid, keys, "y"), torch.arange(total) + 1)  # every row written once
    counts = dp.consumption(pid, "inc")
    assert counts["consumed"] == counts["produced"] == total and counts["ready"] == 0
    assert guard.driver_bytes > 0


def test_group_mesh_peers_share_one_batch_and_only_the_collect_rank_writes(pair, pid) -> None:
    keys = _produce(pid, 0, 6)
    request = dp.StreamRequest(pid, "dbl", 3, ["x"], timeout_s=WAIT_S)
    first, second = pair.double(request), pair.double(request)
    # both ranks are dp replica 0: they took the same 3 keys per call (consumed 3, not 6, per call)
    assert (first.rows, second.rows) == (3, 3)
    assert dp.consumption(pid, "dbl")["consumed"] == 6
    # rank 1 computed x*2 + 1000 on the same rows but is not a collect rank: nothing of it is stored
    assert torch.equal(_column(pid, keys, "y2"), torch.arange(6) * 2)
    assert [s["rank"] for s in first.spans + second.spans] == [0, 0]


def test_group_one_to_all_stream_is_one_batch_written_once(pair, pid) -> None:
    keys = _produce(pid, 0, 5)
    full, other = pair.stamp(dp.StreamRequest(pid, "st", 5, ["x"], timeout_s=WAIT_S))
    assert (full.rows, other.rows) == (5, 0)
    assert dp.consumption(pid, "st")["consumed"] == 5
    assert _column(pid, keys, "stamp").tolist() == [0] * 5


def test_group_async_stream_method_writes_each_rank_shard(pair, pid) -> None:
    keys = _produce(pid, 0, 4)
    report = pair.async_scale(dp.StreamRequest(pid, "z", 2, ["x"], timeout_s=WAIT_S))
    assert report.rows == 4 and report.batches == 2
    assert sorted(_column(pid, keys, "rank").tolist()) == [0, 0, 1, 1]


def test_group_finished_partition_reports_finished_and_call_on_empty_still_calls(pair, pid) -> None:
    _produce(pid, 0, 3)
    dp.finish_partition(pid)
    per_rank = pair.rows_seen(dp.StreamRequest(pid, "seen", 2, ["x"], timeout_s=WAIT_S))
    assert [r.rows for r in per_rank] == [2, 1] or [r.rows for r in per_rank] == [1, 2]
    again = pair.rows_seen(dp.StreamRequest(pid, "seen", 2, ["x"], timeout_s=WAIT_S))
    assert all(r.finished and r.rows == 0 for r in again)
    assert sorted(o["rank"] for r in again for o in r.outputs) == [0, 1]  # called on the empty batch
    assert all(o["rows"] == 0 for r in again for o in r.outputs)
    drained = pair.add_one(dp.StreamRequest(pid, "inc", 2, ["x"], timeout_s=WAIT_S))
    assert drained.rows == 3
    empty = pair.add_one(dp.StreamRequest(pid, "inc", 2, ["x"], timeout_s=WAIT_S))
    assert empty.finished and empty.rows == 0 and empty.spans == []


def test_group_balanced_sampler_splits_one_batch_over_the_ranks(pair, pid) -> None:
    # SeqlenBalancedSampler needs every rank of a call to pass the same batch_index: the bridge's
    # own index is per call, not per rank, so the two ranks share one balanced global batch
    keys = [f"r{i}" for i in range(4)]
    data = TensorDict({"x": torch.arange(4)}, [4])
    dp.kv_batch_put(keys, pid, fields=data, tags=[{"length": n} for n in (8, 1, 7, 2)])
    sampler = dp.SeqlenBalancedSampler("length", dp_size=2)
    report = pair.add_one(dp.StreamRequest(pid, "bal", 2, ["x"], sampler=sampler, timeout_s=WAIT_S))
    assert report.rows == 4 and sorted(s["rank"] for s in report.spans) == [0, 1]
    assert dp.consumption(pid, "bal")["consumed"] == 4
    assert torch.equal(_column(pid, keys, "y"), torch.arange(4) + 1)
