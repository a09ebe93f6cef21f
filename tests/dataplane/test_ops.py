"""The client's KV operations stepped by hand: no sockets, no Ray, no mapped files.

Each operation (``dataplane.client.ops``) is a generator that yields a batch of ``Call`` s and is
sent the batch's results, so a test plays the store: it reads what the operation asks, answers,
and checks what it asks next, the way h11 tests its state machine without a socket.

Two ways to answer, both through the real wire encoding (``frames``, ``requests.decode_result``),
so replies reach an operation exactly as they would from a socket:

* ``Loopback`` serves calls from real ``ShardCore`` s and an ``IndexCore`` in this process (their
  inline-frame path), recording each round; a target marked down answers as a dead process does;
* scripted replies (``ok`` / ``err``), for orderings a healthy store rarely produces, and for the
  shared-memory path, where ``FakeMemory`` (bytearrays and a generation table in a list) stands in
  for the shards' mapped files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from dataplane.client import ops
from dataplane.client.memory import SegmentUnavailable
from dataplane.client.sharding import HashPlacement
from dataplane.codec.columns import decode_fields, encode_fields
from dataplane.errors import (
    DataplaneError,
    KeyNotFoundError,
    PartitionNotFoundError,
    ReservationExpiredError,
    SchemaError,
    ShardUnavailableError,
    StoreFullError,
    WireError,
)
from dataplane.server.index.core import IndexCore
from dataplane.server.shard.core import ShardCore
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, Call, Result, decode_result, next_rid

PID = "p"


# ---- the store, played by the test ------------------------------------------------------------------


class FakeMemory:
    """``SharedMemory`` over bytearrays: files by (shard, file id), one generation table (a list) per shard.

    ``on_view`` runs after each view is handed out: a test uses it to free a file while the
    operation is copying out of it, as a concurrent clear would.
    """

    def __init__(self, num_shards: int, slots: int = 16) -> None:
        self.files: dict[tuple[int, int], bytearray] = {}
        self.tables = [[0] * slots for _ in range(num_shards)]
        self.versions: dict[int, int] = {}
        self.pruned: list[tuple[int, int, list[int]]] = []
        self.on_view: Callable[[], None] | None = None

    def add_file(self, shard: int, file_id: int, size: int, slot: int, gen: int) -> list[int]:
        """A new file of the shard, live in ``slot`` at ``gen``; returns its ref as a shard names it."""
        self.files[(shard, file_id)] = bytearray(size)
        self.tables[shard][slot] = gen
        return [file_id, 100 + file_id, size, 1000 + file_id, slot, gen]

    def view(self, shard: int, ref: Sequence[int]) -> memoryview:
        buf = self.files.get((shard, ref[0]))
        if buf is None:
            raise SegmentUnavailable(f"shard {shard} has no file {ref[0]}")
        if self.on_view is not None:
            self.on_view()
        return memoryview(buf)

    def generations(self, shard: int) -> Sequence[int]:
        return self.tables[shard]

    def version(self, shard: int) -> int:
        return self.versions.get(shard, -1)

    def prune(self, shard: int, version: int, live: list[int]) -> None:
        self.pruned.append((shard, version, list(live)))
        self.versions[shard] = version


def make_route(num_shards: int, shm: bool = False, memory: FakeMemory | None = None) -> ops.Route:
    return ops.Route(
        placement=HashPlacement(num_shards),
        shm=[shm] * num_shards,
        memory=memory or FakeMemory(num_shards),
        shm_min_bytes=0,  # on the shared-memory path, every field goes through a file
        commit_within_s=60.0,
        rpc_timeout_s=5.0,
    )


def _received(frames: list[Any]) -> list[bytes]:
    """Frames as the other side receives them: copies, sharing no memory with the sender."""
    return [bytes(memoryview(f)) for f in frames]


def ok(body: dict[str, Any] | None = None, bufs: Sequence[Any] = ()) -> Result:
    """A successful reply, as an operation receives it (through the wire encoding)."""
    return decode_result(_received(_wire.encode_reply(1, body or {}, list(bufs))))[1]


def wire(body: msgspec.Struct) -> Any:
    """A request body as plain values, as it travels (fields at their default left out)."""
    return msgspec.to_builtins(body)


def err(exc: BaseException) -> Result:
    """A failed reply carrying ``exc``, as an operation receives it (a rebuilt remote error)."""
    return decode_result(_received(_wire.encode_error(1, exc)))[1]


def dead(target: int) -> ShardUnavailableError:
    """What the transport answers for a target whose process is gone."""
    name = "index" if target == INDEX else f"shard{target}"
    return ShardUnavailableError(name, f"{name} is dead (its process is gone)")


class Loopback:
    """Serves calls from real cores in this process through the wire encoding, recording each round."""

    def __init__(self, num_shards: int, **shard_options: Any) -> None:
        self.shards = [ShardCore(i, **shard_options) for i in range(num_shards)]
        self.index = IndexCore()
        self.rounds: list[list[tuple[int, str]]] = []
        self.down: set[int] = set()  # targets that answer as a dead process would

    def serve(self, calls: list[Call]) -> list[Result]:
        self.rounds.append([(c.target, c.op) for c in calls])
        return [self._one(c) for c in calls]

    def _one(self, call: Call) -> Result:
        if call.target in self.down:
            return dead(call.target)
        rid = next_rid()
        request = _received(_wire.encode_request(rid, call.op, call.body, call.bufs))
        if call.target == INDEX:  # the index takes metadata only, as IndexServer does
            answered, reply = _wire.answer(
                request,
                lambda req, bufs: self._index(req.op, req.body, bufs),
                max_frames=0,
                who="the index",
            )
        else:
            shard = self.shards[call.target]
            answered, reply = _wire.answer(
                request, lambda req, bufs: self._shard(shard, req.op, req.body, bufs)
            )
        got, result = decode_result(_received(reply))
        assert answered == got == rid
        return result

    def _index(self, op: str, raw: Any, bufs: list[memoryview]) -> tuple[msgspec.Struct, list]:
        return self.index.handle(op, raw, bufs)

    def _shard(
        self, shard: ShardCore, op: str, raw: Any, bufs: list[memoryview]
    ) -> tuple[msgspec.Struct, list]:
        if op != "put_ready":
            return shard.handle(op, raw, bufs)
        # What ShardServer does with a one-step put: store it, commit it in the index, take it back
        # if the index refuses.
        body = _protocol.decode_body(op, raw, _protocol.SHARD_OPS)
        commit, undo = shard.put_ready(body, bufs)
        raw = msgspec.msgpack.encode(_protocol.Commits([commit]))
        (res,) = self.index.op_commits(_protocol.decode_body("commits", raw, _protocol.INDEX_OPS)).results
        if res.err is not None:
            shard.undo_put(undo)
            raise _wire.rebuild_error(res.err)
        assert res.ok is not None
        return _protocol.PutReadyReply(res.ok.fields, res.ok.tags), []

    def drive(self, op: ops.Op) -> Any:
        """Run ``op`` to completion against the cores (what ``handle.drive`` does with sockets)."""
        try:
            calls = next(op)
            while True:
                calls = op.send(self.serve(calls))
        except StopIteration as stop:
            return stop.value


@pytest.fixture
def stores():
    """Builds ``Loopback`` s; their shards' memory (memfd files) is given back after the test."""
    made: list[Loopback] = []

    def make(num_shards: int, **shard_options: Any) -> Loopback:
        made.append(Loopback(num_shards, **shard_options))
        return made[-1]

    yield make
    for store in made:
        for shard in store.shards:
            shard.close()


def finish(op: ops.Op, results: list[Result]) -> Any:
    """Send the last round's results; the operation must return (its value is returned here)."""
    with pytest.raises(StopIteration) as stop:
        op.send(results)
    return stop.value.value


def targets(calls: list[Call]) -> list[tuple[int, str]]:
    return [(c.target, c.op) for c in calls]


def keys_on(placement: HashPlacement, shard: int, n: int, prefix: str = "k") -> list[str]:
    """``n`` keys that ``placement`` puts on ``shard`` (in partition ``PID``)."""
    out = []
    i = 0
    while len(out) < n:
        key = f"{prefix}{i}"
        if placement.shard_of(PID, key) == shard:
            out.append(key)
        i += 1
    return out


def batch(n: int, offset: float = 0.0) -> dict[str, Any]:
    return {
        "x": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + offset,
        "s": [f"row-{i}-{offset}" * (i + 1) for i in range(n)],  # variable length: offsets travel too
    }


def decoded(cols: dict, n: int) -> dict[str, Any]:
    td = decode_fields(cols, n)
    return {name: td[name] if name == "x" else td.get(name).tolist() for name in cols}


# ---- what the operations stand on ------------------------------------------------------------------

NO_IO = {
    "dataplane.transport.clients",
    "dataplane.transport.shm",
    "dataplane.client.mappings",
    "dataplane.client.handle",
}


@pytest.mark.parametrize("module", ["dataplane.client.ops", "dataplane.client.stream_ops"])
def test_the_operations_stand_on_nothing_that_does_io(module):
    """Neither the operations nor anything of the project they import (lazily too) reaches zmq, the
    transport or the code that maps files: the IO is all in what drives them and what the route holds."""
    import ast
    import pathlib

    from tests.test_layout import ROOT, import_graph

    graph = import_graph()
    reached, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph.get(m, ()))
    assert not reached & NO_IO, f"{module} reaches {sorted(reached & NO_IO)}"
    for m in sorted(reached):
        path = ROOT / pathlib.Path(*m.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] == "zmq"], f"{module} reaches zmq through {m}"


# ---- put and get through real cores ---------------------------------------------------------------


def test_put_then_get_round_trip_through_real_cores(stores):
    store = stores(2)
    route = make_route(2)
    keys = keys_on(route.placement, 0, 3) + keys_on(route.placement, 1, 3)
    data = batch(6)
    tags = [{"i": i} for i in range(6)]

    meta = store.drive(ops.put(route, keys, PID, encode_fields(data, 6), tags))

    assert meta.keys == keys and meta.partition_id == PID
    assert meta.fields == ["x", "s"] and meta.tags == tags
    assert store.rounds == [  # schema and reservations at once, then the shards commit, then the index
        [(INDEX, "prepare"), (0, "reserve"), (1, "reserve")],
        [(0, "commit"), (1, "commit")],
        [(INDEX, "commit")],
    ]
    assert route.schemas[PID].keys() == {"x", "s"}  # confirmed: later small puts may take one round trip

    order = [keys[4], keys[0], keys[5], keys[2], keys[1], keys[3]]
    store.rounds.clear()
    cols = store.drive(ops.get(route, order, PID, None, copy=True))
    assert store.rounds == [[(0, "get"), (1, "get")]]  # one round trip, the index not asked
    got = decoded(cols, 6)
    pos = [keys.index(k) for k in order]
    assert torch.equal(got["x"], data["x"][pos])
    assert got["s"] == [data["s"][i] for i in pos]


def test_small_put_of_a_known_schema_takes_one_round_trip(stores):
    store = stores(2)
    route = make_route(2)
    keys = keys_on(route.placement, 1, 2)
    store.drive(ops.put(route, keys, PID, encode_fields(batch(2), 2), None))
    store.rounds.clear()

    meta = store.drive(ops.put(route, keys, PID, encode_fields(batch(2, offset=10.0), 2), [{"v": 2}] * 2))

    assert store.rounds == [[(1, "put_ready")]]  # the shard commits in the index itself
    assert meta.tags == [{"v": 2}] * 2
    got = decoded(store.drive(ops.get(route, keys, PID, ["x"], copy=True)), 2)
    assert torch.equal(got["x"], batch(2, offset=10.0)["x"])


def test_reserve_failure_aborts_the_reservations_that_succeeded(stores):
    store = stores(2)
    store.shards[1].capacity = 64  # too small for this put: shard 1 refuses, shard 0 reserves
    route = make_route(2)
    keys = keys_on(route.placement, 0, 4) + keys_on(route.placement, 1, 4)

    with pytest.raises(StoreFullError, match="shard 1 is full") as exc:
        store.drive(ops.put(route, keys, PID, encode_fields(batch(8), 8), None))

    assert "nothing was written" in str(exc.value)
    assert "capacity of 64 B" in str(exc.value), exc.value  # sizes as a person reads them, exact
    assert store.rounds == [
        [(INDEX, "prepare"), (0, "reserve"), (1, "reserve")],
        [(0, "abort"), (INDEX, "abort")],  # only what succeeded is undone; nothing is committed
    ]
    assert store.shards[0].stats().bytes_reserved == 0  # the abort really gave the space back
    assert store.index.txns == {} and store.index.schemas == {}  # the new fields are undecided again
    assert PID not in route.schemas


def test_a_dead_shard_during_reserve_is_named_and_the_rest_undone():
    """Scripted: a shard of the first round is dead; whatever answered is undone, in one round."""
    route = make_route(2)
    keys = keys_on(route.placement, 0, 1) + keys_on(route.placement, 1, 1)
    op = ops.put(route, keys, PID, encode_fields(batch(2), 2), None)

    calls = next(op)
    assert targets(calls) == [(INDEX, "prepare"), (0, "reserve"), (1, "reserve")]
    txn = calls[0].body.txn  # the client's choice
    aborts = op.send([ok({"txn": txn}), ok({"resv": 11, "files": {}, "version": 0}), dead(1)])

    assert [(c.target, c.op, wire(c.body)) for c in aborts] == [
        (0, "abort", {"resv": 11}),
        (INDEX, "abort", {"txn": txn}),
    ]
    with pytest.raises(ShardUnavailableError) as exc:
        op.send([ok() for _ in aborts])
    assert exc.value.shard == "shard1"


@pytest.mark.parametrize("index_answer", ["dead", "silent"])
def test_a_prepare_the_index_did_not_answer_is_aborted_all_the_same(index_answer):
    """Scripted: the index did not answer the prepare (dead, or stalled past rpc_timeout_s). It may
    still record the prepare later, so the client aborts it anyway, under the id it chose itself:
    after undoing the reservations, in a round of its own that waits at most ABORT_WAIT_S."""
    route = make_route(2)
    keys = keys_on(route.placement, 0, 1) + keys_on(route.placement, 1, 1)
    op = ops.put(route, keys, PID, encode_fields(batch(2), 2), None)

    calls = next(op)
    txn = calls[0].body.txn
    silent = ShardUnavailableError("index", "index at unix:@x did not answer within 60.0s")
    no_answer = dead(INDEX) if index_answer == "dead" else silent  # (the transport's own errors)
    reserved = [ok({"resv": r, "files": {}, "version": 0}) for r in (11, 12)]
    aborts = op.send([no_answer, *reserved])
    assert [(c.target, wire(c.body)) for c in aborts] == [(0, {"resv": 11}), (1, {"resv": 12})]
    (index_abort,) = op.send([ok(), ok()])
    assert (index_abort.target, index_abort.op, wire(index_abort.body)) == (INDEX, "abort", {"txn": txn})
    assert index_abort.timeout == ops.ABORT_WAIT_S
    with pytest.raises(ShardUnavailableError) as exc:
        op.send([no_answer])  # the abort's own fate changes nothing: the put's error is the prepare's
    assert exc.value.shard == "index"
    assert calls[0].body.txn != next(ops.put(route, keys, PID, encode_fields(batch(2), 2), None))[0].body.txn


def test_schema_refusal_from_the_index(stores):
    store = stores(2)
    route = make_route(2)
    on0, on1 = keys_on(route.placement, 0, 2), keys_on(route.placement, 1, 2)
    store.drive(ops.put(route, on0, PID, encode_fields({"x": torch.zeros(2, 3)}, 2), None))
    store.rounds.clear()

    # Shard 1 holds no "x" yet, so it reserves; only the index knows the partition's schema.
    with pytest.raises(SchemaError, match="'x'") as exc:
        store.drive(
            ops.put(route, on1, PID, encode_fields({"x": torch.zeros(2, 3, dtype=torch.int64)}, 2), None)
        )

    assert exc.value.field == "x"
    assert store.rounds == [[(INDEX, "prepare"), (1, "reserve")], [(1, "abort"), (INDEX, "abort")]]
    assert store.shards[1].stats().bytes_reserved == 0
    assert store.drive(ops.list_keys(route, PID)) == {PID: {k: {} for k in on0}}


def test_schema_refusal_of_a_one_round_trip_put_forgets_the_schema():
    """Scripted: the partition was re-created elsewhere with another dtype since this client saw it."""
    route = make_route(1)
    cols = encode_fields({"x": torch.zeros(1, 3)}, 1)
    route.schemas[PID] = {"x": cols["x"].spec.family()}
    op = ops.put(route, ["a"], PID, cols, None)

    assert targets(next(op)) == [(0, "put_ready")]
    with pytest.raises(SchemaError) as exc:
        op.send([err(SchemaError("x", "field 'x': new data does not match the stored column"))])
    assert exc.value.field == "x"
    assert PID not in route.schemas  # the next put asks the index again


def test_put_that_stalls_past_its_commit_window_aborts():
    route = make_route(1)
    route.commit_within_s = -1.0  # any time between reserve and commit is too long
    op = ops.put(route, ["a"], PID, encode_fields(batch(1), 1), None)
    calls = next(op)
    txn = calls[0].body.txn
    aborts = op.send([ok({"txn": txn}), ok({"resv": 4, "files": {}, "version": 0})])
    assert [(c.target, c.op, wire(c.body)) for c in aborts] == [
        (0, "abort", {"resv": 4}),
        (INDEX, "abort", {"txn": txn}),
    ]
    with pytest.raises(ReservationExpiredError, match="nothing was written"):
        op.send([ok(), ok()])
    assert targets(calls) == [(INDEX, "prepare"), (0, "reserve")]


def test_failed_shard_commit_aborts_the_index_and_names_what_was_written():
    route = make_route(2)
    keys = keys_on(route.placement, 0, 1) + keys_on(route.placement, 1, 1)
    op = ops.put(route, keys, PID, encode_fields(batch(2), 2), None)
    txn = next(op)[0].body.txn
    reserved = [ok({"resv": r, "files": {}, "version": 0}) for r in (1, 2)]
    commits = op.send([ok({"txn": txn}), *reserved])
    assert targets(commits) == [(0, "commit"), (1, "commit")]
    (abort,) = op.send([ok(), dead(1)])  # the index is not asked to commit: the rows are not made ready
    assert (abort.target, abort.op, wire(abort.body)) == (INDEX, "abort", {"txn": txn})
    with pytest.raises(ShardUnavailableError, match=r"committed only in part: shards \[0\]") as exc:
        op.send([ok()])
    assert repr(keys[1]) in str(exc.value) and exc.value.shard == "shard1"


# ---- get ---------------------------------------------------------------------------------------------


def test_get_of_a_missing_key_names_the_key(stores):
    store = stores(2)
    route = make_route(2)
    keys = keys_on(route.placement, 0, 2) + keys_on(route.placement, 1, 2)
    store.drive(ops.put(route, keys, PID, encode_fields(batch(4), 4), None))
    missing = keys_on(route.placement, 1, 1, prefix="gone")[0]
    store.rounds.clear()

    with pytest.raises(KeyNotFoundError) as exc:
        store.drive(ops.get(route, [keys[0], missing, keys[3]], PID, None, copy=True))

    assert exc.value.key == missing and exc.value.partition_id == PID
    assert repr(missing) in str(exc.value)
    assert store.rounds == [[(0, "get"), (1, "get")], [(INDEX, "resolve")]]  # the index explains the miss


def test_get_of_a_key_holding_only_tags_says_so(stores):
    store = stores(1)
    route = make_route(1)
    store.drive(ops.put(route, ["t"], PID, None, [{"only": "tags"}]))
    with pytest.raises(KeyNotFoundError, match="tags only") as exc:
        store.drive(ops.get(route, ["t"], PID, None, copy=True))
    assert exc.value.key == "t"


def test_get_of_an_unknown_partition(stores):
    store = stores(2)
    with pytest.raises(PartitionNotFoundError) as exc:
        store.drive(ops.get(make_route(2), ["a", "b"], "nowhere", None, copy=True))
    assert exc.value.partition_id == "nowhere"


# ---- the shared-memory path, over bytearrays -----------------------------------------------------------


def _shm_put(route: ops.Route, memory: FakeMemory, keys: list[str], x: torch.Tensor) -> list[int]:
    """Step a put through the shared-memory path of one shard; returns the ref of the file it filled."""
    cols = encode_fields({"x": x}, len(keys))
    nbytes = len(cols["x"].data)
    op = ops.put(route, keys, PID, cols, None)
    calls = next(op)
    assert targets(calls) == [(INDEX, "prepare"), (0, "reserve")]
    assert calls[1].body.fields["x"].col is None and calls[1].bufs == []  # no bytes in the request
    ref = memory.add_file(0, file_id=7, size=nbytes + 100, slot=3, gen=9)
    reserved = {"resv": 5, "files": {"x": ref}, "version": 2, "live": [7]}
    (commit,) = op.send([ok({"txn": calls[0].body.txn}), ok(reserved)])
    assert (commit.target, commit.op, commit.body.resv) == (0, "commit", 5)
    assert bytes(memory.files[(0, 7)][:nbytes]) == bytes(cols["x"].data)  # copied straight into the file
    assert memory.pruned == [(0, 2, [7])]
    (index_commit,) = op.send([ok()])
    assert (index_commit.target, index_commit.op, index_commit.body.txn) == (
        INDEX,
        "commit",
        calls[0].body.txn,
    )
    meta = finish(op, [ok({"fields": ["x"], "tags": [{} for _ in keys]})])
    assert meta.keys == keys
    return ref


def _shm_reply(ref: list[int], nbytes: int, num_rows: int, rows: list[int], spec: Any, view: bool) -> Result:
    """A shard's get reply: ``rows`` of a segment of ``num_rows`` rows in file ``ref`` (as
    ``ShardCore._shm_entry`` answers)."""
    frames: list[Any] = []
    entry = {
        "t": "s",
        "segs": [[ref, nbytes, num_rows, -1, view, _wire.spec_to_wire(spec), -1]],
        "seg": _wire.array_to_wire(np.zeros(len(rows), np.int64), frames),
        "row": _wire.array_to_wire(np.array(rows, np.int64), frames),
    }
    return ok({"fields": {"x": entry}, "version": 2}, frames)


def test_shared_memory_put_then_get_through_fake_memory():
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ref = _shm_put(route, memory, ["a", "b", "c", "d"], x)
    spec = encode_fields({"x": x}, 4)["x"].spec

    op = ops.get(route, ["c", "a"], PID, ["x"], copy=True)
    (call,) = next(op)
    assert call.body.shm is True and call.body.export is False and call.body.version == 2
    cols = finish(op, [_shm_reply(ref, 48, 4, [2, 0], spec, view=False)])
    assert torch.equal(decode_fields(cols, 2)["x"], x[[2, 0]])


def test_a_segment_freed_while_copying_out_of_it_makes_the_read_retry():
    """The generation is checked after the copy: a clear that lands during the copy is caught."""
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    x = torch.ones(2, 3)
    ref = _shm_put(route, memory, ["a", "b"], x)
    spec = encode_fields({"x": x}, 2)["x"].spec

    def freed_meanwhile() -> None:  # the shard frees the file (next generation) once we have mapped it
        memory.tables[0][ref[4]] = ref[5] + 1
        memory.on_view = None

    memory.on_view = freed_meanwhile
    op = ops.get(route, ["a", "b"], PID, ["x"], copy=True)
    next(op)
    (again,) = op.send([_shm_reply(ref, 24, 2, [0, 1], spec, view=False)])  # stale: asked again
    assert (again.target, again.op) == (0, "get")

    fresh = memory.add_file(0, file_id=8, size=24, slot=4, gen=11)  # the rows, written again elsewhere
    memory.files[(0, 8)][:24] = bytes(encode_fields({"x": x * 2}, 2)["x"].data)
    cols = finish(op, [_shm_reply(fresh, 24, 2, [0, 1], spec, view=False)])
    assert torch.equal(decode_fields(cols, 2)["x"], x * 2)


def test_a_segment_closed_before_mapping_makes_the_read_retry():
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    x = torch.ones(2, 3)
    ref = _shm_put(route, memory, ["a", "b"], x)
    spec = encode_fields({"x": x}, 2)["x"].spec
    del memory.files[(0, ref[0])]  # closed since the shard answered: SegmentUnavailable

    op = ops.get(route, ["a", "b"], PID, ["x"], copy=True)
    next(op)
    (again,) = op.send([_shm_reply(ref, 24, 2, [0, 1], spec, view=False)])
    assert again.op == "get"


def test_a_read_that_keeps_racing_with_clears_gives_up():
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    x = torch.ones(1, 3)
    ref = _shm_put(route, memory, ["a"], x)
    spec = encode_fields({"x": x}, 1)["x"].spec
    memory.tables[0][ref[4]] = 0  # freed: every answer naming generation 9 is stale

    op = ops.get(route, ["a"], PID, ["x"], copy=True)
    next(op)
    for _ in range(ops.GET_ATTEMPTS - 1):
        assert op.send([_shm_reply(ref, 12, 1, [0], spec, view=False)])[0].op == "get"
    with pytest.raises(DataplaneError, match="raced with clears"):
        op.send([_shm_reply(ref, 12, 1, [0], spec, view=False)])


@pytest.mark.parametrize("device", [None, "cpu"])
def test_an_exported_segment_comes_back_as_a_view(device):
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ref = _shm_put(route, memory, ["a", "b"], x)
    spec = encode_fields({"x": x}, 2)["x"].spec

    op = ops.get(route, ["a", "b"], PID, ["x"], copy=False, device=device)  # the CPU is host memory
    (call,) = next(op)
    assert call.body.export is True
    cols = finish(op, [_shm_reply(ref, 24, 2, [0, 1], spec, view=True)])
    out = np.frombuffer(cols["x"].data, np.uint8)
    assert np.shares_memory(out, np.frombuffer(memory.files[(0, ref[0])], np.uint8))  # no copy


@pytest.mark.parametrize("bad", ["slot", "nbytes"])
def test_a_reply_pointing_outside_the_mapped_memory_is_refused(bad):
    memory = FakeMemory(1, slots=4)
    route = make_route(1, shm=True, memory=memory)
    ref = memory.add_file(0, file_id=1, size=12, slot=2, gen=5)
    spec = encode_fields({"x": torch.ones(1, 3)}, 1)["x"].spec
    nbytes = 12
    if bad == "slot":
        ref[4] = 4  # past the generation table
    else:
        nbytes = 13  # past the file
    op = ops.get(route, ["a"], PID, ["x"], copy=True)
    next(op)
    with pytest.raises(WireError, match="shard 0 answered field 'x'"):
        op.send([_shm_reply(ref, nbytes, 1, [0], spec, view=False)])


def test_a_segment_that_cannot_be_mapped_aborts_the_put():
    memory = FakeMemory(1)
    route = make_route(1, shm=True, memory=memory)
    op = ops.put(route, ["a"], PID, encode_fields({"x": torch.ones(1, 3)}, 1), None)
    txn = next(op)[0].body.txn
    gone = [99, 1, 12, 1, 0, 1]  # a file the fake does not hold
    aborts = op.send([ok({"txn": txn}), ok({"resv": 6, "files": {"x": gone}, "version": 1})])
    assert [(c.target, c.op, wire(c.body)) for c in aborts] == [
        (0, "abort", {"resv": 6}),
        (INDEX, "abort", {"txn": txn}),
    ]
    with pytest.raises(SegmentUnavailable):
        op.send([ok(), ok()])


# ---- clear --------------------------------------------------------------------------------------------


def test_clear_frees_the_keys_everywhere_and_ignores_unknown_ones(stores):
    store = stores(2)
    route = make_route(2)
    keys = keys_on(route.placement, 0, 2) + keys_on(route.placement, 1, 2)
    store.drive(ops.put(route, keys, PID, encode_fields(batch(4), 4), None))
    store.rounds.clear()

    store.drive(ops.clear(route, [*keys, "never-written"], PID))

    assert store.rounds == [[(0, "clear"), (1, "clear"), (INDEX, "clear")]]
    assert all(s.stats().bytes_used == 0 for s in store.shards)
    assert store.drive(ops.list_keys(route, PID)) == {PID: {}}


def test_partial_clear_names_where_the_rows_were_freed(stores):
    store = stores(2)
    route = make_route(2)
    on0, on1 = keys_on(route.placement, 0, 2), keys_on(route.placement, 1, 2)
    store.drive(ops.put(route, on0 + on1, PID, encode_fields(batch(4), 4), None))
    store.down.add(1)

    with pytest.raises(ShardUnavailableError) as exc:
        store.drive(ops.clear(route, on0 + on1, PID))

    msg = str(exc.value)
    assert exc.value.shard == "shard1"
    assert "completed only in part" in msg and "shards [0] freed their rows" in msg
    assert "the index forgot them" in msg and "shard 1:" in msg and "Call it again" in msg
    assert store.shards[0].stats().partitions == {PID: 0}
    assert store.shards[1].stats().partitions == {PID: 2}  # not reached: its rows are still there

    store.down.clear()
    store.drive(ops.clear(route, on0 + on1, PID))  # calling it again finishes the job
    assert store.shards[1].stats().bytes_used == 0


def test_partial_clear_partition_names_the_index(stores):
    store = stores(2)
    route = make_route(2)
    keys = keys_on(route.placement, 0, 1) + keys_on(route.placement, 1, 1)
    store.drive(ops.put(route, keys, PID, encode_fields(batch(2), 2), None))
    assert PID in route.schemas
    store.down.add(INDEX)
    store.rounds.clear()

    with pytest.raises(
        ShardUnavailableError, match=r"shards \[0, 1\] freed their rows; the index did not"
    ) as exc:
        store.drive(ops.clear_partition(route, PID))

    assert exc.value.shard == "index"
    assert store.rounds == [[(0, "clear_partition"), (1, "clear_partition"), (INDEX, "clear_partition")]]
    assert all(PID not in s.stats().partitions for s in store.shards)
    assert PID not in route.schemas  # the partition may be re-created with another schema


def test_partial_clear_keeps_the_first_failures_type():
    """Scripted: a shard that answered with an error (not dead) is named with its own error."""
    route = make_route(2)
    keys = keys_on(route.placement, 0, 1) + keys_on(route.placement, 1, 1)
    op = ops.clear(route, keys, PID)
    calls = next(op)
    assert targets(calls) == [(0, "clear"), (1, "clear"), (INDEX, "clear")]
    assert wire(calls[1].body) == {"partition": PID, "keys": [keys[1]]}
    with pytest.raises(
        WireError, match=r"shards \[1\] freed their rows; the index forgot them; shard 0: malformed"
    ):
        op.send([err(WireError("malformed 'clear' request")), ok({"removed": 1}), ok({"removed": 2})])


def test_a_whole_listing_is_asked_for_in_pages_and_leaves_out_a_partition_cleared_meanwhile(stores):
    store = stores(1)
    route = make_route(1)
    keys = [f"k{i}" for i in range(2 * ops.LIST_PAGE + 3)]
    store.index.op_commit(_protocol.IndexCommit(partition=PID, keys=keys, fields=["x"]))
    store.index.op_commit(_protocol.IndexCommit(partition="q", keys=["a"], fields=["x"]))

    listed = store.drive(ops.list_keys(route, PID))

    assert list(listed[PID]) == keys
    assert store.rounds == [[(INDEX, "list")]] * 3  # no reply holds more than a page
    store.rounds.clear()
    assert store.drive(ops.list_keys(route, None)) == {PID: listed[PID], "q": {"a": {}}}
    assert len(store.rounds) == 1 + 3 + 1  # the names, then each partition's pages

    # A partition cleared between two pages is left out, as if cleared before the listing.
    op = ops.list_keys(route, PID)
    first = store.serve(next(op))
    store.index.op_clear_partition(_protocol.OnePartition(PID))
    store.index.op_commit(_protocol.IndexCommit(partition=PID, keys=["new"], fields=["x"]))
    with pytest.raises(StopIteration) as done:
        op.send(store.serve(op.send(first)))
    assert done.value.value == {}
