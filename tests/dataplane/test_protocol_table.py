"""One protocol for both ends, checked op by op (``dataplane.wire.protocol``).

The client's operations are run against real cores in this process (``test_ops.Loopback``: every
request and reply goes through the wire encoding), and every request they send is recorded. For each
op of the shard's and the index's tables, one test row checks both directions:

* the request the client built decodes into the server's struct for that op, and encodes back to
  the very bytes the client sent (nothing lost or renamed on the way);
* the server's handler answered an instance of the op's reply struct (``SHARD_REPLIES`` /
  ``INDEX_REPLIES``), and what the client received is that struct's encoding, which reads back as the
  same struct (no field lost, none the struct lacks).

Ops no client operation here sends say who does (``ELSEWHERE``); the table must cover the rest.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from dataplane import watch
from dataplane.client import ops, stream_ops
from dataplane.codec.columns import encode_fields
from dataplane.errors import KeyNotFoundError, StoreFullError
from dataplane.samplers import Sampler
from dataplane.server.shard.core import ShardCore
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, Call, Result, reply
from tests.dataplane.test_ops import PID, Loopback, batch, keys_on, make_route

# Ops whose requests no operation of ``client.ops`` / ``client.stream_ops`` / ``watch`` sends.
ELSEWHERE = {
    ("index", "checkpoint_save"): "dataplane.checkpoint (tests/dataplane/test_checkpoint*.py)",
    ("index", "checkpoint_finish"): "dataplane.checkpoint",
    ("index", "checkpoint_stage"): "dataplane.checkpoint",
    ("index", "checkpoint_install"): "dataplane.checkpoint",
    ("index", "checkpoint_drop"): "dataplane.checkpoint",
}


class Recorder(Loopback):
    """A ``Loopback`` that keeps every call it served with its result and the reply object the
    server's handler returned, and serves ``put_ready`` the way ``ShardServer`` does (the shard's
    ``commits`` to the index recorded too)."""

    def __init__(self, num_shards: int, **shard_options: Any) -> None:
        super().__init__(num_shards, **shard_options)
        self.seen: list[tuple[str, str, bytes, Result, Any]] = []
        self._answered: list[Any] = []  # what the handlers of the calls in progress returned

    def _one(self, call: Call) -> Result:
        self._answered.append(None)
        result = super()._one(call)
        side = "index" if call.target == INDEX else "shard"
        header = _wire.encode_request(0, call.op, call.body)[0]
        self.seen.append((side, call.op, header, result, self._answered.pop()))
        return result

    def _index(self, op: str, raw: Any, bufs: list[memoryview]) -> tuple[Any, list[Any]]:
        out = super()._index(op, raw, bufs)
        self._answered[-1] = out[0]
        return out

    def _shard(self, shard: ShardCore, op: str, raw: Any, bufs: list[memoryview]) -> tuple[Any, list[Any]]:
        if op != "put_ready":
            out = shard.handle(op, raw, bufs)
        else:
            commit, undo = shard.put_ready(_protocol.decode_body(op, raw, _protocol.SHARD_OPS), bufs)
            commits = Call(INDEX, "commits", _protocol.Commits([commit]))
            (res,) = reply(self._one(commits)[0], _protocol.CommitsReply).results  # type: ignore[index]
            if res.err is not None:
                shard.undo_put(undo)
                raise _wire.rebuild_error(res.err)
            out = _protocol.PutReadyReply(res.ok.fields, res.ok.tags), []
        self._answered[-1] = out[0]
        return out


class _Mine(Sampler):
    """A sampler of the caller's own: ``next_batch`` runs it here (``ready`` + ``claim``)."""


def _scenario(store: Recorder) -> None:
    """Every op a client sends, each at least once."""
    route = make_route(2)
    keys = keys_on(route.placement, 0, 3) + keys_on(route.placement, 1, 3)
    tags = [{"n": i} for i in range(len(keys))]
    store.drive(ops.put(route, keys, PID, encode_fields(batch(6), 6), tags))  # prepare, reserve, commits
    store.drive(ops.put(route, keys[:1], PID, encode_fields(batch(1), 1), None))  # put_ready (+ commits)
    store.drive(ops.put(route, keys[1:2], PID, None, [{"t": 1}]))  # tags only: index commit
    store.drive(ops.get(route, keys, PID, None, True))
    with pytest.raises(KeyNotFoundError):
        store.drive(ops.get(route, ["nope"], PID, ["x"], True))  # resolve explains it
    store.drive(ops.list_keys(route, PID))
    store.drive(ops.stats(route))
    store.drive(watch.snapshot(["n0", "n1"], 4, 5.0))  # stats, tasks
    take = stream_ops.Take.new()
    got = store.drive(
        stream_ops.next_batch(route, PID, "t", 2, ["x"], None, 0.0, None, None, None, take, 60.0)
    )
    store.drive(stream_ops.ack(PID, "t", take.id, got.keys[:1]))
    store.drive(stream_ops.release(PID, "t", take.id))
    mine = stream_ops.Take.new()
    store.drive(stream_ops.next_batch(route, PID, "u", 2, ["x"], _Mine(), 0.0, None, None, None, mine))
    store.drive(stream_ops.consumption(PID, "u"))
    store.drive(stream_ops.consumed(PID, "u"))
    store.drive(stream_ops.resolve(PID, keys[:2]))
    store.drive(stream_ops.reset(PID, "u"))
    store.drive(stream_ops.finish(PID))
    store.drive(ops.clear(route, keys[:2], PID))
    store.drive(ops.clear_partition(route, PID))
    full = Recorder(2)  # shard 1 refuses a reserve: the rest is aborted (shard 0 and the index)
    full.shards[1].capacity = 64
    with pytest.raises(StoreFullError):
        full.drive(ops.put(route, keys, PID, encode_fields(batch(6), 6), None))
    store.seen.extend(full.seen)
    for shard in full.shards:
        shard.close()


@pytest.fixture(scope="module")
def seen() -> dict[tuple[str, str], list[tuple[bytes, Result, Any]]]:
    store = Recorder(2)
    try:
        _scenario(store)
    finally:
        for shard in store.shards:
            shard.close()
    out: dict[tuple[str, str], list[tuple[bytes, Result, Any]]] = {}
    for side, op, header, result, answered in store.seen:
        out.setdefault((side, op), []).append((header, result, answered))
    return out


TABLE = [("shard", op) for op in _protocol.SHARD_OPS] + [("index", op) for op in _protocol.INDEX_OPS]


def test_the_reply_tables_name_the_ops_the_request_tables_do() -> None:
    assert set(_protocol.SHARD_REPLIES) == set(_protocol.SHARD_OPS)
    assert set(_protocol.INDEX_REPLIES) == set(_protocol.INDEX_OPS)


@pytest.mark.parametrize(("side", "op"), TABLE, ids=[f"{s}.{o}" for s, o in TABLE])
def test_each_op_is_one_protocol_for_both_ends(side: str, op: str, seen: dict) -> None:
    if (side, op) in ELSEWHERE:
        assert (side, op) not in seen, f"{side}.{op} is sent here now: take it out of ELSEWHERE"
        pytest.skip(f"sent by {ELSEWHERE[(side, op)]}")
    assert (side, op) in seen, f"no client operation sent {side}.{op}: a dead op, or the scenario misses it"
    requests = _protocol.SHARD_OPS if side == "shard" else _protocol.INDEX_OPS
    replies = _protocol.SHARD_REPLIES if side == "shard" else _protocol.INDEX_REPLIES
    for header, result, answered in seen[(side, op)]:
        sent = msgspec.msgpack.decode(header)[2]  # [rid, op, body, version]
        raw = msgspec.msgpack.encode(sent)
        body = _protocol.decode_body(op, raw, requests)
        assert type(body) is requests[op]
        assert msgspec.msgpack.encode(body) == raw  # decoded and encoded again: the same bytes
        if isinstance(result, BaseException):  # refused for what it asked, never for how
            assert "malformed" not in str(result), result
            continue
        assert type(answered) is replies[op], f"{side}.{op} answered a {type(answered).__name__}"
        assert bytes(result[0]) == msgspec.msgpack.encode(answered)  # the struct, as it travels
        typed = reply(result[0], replies[op])
        assert typed == answered  # read back whole: no field lost on the way
        declared = set(type(typed).__struct_fields__)
        assert set(msgspec.msgpack.decode(result[0])) <= declared, f"{op} answers fields its reply lacks"


def test_a_reply_of_the_wrong_shape_is_a_wire_error_naming_the_struct() -> None:
    from dataplane.errors import WireError

    with pytest.raises(WireError, match="not a ReserveReply"):
        reply(msgspec.msgpack.encode({"resv": "eleven"}), _protocol.ReserveReply)


def test_tags_are_encoded_once_and_sent_as_they_were_checked() -> None:
    route = make_route(1)
    op = ops.put(route, ["k"], PID, None, [{"n": torch.tensor(1).item()}])
    (call,) = next(op)
    assert isinstance(call.body.tags, msgspec.Raw)  # (checked by encoding; those bytes are sent)
    body = _protocol.decode_body("commit", msgspec.msgpack.encode(call.body), _protocol.INDEX_OPS)
    assert body.tags == [{"n": 1}]
    with pytest.raises(TypeError, match="tags cannot be stored"):
        next(ops.put(route, ["k"], PID, None, [{"n": 2**70}]))


class _Ping(msgspec.Struct):
    """A toy op of this test's own (the store has none such): the request of ``op_ping`` below."""


class _Pong(msgspec.Struct):
    shard: int


def test_a_core_whose_handler_answers_another_reply_struct_is_refused_at_import() -> None:
    """The op tables tie each op to its reply struct: a handler annotated with another struct (or with
    none) is refused when its class is made, as a missing handler is."""
    from dataplane.server.dispatch import Operations
    from dataplane.server.index.core import IndexCore

    with pytest.raises(
        TypeError, match=r"op_get is annotated to answer ReserveReply, but 'get' answers GetReply"
    ):

        class WrongGet(ShardCore):
            def op_get(
                self, body: _protocol.Get, bufs: list[memoryview]
            ) -> tuple[_protocol.ReserveReply, list]:
                raise AssertionError("never served")

    with pytest.raises(
        TypeError, match=r"op_next is annotated to answer ReadyReply, but 'next' answers BatchReply"
    ):

        class WrongNext(IndexCore):
            def op_next(self, body: _protocol.Next) -> _protocol.ReadyReply | None:
                return None

    with pytest.raises(TypeError, match=r"op_ping is annotated to answer no reply struct"):

        class Unannotated(Operations):
            OPS = {"ping": _Ping}
            REPLIES = {"ping": _Pong}

            def op_ping(self, body, bufs):  # type: ignore[no-untyped-def]
                return {"shard": 0}, []

    class RightPing(Operations):  # the same op, annotated with its struct: accepted
        OPS = {"ping": _Ping}
        REPLIES = {"ping": _Pong}

        def op_ping(self, body: _Ping, bufs: list[memoryview]) -> tuple[_Pong, list]:
            return _Pong(0), []

    assert RightPing().handle("ping", msgspec.msgpack.encode({}), []) == (_Pong(0), [])
