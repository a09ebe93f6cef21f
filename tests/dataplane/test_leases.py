"""The index's delivery bookkeeping without Ray or sockets: takes filed by id, given back by id,
leases that run out, acknowledgements (the store-level behaviour is in ``test_delivery.py``)."""

from __future__ import annotations

import time

import pytest

from dataplane.errors import DataplaneError, WireError
from dataplane.server import index_streaming
from dataplane.server.index import IndexCore
from dataplane.wire import protocol as _protocol

from .test_samplers import PENDING, call, put


def take(
    core: IndexCore, pid: str, n: int, take_id: str, lease_s: float | None = None, **kw
) -> list[str] | None:
    body = {
        "pid": pid,
        "task": "t",
        "batch_size": n,
        "fields": ["x"],
        "take": take_id,
        "lease_s": lease_s,
        **kw,
    }
    res = call(core, "next", body)
    return None if res == PENDING else res.keys


def counts(core: IndexCore, pid: str = "p") -> tuple[int, int, int]:
    c = call(core, "consumption", {"pid": pid, "task": "t"})
    return c.consumed, c.ready, c.leased


def later(core: IndexCore, seconds: float) -> None:
    core.expire_leases(time.monotonic() + seconds)


def test_a_take_given_back_by_id_is_first_in_line_and_its_id_is_spent():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 2, "T1") == ["a", "b"]
    assert take(core, "p", 2, "T1") == ["a", "b"]  # a retry of the same take: the same keys
    assert call(core, "release", {"pid": "p", "task": "t", "take": "T1"}) == _protocol.ReleaseReply(2, True)
    assert counts(core) == (0, 3, 0)
    with pytest.raises(DataplaneError, match="given back"):
        take(core, "p", 2, "T1")  # a late duplicate of a given-back take
    assert take(core, "p", 3, "T2") == ["a", "b", "c"]
    assert call(core, "release", {"pid": "q", "task": "t", "take": "T3"}).known is False
    with pytest.raises(DataplaneError, match="given back"):
        take(core, "q", 1, "T3")  # the release overtook it


def test_a_lease_runs_out_unless_acknowledged():
    core = IndexCore()
    put(core, "p", ["a", "b", "c", "d"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    assert take(core, "p", 2, "L2", lease_s=5) == ["c", "d"]
    assert counts(core) == (4, 0, 4)
    assert call(
        core, "ack", {"pid": "p", "task": "t", "take": "L1", "keys": ["a", "b"]}
    ) == _protocol.AckReply([])
    assert call(core, "ack", {"pid": "p", "task": "t", "take": "L2", "keys": ["c"]}) == _protocol.AckReply([])
    core.changed.clear()
    later(core, 1)
    assert counts(core) == (4, 0, 1) and not core.changed  # not due yet
    later(core, 6)
    assert core.changed == {"p"} and counts(core) == (3, 1, 0)  # "d" is back
    assert call(core, "ack", {"pid": "p", "task": "t", "take": "L2", "keys": ["d"]}) == _protocol.AckReply(
        ["d"]
    )
    assert call(core, "ack", {"pid": "p", "task": "t", "take": "L1", "keys": ["a"]}) == _protocol.AckReply(
        []
    )  # again
    assert take(core, "p", 1, "T3") == ["d"]
    assert call(core, "ack", {"pid": "p", "task": "t", "take": "L2", "keys": ["d"]}) == _protocol.AckReply(
        ["d"]
    )


def test_cleared_and_reset_rows_leave_their_leases():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    call(core, "clear", {"pid": "p", "keys": ["a"]})
    assert counts(core) == (1, 1, 1)
    call(core, "reset", {"pid": "p", "task": "t"})
    assert counts(core) == (0, 2, 0)
    later(core, 10)  # the lease's deadline comes up: nothing is left to give back
    assert counts(core) == (0, 2, 0)


def test_a_lapsed_lease_of_a_rank_aware_slot_frees_the_slot():
    """TP peers share a slot's keys; if the lease runs out the slot's consumer is gone, so the keys go
    back to the task (a peer asking the slot later gets a fresh choice)."""
    core = IndexCore()
    put(core, "p", ["a", "b", "c", "d"], ["x"])
    slot = {"dp_rank": 0, "dp_size": 2, "batch_index": 0}
    assert take(core, "p", 2, "L1", lease_s=5, **slot) == ["a", "b"]
    res = call(core, "next", {"pid": "p", "task": "t", "batch_size": 2, "fields": ["x"], "take": "P", **slot})
    assert res.keys == ["a", "b"] and res.lease == "L1"  # a peer acknowledges under the lease's id
    later(core, 10)
    assert counts(core) == (0, 4, 0)
    assert take(core, "p", 2, "L2", **slot) == ["a", "b"]


def test_the_lease_queue_sheds_acknowledged_leases(monkeypatch):
    monkeypatch.setattr(index_streaming, "LEASE_HEAP_COMPACT", 8)
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(20)], ["x"])
    for i in range(10):
        take(core, "p", 1, f"L{i}", lease_s=60 + i)
        if i:
            call(core, "ack", {"pid": "p", "task": "t", "take": f"L{i}", "keys": [f"k{i}"]})
    core.expire_leases(time.monotonic())
    assert [e[4] for e in core.lease_due] == ["L0"]


def test_bad_sampler_arguments_are_refused_before_the_partition_exists():
    """A consumer of a partition nobody wrote yet waits for it; its arguments are checked first."""
    core = IndexCore()
    bad = {"pid": "nobody", "task": "t", "batch_size": 2, "fields": ["x"], "dp_rank": 3, "dp_size": 2}
    with pytest.raises(WireError, match="dp_rank must be below dp_size"):
        call(core, "next", bad)
    grouped = {**bad, "dp_rank": 0, "sampler": {"name": "group", "group_tag": "uid", "group_size": 4}}
    with pytest.raises(WireError, match="not a multiple of group_size 4"):
        call(core, "next", grouped)
