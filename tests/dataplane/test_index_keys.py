"""The index's keys at scale, on its core and its loop (no Ray): records with no object per key,
listings in pages whose cursors survive clears and compaction, and a dropped partition freed and a
new consumer's stream over a big partition gathered in slices, with other requests answered between."""

from __future__ import annotations

import gc
import threading
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from dataplane.errors import PartitionNotFoundError, WireError
from dataplane.server.checkpoint_files import new_token
from dataplane.server.index import checkpoint as index_checkpoint
from dataplane.server.index.actor import IndexServer
from dataplane.server.index.core import IndexCore
from dataplane.server.index.keytable import COMPACT_MIN_HOLES
from dataplane.server.index.puts import COMMIT_SLICE, ON_NEW_MIN
from dataplane.server.index.records import FREE_SLICE
from dataplane.server.index.streams import BUILD_SLICE
from dataplane.transport.auth import Credentials
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import reply

from .conftest import held_after_first_step, wait_for
from .test_loop_faults import REPLY_MS, _ask, _dealer, _rids


def _commit(core: IndexCore, pid: str, keys: list[str], fields: list[str], tags=None) -> None:
    core.op_commit(_protocol.IndexCommit(partition=pid, keys=keys, fields=fields, tags=tags))


def _page(core: IndexCore, pid: str, limit: int, cursor: str | None = None) -> tuple[list[str], str | None]:
    got = core.op_list(_protocol.ListKeys(pid, limit=limit, cursor=cursor))
    return list(got.list.get(pid, {})), got.cursor


def _all_pages(core: IndexCore, pid: str, limit: int) -> list[str]:
    keys, cursor = _page(core, pid, limit)
    while cursor is not None:
        more, cursor = _page(core, pid, limit, cursor)
        keys += more
    return keys


def test_keys_cost_no_object_of_their_own_and_share_their_field_sets():
    core = IndexCore()
    keys = [f"k{i}" for i in range(20_000)]
    _commit(core, "warm", ["w"], ["x"])  # (the partition's own objects are not per key)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(0, len(keys), 5_000):
        _commit(core, "warm", keys[i : i + 5_000], ["x"])
    _commit(core, "warm", keys[:100], ["y"], tags=[{"i": i} for i in range(100)])
    gc.collect()
    assert len(gc.get_objects()) - before < 200  # (a record per key would be tens of thousands)
    table = core.partitions["warm"].keys
    assert len({id(table[k]) for k in keys[100:]}) == 1 and table[keys[0]] == {"x", "y"}
    assert len({id(table[k]) for k in keys[:100]}) == 1  # the grown set, interned too
    assert table.tag(keys[5]) == {"i": 5} and table.tag(keys[500]) == {}  # tags only where given


def test_what_a_task_takes_leaves_the_collector_nothing_to_walk_again():
    """A consumer's bookkeeping over a big stream: each take it remembers (for retries and give-backs)
    is in a container the garbage collector stops tracking at its first look; a list would be walked
    by every collection until the heap's next freeze (a second of takes: half a million keys)."""
    core = IndexCore()
    _commit(core, "p", [f"k{i}" for i in range(2 * BUILD_SLICE)], ["x"])
    assert core.op_next(_protocol.Next("p", "t", 1000, ["x"])) is None  # (a big stream: gathered first)
    while core.building:
        core.build_some()
    takes = []
    for _ in range(12):
        take = uuid.uuid4().hex
        got = core.op_next(_protocol.Next("p", "t", 1000, ["x"], take=take, lease_s=60.0)).keys
        takes.append((take, got))
    task = core.partitions["p"].streams.tasks["t"]
    gc.collect()
    assert len(task.consumed) == 12_000
    assert [list(task.takes[take]) for take, _ in takes] == [got for _, got in takes]
    assert not any(map(gc.is_tracked, task.takes.values()))
    # A retry of a take still gets its keys, and a give-back puts them first in line again.
    assert core.op_next(_protocol.Next("p", "t", 1000, ["x"], take=takes[0][0])).keys == takes[0][1]
    core.op_release(_protocol.Release("p", "t", takes[1][0]))
    assert core.op_next(_protocol.Next("p", "t", 1000, ["x"])).keys == takes[1][1]


def test_a_listing_pages_in_put_order_and_its_cursor_survives_clears_and_compaction():
    core = IndexCore()
    n = 3 * COMPACT_MIN_HOLES
    keys = [f"k{i}" for i in range(n)]
    _commit(core, "p", keys, ["x"], tags=[{"i": i} if i % 7 == 0 else None for i in range(n)])
    first, cursor = _page(core, "p", 1000)
    assert first == keys[:1000] and cursor is not None
    page = core.op_list(_protocol.ListKeys("p", limit=3)).list["p"]
    assert page == {"k0": {"i": 0}, "k1": {}, "k2": {}}
    # Clear most keys, behind and ahead of the cursor (the rows are compacted), and put new ones.
    gone = set(keys[500 : n - 100])
    core.op_clear(_protocol.Clear("p", sorted(gone)))
    assert len(core.partitions["p"].keys._names) < n  # compacted
    _commit(core, "p", ["new0", "new1", keys[0]], ["x"])  # (k0 again: it keeps its place)
    rest = []
    while cursor is not None:
        more, cursor = _page(core, "p", 7, cursor)
        assert len(more) <= 7
        rest += more
    assert rest == [*keys[n - 100 :], "new0", "new1"]
    assert _all_pages(core, "p", 64) == [k for k in keys if k not in gone] + ["new0", "new1"]
    whole = core.op_list(_protocol.ListKeys("p")).list["p"]  # the whole form agrees
    assert list(whole) == _all_pages(core, "p", 1000) and whole["k7"] == {"i": 7}


def test_a_cursor_of_a_partition_cleared_since_is_refused_and_bad_pages_are_refused():
    core = IndexCore()
    _commit(core, "p", ["a", "b", "c"], ["x"])
    _, cursor = _page(core, "p", 1)
    core.op_clear_partition(_protocol.OnePartition("p"))
    _commit(core, "p", ["a", "b", "c"], ["x"])  # a new partition of the same name
    with pytest.raises(PartitionNotFoundError, match="cleared since this listing began"):
        _page(core, "p", 1, cursor)
    assert _page(core, "absent", 5) == ([], None)
    names = core.op_list(_protocol.ListKeys(None, limit=0)).list
    assert names == {"p": {}}
    with pytest.raises(WireError, match="not a cursor"):
        _page(core, "p", 1, "garbage")
    with pytest.raises(WireError, match="one partition"):
        core.op_list(_protocol.ListKeys(None, limit=5))
    with pytest.raises(WireError, match="at least 1 key"):  # its cursor would never move
        core.op_list(_protocol.ListKeys("p", limit=0))


def test_a_cleared_partition_is_gone_at_once_and_freed_in_slices():
    core = IndexCore()
    n = 3 * FREE_SLICE + 5
    keys = [f"k{i}" for i in range(n)]
    _commit(core, "big", keys, ["x"])
    core.op_next(_protocol.Next(partition="big", task="t", fields=["x"], batch_size=FREE_SLICE))
    assert core.op_clear_partition(_protocol.OnePartition("big")).existed
    assert "big" not in core.op_stats(_protocol.Stats()).partitions  # gone for every caller now
    _commit(core, "big", ["fresh"], ["x"])  # a new partition of the name meanwhile
    freed = []
    while core.dropped:
        freed.append(core.free_some())
        assert freed[-1] <= FREE_SLICE
    assert sum(freed) >= n and len(freed) > 3  # every key (and its consumer's state) a slice at a time
    assert list(core.partitions["big"].keys) == ["fresh"]


@pytest.fixture
def creds() -> Credentials:
    return Credentials.new(encrypt=False)


def test_the_loop_frees_one_slice_per_pass_and_does_not_wait_meanwhile(creds: Credentials):
    core = IndexCore()
    _commit(core, "big", [f"k{i}" for i in range(2 * FREE_SLICE + 1)], ["x"])
    server = IndexServer(core, "127.0.0.1", f"ik-index-{uuid.uuid4().hex[:6]}", creds)
    try:
        assert server.poll_timeout_ms() > 0  # idle: the loop waits for requests
        core.op_clear_partition(_protocol.OnePartition("big"))
        passes = 0
        while core.dropped:
            assert server.poll_timeout_ms() == 0  # work left: poll for requests, do not wait
            table = core.dropped[0].keys
            left = len(table)
            server.after_poll()  # one pass of the loop after its poll: one slice, then requests again
            assert left - len(table) <= FREE_SLICE
            passes += 1
        assert passes >= 3 and server.poll_timeout_ms() > 0
        _commit(core, "big", [f"k{i}" for i in range(BUILD_SLICE + 1)], ["x"])
        assert core.op_next(_protocol.Next(partition="big", task="t", fields=["x"], batch_size=1)) is None
        assert server.poll_timeout_ms() == 0  # a stream being gathered: no wait either
        server.after_poll()
        server.after_poll()
        assert not core.building and server.poll_timeout_ms() > 0
    finally:
        server.start()  # (its loop closes the sockets as it stops)
        server.stop()


def test_a_new_task_finds_the_ready_keys_in_put_order_whatever_fields_the_others_hold():
    core = IndexCore()
    _commit(core, "p", ["a", "b", "c", "d"], ["x"])
    core.op_clear(_protocol.Clear("p", ["b"]))
    _commit(core, "p", ["b"], ["x"])  # (put again: last now)
    _commit(core, "p", ["c"], ["y"])

    def first(task: str, fields: list[str]) -> list[str]:
        got = core.op_ready(_protocol.Ready(partition="p", task=task, fields=fields))
        assert got is not None
        return [key for key, _ in got.rows]

    assert first("all-x", ["x"]) == ["a", "c", "d", "b"]  # every key holds x (the key dict itself)
    assert first("x-and-y", ["x", "y"]) == ["c"]  # some do (a walk over the rows)
    _commit(core, "p", ["e"], ["y"])
    assert first("y", ["y"]) == ["c", "e"]


def test_keys_cleared_oldest_first_are_cut_off_the_front_and_every_lookup_still_holds():
    core = IndexCore()
    keys = [f"k{i}" for i in range(3 * COMPACT_MIN_HOLES)]
    _commit(core, "p", keys, ["x"])
    _, cursor = _page(core, "p", 10)
    table = core.partitions["p"].keys
    cut = 9000  # (more holes than keys left: a compaction, were they not cut off the front)
    for i in range(0, cut, 1000):  # a consumer clearing what it took, in batches
        core.op_clear(_protocol.Clear("p", keys[i : i + 1000]))
        assert len(table._names) == len(table)  # no hole kept
    _commit(core, "p", [keys[-1], "new"], ["y"])
    rest = keys[cut:]
    assert list(table) == [*rest, "new"] and table[keys[-1]] == {"x", "y"} and table["new"] == {"y"}
    assert keys[0] not in table and table[rest[0]] == {"x"}
    assert _all_pages(core, "p", 999) == [*rest, "new"]
    assert _page(core, "p", 2, cursor)[0] == rest[:2]  # a cursor from before the clears goes on


def _ready(core: IndexCore, task: str, fields: list[str]) -> list[str] | None:
    got = core.op_ready(_protocol.Ready(partition="p", task=task, fields=fields, limit=1 << 20))
    return None if got is None else [key for key, _ in got.rows]


def test_a_new_stream_over_a_big_partition_is_gathered_in_slices_in_ready_order():
    core = IndexCore()
    n = 2 * BUILD_SLICE + 10
    keys = [f"k{i}" for i in range(n)]
    _commit(core, "p", keys, ["x"])
    x, xy = frozenset({"x"}), frozenset({"x", "y"})
    first = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=3)
    assert core.op_next(first) is None and _ready(core, "u", ["x", "y"]) is None  # gathering: wait
    streams = core.partitions["p"].streams
    t, u = streams.tasks["t"].streams[x], streams.tasks["u"].streams[xy]
    assert core.op_consumption(_protocol.Consumption("p", "t")).ready == n  # right meanwhile
    core.op_clear(_protocol.Clear("p", ["k1"]))  # ahead of the walk
    late = [f"late{i}" for i in range(1, ON_NEW_MIN + 2)]
    _commit(core, "p", late[:1], ["x"])  # after the stream was asked for: one key, then many at once
    _commit(core, "p", late[1:], ["x"])
    core.changed.clear()
    while u.build is not None and u.build.cursor == 0:  # t whole, u's walk begun
        core.build_some()
    assert t.build is None and "p" in core.changed and core.op_next(first).keys == ["k0", "k2", "k3"]
    _commit(core, "p", ["k0", keys[-1]], ["y"])  # behind u's walk, and ahead of it
    _commit(core, "p", ["both"], ["x", "y"])
    while core.building:
        core.build_some()
    assert _ready(core, "t", ["x"]) == [*keys[4:], *late, "both"]
    assert _ready(core, "u", ["x", "y"]) == [keys[-1], "k0", "both"]  # as they became ready


def test_a_sequential_take_is_served_from_the_first_slices_of_a_stream_being_gathered():
    """A new stream over a big partition is gathered a slice at a time; a sequential take is
    answered as soon as the walk has found its batch (the walk goes in ready order, so those are
    the rows the whole stream would hand out first), while a grouped take, a bigger batch, and a
    finished partition's short last batch wait for the stream to be whole."""
    core = IndexCore()
    n = 3 * BUILD_SLICE
    keys = [f"k{i}" for i in range(n)]
    _commit(core, "p", keys, ["x"], tags=[{"g": i // 2} for i in range(n)])  # (groups of two)
    take = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=5)
    grouped = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=2,
                             sampler={"name": "group", "group_tag": "g", "group_size": 2})  # fmt: skip
    assert core.op_next(take) is None  # (asked first: the walk has found nothing yet)
    core.op_clear(_protocol.Clear("p", ["k2"]))  # ahead of the walk
    core.changed.clear()
    core.build_some()
    stream = core.partitions["p"].streams.tasks["t"].streams[frozenset({"x"})]
    assert stream.build is not None and "p" in core.changed  # one slice: waiting takes look again
    assert core.op_next(take).keys == ["k0", "k1", "k3", "k4", "k5"]
    assert core.op_next(grouped) is None  # (whole groups are ready: it waits for the stream)
    core.op_finish(_protocol.OnePartition("p"))
    big = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=n)
    assert core.op_next(big) is None  # not a short batch of what the walk has found so far
    while core.building:
        core.build_some()
    assert core.op_next(big).keys == keys[6:]  # the rest, in order, none twice


def test_a_reset_over_a_big_partition_gathers_the_streams_again_in_slices():
    """A reset makes every row ready again; over a big partition its streams are gathered again a
    slice at a time (one step over the partition before), takes waiting until they are whole."""
    core = IndexCore()
    n = 2 * BUILD_SLICE + 10
    keys = [f"k{i}" for i in range(n)]
    _commit(core, "p", keys, ["x"])
    take = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=3)
    while (got := core.op_next(take)) is None:  # (the first ask gathers the stream)
        core.build_some()
    assert got.keys == keys[:3]
    core.op_reset(_protocol.Reset(partition="p", task="t"))
    assert core.op_next(take) is None and core.building  # gathering again: wait
    assert core.op_consumption(_protocol.Consumption("p", "t")).consumed == 0
    core.build_some()
    assert core.building  # one slice, not the whole partition
    _commit(core, "p", ["late"], ["x"])
    while core.building:
        core.build_some()
    assert core.op_next(take).keys == keys[:3] and _ready(core, "t", ["x"]) == [*keys[3:], "late"]


def test_requests_are_answered_while_a_big_clear_is_freed_and_a_big_stream_is_gathered(
    creds: Credentials, monkeypatch
):
    """Through the loop and its sockets: while a cleared partition's keys wait to be freed and a new
    consumer's stream over a big partition waits to be gathered (held by a gate, so the order is
    certain), a put, a 1-row take and a consumption of another partition are answered; the parked
    take over the big partition is answered once its stream is whole."""
    core = IndexCore()
    _commit(core, "cleared", [f"c{i}" for i in range(2 * FREE_SLICE + 1)], ["x"])
    big = [f"b{i}" for i in range(2 * BUILD_SLICE + 1)]
    _commit(core, "big", big, ["x"])
    go = threading.Event()
    for name in ("free_some", "build_some"):
        real = getattr(core, name)
        monkeypatch.setattr(core, name, lambda real=real: real() if go.is_set() else 0)
    server = IndexServer(core, "127.0.0.1", f"ik-index-{uuid.uuid4().hex[:6]}", creds)
    server.start()
    ctx = zmq.Context()
    try:
        sock = _dealer(ctx, creds, server)
        assert _ask(sock, "clear_partition", {"partition": "cleared"}).error is None
        take = {"task": "t", "batch_size": 2, "fields": ["x"], "timeout_s": 30.0}
        rid = next(_rids)  # parked: its stream is being gathered
        sock.send_multipart(_wire.encode_request(rid, "next", {**take, "partition": "big"}))
        assert _ask(sock, "commit", {"partition": "small", "keys": ["s"], "fields": ["x"]}).error is None
        got = _ask(sock, "next", {**take, "partition": "small", "batch_size": 1})
        assert reply(got.body, _protocol.BatchReply).keys == ["s"]
        assert reply(_ask(sock, "consumption", {"partition": "small", "task": "t"}).body,
                     _protocol.ConsumptionReply).consumed == 1  # fmt: skip
        assert core.dropped and core.building  # all of it answered before either was done
        go.set()
        assert sock.poll(REPLY_MS)
        parked = _wire.decode_raw_reply(sock.recv_multipart())[0]
        assert parked.rid == rid and reply(parked.body, _protocol.BatchReply).keys == big[:2]
        wait_for(lambda: not core.dropped, REPLY_MS / 1000, "the cleared partition to be freed")
    finally:
        server.stop()
        ctx.destroy(linger=0)


def test_a_commit_of_many_new_keys_makes_them_ready_at_once_for_the_streams_that_want_them():
    core = IndexCore()
    _commit(core, "p", ["a"], ["x"])
    take = _protocol.Next(partition="p", task="t", fields=["x"], batch_size=1)
    assert core.op_next(take).keys == ["a"]
    assert _ready(core, "u", ["x", "y"]) is None  # (a stream waiting for two fields)
    new = [f"n{i}" for i in range(ON_NEW_MIN)]
    _commit(core, "p", new, ["x"])
    assert _ready(core, "t", ["x"]) == new and _ready(core, "u", ["x", "y"]) is None
    _commit(core, "p", new[::-1], ["y"])  # (keys that exist: one at a time, in commit order)
    assert _ready(core, "u", ["x", "y"]) == new[::-1]


def test_requests_are_answered_while_the_index_writes_a_checkpoint(creds: Credentials, monkeypatch, tmp_path):
    """Through the loop and its sockets: a checkpoint save whose file write stalls (held by a gate,
    as slow storage would) holds up no other request; the save is answered once the file is written,
    with the partitions as they were when it began."""
    core = IndexCore()
    _commit(core, "big", [f"b{i}" for i in range(100)], ["x"])
    writing, go = threading.Event(), threading.Event()
    real = index_checkpoint.write_small

    def stalled(*args: Any) -> dict[str, int]:
        writing.set()
        assert go.wait(REPLY_MS / 1000)
        return real(*args)

    monkeypatch.setattr(index_checkpoint, "write_small", stalled)
    server = IndexServer(core, "127.0.0.1", f"ik-index-{uuid.uuid4().hex[:6]}", creds)
    server.start()
    ctx = zmq.Context()
    try:
        sock = _dealer(ctx, creds, server)
        token = new_token()
        (tmp_path / token).touch()
        rid = next(_rids)
        sock.send_multipart(
            _wire.encode_request(rid, "checkpoint_save", {"path": str(tmp_path), "token": token})
        )
        assert writing.wait(REPLY_MS / 1000)
        assert _ask(sock, "commit", {"partition": "small", "keys": ["s"], "fields": ["x"]}).error is None
        got = _ask(sock, "next", {"partition": "small", "task": "t", "batch_size": 1, "fields": ["x"]})
        assert reply(got.body, _protocol.BatchReply).keys == ["s"]
        go.set()
        assert sock.poll(REPLY_MS)
        saved = _wire.decode_raw_reply(sock.recv_multipart())[0]
        assert saved.rid == rid
        assert reply(saved.body, _protocol.CheckpointSaveReply).partitions == {"big": 100}
    finally:
        go.set()
        server.stop()
        ctx.destroy(linger=0)


def test_a_big_commit_is_recorded_in_slices_with_other_requests_answered_between(
    creds: Credentials, monkeypatch
):
    """Through the loop and its sockets: a big commit is recorded a slice per step; held after its
    first slice (by a gate the job waits on, the loop free), a 1-key commit sent meanwhile is answered
    at once; the big one then records every key."""
    core = IndexCore()
    started, gate = threading.Event(), Future()
    real = core.job_commit

    def gated(body: Any) -> Any:
        job = real(body)
        return held_after_first_step(job, started, gate) if body.partition == "big" else job

    monkeypatch.setattr(core, "job_commit", gated)
    server = IndexServer(core, "127.0.0.1", f"ik-index-{uuid.uuid4().hex[:6]}", creds)
    server.start()
    ctx = zmq.Context()
    big = [f"b{i}" for i in range(3 * COMMIT_SLICE)]
    try:
        sock = _dealer(ctx, creds, server)
        rid = next(_rids)
        sock.send_multipart(
            _wire.encode_request(rid, "commit", {"partition": "big", "keys": big, "fields": ["x"]})
        )
        assert started.wait(REPLY_MS / 1000)
        assert len(core.partitions["big"].keys) == COMMIT_SLICE  # one slice recorded
        assert _ask(sock, "commit", {"partition": "small", "keys": ["s"], "fields": ["x"]}).error is None
        gate.set_result(None)
        assert sock.poll(REPLY_MS)
        rep = _wire.decode_raw_reply(sock.recv_multipart())[0]
        assert rep.rid == rid and rep.error is None
        assert list(core.partitions["big"].keys) == big
    finally:
        if not gate.done():
            gate.set_result(None)
        server.stop()
        ctx.destroy(linger=0)


def test_a_task_s_consumed_keys_come_a_page_at_a_time():
    """``consumed`` (TransferQueue's per-row status) looks at ``limit`` keys of the partition per
    request, in key order: a take between two pages shows in the pages after it; a cleared key is
    a hole a page steps over; a cursor of a partition cleared since is refused, a bad one named."""
    core = IndexCore()
    keys = [f"k{i}" for i in range(10)]
    _commit(core, "p", keys, ["x"])

    def take(n: int) -> None:
        assert core.op_next(_protocol.Next(partition="p", task="t", batch_size=n, fields=["x"])) is not None

    def page(cursor: str | None, task: str = "t") -> tuple[list[str], str | None]:
        got = core.op_consumed(_protocol.Consumed("p", task, 4, cursor))
        return got.keys, got.cursor

    take(3)
    core.op_clear(_protocol.Clear("p", ["k1"]))
    first, cursor = page(None)
    assert first == ["k0", "k2"]  # (four rows looked at: k1 a hole, k3 not taken yet)
    take(7)
    second, after = page(cursor)
    third, end = page(after)
    assert second == keys[4:8] and third == keys[8:] and end is None
    assert page(None, "nobody")[0] == [] and core.op_consumed(_protocol.Consumed("q", "t", 4)).keys == []
    with pytest.raises(WireError, match="walk of consumed keys: 'x' is not a cursor"):
        page("x")
    core.op_clear_partition(_protocol.OnePartition("p"))
    _commit(core, "p", keys, ["x"])
    with pytest.raises(PartitionNotFoundError, match="cleared since this walk of consumed keys began"):
        page(cursor)
