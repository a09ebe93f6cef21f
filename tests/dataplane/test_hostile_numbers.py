"""Every number a peer or a caller can give the store is checked where it enters: no value stops it.

* Over the wire, as a raw peer sends them, to a real index and a real shard (zmq and the Unix
  lane): every numeric field of every request body, each set to ``inf``, ``nan``, ``1e306``, ``-1``,
  the largest and smallest integers msgpack carries (``2**64 - 1`` and ``-2**63``: the wire's
  nearest to ``2**70``, which msgpack cannot encode) and the float ``2.0**70``. Each is refused with
  a ``WireError`` naming the field (or, where the value is in the field's range, answered with a
  typed reply), and both services then still answer, park and time out requests. On the old code a
  ``next`` whose ``timeout_s`` was ``inf`` or ``1e306`` killed the index's request thread.
* Where a caller passes them (``dp.init``, a ``DATAPLANE_*`` variable): a ``ValueError`` or
  ``TypeError`` naming the argument, before anything starts.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from typing import Any

import pytest

import dataplane as dp
from dataplane import errors
from dataplane.config import StoreConfig
from dataplane.wire import frames as _wire

from .conftest import raw_socket, raw_unix_socket, start_store

pytestmark = pytest.mark.ray

NAME = "t-numbers"
REPLY_MS = 10_000
_rids = itertools.count(1)

HOSTILE = [math.inf, math.nan, 1e306, -1, 2**64 - 1, -(2**63), 2.0**70]


@pytest.fixture(scope="module")
def store(ray_cluster):
    dp.close()
    cfg, registry, handle = start_store(name=NAME, num_shards=1, capacity_bytes=4 << 20, rpc_timeout_s=20)
    yield registry
    handle.stop()


@pytest.fixture(scope="module", params=["zmq", "unix"])
def socks(store, request):
    """Raw authenticated sockets to the index and to the shard: zmq DEALERs, or Unix-lane connections."""
    make = raw_socket if request.param == "zmq" else raw_unix_socket
    index, shard = make(store, "index"), make(store, 0)
    # One ready row, so a consumer's arguments reach the sampler (a partition nobody wrote parks first).
    assert _ask(index, "commit", {"partition": "hostile", "keys": ["z"], "fields": ["x"]}).error is None
    yield {"index": index, "shard": shard}
    index.close(linger=0)
    shard.close(linger=0)


def _ask(sock, op: str, body: dict, frames=()) -> _wire.RawReply:
    rid = next(_rids)
    sock.send_multipart(_wire.encode_request(rid, op, body, list(frames)))
    deadline = time.monotonic() + REPLY_MS / 1000
    while (left := deadline - time.monotonic()) > 0:
        assert sock.poll(max(1, int(left * 1000))), f"no reply to {op!r}: the service stopped serving"
        rep = _wire.decode_raw_reply(sock.recv_multipart())[0]
        if rep.rid == rid:
            return rep
    raise AssertionError(f"no reply to {op!r} within {REPLY_MS} ms: the service stopped serving")


SPEC = ["dense", "uint8", [4]]
INLINE = {"spec": SPEC, "nbytes": 4, "col": {"spec": SPEC, "rows": 1, "data": 0, "offsets": -1, "shapes": -1}}
RESERVE = {"partition": "hostile", "keys": ["a"], "fields": {"f": INLINE}, "version": -1}
NEXT = {"partition": "hostile", "task": "t", "batch_size": 2, "fields": ["x"], "timeout_s": 0.05}
BALANCED = {**NEXT, "dp_rank": 0, "dp_size": 2, "batch_index": 0}
READY = {"partition": "hostile", "task": "t", "fields": ["x"], "min_rows": 1, "limit": 8, "timeout_s": 0.05}
COMMIT = {
    "partition": "hostile",
    "keys": ["a"],
    "fields": ["x"],
    "txn": 1,
    "specs": {"x": ["dense", "float32", [2]]},
}

# (service, op, base body, path of the number in it): every numeric field a raw peer can send.
FIELDS: dict[str, tuple[str, str, dict, tuple]] = {
    "reserve.version": ("shard", "reserve", RESERVE, ("version",)),
    "reserve.nbytes": ("shard", "reserve", RESERVE, ("fields", "f", "nbytes")),
    "reserve.spec-dim": ("shard", "reserve", RESERVE, ("fields", "f", "spec", 2, 0)),
    "reserve.col.rows": ("shard", "reserve", RESERVE, ("fields", "f", "col", "rows")),
    "reserve.col.data": ("shard", "reserve", RESERVE, ("fields", "f", "col", "data")),
    "reserve.col.offsets": ("shard", "reserve", RESERVE, ("fields", "f", "col", "offsets")),
    "reserve.col.shapes": ("shard", "reserve", RESERVE, ("fields", "f", "col", "shapes")),
    "put_ready.version": ("shard", "put_ready", RESERVE, ("version",)),
    "put_ready.nbytes": ("shard", "put_ready", RESERVE, ("fields", "f", "nbytes")),
    "commit.resv": ("shard", "commit", {"resv": 1}, ("resv",)),
    "commit.offsets": ("shard", "commit", {"resv": 1, "offsets": {"f": 0}}, ("offsets", "f")),
    "commit.shapes": ("shard", "commit", {"resv": 1, "shapes": {"f": 0}}, ("shapes", "f")),
    "abort.resv": ("shard", "abort", {"resv": 1}, ("resv",)),
    "get.version": ("shard", "get", {"partition": "hostile", "keys": ["a"], "version": -1}, ("version",)),
    "index.prepare.spec-dim": (
        "index",
        "prepare",
        {"partition": "hostile", "specs": COMMIT["specs"]},
        ("specs", "x", 2, 0),
    ),
    "index.commit.txn": ("index", "commit", COMMIT, ("txn",)),
    "index.commit.spec-dim": ("index", "commit", COMMIT, ("specs", "x", 2, 0)),
    "index.commits.txn": ("index", "commits", {"items": [COMMIT]}, ("items", 0, "txn")),
    "index.abort.txn": ("index", "abort", {"txn": 1}, ("txn",)),
    "index.next.batch_size": ("index", "next", NEXT, ("batch_size",)),
    "index.next.timeout_s": ("index", "next", NEXT, ("timeout_s",)),
    "index.next.dp_rank": ("index", "next", BALANCED, ("dp_rank",)),
    "index.next.dp_size": ("index", "next", BALANCED, ("dp_size",)),
    "index.next.batch_index": ("index", "next", BALANCED, ("batch_index",)),
    "index.next.sampler.group_size": (
        "index",
        "next",
        {**NEXT, "sampler": {"name": "group", "group_size": 2}},
        ("sampler", "group_size"),
    ),
    "index.next.sampler.dp_size": (
        "index",
        "next",
        {**BALANCED, "sampler": {"name": "seqlen_balanced", "dp_size": 2}},
        ("sampler", "dp_size"),
    ),
    "index.ready.min_rows": ("index", "ready", READY, ("min_rows",)),
    "index.ready.limit": ("index", "ready", READY, ("limit",)),
    "index.ready.timeout_s": ("index", "ready", READY, ("timeout_s",)),
    "index.ready.dp_rank": ("index", "ready", {**READY, "dp_rank": 0, "batch_index": 0}, ("dp_rank",)),
    "index.ready.batch_index": (
        "index",
        "ready",
        {**READY, "dp_rank": 0, "batch_index": 0},
        ("batch_index",),
    ),
    "index.claim.dp_rank": (
        "index",
        "claim",
        {"partition": "hostile", "task": "t", "fields": ["x"], "keys": ["a"], "dp_rank": 0, "batch_index": 0},
        ("dp_rank",),
    ),
    "index.claim.batch_index": (
        "index",
        "claim",
        {"partition": "hostile", "task": "t", "fields": ["x"], "keys": ["a"], "dp_rank": 0, "batch_index": 0},
        ("batch_index",),
    ),
}
# Values in a field's range, answered as any request is (a result or a typed error): -1 says "no
# version yet" and "no such frame"; a shape dimension is the codec's to refuse (SchemaError).
IN_RANGE = {
    "reserve.version": {-1},
    "put_ready.version": {-1},
    "get.version": {-1},
    "reserve.col.offsets": {-1},
    "reserve.col.shapes": {-1},
    "reserve.spec-dim": {-1, -(2**63)},
    "index.prepare.spec-dim": {-1, -(2**63)},
    "index.commit.spec-dim": {-1, -(2**63)},
}
SAMPLER_ARGS = {"index.next.sampler.group_size", "index.next.sampler.dp_size"}  # checked by the sampler


def _with(body: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(body)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return out


def _still_serving(socks: dict) -> None:
    """Both services answer at once, and the index still parks a request and times it out."""
    assert _ask(socks["shard"], "stats", {}).error is None
    assert _ask(socks["index"], "stats", {}).error is None
    rep = _ask(socks["index"], "next", {**NEXT, "partition": "never-written"})
    assert rep.error is not None and rep.error[0] == "PartitionNotFoundError", rep.error


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_every_number_a_peer_sends_is_checked_where_the_wire_decodes_it(socks, field):
    service, op, body, path = FIELDS[field]
    sock = socks[service]
    named = field.rsplit(".", 1)[-1].replace("spec-dim", "spec")  # the field the error must name
    frames = [b"abcd"] if op in ("reserve", "put_ready") else []
    for value in HOSTILE:
        rep = _ask(sock, op, _with(body, path, value), frames)
        got = f"{field}={value!r}: {rep.error or bytes(rep.body)!r}"
        if rep.error is not None:
            assert isinstance(getattr(errors, rep.error[0], None), type), got
            assert rep.error[0] != "DataplaneError", f"an untyped failure: {got}"
        if value in IN_RANGE.get(field, ()):
            continue
        assert rep.error is not None, f"accepted: {got}"
        if field in SAMPLER_ARGS:  # inside the sampler's spec: the sampler names its argument
            assert rep.error[0] in ("WireError", "BatchSizeError") and named in rep.error[1], got
        else:
            assert rep.error[0] == "WireError" and named in rep.error[1], got
    _still_serving(socks)


# ---- where a caller passes them ------------------------------------------------------------------

NUMERIC_OPTIONS = {
    "num_shards": [0, -1, 2**70, 1.5, True, "2"],
    "capacity_bytes": [0, -1, 2**70, math.inf, 1e6, True],
    "num_cpus": [-1, -0.5, math.inf, math.nan, 65, "1"],  # 0 is valid: the default
    "rpc_timeout_s": [0, -1, math.inf, math.nan, 1e306, "60", None],
    "schedule_timeout_s": [0, math.inf, math.nan, 1e306],
    "shm_min_bytes": [-1, 2**70, math.inf, 1.5],
    "warm_idle_s": [-1, math.inf, math.nan, 1e306],
    "warm_retain_bytes": [-1, 2**70, math.nan],
    "reservation_timeout_s": [0, -1, math.inf, math.nan, 1e306],
    "max_message_bytes": [0, -1, 2**70, math.inf],
}


@pytest.mark.parametrize("option", sorted(NUMERIC_OPTIONS))
def test_init_refuses_every_bad_number_naming_the_option(ray_cluster, option):
    dp.close()
    for value in NUMERIC_OPTIONS[option]:
        if value is None:  # None means "the default" for dp.init's options; the config refuses it
            with pytest.raises((ValueError, TypeError), match=option):
                StoreConfig(**{option: value})
            continue
        with pytest.raises((ValueError, TypeError), match=option):
            dp.init(name="t-numbers-never", **{option: value})
        assert not dp.is_initialized()


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "1e400", "soon"])
def test_a_bad_number_in_the_environment_names_the_variable(ray_cluster, monkeypatch, raw):
    dp.close()
    monkeypatch.setenv("DATAPLANE_RPC_TIMEOUT", raw)
    with pytest.raises(ValueError, match="DATAPLANE_RPC_TIMEOUT"):
        dp.init(name="t-numbers-never")
    monkeypatch.delenv("DATAPLANE_RPC_TIMEOUT")
    monkeypatch.setenv("DATAPLANE_READ_POOL_BYTES", raw)
    from dataplane.config import read_buffer_pool_bytes

    with pytest.raises(ValueError, match="DATAPLANE_READ_POOL_BYTES"):
        read_buffer_pool_bytes()
