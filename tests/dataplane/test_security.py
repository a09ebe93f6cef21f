"""The store's security guarantees, over real sockets against real stores.

* Authentication: every index and shard socket (ipc and tcp) answers only peers presenting the
  store's credentials; a peer without them, or with a wrong password, gets no reply and changes
  nothing, whether it runs in the test process, in a separate process given only the endpoints, or
  as another user. ``encrypt=True`` makes the tcp endpoints speak CURVE only.
* Pickle: a reader that did not opt in never unpickles, even a column a peer wrote by hand.
* Peer-declared sizes: every size and offset a peer declares is checked; a malformed request gets
  a typed error reply within seconds, changes nothing, and the shard keeps serving.
* Zero-copy views keep their bytes after the rows are cleared and the memory could be reused.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import pwd
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zmq

import dataplane as dp
from dataplane.client.sharding import HashPlacement
from dataplane.transport.auth import Credentials, secure_client
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import R, reply

from .conftest import keys_on_shards, raw_socket, raw_unix_socket, start_store

pytestmark = pytest.mark.ray

NAME = "t-sec"
NUM_SHARDS = 2
SHARD_CAPACITY = 2 << 20
SILENCE_S = 2.0  # how long an unauthenticated peer waits for a reply that must never come
SEND_MS = 10_000  # no test send waits longer for a peer (a hang fails the test, named)
REPLY_MS = 5_000  # how long an authenticated peer waits for a reply that must come
_rids = itertools.count(1000)


# ---- stores and sockets -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(ray_cluster):
    """The module's store: 2 shards of 2 MiB each (so each shard accepts frames up to 3 MiB)."""
    dp.close()
    cfg, registry, handle = start_store(
        name=NAME, num_shards=NUM_SHARDS, capacity_bytes=NUM_SHARDS * SHARD_CAPACITY, rpc_timeout_s=20
    )
    yield registry
    dp.close()
    handle.stop()


@pytest.fixture(scope="module")
def big_store(ray_cluster):
    """A store of unbounded capacity whose sockets take frames of at most 1 MiB."""
    cfg, registry, handle = start_store(
        name="t-sec-big", num_shards=1, capacity_bytes=None, max_message_bytes=1 << 20, rpc_timeout_s=20
    )
    yield registry
    handle.stop()


@pytest.fixture
def attached(store, monkeypatch):
    """This process attached to the module's store, without any pickle opt-in."""
    monkeypatch.delenv("DATAPLANE_ALLOW_PICKLE", raising=False)
    dp.close()
    dp.init(name=NAME)
    assert not dp.api.current_client().allow_pickle
    yield store
    dp.close()


def _dealer(endpoint: str, creds: Credentials | None = None, password: str | None = None, curve=False):
    """A raw DEALER to ``endpoint``: the store's credentials, a PLAIN ``password``, or nothing."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_MS)  # a peer that drops the link leaves no pipe: a send waits
    if creds is not None:
        secure_client(sock, creds, curve=curve)
    elif password is not None:
        sock.plain_username = b"dataplane"
        sock.plain_password = password.encode()
    sock.connect(endpoint)
    return sock


def _ask(sock, op: str, body: dict, frames=(), timeout_ms: int = REPLY_MS):
    """One request with a fresh id; its reply ``(header, frames)`` (the body raw, as a client receives
    it), or None when none came in time."""
    rid = next(_rids)
    sock.send_multipart(_wire.encode_request(rid, op, body, list(frames)), copy=False)
    deadline = time.monotonic() + timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(max(1, int(left * 1000))):
            break
        rep, bufs = _wire.decode_raw_reply(sock.recv_multipart())
        if rep.rid == rid:  # else: a late reply to an earlier request
            return rep, bufs
    return None


def _ok(sock, op: str, body: dict, cls: type[R], frames=()) -> R:
    """One request that must succeed: its reply read as ``cls``, the op's reply struct, as the client
    reads it."""
    got = _ask(sock, op, body, frames)
    assert got is not None, f"no reply to {op!r} within {REPLY_MS} ms"
    assert got[0].error is None, got[0].error
    return reply(got[0].body, cls)


def _replies_within(socks: dict[str, zmq.Socket], seconds: float) -> dict[str, int]:
    """How many messages each socket received within ``seconds`` (all polled together)."""
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    label = {s: name for name, s in socks.items()}
    got = dict.fromkeys(socks, 0)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for s, _ in poller.poll(max(1, int(left * 1000))):
            while True:
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got[label[s]] += 1
    return got


def _endpoints(registry: dict) -> dict[str, str]:
    out = {}
    for transport in ("ipc", "tcp"):
        out[f"index/{transport}"] = registry["index"][transport]
        out[f"shard0/{transport}"] = registry["shards"][0][transport]
    return out


def _hostile_requests(pid: str, key: str) -> list[tuple[str, dict]]:
    return [
        ("stats", {}),
        ("list", {"partition": None}),
        ("get", {"partition": pid, "keys": [key]}),
        ("clear_partition", {"partition": pid}),
    ]


@pytest.fixture
def stored(attached, pid):
    """A partition with one row on each shard; yields (pid, keys, the values put)."""
    keys = keys_on_shards(pid, NUM_SHARDS)
    x = torch.arange(len(keys) * 8, dtype=torch.float32).reshape(len(keys), 8)
    dp.kv_batch_put(keys, pid, {"x": x, "s": [f"row {k}" for k in keys]})
    yield pid, keys, x
    dp.clear_partition(pid)


def _assert_unchanged(pid: str, keys: list[str], x: torch.Tensor) -> None:
    td = dp.kv_batch_get(keys, pid)
    assert torch.equal(td["x"], x), "the stored rows changed"
    assert td.get("s").tolist() == [f"row {k}" for k in keys]
    assert sorted(dp.kv_list(pid)[pid]) == sorted(keys)


# ---- A. authentication ----------------------------------------------------------------------------------


def test_peers_without_the_credentials_get_no_reply_and_change_nothing(store, stored):
    """No credentials / a wrong password, to the index and a shard, over ipc and tcp: silence."""
    pid, keys, x = stored
    socks = {}
    for where, endpoint in _endpoints(store).items():
        socks[f"{where}/none"] = _dealer(endpoint)
        socks[f"{where}/wrong-password"] = _dealer(endpoint, password="0" * 64)
    try:
        for s in socks.values():
            for op, body in _hostile_requests(pid, keys[0]):
                # A refused handshake closes the connection; until zmq reconnects the DEALER has no
                # pipe to queue into, and the request cannot even leave: silence all the same.
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(_wire.encode_request(next(_rids), op, body), flags=zmq.NOBLOCK)
        got = _replies_within(socks, SILENCE_S)
    finally:
        for s in socks.values():
            s.close(linger=0)
    assert not any(got.values()), f"peers without the store's credentials got replies: {got}"
    _assert_unchanged(pid, keys, x)


def test_authenticated_raw_peer_gets_replies(store, stored):
    """The same sockets with the store's credentials are answered: the silence above is refusal."""
    pid, keys, x = stored
    creds = Credentials.from_dict(store["credentials"])
    for where, endpoint in _endpoints(store).items():
        sock = _dealer(endpoint, creds)
        try:
            if where.startswith("index"):
                listed = _ok(sock, "list", {"partition": pid}, _protocol.ListReply)
                assert listed.list[pid].keys() == set(keys), where
            else:
                got = _ok(
                    sock, "get", {"partition": pid, "keys": [keys[0]], "fields": ["x"]}, _protocol.GetReply
                )
                assert list(got.fields) == ["x"], where
            assert _ask(sock, "stats", {}) is not None, where
        finally:
            sock.close(linger=0)


PROBE = r"""
import json, os, sys, time
import msgspec, zmq

endpoints, pid, key, drop_to = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if drop_to:  # imports done: become that user before touching the store
    uid, gid = map(int, drop_to.split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
ctx = zmq.Context()
socks = []
for ep in endpoints:
    for password in (None, "x", "dataplane", "0" * 64):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if password is not None:
            s.plain_username = b"dataplane"
            s.plain_password = password.encode()
        s.connect(ep)
        socks.append(s)
sent = 0
for s in socks:
    for rid, (op, body) in enumerate(
        [
            ("stats", {}),
            ("list", {"partition": None}),
            ("get", {"partition": pid, "keys": [key]}),
            ("clear_partition", {"partition": pid}),
        ]
    ):
        s.send_multipart([msgspec.msgpack.encode([rid, op, body])])
        sent += 1
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLIN)
replies, deadline = 0, time.monotonic() + float(sys.argv[5])
while (left := deadline - time.monotonic()) > 0:
    for s, _ in poller.poll(max(1, int(left * 1000))):
        s.recv_multipart()
        replies += 1
print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "sent": sent, "replies": replies}))
"""


def _probe_cmd(store: dict, pid: str, key: str, drop_to: str = "") -> list[str]:
    endpoints = list(_endpoints(store).values())
    return [sys.executable, "-c", PROBE, json.dumps(endpoints), pid, key, drop_to, str(SILENCE_S)]


def _run_probe(cmd: list[str], **kwargs) -> tuple[dict | None, str]:
    """The probe's report, or None and why it could not run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DATAPLANE_"))}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kwargs)
    except PermissionError as exc:
        return None, f"cannot exec {cmd[0]}: {exc}"
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def test_a_process_with_only_the_endpoints_gets_no_reply(store, stored):
    """A separate process given the endpoints (not the credentials) gets nothing, also as ``nobody``.

    As root the probe also runs as uid ``nobody``: exec'ed as that user (``user=``/``group=`` of
    ``subprocess``, the thread-safe form of a ``preexec_fn`` doing setgid/setuid: this process runs
    Ray's threads); when that user cannot run this venv's interpreter (here it lives under /root),
    the probe imports pyzmq as root and drops to ``nobody`` before it opens a single socket.
    """
    pid, keys, x = stored
    cmd = _probe_cmd(store, pid, keys[0])
    with ThreadPoolExecutor(1) as pool:
        same_user = pool.submit(_run_probe, cmd)
        nobody_report, how = None, "not root"
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            ids = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": [], "cwd": "/"}
            nobody_report, why = _run_probe(cmd, **ids)
            how = "exec'ed as nobody"
            if nobody_report is None:
                print(f"nobody cannot run the probe from this venv ({why.strip()[:300]})")
                nobody_report, why = _run_probe(
                    _probe_cmd(store, pid, keys[0], f"{nobody.pw_uid}:{nobody.pw_gid}")
                )
                how = "dropped to nobody after importing pyzmq" + (f": {why}" if why else "")
        report, why = same_user.result()
    assert report is not None, f"the probe failed: {why}"
    print(f"probe as this user: {report}; as nobody ({how}): {nobody_report}")
    assert report["sent"] > 0 and report["replies"] == 0, (
        f"a process with only the endpoints got replies: {report}"
    )
    _assert_unchanged(pid, keys, x)
    if nobody_report is None:
        pytest.skip(f"the probe could not run as uid nobody ({how})")
    assert nobody_report["uid"] == nobody_report["euid"] == pwd.getpwnam("nobody").pw_uid, nobody_report
    assert nobody_report["sent"] > 0 and nobody_report["replies"] == 0, (
        f"uid nobody got replies: {nobody_report}"
    )
    _assert_unchanged(pid, keys, x)


def test_encrypted_store_speaks_only_curve_over_tcp(ray_cluster):
    """``encrypt=True``: a tcp client (as on another node) works over CURVE; PLAIN over tcp is refused,
    as is CURVE with a key pair the store did not issue; same-host ipc stays PLAIN."""
    dp.close()
    cfg, registry, handle = start_store(name="t-sec-enc", num_shards=1, encrypt=True, rpc_timeout_s=20)
    socks: dict[str, zmq.Socket] = {}
    try:
        dp.init(name="t-sec-enc", transport="tcp")
        client = dp.api.current_client()
        assert client.transport == "zmq"
        for ep in client.sync.endpoints.values():
            assert ep.address.startswith("tcp://") and ep.curve, ep
        keys = ["a", "b"]
        x = torch.randn(2, 50_000)  # 400 KB: goes inline over the encrypted tcp socket
        dp.kv_batch_put(keys, "enc", {"x": x, "s": ["hello", "world"]})
        td = dp.kv_batch_get(keys, "enc")
        assert torch.equal(td["x"], x) and td.get("s").tolist() == ["hello", "world"]

        creds = Credentials.from_dict(registry["credentials"])
        assert creds.encrypt
        stranger_public, stranger_secret = zmq.curve_keypair()
        stranger = Credentials(
            creds.secret, creds.server_public, "", stranger_public.decode(), stranger_secret.decode()
        )
        for who, actor in (("index", registry["index"]), ("shard0", registry["shards"][0])):
            socks[f"{who}/tcp/plain"] = _dealer(actor["tcp"], creds, curve=False)
            socks[f"{who}/tcp/none"] = _dealer(actor["tcp"])
            socks[f"{who}/tcp/stranger-curve"] = _dealer(actor["tcp"], stranger, curve=True)
        for s in socks.values():
            s.send_multipart(_wire.encode_request(next(_rids), "stats", {}))
            s.send_multipart(_wire.encode_request(next(_rids), "get", {"partition": "enc", "keys": keys}))
        got = _replies_within(socks, SILENCE_S)
        assert not any(got.values()), f"peers not speaking the store's CURVE over tcp got replies: {got}"
        for who, actor in (("index", registry["index"]), ("shard0", registry["shards"][0])):
            for endpoint, curve in ((actor["ipc"], False), (actor["tcp"], True)):
                sock = _dealer(endpoint, creds, curve=curve)
                try:
                    assert _ask(sock, "stats", {}) is not None, f"{who} at {endpoint} (curve={curve})"
                finally:
                    sock.close(linger=0)
        assert torch.equal(dp.kv_batch_get(keys, "enc")["x"], x)
    finally:
        for s in socks.values():
            s.close(linger=0)
        dp.close()
        handle.stop()


# ---- B. pickle is never run by a reader that did not opt in ----------------------------------------------


class _Payload:
    """Unpickling this creates the file ``path`` (pickle calls ``open(path, "w")``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_reader_never_unpickles_a_peer_written_object_column(attached, pid, tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(str(marker)))
    proof = tmp_path / "proof"  # the payload is live: unpickling its twin does create the file
    pickle.loads(pickle.dumps(_Payload(str(proof)))).close()
    assert proof.exists()

    key = "evil"
    shard = HashPlacement(NUM_SHARDS).shard_of(pid, key)
    spec = ["object", "pickle", []]
    offsets = np.array([0, len(blob)], dtype=np.int64).tobytes()
    col = {"spec": spec, "rows": 1, "data": 0, "offsets": 1}
    body = {
        "partition": pid,
        "keys": [key],
        "fields": {"obj": {"spec": spec, "nbytes": len(blob), "col": col}},
    }
    sock = raw_socket(attached, shard)
    index = raw_socket(attached, "index")
    try:
        resv = _ok(sock, "reserve", body, _protocol.ReserveReply, [blob, offsets]).resv
        _ok(sock, "commit", {"resv": resv}, _protocol.Done)
        _ok(index, "commit", {"partition": pid, "keys": [key], "fields": ["obj"]}, _protocol.CommitReply)
        with pytest.raises(dp.SerializationError, match="obj"):
            dp.kv_batch_get([key], pid)
        with pytest.raises(dp.SerializationError):
            dp.kv_batch_get([key], pid, select_fields=["obj"], copy=False)
        assert not marker.exists(), "a reader that did not opt in ran the pickle"
        assert dp.kv_list(pid) == {pid: {key: {}}}  # it is stored, just never unpickled
    finally:
        sock.close(linger=0)
        index.close(linger=0)
        dp.clear_partition(pid)
    assert not marker.exists()


# ---- C. every peer-declared size is checked ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["zmq", "unix"])
def shard_sock(store, request):
    """An authenticated raw socket to shard 0 of the module's store (2 MiB capacity): a zmq DEALER,
    or a connection on the Unix lane (the same checks must hold on both)."""
    sock = raw_socket(store, 0) if request.param == "zmq" else raw_unix_socket(store, 0)
    yield sock
    sock.close(linger=0)


def _stats(sock) -> _protocol.ShardStatsReply:
    st = _ok(sock, "stats", {}, _protocol.ShardStatsReply)
    assert st.bytes_used >= 0 and st.bytes_reserved >= 0, st
    return st


def _refused(sock, op: str, body: dict, frames=(), expect=("WireError",), within_s: float = 5.0) -> str:
    """Send a malformed request: a typed error within ``within_s``, nothing changed, still serving."""
    before = _stats(sock)
    t0 = time.monotonic()
    got = _ask(sock, op, body, frames, timeout_ms=int(within_s * 1000))
    took = time.monotonic() - t0
    assert got is not None, f"no reply to a malformed {op!r} within {within_s}s"
    rep = got[0]
    assert rep.error is not None, f"a malformed {op!r} was accepted: {bytes(rep.body)!r}"
    assert rep.error[0] in expect, f"expected {expect}, got {rep.error[:2]}"
    after = _stats(sock)
    for k in ("bytes_used", "bytes_reserved", "partitions"):
        was, now = getattr(before, k), getattr(after, k)
        assert now == was, f"{k} changed from {was} to {now}"
    assert _ask(sock, "stats", {}) is not None, "the shard stopped answering"
    assert took < within_s
    return rep.error[1]


STR = ["arrow", "large_string", []]
BIN = ["arrow", "large_binary", []]


def _i64(*values: int) -> bytes:
    return np.array(values, dtype=np.int64).tobytes()


def _reserve(fields: dict, keys=("a",), pid: str = "malformed") -> dict:
    return {"partition": pid, "keys": list(keys), "fields": fields}


def _inline(spec, nbytes, rows, offsets=True):
    col = {"spec": spec, "rows": rows, "data": 0, "offsets": 1 if offsets else -1}
    return {"spec": spec, "nbytes": nbytes, "col": col}


MALFORMED = {
    # sizes against capacity (2 MiB here)
    "nbytes-2**62-var": (
        "reserve",
        _reserve({"f": {"spec": BIN, "nbytes": 2**62}}),
        [],
        ("StoreFullError",),
    ),
    "nbytes-2**62-dense": (
        "reserve",
        _reserve({"f": {"spec": ["dense", "uint8", [2**62]], "nbytes": 2**62}}),
        [],
        ("StoreFullError", "SchemaError"),  # a row that large is refused by its spec already
    ),
    "nbytes-2**64-1": (  # beyond int64: refused where the wire decodes it
        "reserve",
        _reserve({"f": {"spec": BIN, "nbytes": 2**64 - 1}}),
        [],
        ("WireError",),
    ),
    "nbytes-sum-overflows-int64": (
        "reserve",
        _reserve({f"f{i}": {"spec": BIN, "nbytes": 2**62} for i in range(4)}),
        [],
        ("StoreFullError",),
    ),
    "nbytes-negative": ("reserve", _reserve({"f": {"spec": BIN, "nbytes": -1}}), [], ("WireError",)),
    # declared sizes against the frames sent
    "declared-0-sent-3MiB-var": (
        "reserve",
        _reserve({"f": _inline(BIN, 0, 1)}),
        None,  # built in the test: 3 MiB
        ("WireError", "SchemaError"),
    ),
    "declared-1-sent-3MiB-dense": (
        "reserve",
        _reserve({"f": _inline(["dense", "uint8", [1]], 1, 1, offsets=False)}),
        None,
        ("WireError", "SchemaError"),
    ),
    "dense-2x4-float32-in-3-bytes": (
        "reserve",
        _reserve({"f": _inline(["dense", "float32", [4]], 32, 2, offsets=False)}, keys=("a", "b")),
        [b"abc"],
        ("SchemaError",),
    ),
    "dense-declares-3-bytes": (
        "reserve",
        _reserve({"f": _inline(["dense", "float32", [4]], 3, 2, offsets=False)}, keys=("a", "b")),
        [b"abc"],
        ("SchemaError",),
    ),
    "inline-rows-differ-from-keys": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 1)}, keys=("a", "b")),
        [b"abcdef", _i64(0, 6)],
        ("WireError", "SchemaError"),
    ),
    # offsets of variable-size rows (3 rows of "abcdef")
    "offsets-decrease": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", _i64(0, 4, 2, 6)],
        ("SchemaError",),
    ),
    "offsets-not-from-0": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", _i64(1, 2, 3, 6)],
        ("SchemaError",),
    ),
    "offsets-past-the-data": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", _i64(0, 2, 3, 9)],
        ("SchemaError",),
    ),
    "offsets-wrong-count": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", _i64(0, 3, 6)],
        ("SchemaError",),
    ),
    "offsets-negative-inside": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", _i64(0, -5, 3, 6)],
        ("SchemaError",),
    ),
    "offsets-not-int64": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef", b"\0" * 7],
        ("WireError",),
    ),
    "offsets-frame-missing": (
        "reserve",
        _reserve({"f": _inline(STR, 6, 3)}, keys="abc"),
        [b"abcdef"],
        ("WireError",),
    ),
    "data-frame-missing": ("reserve", _reserve({"f": _inline(STR, 0, 1)}), [], ("WireError",)),
    # bodies of the wrong shape
    "unknown-op": ("frobnicate", {}, [], ("WireError",)),
    "op-is-a-method-name": ("__init__", {}, [], ("WireError",)),
    "op-of-the-handler": ("handle", {}, [], ("WireError",)),
    "keys-not-a-list": ("reserve", {"partition": "p", "keys": 5, "fields": {}}, [], ("WireError",)),
    "get-keys-a-string": ("get", {"partition": "p", "keys": "abc"}, [], ("WireError",)),
    "pid-not-a-string": ("clear_partition", {"partition": 7}, [], ("WireError",)),
    "unknown-body-field": ("stats", {"x": 1}, [], ("WireError",)),
    "unknown-field-in-a-column": (
        "reserve",
        _reserve({"f": {"spec": BIN, "nbytes": 1, "extra": True}}),
        [],
        ("WireError",),
    ),
    "missing-body-field": ("reserve", {"partition": "p", "keys": ["a"]}, [], ("WireError",)),
    "duplicate-keys": (
        "reserve",
        _reserve({"f": {"spec": BIN, "nbytes": 1}}, keys=("a", "b", "a")),
        [],
        ("WireError",),
    ),
    # specs
    "unknown-kind": (
        "reserve",
        _reserve({"f": {"spec": ["mystery", "x", []], "nbytes": 1}}),
        [],
        ("SchemaError",),
    ),
    "unknown-dense-dtype": (
        "reserve",
        _reserve({"f": {"spec": ["dense", "float128", []], "nbytes": 16}}),
        [],
        ("SchemaError",),
    ),
    "unknown-arrow-dtype": (
        "reserve",
        _reserve({"f": {"spec": ["arrow", "large_mystery", []], "nbytes": 1}}),
        [],
        ("SchemaError",),
    ),
    "object-with-another-dtype": (
        "reserve",
        _reserve({"f": {"spec": ["object", "json", []], "nbytes": 1}}),
        [],
        ("SchemaError",),
    ),
    "negative-dim": (
        "reserve",
        _reserve({"f": {"spec": ["dense", "float32", [-1]], "nbytes": 0}}),
        [],
        ("SchemaError",),
    ),
    "40-dims": (
        "reserve",
        _reserve({"f": {"spec": ["dense", "uint8", [1] * 40], "nbytes": 1}}),
        [],
        ("SchemaError",),
    ),
    "spec-of-two-items": (
        "reserve",
        _reserve({"f": {"spec": ["dense", "uint8"], "nbytes": 1}}),
        [],
        ("WireError",),
    ),
    # reservations
    "commit-unknown-reservation": ("commit", {"resv": 987654321}, [], ("ReservationExpiredError",)),
    "commit-negative-reservation": ("commit", {"resv": -1}, [], ("WireError",)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_is_refused_and_changes_nothing(shard_sock, case):
    op, body, frames, expect = MALFORMED[case]
    if frames is None:  # a 3 MiB frame (the most this 2 MiB shard's socket takes) declared as 0 or 1 byte
        data = b"\0" * (3 << 20)
        frames = [data, _i64(0, len(data))] if case.endswith("-var") else [data]
    _refused(shard_sock, op, body, frames, expect)


def test_undecodable_header_and_too_many_frames_are_refused(shard_sock):
    before = _stats(shard_sock)
    shard_sock.send_multipart([b"\xc1 not msgpack"])
    assert shard_sock.poll(REPLY_MS), "no reply to an undecodable header"
    rep, _ = _wire.decode_raw_reply(shard_sock.recv_multipart())
    assert rep.rid == -1 and rep.error[0] == "WireError", rep
    _refused(shard_sock, "stats", {}, [b""] * (_wire.MAX_FRAMES + 1), ("WireError",))
    after = _stats(shard_sock)
    assert (after.bytes_used, after.bytes_reserved) == (before.bytes_used, before.bytes_reserved)


@pytest.mark.parametrize(
    "bad, expect",
    [
        ("missing", "WireError"),
        ("too-short", "WireError"),
        ("past-nbytes", "SchemaError"),
        ("not-int64", "WireError"),
        ("no-such-frame", "WireError"),
    ],
)
def test_bad_commit_of_a_shared_memory_reservation_gives_it_back(shard_sock, bad, expect):
    before = _stats(shard_sock)
    body = _reserve({"s": {"spec": STR, "nbytes": 10}}, keys=("a", "b"), pid="shm-commit")
    resv = _ok(shard_sock, "reserve", body, _protocol.ReserveReply).resv
    held = _stats(shard_sock)
    assert held.bytes_reserved == before.bytes_reserved + 10 + 8 * 3
    offsets, frames = {"s": 0}, [_i64(0, 4, 10)]  # the valid commit, then broken
    if bad == "missing":
        offsets, frames = {}, []
    elif bad == "too-short":
        frames = [_i64(0, 10)]
    elif bad == "past-nbytes":
        frames = [_i64(0, 4, 11)]
    elif bad == "not-int64":
        frames = [b"\0" * 20]
    elif bad == "no-such-frame":
        offsets = {"s": 3}
    got = _ask(shard_sock, "commit", {"resv": resv, "offsets": offsets}, frames)
    assert got is not None and got[0].error is not None, got
    assert got[0].error[0] == expect, got[0].error
    after = _stats(shard_sock)
    assert after.bytes_reserved == before.bytes_reserved, "the bad commit kept its reservation"
    assert after.bytes_used == before.bytes_used and after.partitions == before.partitions
    _refused(
        shard_sock,
        "commit",
        {"resv": resv, "offsets": {"s": 0}},
        [_i64(0, 4, 10)],
        ("ReservationExpiredError",),
    )


def test_index_refuses_malformed_metadata(store):
    sock = raw_socket(store, "index")
    try:
        before = _ok(sock, "stats", {}, _protocol.IndexStatsReply)
        cases = [
            ("prepare", {"partition": "m", "specs": {"f": ["mystery", "x", []]}, "txn": 1}, ("SchemaError",)),
            (
                "prepare",
                {"partition": "m", "specs": {"f": ["dense", "float32", [1] * 40]}, "txn": 2},
                ("SchemaError",),
            ),
            (
                "prepare",
                {"partition": "m", "specs": {"f": ["dense", "float32", []]}},
                ("WireError",),
            ),  # no put id
            (
                "commit",
                {"partition": "m", "keys": ["a"], "txn": 3},
                ("ReservationExpiredError",),
            ),  # never prepared
            ("commit", {"partition": "m", "keys": ["a", "a"]}, ("WireError",)),
            ("commit", {"partition": "m", "keys": ["a"], "tags": [{}, {}]}, ("WireError",)),
            ("commit", {"partition": "m", "keys": "a"}, ("WireError",)),
            ("list", {"partition": 5}, ("WireError",)),
            ("reserve", {}, ("WireError",)),
        ]
        for op, body, expect in cases:
            got = _ask(sock, op, body)
            assert got is not None and got[0].error is not None and got[0].error[0] in expect, (op, body, got)
        after = _ok(sock, "stats", {}, _protocol.IndexStatsReply)
        assert all(after.idle[p] >= before.idle[p] for p in before.idle)  # nothing happened to any
        after.idle = before.idle
        assert after == before
    finally:
        sock.close(linger=0)


def test_huge_reservation_on_an_unbounded_store_is_refused_quickly(big_store):
    sock = raw_socket(big_store, 0)
    try:
        for nbytes in (2**62, 2**63 - 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") + 1):
            msg = _refused(
                sock, "reserve", _reserve({"f": {"spec": BIN, "nbytes": nbytes}}), [], ("StoreFullError",)
            )
            assert "memory" in msg, msg
    finally:
        sock.close(linger=0)


def test_frame_over_max_message_bytes_is_dropped_and_the_server_lives(big_store):
    """A 2 MiB frame to sockets that take 1 MiB: libzmq drops the peer (no reply); others are served."""
    creds = Credentials.from_dict(big_store["credentials"])
    data = b"\0" * (2 << 20)
    socks = {}
    for who, actor in (("index", big_store["index"]), ("shard0", big_store["shards"][0])):
        for transport in ("ipc", "tcp"):
            socks[f"{who}/{transport}"] = _dealer(actor[transport], creds)
    try:
        for s in socks.values():
            assert _ask(s, "stats", {}) is not None  # connected and authenticated first
            body = _reserve({"f": _inline(BIN, len(data), 1)})
            s.send_multipart(_wire.encode_request(next(_rids), "reserve", body, [data, _i64(0, len(data))]))
        got = _replies_within(socks, SILENCE_S)
        assert not any(got.values()), f"an oversized frame was answered: {got}"
    finally:
        for s in socks.values():
            s.close(linger=0)
    for who, actor in (("index", big_store["index"]), ("shard0", big_store["shards"][0])):
        fresh = _dealer(actor["ipc"], creds)
        try:
            assert _ask(fresh, "stats", {}) is not None, f"{who} stopped serving after an oversized frame"
            if who == "shard0":
                st = _ok(fresh, "stats", {}, _protocol.ShardStatsReply)
                assert st.bytes_reserved == 0 and st.bytes_used == 0, st
        finally:
            fresh.close(linger=0)


# ---- zero-copy views ---------------------------------------------------------------------------------------


def test_zero_copy_view_keeps_its_bytes_after_clear_and_reuse(attached, pid):
    numel = 64 * 1024  # 256 KiB: above shm_min_bytes, so it lives in a shared-memory segment
    x = torch.arange(numel, dtype=torch.float32).reshape(1, numel)
    dp.kv_batch_put(["k"], pid, {"x": x})
    try:
        view = dp.kv_batch_get(["k"], pid, copy=False)["x"]
        expect = x.clone()
        assert torch.equal(view, expect)
        dp.kv_clear(["k"], pid)
        for value in (-1.0, -2.0):  # puts of the same size, which would reuse a recycled segment
            dp.kv_batch_put(["k"], pid, {"x": torch.full((1, numel), value)})
            assert dp.kv_batch_get(["k"], pid)["x"].max().item() == value
            assert torch.equal(view, expect), "a zero-copy view changed after its rows were cleared"
            dp.kv_clear(["k"], pid)
        dp.clear_partition(pid)
        dp.kv_batch_put(["k2"], pid, {"x": torch.full((1, numel), 5.0)})
        assert torch.equal(view, expect), "a zero-copy view changed after its partition was dropped"
    finally:
        dp.clear_partition(pid)
