"""The index's delivery bookkeeping without Ray or sockets: takes filed by id, given back by id,
leases that run out, acknowledgements (the store-level behaviour is in ``test_delivery.py``)."""

from __future__ import annotations

import time

import pytest

from dataplane.errors import DataplaneError, WireError
from dataplane.server.index import streaming as index_streaming
from dataplane.server.index.core import IndexCore
from dataplane.wire import protocol as _protocol

from .test_samplers import PENDING, call, put


def take(
    core: IndexCore, pid: str, n: int, take_id: str, lease_s: float | None = None, **kw
) -> list[str] | None:
    body = {
        "partition": pid,
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
    c = call(core, "consumption", {"partition": pid, "task": "t"})
    return c.consumed, c.ready, c.leased


def later(core: IndexCore, seconds: float) -> None:
    core.expire_leases(time.monotonic() + seconds)


def test_a_take_given_back_by_id_is_first_in_line_and_its_id_is_spent():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 2, "T1") == ["a", "b"]
    assert take(core, "p", 2, "T1") == ["a", "b"]  # a retry of the same take: the same keys
    assert call(core, "release", {"partition": "p", "task": "t", "take": "T1"}) == _protocol.ReleaseReply(
        2, True
    )
    assert counts(core) == (0, 3, 0)
    with pytest.raises(DataplaneError, match="given back"):
        take(core, "p", 2, "T1")  # a late duplicate of a given-back take
    assert take(core, "p", 3, "T2") == ["a", "b", "c"]
    assert call(core, "release", {"partition": "q", "task": "t", "take": "T3"}).known is False
    with pytest.raises(DataplaneError, match="given back"):
        take(core, "q", 1, "T3")  # the release overtook it


def test_a_lease_runs_out_unless_acknowledged():
    core = IndexCore()
    put(core, "p", ["a", "b", "c", "d"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    assert take(core, "p", 2, "L2", lease_s=5) == ["c", "d"]
    assert counts(core) == (4, 0, 4)
    assert call(
        core, "ack", {"partition": "p", "task": "t", "take": "L1", "keys": ["a", "b"]}
    ) == _protocol.AckReply([])
    assert call(
        core, "ack", {"partition": "p", "task": "t", "take": "L2", "keys": ["c"]}
    ) == _protocol.AckReply([])
    core.changed.clear()
    later(core, 1)
    assert counts(core) == (4, 0, 1) and not core.changed  # not due yet
    later(core, 6)
    assert core.changed == {"p"} and counts(core) == (3, 1, 0)  # "d" is back
    assert call(
        core, "ack", {"partition": "p", "task": "t", "take": "L2", "keys": ["d"]}
    ) == _protocol.AckReply(["d"])
    assert call(
        core, "ack", {"partition": "p", "task": "t", "take": "L1", "keys": ["a"]}
    ) == _protocol.AckReply([])  # again
    assert take(core, "p", 1, "T3") == ["d"]
    assert call(
        core, "ack", {"partition": "p", "task": "t", "take": "L2", "keys": ["d"]}
    ) == _protocol.AckReply(["d"])


def test_cleared_and_reset_rows_leave_their_leases():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    call(core, "clear", {"partition": "p", "keys": ["a"]})
    assert counts(core) == (1, 1, 1)
    call(core, "reset", {"partition": "p", "task": "t"})
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
    res = call(
        core, "next", {"partition": "p", "task": "t", "batch_size": 2, "fields": ["x"], "take": "P", **slot}
    )
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
            call(core, "ack", {"partition": "p", "task": "t", "take": f"L{i}", "keys": [f"k{i}"]})
    core.expire_leases(time.monotonic())
    assert [e[4] for e in core.lease_due] == ["L0"]


def test_bad_sampler_arguments_are_refused_before_the_partition_exists():
    """A consumer of a partition nobody wrote yet waits for it; its arguments are checked first."""
    core = IndexCore()
    bad = {"partition": "nobody", "task": "t", "batch_size": 2, "fields": ["x"], "dp_rank": 3, "dp_size": 2}
    with pytest.raises(WireError, match="dp_rank must be below dp_size"):
        call(core, "next", bad)
    grouped = {**bad, "dp_rank": 0, "sampler": {"name": "group", "group_tag": "uid", "group_size": 4}}
    with pytest.raises(WireError, match="not a multiple of group_size 4"):
        call(core, "next", grouped)


def _release(core: IndexCore, take_id: str) -> int:
    return call(core, "release", {"partition": "p", "task": "t", "take": take_id}).released


def _ack(core: IndexCore, take_id: str, keys: list[str]) -> list[str]:
    return call(core, "ack", {"partition": "p", "task": "t", "take": take_id, "keys": keys}).late


def test_a_release_after_the_ack_gives_back_nothing():
    """``try: ...; ack() finally: release()``: the acknowledged rows stay taken."""
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=30) == ["a", "b"]
    assert _ack(core, "L1", ["a", "b"]) == []
    assert _release(core, "L1") == 0
    assert counts(core) == (2, 1, 0)
    assert take(core, "p", 1, "T2") == ["c"]  # nothing acknowledged is delivered again
    assert take(core, "p", 1, "T3") is None


def test_a_release_after_a_partial_ack_gives_back_only_the_rest():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert take(core, "p", 3, "L1", lease_s=30) == ["a", "b", "c"]
    assert _ack(core, "L1", ["b"]) == []
    assert _release(core, "L1") == 2
    assert counts(core) == (1, 2, 0)
    assert take(core, "p", 2, "T2") == ["a", "c"]
    assert _release(core, "L1") == 0  # twice: nothing more


def test_a_release_after_the_lease_ran_out_leaves_the_rows_with_their_new_taker():
    core = IndexCore()
    put(core, "p", ["a", "b"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    later(core, 10)  # the lease runs out: the rows go back ...
    assert take(core, "p", 2, "L2", lease_s=30) == ["a", "b"]  # ... and another take gets them
    assert _release(core, "L1") == 0
    assert counts(core) == (2, 0, 2)  # still L2's
    assert _ack(core, "L2", ["a", "b"]) == []


def test_acknowledged_leases_are_forgotten_with_their_takes(monkeypatch):
    """A lease acknowledged in full is kept (empty) so a release finds it, but no longer than its take."""
    from dataplane.server.index import streams

    monkeypatch.setattr(streams, "TAKE_MEMORY", 4)
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(10)], ["x"])
    for i in range(10):
        take(core, "p", 1, f"L{i}", lease_s=600)
        assert _ack(core, f"L{i}", [f"k{i}"]) == []
    leases = core.partitions["p"].streams.tasks["t"].leases
    assert sorted(leases) == ["L6", "L7", "L8", "L9"] and not any(lease.keys for lease in leases.values())


def test_a_finished_partition_is_not_drained_while_rows_of_it_are_leased():
    """The last rows are leased: a draining take waits (None: parked) instead of answering empty, and
    is woken by the ack (then empty) or by the lease running out (then those rows). "Finished" tells a
    sampler that no more rows will come, so a short last batch waits for the leases to settle too."""
    core = IndexCore()
    put(core, "p", ["a", "b", "c", "d", "e"], ["x"])
    assert take(core, "p", 2, "L1", lease_s=5) == ["a", "b"]
    call(core, "finish", {"partition": "p"})
    assert take(core, "p", 2, "T2") == ["c", "d"]
    assert take(core, "p", 4, "T3") is None  # "e" is ready, "a", "b" leased: not the last batch yet
    c = call(core, "consumption", {"partition": "p", "task": "t"})
    assert (c.finished, c.ready, c.leased, c.drained) == (True, 1, 2, False)
    ready = call(core, "ready", {"partition": "p", "task": "t", "fields": ["x"], "min_rows": 2})
    assert ready == PENDING  # a sampler of the client's own waits too
    later(core, 10)  # the holder died: the rows come back to the draining consumer
    assert take(core, "p", 4, "T3") == ["a", "b", "e"]
    assert take(core, "p", 4, "T4") == []
    assert call(core, "consumption", {"partition": "p", "task": "t"}).drained is True

    put(core, "q", ["a", "b"], ["x"])
    body = {"partition": "q", "task": "t", "batch_size": 2, "fields": ["x"], "take": "M1", "lease_s": 60}
    assert call(core, "next", body).keys == ["a", "b"]
    call(core, "finish", {"partition": "q"})
    core.changed.clear()
    assert call(core, "next", {**body, "take": "M2", "lease_s": None}) == PENDING
    call(core, "ack", {"partition": "q", "task": "t", "take": "M1", "keys": ["a", "b"]})
    assert "q" in core.changed  # the ack wakes the parked take: now drained, it answers empty
    assert call(core, "next", {**body, "take": "M2", "lease_s": None}).keys == []
    ready = call(core, "ready", {"partition": "q", "task": "t", "fields": ["x"], "min_rows": 1})
    assert ready.finished is True and ready.rows == []
