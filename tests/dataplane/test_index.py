"""IndexCore, the wire codec, row assembly and placement: pure tests, no Ray, no sockets."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from dataplane.client.sharding import HashPlacement
from dataplane.codec.columns import encode_fields
from dataplane.codec.rows import assemble, contiguous_view
from dataplane.errors import (
    KeyNotFoundError,
    ReservationExpiredError,
    SchemaError,
    ShardUnavailableError,
    WireError,
)
from dataplane.server.index.core import IndexCore
from dataplane.server.index.records import CLEARED_KEYS_KEPT, CLEARED_PARTITIONS_KEPT
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol

F32 = ["dense", "float32", [4]]
I64 = ["dense", "int64", [4]]


def call(core: IndexCore, op: str, body: dict) -> Any:
    """One request as the index serves it: the body msgpack-encoded, then decoded for its op; the reply
    is the op's reply struct (``wire.protocol.INDEX_REPLIES``)."""
    return core.handle(op, msgspec.msgpack.encode(body), [])[0]


def prepare(core: IndexCore, pid: str, specs: dict, txn: int) -> _protocol.PrepareReply:
    """A put's prepare; ``txn`` is the put's id, chosen by its client."""
    return call(core, "prepare", {"partition": pid, "specs": specs, "txn": txn})


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_index_decides_a_new_fields_schema_at_prepare():
    core = IndexCore()
    assert prepare(core, "p", {"x": F32}, 1) == _protocol.PrepareReply(txn=1)
    with pytest.raises(SchemaError, match="'x'"):  # a racing put of another dtype: refused at once
        prepare(core, "p", {"x": I64}, 2)
    prepare(core, "p", {"x": F32}, 3)  # the same spec: fine
    call(core, "abort", {"txn": 1})
    with pytest.raises(SchemaError, match="'x'"):  # 3 still relies on it
        prepare(core, "p", {"x": I64}, 4)
    call(core, "commit", {"partition": "p", "keys": ["a"], "fields": ["x"], "txn": 3})
    with pytest.raises(SchemaError, match="'x'"):
        prepare(core, "p", {"x": I64}, 5)
    prepare(core, "q", {"x": I64}, 6)  # partitions are separate
    # a prepared put that gave up leaves no schema behind
    prepare(core, "p", {"y": F32}, 7)
    call(core, "abort", {"txn": 7})
    prepare(core, "p", {"y": ["dense", "int8", []]}, 8)
    with pytest.raises(SchemaError, match="'z'.*dtype 'float99'"):  # specs a shard could not size
        prepare(core, "p", {"z": ["dense", "float99", []]}, 9)
    with pytest.raises(WireError, match="already open"):  # put ids are the clients': one may repeat
        prepare(core, "p", {"w": F32}, 8)
    for txn in (0, -1, 2**63):
        with pytest.raises(WireError):
            prepare(core, "p", {"w": F32}, txn)


def test_a_prepare_expires_with_the_reservations_of_its_put():
    """A put whose writer died (or gave up) after its prepare holds its new fields only as long as
    the shards hold its reservations: past ``reservation_timeout_s`` they are undecided again, and
    a commit that comes later is refused with nothing recorded, as the shards refuse theirs."""
    clock = Clock()
    core = IndexCore(prepare_ttl_s=10.0, clock=clock)
    call(core, "commit", {"partition": "p", "keys": ["a"], "fields": ["x"], "specs": {"x": F32}})  # x decided
    prepare(core, "p", {"x": F32, "y": F32, "z": F32}, 1)  # y, z are new: decided while put 1 is open
    clock.now += 9.9
    with pytest.raises(SchemaError, match="'y'.*put in flight") as err:
        prepare(core, "p", {"y": I64}, 2)
    assert "10s" in str(err.value), err.value  # says how long the in-flight put may hold it
    clock.now += 0.1
    assert prepare(core, "p", {"y": I64}, 3) == _protocol.PrepareReply(
        txn=3
    )  # put 1 expired: y undecided, 3 decides it
    one_trip = {"partition": "p", "keys": ["c"], "fields": ["z"], "specs": {"z": I64}}  # a put_ready's commit
    call(core, "commit", one_trip)  # z is undecided again too
    with pytest.raises(SchemaError, match="'x'"):  # a field decided by a commit stays decided
        prepare(core, "p", {"x": I64}, 4)
    with pytest.raises(ReservationExpiredError, match="put 1 .*expired.*nothing was recorded"):
        call(core, "commit", {"partition": "p", "keys": ["b"], "fields": ["x", "y"], "txn": 1})
    assert call(core, "list", {"partition": "p"}).list == {"p": {"a": {}, "c": {}}}  # b was not recorded
    with pytest.raises(ReservationExpiredError):  # a put id the index never saw: refused alike
        call(core, "commit", {"partition": "p", "keys": ["b"], "fields": ["x"], "txn": 77})
    call(core, "commit", {"partition": "p", "keys": ["b"], "fields": ["y"], "txn": 3})
    assert call(core, "stats", {}).puts == {"open": 0, "aborted": 0, "expired": 1, "refused": 0}


def test_an_abort_that_overtakes_its_prepare_makes_the_index_refuse_the_prepare():
    """A client aborts every prepare it sent, answered or not (the index may have been stalled): an
    abort of a put the index has not seen yet is remembered, and the prepare, when it arrives, is
    refused and decides nothing. The memory of such an abort lasts as long as a prepare would."""
    clock = Clock()
    core = IndexCore(prepare_ttl_s=10.0, clock=clock)
    assert call(core, "abort", {"txn": 5}) == _protocol.Done()
    with pytest.raises(ReservationExpiredError, match="put 5 was aborted"):
        prepare(core, "p", {"x": F32}, 5)
    assert core.schemas.get("p", {}) == {}
    prepare(core, "p", {"x": I64}, 6)  # nothing of put 5 is left in the way
    assert call(core, "stats", {}).puts == {"open": 1, "aborted": 0, "expired": 0, "refused": 1}
    call(core, "abort", {"txn": 7})
    clock.now += 10.0
    prepare(core, "p", {"z": F32}, 7)  # forgotten with the reservations it stood for (6 expired too)
    assert call(core, "stats", {}).puts == {"open": 1, "aborted": 0, "expired": 1, "refused": 1}


def test_index_fields_tags_list_resolve_drop():
    core = IndexCore()
    r = call(
        core, "commit", {"partition": "p", "keys": ["a", "b"], "fields": ["x"], "tags": [{"s": 1}, None]}
    )
    assert r == _protocol.CommitReply(fields=["x"], tags=[{"s": 1}, {}])
    r = call(core, "commit", {"partition": "p", "keys": ["a"], "fields": ["y"], "tags": [{"t": 2}]})
    assert r.fields == ["x", "y"] and r.tags == [{"s": 1, "t": 2}]
    assert call(core, "list", {"partition": "p"}).list == {"p": {"a": {"s": 1, "t": 2}, "b": {}}}
    assert call(core, "list", {"partition": "zz"}).list == {}
    assert call(core, "resolve", {"partition": "p", "keys": ["a", "c"]}) == _protocol.ResolveReply(
        partition=True, known={"a": ["x", "y"]}, cleared=[], cleared_kept=CLEARED_KEYS_KEPT
    )
    call(core, "clear", {"partition": "p", "keys": ["a"]})
    assert call(core, "stats", {}).partitions == {"p": 1}
    assert call(core, "resolve", {"partition": "p", "keys": ["a", "c"]}).cleared == ["a"]  # c: never written
    call(core, "clear_partition", {"partition": "p"})
    gone = call(core, "resolve", {"partition": "p", "keys": ["b"]})
    assert gone.partition is False and gone.error is not None and "it was cleared" in gone.error, gone
    with pytest.raises(WireError, match="malformed 'commit'"):
        call(core, "commit", {"partition": "p", "keys": "a"})
    with pytest.raises(WireError, match="unknown operation 'evil'"):
        call(core, "evil", {})


def test_index_remembers_cleared_keys_and_partitions_within_a_bound():
    core = IndexCore()
    keys = [f"k{i}" for i in range(CLEARED_KEYS_KEPT + 1)]
    call(core, "commit", {"partition": "p", "keys": keys, "fields": ["x"]})
    call(core, "clear", {"partition": "p", "keys": keys})  # in order: k0 is the oldest
    said = call(core, "resolve", {"partition": "p", "keys": ["k0", "k1", keys[-1]]})
    assert said.cleared == ["k1", keys[-1]], "the oldest cleared key is forgotten past the bound"
    for i in range(CLEARED_PARTITIONS_KEPT + 1):
        call(core, "commit", {"partition": f"q{i}", "keys": ["a"], "fields": ["x"]})
        call(core, "clear_partition", {"partition": f"q{i}"})
    oldest = call(core, "resolve", {"partition": "q0", "keys": ["a"]}).error
    newest = call(core, "resolve", {"partition": "q1", "keys": ["a"]}).error
    assert "it was cleared" in newest and "it was cleared" not in oldest, (oldest, newest)
    assert f"last {CLEARED_PARTITIONS_KEPT} partitions cleared" in oldest, oldest
    call(core, "commit", {"partition": "step1", "keys": ["a"], "fields": ["x"]})
    typo = call(core, "resolve", {"partition": "setp1", "keys": ["a"]}).error
    assert "did you mean 'step1'?" in typo, typo


def test_wire_frames_are_zero_copy_and_errors_round_trip():
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    col = encode_fields({"x": x, "s": ["a", "bcd"]}, 2)
    bufs: list = []
    body = {name: _wire.column_to_wire(c, bufs) for name, c in col.items()}
    frames = _wire.encode_request(5, "reserve", body, bufs)
    assert len(frames) == 1 + 1 + 2  # header, x data, s data + s offsets
    req, got = _wire.decode_request(frames)
    assert req.rid == 5 and req.op == "reserve"
    back = _wire.column_from_wire(msgspec.msgpack.decode(req.body)["x"], got)
    assert np.shares_memory(np.frombuffer(back.data, np.uint8), x.numpy())
    err = KeyNotFoundError("k", "p")
    rep, _ = _wire.decode_raw_reply(_wire.encode_error(9, err))
    again = _wire.rebuild_error(rep.error)
    assert isinstance(again, KeyNotFoundError) and again.key == "k" and again.partition_id == "p"
    rep, _ = _wire.decode_raw_reply(_wire.encode_error(9, ShardUnavailableError("s-1", "gone")))
    assert _wire.rebuild_error(rep.error).shard == "s-1"
    rep, _ = _wire.decode_raw_reply(_wire.encode_error(9, RuntimeError("boom")))
    assert "RuntimeError: boom" in str(_wire.rebuild_error(rep.error))
    with pytest.raises(_wire.WireError):
        _wire.decode_request([b"\xff\x00garbage"])


def test_assemble_scatters_rows_of_every_kind():
    dense = encode_fields({"x": torch.arange(12).reshape(6, 2)}, 6)["x"]
    var = encode_fields({"s": ["a", "bb", "", "dddd", "e", "ff"]}, 6)["s"]
    src_a, dst_a = np.array([0, 1, 2]), np.array([4, 0, 2])
    src_b, dst_b = np.array([5, 3, 4]), np.array([1, 3, 5])
    out = assemble(dense.spec, 6, [(dense, src_a, dst_a), (dense, src_b, dst_b)])
    order = [1, 5, 2, 3, 0, 4]
    assert np.frombuffer(out.data, np.int64).reshape(6, 2)[:, 0].tolist() == [2 * i for i in order]
    out = assemble(var.spec, 6, [(var, src_a, dst_a), (var, src_b, dst_b)])
    strings = ["a", "bb", "", "dddd", "e", "ff"]
    got = [bytes(out.data[out.offsets[i] : out.offsets[i + 1]]).decode() for i in range(6)]
    assert got == [strings[i] for i in order]
    view = contiguous_view(var, np.array([1, 2, 3]))
    assert view is not None and bytes(view.data) == b"bbdddd" and view.offsets.tolist() == [0, 2, 2, 6]
    assert contiguous_view(var, np.array([1, 3])) is None


def test_placement_is_stable_and_covers_every_key():
    p = HashPlacement(3)
    keys = [f"k{i}" for i in range(100)]
    groups = p.group("part", keys)
    assert sorted(np.concatenate(list(groups.values())).tolist()) == list(range(100))
    assert set(groups) == {0, 1, 2}
    assert p.shard_of("part", "k7") == HashPlacement(3).shard_of("part", "k7")  # no per-process salt
    assert HashPlacement(1).group("part", keys)[0].tolist() == list(range(100))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_keys_placed_at_c_speed_go_where_each_key_alone_goes(num_shards):
    """``shards_of`` (a batch's routing, a shard's share of a checkpoint) continues the partition's
    checksum over each key: the same shard as ``shard_of`` for every key, whatever its characters."""
    from dataplane.wire.placement import shard_of, shards_of

    keys = [f"k{i}" for i in range(200)] + ["", "\0", "ключ", "🔑 key", "a" * 1000]
    for pid in ("part", "", "раздел"):
        assert shards_of(pid, keys, num_shards).tolist() == [shard_of(pid, k, num_shards) for k in keys]
        groups = HashPlacement(num_shards).group(pid, keys)
        assert {int(i): s for s, at in groups.items() for i in at} == {
            i: shard_of(pid, k, num_shards) for i, k in enumerate(keys)
        }


def test_a_commit_without_prepare_confirms_a_field_a_prepared_put_declared():
    """A one-round-trip put (its commit carries specs) to a field a concurrent prepared put declared
    relies on that field too: the prepared put's abort must not take the field's schema back, or a
    later put could declare the field again with another dtype while rows of the first one exist."""
    core = IndexCore()
    txn = prepare(core, "p", {"y": F32}, 1).txn
    call(core, "commit", {"partition": "p", "keys": ["a"], "fields": ["y"], "specs": {"y": F32}})
    call(core, "abort", {"txn": txn})
    with pytest.raises(SchemaError, match="'y'"):
        prepare(core, "p", {"y": I64}, 2)
    with pytest.raises(SchemaError, match="'y'"):  # the same spec is remembered, another is checked
        call(core, "commit", {"partition": "p", "keys": ["b"], "fields": ["y"], "specs": {"y": I64}})
    call(core, "commit", {"partition": "p", "keys": ["b"], "fields": ["y"], "specs": {"y": F32}})
    assert sorted(call(core, "list", {"partition": "p"}).list["p"]) == ["a", "b"]


def test_commits_answer_each_commit_and_a_refused_one_changes_nothing():
    core = IndexCore()
    call(
        core,
        "commit",
        {"partition": "p", "keys": ["a"], "fields": ["x"], "specs": {"x": ["dense", "int64", []]}},
    )
    res = call(
        core,
        "commits",
        {
            "items": [
                {"partition": "p", "keys": ["b"], "fields": ["x"], "specs": {"x": ["dense", "int64", []]}},
                {"partition": "p", "keys": ["c"], "fields": ["x"], "specs": {"x": ["dense", "float32", []]}},
                {
                    "partition": "p",
                    "keys": ["d"],
                    "fields": ["y"],
                    "tags": [{"t": 1}],
                    "specs": {"y": ["dense", "int8", []]},
                },
            ]
        },
    ).results
    assert res[0] == _protocol.CommitResult(ok=_protocol.CommitReply(fields=["x"], tags=[{}]))
    name, msg, attrs = res[1].err
    assert name == "SchemaMismatchError" and attrs["field"] == "x" and "float32" in msg
    assert attrs["stored"] == "tensor:int64:0"  # what the field is stored as, for a caller to adapt to
    assert res[2] == _protocol.CommitResult(ok=_protocol.CommitReply(fields=["y"], tags=[{"t": 1}]))
    assert sorted(call(core, "list", {"partition": "p"}).list["p"]) == ["a", "b", "d"]  # "c" was not recorded
