"""The wire protocol version, over real sockets: sent in every header, a peer of another version
refused with both versions named, and the service serving everyone else all the while.

No Ray: the shard's and the index's servers run here on their own threads, as their actors run
them, and the peers are raw authenticated zmq sockets that speak whatever version they are told.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from dataplane.errors import ProtocolVersionError, WireError
from dataplane.server.index.actor import IndexServer
from dataplane.server.index.core import IndexCore
from dataplane.server.router import RequestServer
from dataplane.server.shard.actor import ShardServer
from dataplane.server.shard.core import ShardCore
from dataplane.transport.auth import Credentials, secure_client
from dataplane.transport.liveness import process_start
from dataplane.transport.locality import Locality
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import decode_result, reply

OURS = _wire.PROTOCOL_VERSION
OTHER = OURS + 1
REPLY_MS = 10_000  # a deadline for every reply: a missing one fails the test, never hangs it


@pytest.fixture
def creds() -> Credentials:
    return Credentials.new(encrypt=False)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _shard_server(creds: Credentials, name: str = "v-shard") -> ShardServer:
    core = ShardCore(0, capacity_bytes=1 << 20, name=f"{name}-{os.getpid()}")
    return ShardServer(core, "127.0.0.1", name, creds, rpc_timeout_s=10.0, lock=threading.Lock())


@pytest.fixture(params=["shard", "index"])
def server(request, creds) -> Iterator[RequestServer]:
    if request.param == "shard":
        srv: RequestServer = _shard_server(creds)
    else:
        srv = IndexServer(IndexCore(), "127.0.0.1", "v-index", creds)
    srv.start()
    yield srv
    srv.stop()
    if isinstance(srv, ShardServer):
        srv.core.close()


def _dealer(ctx: zmq.Context, creds: Credentials, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, creds.for_clients(), curve=False)
    sock.connect(endpoint)
    return sock


def _header(rid: int, op: str, body: dict, version: int | None) -> bytes:
    """A request header as a peer of ``version`` sends it (None: a peer from before versions)."""
    return msgspec.msgpack.encode([rid, op, body] + ([] if version is None else [version]))


def _reply(sock: zmq.Socket) -> _wire.RawReply:
    assert sock.poll(REPLY_MS), "no reply within the deadline"
    return _wire.decode_raw_reply(sock.recv_multipart())[0]


def test_every_header_carries_the_version() -> None:
    assert msgspec.msgpack.decode(_wire.encode_request(1, "stats", {})[0])[-1] == OURS
    assert msgspec.msgpack.decode(_wire.encode_reply(1, {})[0])[-1] == OURS
    assert msgspec.msgpack.decode(_wire.encode_error(1, ValueError("x"))[0])[-1] == OURS


def test_a_request_of_another_version_is_refused_by_name_and_others_are_served(server, creds, ctx) -> None:
    other = _dealer(ctx, creds, server.ipc)
    bystander = _dealer(ctx, creds, server.tcp)
    try:
        other.send(_header(5, "stats", {}, OTHER))
        rep = _reply(other)
        assert rep.rid == 5 and rep.error is not None and rep.error[0] == "ProtocolVersionError", rep
        err = _wire.rebuild_error(rep.error)
        assert isinstance(err, ProtocolVersionError)
        assert (err.client_version, err.service_version) == (OTHER, OURS)
        assert f"version {OTHER}" in str(err) and f"version {OURS}" in str(err) and server.name in str(err)
        # the server goes on: other peers, and the same peer once it speaks this version
        bystander.send(_header(6, "stats", {}, OURS))
        assert _reply(bystander).error is None
        other.send(_header(7, "stats", {}, OURS))
        rep = _reply(other)
        assert rep.rid == 7 and rep.error is None, rep
    finally:
        other.close()
        bystander.close()


def test_nothing_of_a_refused_request_is_read_past_its_header(server, creds, ctx) -> None:
    """A body that this version would refuse as malformed is not even decoded: the version decides."""
    sock = _dealer(ctx, creds, server.ipc)
    try:
        sock.send(_header(8, "no-such-op", {"junk": [1, 2]}, OTHER))
        rep = _reply(sock)
        assert rep.rid == 8 and rep.error[0] == "ProtocolVersionError", rep.error
    finally:
        sock.close()


def test_a_header_without_a_version_is_version_1(server, creds, ctx) -> None:
    """Peers from before the version was sent spoke version 1 (served while that is this version)."""
    sock = _dealer(ctx, creds, server.ipc)
    try:
        sock.send(_header(9, "stats", {}, None))
        rep = _reply(sock)
        assert rep.rid == 9
        assert (rep.error is None) == (OURS == 1), rep.error
    finally:
        sock.close()


@pytest.mark.parametrize("body", [{"fields": "of another layout"}, ["a", "body", "this version cannot read"]])
def test_a_reply_of_another_version_becomes_the_error_of_its_request(body: Any) -> None:
    frames = [msgspec.msgpack.encode([11, body, None, OTHER]), b"a buffer"]
    rid, err = decode_result(frames)  # as the client reads a reply
    assert rid == 11 and isinstance(err, ProtocolVersionError), err
    assert (err.client_version, err.service_version) == (OURS, OTHER)
    # this version: malformed is malformed, refused by the operation that reads it as its reply struct
    rid, result = decode_result([msgspec.msgpack.encode([11, ["not", "a", "dict"], None, OURS])])
    assert rid == 11 and not isinstance(result, BaseException), result
    with pytest.raises(WireError, match="a malformed reply: not a CommitReply"):
        reply(result[0], _protocol.CommitReply)


class _IndexOfAnotherVersion(RequestServer):
    """Answers every request with a reply of another protocol version."""

    def _serve_one(self, sock: zmq.Socket, msg: list[Any]) -> None:
        rid = msgspec.msgpack.decode(msg[1])[0]
        header = msgspec.msgpack.encode([rid, {"results": [{"ok": {"fields": [], "tags": []}}]}, None, OTHER])
        self.deliver(sock, msg[0], [header])


def test_a_shard_refuses_a_put_its_index_answered_in_another_version(creds, ctx) -> None:
    """The shard passes a one-step put on to an index of another version: the writer gets the
    version error at once (not a timeout), and the shard takes the rows back."""
    index = _IndexOfAnotherVersion(IndexCore(), "127.0.0.1", "v-old-index", creds).start()
    shard = _shard_server(creds, "v-linked-shard")
    shard.link(
        {
            "locality": Locality.here().to_dict(),
            "ipc": index.ipc,
            "tcp": index.tcp,
            "name": index.name,
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
        }
    )
    shard.start()
    writer = _dealer(ctx, creds, shard.ipc)
    try:
        spec = ["dense", "int64", []]
        col = {"spec": spec, "rows": 2, "data": 0}
        body = {
            "partition": "p",
            "keys": ["a", "b"],
            "fields": {"x": {"spec": spec, "nbytes": 16, "col": col}},
        }
        writer.send_multipart([_header(12, "put_ready", body, OURS), bytes(16)])
        rep = _reply(writer)
        assert rep.rid == 12 and rep.error is not None and rep.error[0] == "ProtocolVersionError", rep
        assert f"version {OTHER}" in rep.error[1] and f"version {OURS}" in rep.error[1]
        writer.send(_header(13, "stats", {}, OURS))
        stats = reply(_reply(writer).body, _protocol.ShardStatsReply)
        assert stats.bytes_used == 0 and not stats.partitions.get("p"), stats
    finally:
        writer.close()
        shard.stop()
        shard.core.close()
        index.stop()
