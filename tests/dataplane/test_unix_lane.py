"""The same-host Unix lane (``transport.unix``) over real sockets: its framing, its limits against a lying or
hostile peer, its writes to peers that are gone or do not read, a real server's gate (hello, secret,
handshake deadline) and its connection count, the blocking client over it, and the store on it.

Everything runs on real sockets: socket pairs for the framing, real ``RequestServer`` s (an ``IndexCore``
behind them) on their own threads for the gate and the client, the session's Ray cluster for the
store. Every wait has a deadline; a peer's close is seen as EOF on a poll, never waited for by time.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import random
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from dataplane.errors import ShardUnavailableError
from dataplane.server.index.actor import IndexServer
from dataplane.server.router import RequestServer
from dataplane.transport import unix
from dataplane.transport.auth import Credentials
from dataplane.transport.clients import SyncTransport
from dataplane.transport.liveness import Liveness, Target, process_start
from dataplane.transport.sockets import Endpoint
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, Call, reply

from ._ping_core import PingIndex
from .conftest import keys_on_shards, store_fixtures, wait_for

DEADLINE_S = 10.0  # for every wait on a peer: a missing reply or close fails the test, never hangs it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- helpers -------------------------------------------------------------------------------------


def _header(*sizes: int) -> bytes:
    """A message header declaring frames of ``sizes`` bytes: ``[u32 n][u64 len]*n``, little endian
    (written out here, not by the module under test: this is the format both ends must agree on)."""
    return struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)


def _wire_bytes(frames: list[bytes]) -> bytes:
    """A message as it crosses the socket: its header, then the frames' bytes."""
    return _header(*map(len, frames)) + b"".join(frames)


def _pair(max_frames: int = 1 << 10, max_bytes: int = -1) -> tuple[unix.Conn, unix.Conn]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    limits = {"max_frames": max_frames, "max_bytes": max_bytes}
    return unix.Conn(a, **limits), unix.Conn(b, **limits)


def _readable(sock: socket.socket, deadline: float) -> bool:
    """Whether ``sock`` has bytes (or EOF) before ``deadline`` (at least a 1 ms poll)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(1, int((deadline - time.monotonic()) * 1000))))


def _as_bytes(messages: list[list[memoryview]]) -> list[list[bytes]]:
    return [[bytes(f) for f in m] for m in messages]


def _pump(writer: unix.Conn, reader: unix.Conn, count: int) -> list[list[bytes]]:
    """Flush ``writer`` and read ``reader`` until ``count`` messages arrived."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count:
        writer.flush()  # after it, either all is sent or the socket is full: the reader has bytes
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages arrived in time"
        if _readable(reader.sock, deadline):
            got += _as_bytes(reader.read())
    return got


def _feed(reader: unix._Reader, sock: socket.socket, peer: socket.socket, data: bytes) -> list[list[bytes]]:
    """Send ``data`` on ``peer`` while ``reader`` reads ``sock``, until all is sent and read."""
    out: list[list[bytes]] = []
    rest = memoryview(data)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        if rest:
            try:
                rest = rest[peer.send(rest, socket.MSG_DONTWAIT) :]
            except BlockingIOError:
                pass
        while _readable(sock, time.monotonic()):  # what is there now: sent bytes are there at once
            out += _as_bytes(reader.read(sock))
        if not rest:
            return out
        assert time.monotonic() < deadline, "the reader stopped taking bytes"


def _closed_by_peer(sock: socket.socket, timeout: float = DEADLINE_S) -> bytes:
    """Everything the peer sends until it closes the connection; fails if it is still open at ``timeout``."""
    got = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() >= deadline:
            raise AssertionError(f"the peer kept the connection open for {timeout}s (sent {len(got)} bytes)")
        if not _readable(sock, deadline):
            continue
        try:
            chunk = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except ConnectionResetError:  # closed with bytes of ours unread: a close all the same
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


def _raw(address: str) -> socket.socket:
    """A plain connection to a server's Unix lane, as any local process could open one (no hello)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE_S)
    sock.connect(unix.abstract(address))
    return sock


def _hello(secret: str) -> bytes:
    return _wire_bytes([unix.HELLO, secret.encode()])


def _request(rid: int, op: str = "ping", body: dict | None = None, bufs: list[bytes] | None = None) -> bytes:
    return _wire_bytes([bytes(f) for f in _wire.encode_request(rid, op, body or {}, bufs or [])])


def _replies(conn: unix.Conn, n: int) -> list[tuple[_wire.RawReply, list[memoryview]]]:
    """The next ``n`` replies on ``conn``, decoded (the bodies raw, as a client receives them), within
    the deadline."""
    got: list = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < n:
        assert _readable(conn.sock, deadline), f"{len(got)} of {n} replies within the deadline"
        got += [_wire.decode_raw_reply(m) for m in conn.read()]
    assert len(got) == n, got
    return got


def _good_client(server: RequestServer, creds: Credentials) -> unix.Conn:
    return unix.connect(server.unix, creds.secret, max_frames=16, max_bytes=-1)


def _ping(conn: unix.Conn, rid: int) -> None:
    assert conn.send_all(_wire.encode_request(rid, "ping", {}), time.monotonic() + DEADLINE_S)
    ((rep, _),) = _replies(conn, 1)
    assert rep.rid == rid and rep.error is None, rep


def _connections_settle(server: RequestServer, n: int) -> None:
    wait_for(
        lambda: server.connections == n, DEADLINE_S, f"server.connections == {n} (is {server.connections})"
    )


class _Index(IndexServer):
    """The index's server, recording every op it runs: a refused peer must never reach one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ran: list[str] = []
        super().__init__(*args, **kwargs)

    def serve(self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]) -> Any:
        self.ran.append(op)
        return super().serve(sock, ident, rid, op, body, bufs)


class _Closer(RequestServer):
    """Closes the connection of a ``stats`` request instead of answering it (a service lost mid-call),
    as the server closes any connection; answers everything else."""

    def serve(self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]) -> Any:
        if op == "stats":
            self._close_conn(sock)
            return None
        return super().serve(sock, ident, rid, op, body, bufs)


class _Slow(RequestServer):
    """Holds its loop in a ``stats`` request until released (a long op: a big clear, a busy host)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def serve(self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]) -> Any:
        if op == "stats":
            self.entered.set()
            self.release.wait(DEADLINE_S)
        return super().serve(sock, ident, rid, op, body, bufs)


class _BigReplies(RequestServer):
    """Answers every request with a buffer of ``reply_bytes`` (replies the peer must read)."""

    reply_bytes = 64 << 10

    def serve(self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]) -> Any:
        return {}, [bytes(self.reply_bytes)]


@contextlib.contextmanager
def _serving(cls: type[RequestServer], creds: Credentials, name: str) -> Iterator[Any]:
    """A real server of ``cls`` (an ``IndexCore`` behind it, with the toy op ``ping``) on its own thread, as
    its actor runs it."""
    server = cls(PingIndex(), "127.0.0.1", f"{name}-{uuid.uuid4().hex[:6]}", creds).start()
    try:
        yield server
    finally:
        server.stop()
        if not server._ctx.closed:  # its loop died (a bug shown below): close what it left, or the
            server._ctx.destroy(linger=0)  # context's finaliser would wait for it at exit, forever


@pytest.fixture
def creds() -> Credentials:
    return Credentials.new(encrypt=False)


@pytest.fixture
def index(creds) -> Iterator[_Index]:
    with _serving(_Index, creds, "ul-index") as server:
        yield server


@pytest.fixture
def closer(creds) -> Iterator[RequestServer]:
    with _serving(_Closer, creds, "ul-closer") as server:
        yield server


def bodies(results: list[Any]) -> list[Any]:
    """A transport's results with each reply body decoded to plain values (the wire leaves it raw
    for the operation that asked to read as its reply struct)."""
    return [r if isinstance(r, BaseException) else (msgspec.msgpack.decode(r[0]), r[1]) for r in results]


def _transport(server: RequestServer, creds: Credentials, timeout: float = 20.0) -> SyncTransport:
    """A blocking client with ``server`` as target 0 and as INDEX over the Unix lane, as a same-host
    client has it (``creds`` may be another store's)."""
    ep = Endpoint(server.ipc, server.name, False, server.unix)
    me = Target(server.name, os.getpid(), process_start(os.getpid()), True)  # alive: never "dead"
    return SyncTransport({0: ep, INDEX: ep}, creds.for_clients(), timeout, Liveness({0: me, INDEX: me}))


# ---- 1. framing ----------------------------------------------------------------------------------

MESSAGES = [
    [b""],
    [b"", b"", b""],
    [b"header", b"", b"x" * 7],
    [bytes([i % 251]) * (i % 13) for i in range(300)],  # many frames
    [b"big", os.urandom(100 << 10)],  # larger than the read buffer (64 KiB)
    [os.urandom((1 << 20) + 17), b"tail"],  # over 1 MiB: received whole into a buffer of its own
    [b"after the big ones"],
]


def test_messages_round_trip_between_two_conns() -> None:
    a, b = _pair()
    try:
        for message in MESSAGES:
            assert a.write(message)
        assert _pump(a, b, len(MESSAGES)) == MESSAGES
        assert b.write([b"reply", b""]) and _pump(b, a, 1) == [[b"reply", b""]]  # the other way
        assert not a.pending and a.pending_bytes == 0
    finally:
        a.close()
        b.close()


@pytest.fixture
def raw_pair():
    """A non-blocking socket to read from with a bare ``_Reader``, and its peer to write into."""
    sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    yield sock, peer, unix._Reader(max_frames=8, max_bytes=-1)
    sock.close()
    peer.close()


def test_bytes_arriving_one_at_a_time_make_one_message_at_the_last_byte(raw_pair) -> None:
    sock, peer, reader = raw_pair
    for message in ([b"ab", b"", b"c"], [b"q" * 70_000, b"r"]):  # in the read buffer, and larger
        data = _wire_bytes(message)
        # byte by byte over the header and the ends, in odd chunks in between
        edges = {*range(40), *range(len(data) - 40, len(data))}
        cuts = sorted(c for c in {*edges, *range(40, len(data), 4093)} if 0 <= c < len(data))
        got: list[list[bytes]] = []
        for start, end in zip(cuts, [*cuts[1:], len(data)], strict=True):
            assert not got, f"a message completed at byte {start} of {len(data)}"
            got = _feed(reader, sock, peer, data[start:end])
        assert got == [message]


def test_several_messages_in_one_read_and_messages_across_the_read_buffer(raw_pair) -> None:
    sock, peer, reader = raw_pair
    three = [[b"one"], [b"", b"two"], [b"three", b"3" * 1000]]
    peer.sendall(b"".join(_wire_bytes(m) for m in three))
    assert _as_bytes(reader.read(sock)) == three  # one read, all three
    # Sizes around the 64 KiB read buffer, the stream cut anywhere: every message whole, in order.
    rng = random.Random(7)
    sizes = [60_000, 5_000, 65_500, 1, 0, 70_000, 4_090, 65_536 - 12, 130_000, 3, 65_000, 9]
    stream = [[bytes([i]) * size, bytes([i])] for i, size in enumerate(sizes)]
    data = b"".join(_wire_bytes(m) for m in stream)
    got, at = [], 0
    while at < len(data):
        step = rng.choice([1, 7, 4096, 20_000, 65_536, 100_000])
        got += _feed(reader, sock, peer, data[at : at + step])
        at += step
    assert got == stream


# ---- 2. limits against a lying or hostile peer -----------------------------------------------------


@pytest.mark.parametrize(
    "header, match",
    [
        (_header(*[1] * 9), "9 frames"),  # over max_frames (8)
        (_header(), "0 frames"),  # no frame at all
        (_header(3, 1001), "1001 bytes"),  # a frame over max_bytes (1000)
    ],
    ids=["too many frames", "no frames", "a frame too large"],
)
def test_a_message_over_the_limits_closes_the_connection(header: bytes, match: str) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = unix.Conn(a, max_frames=8, max_bytes=1000)
    try:
        b.sendall(header)
        assert _readable(conn.sock, time.monotonic() + DEADLINE_S)
        with pytest.raises(unix.ConnectionClosed, match=match):
            conn.read()
    finally:
        conn.close()
        b.close()


def test_a_declared_huge_frame_costs_memory_only_as_its_bytes_arrive() -> None:
    sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    reader = unix._Reader(max_frames=8, max_bytes=-1)  # no limit: only the bytes that arrive may cost
    tracemalloc.start()
    try:
        assert _feed(reader, sock, peer, _header(2**40) + b"x" * 100) == []
        held = len(reader.buf) + (len(reader.big) if reader.big is not None else 0)
        assert held <= 2 << 20, f"a claim of 1 TiB made the reader hold {held} bytes for 100 received"
        for _ in range(3):  # 3 MiB more: the buffer grows with them, never to the declared size
            assert _feed(reader, sock, peer, b"y" * (1 << 20)) == []
        assert reader.big is not None and len(reader.big) <= 2 * reader.big_filled, len(reader.big)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 32 << 20, f"{peak} bytes allocated at the peak for ~3 MiB received"
        peer.close()  # and EOF in the middle of it
        assert _readable(sock, time.monotonic() + DEADLINE_S)
        with pytest.raises(unix.ConnectionClosed, match="closed"):
            reader.read(sock)
    finally:
        tracemalloc.stop()
        sock.close()
        peer.close()


@pytest.mark.parametrize(
    "sent",
    [b"\x02\x00", _wire_bytes([b"abc", b"defg"])[:-2], _wire_bytes([b"z" * 80_000])[:70_000]],
    ids=["mid header", "mid body", "mid a large message"],
)
def test_eof_mid_message_closes_the_connection(sent: bytes) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = unix.Conn(a, max_frames=8, max_bytes=-1)
    try:
        b.sendall(sent)
        b.close()
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(unix.ConnectionClosed, match="closed"):
            while True:  # what arrived parses to no message; then the EOF
                assert _readable(conn.sock, deadline), "neither the bytes nor the EOF arrived"
                assert conn.read() == []
    finally:
        conn.close()


# ---- 3. writes -----------------------------------------------------------------------------------


def test_writes_to_a_closed_peer_return_false_without_sigpipe() -> None:
    """In a process with SIGPIPE's default action (death), as a non-Python host of the client has it."""
    script = textwrap.dedent(
        """
        import signal, socket, time
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        from dataplane.transport import unix

        def closed_pair():
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            return unix.Conn(a, max_frames=4, max_bytes=-1), b

        conn, b = closed_pair()
        b.close()
        assert conn.write([b"x"]) is False and conn.closed
        assert conn.write([b"y"]) is False
        conn, b = closed_pair()
        assert conn.write([bytes(4 << 20)]) and conn.pending  # more than the socket takes
        b.close()
        conn.flush()
        assert conn.closed and not conn.pending
        conn, b = closed_pair()
        b.close()
        assert conn.send_all([b"z"], time.monotonic() + 5) is False
        print("survived")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "survived", (proc.returncode, proc.stderr[-2000:])


def test_replies_a_peer_does_not_read_wait_in_pending_until_it_reads() -> None:
    a, b = _pair()
    try:
        messages = [[b"m%d" % i, bytes([i]) * (300 << 10)] for i in range(4)]  # 1.2 MiB: more than the socket
        for m in messages:
            assert a.write(m)
        assert a.pending and a.pending_bytes > 0
        waiting = a.pending_bytes
        assert not a.flush() and a.pending_bytes == waiting  # the peer has read nothing: still full
        assert _pump(a, b, len(messages)) == messages  # the peer reads: flush sends the rest
        assert a.flush() and not a.pending and a.pending_bytes == 0
    finally:
        a.close()
        b.close()


def test_a_peer_that_leaves_too_much_unread_is_closed(monkeypatch) -> None:
    monkeypatch.setattr(unix, "MAX_PENDING_BYTES", 1 << 20)
    a, b = _pair()
    try:
        socket_takes = a.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        results = [a.write([bytes(128 << 10)]) for _ in range(64)]  # 8 MiB; the peer reads nothing
        assert False in results, "8 MiB waited for a peer that reads nothing"
        first = results.index(False)
        assert all(results[:first]) and not any(results[first:]), results
        assert first * (128 << 10) <= (1 << 20) + socket_takes + (128 << 10), f"closed only at write {first}"
        assert a.closed and not a.pending and a.pending_bytes == 0
        a.close()  # what its owner then does (a server: ``_close_conn``, after unregistering it)
        _closed_by_peer(b.sock)  # the peer sees the end once it reads
    finally:
        a.close()
        b.close()


# ---- 4. a real server's gate ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        lambda secret: _request(3),
        lambda secret: _hello(Credentials.new(encrypt=False).secret),
        lambda secret: _wire_bytes([unix.HELLO, b"s" * 300]),
        lambda secret: _wire_bytes([unix.HELLO, secret.encode(), b""]),
        lambda secret: _header(len(unix.HELLO), 2**40) + unix.HELLO,
    ],
    ids=[
        "a request without hello",
        "a wrong secret",
        "an oversized hello",
        "a hello of 3 frames",
        "a 1 TiB hello",
    ],
)
def test_the_server_closes_a_peer_that_does_not_open_with_the_hello(index, creds, first) -> None:
    bad = _raw(index.unix)
    try:
        bad.sendall(first(creds.secret) + _request(4, "finish", {"partition": "p"}))
        assert _closed_by_peer(bad) == b"", "a refused peer was sent something"
    finally:
        bad.close()
    good = _good_client(index, creds)
    try:
        _ping(good, 5)  # answered after the refusal: had the refused requests run, they would show first
        assert index.ran == ["ping"], index.ran
    finally:
        good.close()
    _connections_settle(index, 0)


def test_a_silent_peer_is_closed_after_the_handshake_deadline(index, creds, monkeypatch) -> None:
    monkeypatch.setattr(unix, "HANDSHAKE_S", 1.0)  # checked on the server's tick (every 0.25 s)
    started = time.monotonic()
    silent, partial = _raw(index.unix), _raw(index.unix)
    good = _good_client(index, creds)
    try:
        partial.sendall(_hello(creds.secret)[:-5])  # most of a hello, then nothing
        _connections_settle(index, 3)
        for sock in (silent, partial):
            assert _closed_by_peer(sock) == b""
        assert time.monotonic() - started >= 1.0, "closed before its handshake deadline"
        _connections_settle(index, 1)
        _ping(good, 6)  # said hello in time: served after the deadline too
        assert index.ran == ["ping"]
    finally:
        silent.close()
        partial.close()
        good.close()


def test_a_hello_and_requests_in_one_send_are_all_served(index, creds) -> None:
    sock = _raw(index.unix)
    conn = unix.Conn(sock, max_frames=16, max_bytes=-1)
    try:
        # the third request is larger than a hello may be: held to the limits of a peer that said hello
        long = {"partition": "p" * 400}
        sock.sendall(_hello(creds.secret) + _request(11) + _request(12, "stats") + _request(13, "list", long))
        replies = [rep for rep, _ in _replies(conn, 3)]
        assert [(r.rid, r.error) for r in replies] == [(11, None), (12, None), (13, None)], replies
        assert reply(replies[1].body, _protocol.IndexStatsReply).partitions == {}
        assert reply(replies[2].body, _protocol.ListReply).list == {}
        assert index.ran == ["ping", "stats", "list"]
    finally:
        conn.close()


def test_after_all_the_abuse_the_server_still_answers(index, creds) -> None:
    abuse = [
        b"\xff" * 64,  # garbage
        _request(1) * 3,
        _hello("wrong") + _request(2),
        _header(len(unix.HELLO), 2**40) + unix.HELLO,
    ]
    abusers = [_raw(index.unix) for _ in abuse]
    lingering = _raw(index.unix)
    good = _good_client(index, creds)
    try:
        lingering.sendall(_hello(creds.secret)[:7])  # stays open (HANDSHAKE_S is 10 s) meanwhile
        for sock, data in zip(abusers, abuse, strict=True):
            sock.sendall(data)
        for sock in abusers:
            assert _closed_by_peer(sock) == b""
        _ping(good, 21)
        # a request the index refuses (it takes no buffer frames) gets the typed refusal it gets over zmq
        request = _wire.encode_request(22, "ping", {}, [b"frame"])
        assert good.send_all(request, time.monotonic() + DEADLINE_S)
        ((refused, _),) = _replies(good, 1)
        assert refused.rid == 22 and refused.error is not None, refused
        # an authenticated peer that breaks the lane's framing is closed, served nothing
        other = _good_client(index, creds)
        try:
            other.sock.sendall(struct.pack("<I", 2**31))  # a message of 2**31 frames, it says
            assert _closed_by_peer(other.sock) == b""
        finally:
            other.close()
        _ping(good, 23)
        assert index.ran == ["ping", "ping"]
        _connections_settle(index, 2)  # the good client and the one still within its handshake
    finally:
        for sock in [*abusers, lingering]:
            sock.close()
        good.close()


def test_the_server_counts_its_unix_connections(index, creds) -> None:
    conns = [_good_client(index, creds) for _ in range(3)]
    raw = _raw(index.unix)  # accepted, not yet authenticated: counted too
    try:
        _connections_settle(index, 4)
        conns.pop().close()
        _connections_settle(index, 3)
        raw.close()
        _connections_settle(index, 2)
        _ping(conns[0], 31)
    finally:
        for conn in conns:
            conn.close()
        raw.close()
    _connections_settle(index, 0)


def test_the_server_closes_a_peer_that_does_not_read_its_replies_and_serves_on(creds, monkeypatch) -> None:
    monkeypatch.setattr(unix, "MAX_PENDING_BYTES", 1 << 20)
    with _serving(_BigReplies, creds, "ul-big") as server:
        sock = _raw(server.unix)
        try:
            # 64 requests for 4 MiB of replies, none read: the server holds at most ~1 MiB, then closes
            sock.sendall(_hello(creds.secret) + b"".join(_request(100 + i) for i in range(64)))
            assert len(_closed_by_peer(sock)) < 3 << 20
        finally:
            sock.close()
        t = _transport(server, creds, timeout=2.0)  # everyone else is served
        try:
            (result,) = t.call_many([Call(0, "ping", {})])
            assert not isinstance(result, BaseException), result
            assert [b.nbytes for b in result[1]] == [_BigReplies.reply_bytes]
        finally:
            t.close()
        _connections_settle(server, 0)


def test_a_client_that_gives_up_while_the_server_is_busy_does_not_take_it_down(creds) -> None:
    with _serving(_Slow, creds, "ul-slow") as server:
        t = _transport(server, creds, timeout=0.5)
        try:
            (gave_up,) = t.call_many([Call(0, "stats", {})])  # times out, closing its connection
        finally:
            t.close()
        assert isinstance(gave_up, ShardUnavailableError) and server.entered.is_set(), gave_up
        server.release.set()  # the reply now goes to a peer that left (EPIPE)
        t = _transport(server, creds, timeout=2.0)
        try:
            assert bodies(t.call_many([Call(0, "ping", {})])) == [({}, [])]
        finally:
            t.close()
        _connections_settle(server, 0)


# A process of another user (stdlib only: that user may not read this venv). Started as root, it drops
# to ``drop`` ("uid:gid") before it opens its socket, sends ``data`` (hex) and reports what came back
# before the connection closed or ``wait_s`` passed (it stops at the first bytes).
OTHER_USER = textwrap.dedent(
    r"""
    import json, os, select, socket, sys, time
    cfg = json.loads(sys.stdin.read())
    uid, gid = map(int, cfg["drop"].split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + cfg["address"][1:])
    got, closed, deadline = b"", False, time.monotonic() + cfg["wait_s"]
    try:
        sock.sendall(bytes.fromhex(cfg["data"]))
    except (BrokenPipeError, ConnectionResetError):  # closed before all of it was sent
        closed = True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while not got and not closed and (left := deadline - time.monotonic()) > 0:
        if poller.poll(max(1, int(left * 1000))):
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            got += chunk
    print(json.dumps({"uid": os.getuid(), "got": len(got), "closed": closed}))
    """
)


def _as_other_user(address: str, data: bytes) -> dict[str, Any]:
    """Connect to ``address`` from a process running as uid ``nobody``, send ``data``, report."""
    if os.geteuid() != 0:
        pytest.skip("running a process as uid nobody needs root")
    nobody = pwd.getpwnam("nobody")
    cfg = {
        "address": address,
        "data": data.hex(),
        "drop": f"{nobody.pw_uid}:{nobody.pw_gid}",
        "wait_s": DEADLINE_S,
    }
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", OTHER_USER],
        input=json.dumps(cfg),
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["uid"] == nobody.pw_uid, report
    return report


def test_a_peer_of_another_uid_is_closed_at_accept_even_with_the_secret(index, creds) -> None:
    report = _as_other_user(index.unix, _hello(creds.secret) + _request(41))
    assert report == {**report, "got": 0, "closed": True}, report
    assert index.ran == [] and index.refused >= 1, (index.ran, index.refused)
    good = _good_client(index, creds)  # the store's own uid: served
    try:
        _ping(good, 42)
        assert index.ran == ["ping"]
    finally:
        good.close()


def test_a_uid_the_allow_list_names_may_connect(creds, monkeypatch) -> None:
    monkeypatch.setenv("DATAPLANE_UNIX_PEER_UIDS", f"{pwd.getpwnam('nobody').pw_uid}")
    with _serving(_Index, creds, "ul-allowed") as server:  # the list is read when a server starts
        report = _as_other_user(server.unix, _hello(creds.secret) + _request(43))
        assert report["got"] > 0, report  # its ping was answered
        assert server.ran == ["ping"] and server.refused == 0


def test_the_allow_list_must_be_uids() -> None:
    from dataplane.config import unix_peer_uids

    os.environ["DATAPLANE_UNIX_PEER_UIDS"] = "1001, alice"
    try:
        with pytest.raises(ValueError, match="DATAPLANE_UNIX_PEER_UIDS.*'alice' is not a uid"):
            unix_peer_uids()
        os.environ["DATAPLANE_UNIX_PEER_UIDS"] = " 1001,1002,"
        assert unix_peer_uids() == {os.getuid(), 1001, 1002}
    finally:
        del os.environ["DATAPLANE_UNIX_PEER_UIDS"]


def test_silent_connections_are_capped_oldest_first_and_a_hello_that_arrived_is_served(
    creds, monkeypatch
) -> None:
    """A listener keeps at most ``max_unauthenticated()`` connections that have not said hello (16
    here); a newer one drops the oldest, unless that one's hello has arrived by then: it is served.

    The server's loop is held in a request while the connections queue up, so all arrive in one
    accept pass, before the loop could read any of them: the first, which sent its hello and a ping,
    is the oldest when the cap is passed and must be read, not dropped."""
    monkeypatch.setattr(unix, "MAX_UNAUTHENTICATED", 16)
    with _serving(_Slow, creds, "ul-capped") as server:
        t = _transport(server, creds)
        holder = threading.Thread(target=lambda: t.call_many([Call(0, "stats", {})]), daemon=True)
        holder.start()
        early: socket.socket | None = None
        silent: list[socket.socket] = []
        try:
            assert server.entered.wait(DEADLINE_S), "the server never took the request that holds it"
            early = _raw(server.unix)
            early.sendall(_hello(creds.secret) + _request(51))
            silent = [_raw(server.unix) for _ in range(20)]
            server.release.set()
            early_conn = unix.Conn(early, max_frames=16, max_bytes=-1)
            ((rep, _),) = _replies(early_conn, 1)
            assert rep.rid == 51 and rep.error is None, rep
            for sock in silent[:4]:  # 21 accepted, 16 kept: the 4 oldest silent ones were dropped
                assert _closed_by_peer(sock) == b""
            _connections_settle(server, 1 + 1 + 16)  # the holder, the early one, 16 silent
            assert server.evicted == 4
            assert not any(_readable(sock, time.monotonic()) for sock in silent[4:])  # still open
            _ping(early_conn, 52)  # and served on
        finally:
            server.release.set()
            holder.join(DEADLINE_S)
            t.close()
            for sock in [s for s in (early, *silent) if s is not None]:
                sock.close()


# ---- 5. the blocking client ----------------------------------------------------------------------


def test_the_sync_client_is_answered_over_the_unix_lane(index, creds) -> None:
    t = _transport(index, creds)
    try:
        assert bodies(t.call_many([Call(0, "ping", {})])) == [({}, [])]
        calls = [Call(0, "ping", {}), Call(INDEX, "stats", {}), Call(0, "ping", {})]
        ping, (stats, bufs), pong = bodies(t.call_many(calls))
        assert ping == pong == ({}, []) and stats["partitions"] == {} and bufs == []
        (kept,) = t._idle  # the call set kept for the next call: Unix-lane connections, no zmq socket
        assert sorted(kept) == [INDEX, 0] and all(type(s) is unix.Conn for s in kept.values())
        assert index.connections == 2  # one per target, and nothing over zmq
        assert sorted(index.ran) == ["ping", "ping", "ping", "stats"]
    finally:
        t.close()
    _connections_settle(index, 0)


@pytest.mark.parametrize("ops", [["stats"], ["ping", "stats"]], ids=["one call", "two calls"])
def test_a_call_whose_connection_the_server_closes_fails_as_unavailable(closer, creds, ops) -> None:
    t = _transport(closer, creds)
    try:
        started = time.monotonic()
        results = t.call_many([Call(0, op, {}) for op in ops])
        took = time.monotonic() - started
        assert took < 5, f"took {took:.1f}s of a 20s deadline"
        lost = results[-1]
        assert isinstance(lost, ShardUnavailableError), results
        assert lost.shard == closer.name and "closed" in str(lost), lost
        assert bodies(results[:-1]) == [({}, [])] * (len(ops) - 1)  # answered before the close
        assert bodies(t.call_many([Call(0, "ping", {})])) == [({}, [])]  # the next call connects afresh
    finally:
        t.close()


def test_a_wrong_secret_fails_the_call_at_once(index) -> None:
    t = _transport(index, Credentials.new(encrypt=False))  # another store's secret
    try:
        started = time.monotonic()
        results = t.call_many([Call(0, "ping", {})]) + t.call_many(
            [Call(0, "ping", {}), Call(INDEX, "stats", {})]
        )
        took = time.monotonic() - started
        assert took < 5, f"took {took:.1f}s of a 20s deadline"
        assert all(isinstance(r, ShardUnavailableError) for r in results), results
        assert index.ran == []
    finally:
        t.close()


def test_a_unix_address_nobody_listens_on_fails_the_call_at_once(creds) -> None:
    ep = Endpoint("ipc://@nobody", "ul-nobody", False, f"@ul-nobody-{uuid.uuid4().hex}")
    t = SyncTransport({0: ep}, creds.for_clients(), 20.0, Liveness({}))
    try:
        started = time.monotonic()
        (result,) = t.call_many([Call(0, "ping", {})])
        assert isinstance(result, ShardUnavailableError) and "connecting failed" in str(result), result
        assert time.monotonic() - started < 5
    finally:
        t.close()


# ---- found by these tests and fixed: large messages, a connection lost mid-batch, a full backlog ------


def test_a_request_larger_than_max_pending_reaches_a_server_that_reads_it(closer, creds, monkeypatch) -> None:
    monkeypatch.setattr(unix, "MAX_PENDING_BYTES", 1 << 20)  # stands for the real 256 MiB
    t = _transport(closer, creds)
    try:
        assert bodies(t.call_many([Call(0, "ping", {}, [bytes(4 << 20)])])) == [({}, [])]
    finally:
        t.close()


def test_a_reply_larger_than_max_pending_reaches_a_client_that_reads_it(creds, monkeypatch) -> None:
    monkeypatch.setattr(unix, "MAX_PENDING_BYTES", 1 << 20)  # stands for the real 256 MiB
    monkeypatch.setattr(_BigReplies, "reply_bytes", 4 << 20)
    with _serving(_BigReplies, creds, "ul-bigger") as server:
        t = _transport(server, creds)
        try:
            (result,) = t.call_many([Call(0, "ping", {})])
            assert not isinstance(result, BaseException), result
            assert [b.nbytes for b in result[1]] == [4 << 20]
        finally:
            t.close()


def test_a_connection_lost_while_sending_ends_the_calls_already_sent_on_it_at_once(closer, creds) -> None:
    t = _transport(closer, creds, timeout=2.0)
    try:
        cpu, started = time.process_time(), time.monotonic()
        # The server closes the connection on "stats" while the client is still sending the 8 MiB ping.
        results = t.call_many([Call(0, "stats", {}), Call(0, "ping", {}, [bytes(8 << 20)])])
        took, spent = time.monotonic() - started, time.process_time() - cpu
        assert all(isinstance(r, ShardUnavailableError) for r in results), results
        assert took < 1.0, f"took {took:.1f}s ({spent:.1f}s of CPU) of a 2s deadline: {results[0]}"
    finally:
        t.close()


def _full_backlog() -> tuple[socket.socket, str, list[socket.socket]]:
    """A listener that does not accept, its backlog filled by connections of its own."""
    listener, address = unix.listen(f"ul-full-{uuid.uuid4().hex[:8]}")
    listener.listen(0)  # a backlog of one: what 513 connects do to a service whose loop is busy
    fill: list[socket.socket] = []
    while len(fill) < 64:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        fill.append(s)
        try:
            s.connect(unix.abstract(address))
        except BlockingIOError:  # the backlog is full
            fill.pop().close()
            return listener, address, fill
    raise AssertionError("the backlog never filled")


@pytest.fixture
def connect_attempts(monkeypatch) -> list[float]:
    """When each connect try of ``unix.connect`` was made (the real call, counted)."""
    attempts: list[float] = []
    real = unix._attempt

    def counted(sock: socket.socket, where: str) -> None:
        attempts.append(time.monotonic())
        real(sock, where)

    monkeypatch.setattr(unix, "_attempt", counted)
    return attempts


def test_connecting_to_a_service_that_does_not_accept_honours_the_deadline(creds) -> None:
    listener, address, fill = _full_backlog()
    out: list = []
    t = SyncTransport({0: Endpoint("ipc://@none", "ul-full", False, address)}, creds, 1.0, Liveness({}))
    caller = threading.Thread(target=lambda: out.append(t.call_many([Call(0, "ping", {})])), daemon=True)
    try:
        caller.start()
        caller.join(2.5)
        returned = not caller.is_alive()
    finally:
        listener.close()  # refuses a connect blocked on it: the caller ends either way
        for s in fill:
            s.close()
    caller.join(DEADLINE_S)
    t.close()
    assert not caller.is_alive(), "the call did not end even once the listener closed"
    assert returned, "a call with a 1 s deadline was still connecting after 2.5 s"
    assert isinstance(out[0][0], ShardUnavailableError), out


def test_a_connect_to_a_full_backlog_waits_for_room(creds, connect_attempts) -> None:
    attempts = connect_attempts
    listener, address, fill = _full_backlog()
    out: list[Any] = []

    def connecting() -> None:
        try:
            out.append(unix.connect(address, creds.secret, max_frames=16, max_bytes=-1, timeout=DEADLINE_S))
        except OSError as exc:
            out.append(exc)

    caller = threading.Thread(target=connecting, daemon=True)
    accepted: list[socket.socket] = []
    try:
        caller.start()
        wait_for(lambda: len(attempts) >= 3 or out, DEADLINE_S, "three tries at the full backlog")
        assert not out, f"the connect gave up at once on a full backlog: {out}"
        accepted.append(listener.accept()[0])  # the service takes one: room for one more
        caller.join(DEADLINE_S)
        assert out and isinstance(out[0], unix.Conn), out
        accepted += [listener.accept()[0] for _ in range(len(fill))]  # the rest, then the caller's
        assert _readable(accepted[-1], time.monotonic() + DEADLINE_S)
        assert accepted[-1].recv(1 << 10) == _hello(creds.secret)  # connected, its hello sent
    finally:
        for s in [*fill, *accepted, *[c.sock for c in out if isinstance(c, unix.Conn)]]:
            s.close()
        listener.close()


def test_a_connect_to_a_backlog_that_stays_full_fails_at_its_deadline_without_spinning(
    creds, connect_attempts
) -> None:
    attempts = connect_attempts
    listener, address, fill = _full_backlog()
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError, match="backlog stayed full"):
            unix.connect(address, creds.secret, max_frames=16, max_bytes=-1, timeout=1.0)
        assert time.monotonic() - started >= 1.0, "gave up before its deadline"
        # pauses from 1 ms doubling to 25 ms: some 45 tries in a second (a spin would make thousands)
        assert 2 <= len(attempts) <= 100, len(attempts)
        attempts.clear()
        with pytest.raises(ConnectionRefusedError):  # a deadline of 0: one try, no wait
            unix.connect(address, creds.secret, max_frames=16, max_bytes=-1)
        assert len(attempts) == 1
    finally:
        for s in fill:
            s.close()
        listener.close()


# ---- 6. the store on the Unix lane ---------------------------------------------------------------

STORE = "t-unix-lane"


# With "zmq" the rows themselves cross the lane (no shared memory).
store, attached = store_fixtures(STORE, transports=["shm", "zmq"], num_shards=2, rpc_timeout_s=20)


def _client() -> Any:
    from dataplane.api import _state

    assert _state.client is not None
    return _state.client


def _ready_puts() -> int:
    import dataplane as dp

    return sum(s["ready_puts"] for s in dp.stats()["shards"])


@pytest.mark.ray
def test_the_store_round_trips_over_the_unix_lane(attached, pid) -> None:
    import torch

    import dataplane as dp

    client = _client()
    registry = client.registry
    lanes = {target: ep.unix for target, ep in client.sync.endpoints.items()}
    assert lanes == {
        INDEX: registry["index"]["unix"],
        **{i: s["unix"] for i, s in enumerate(registry["shards"])},
    }
    assert None not in lanes.values()  # every actor is on this host
    keys = keys_on_shards(pid, 2)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    dp.kv_batch_put(keys, pid, {"x": x})
    assert torch.equal(dp.kv_batch_get(keys, pid)["x"], x)
    meta = dp.next_batch(pid, "reader", 2, ["x"], timeout_s=20)
    assert sorted(meta.keys) == sorted(keys)
    assert torch.equal(dp.kv_batch_get_by_meta(meta)["x"], x[[keys.index(k) for k in meta.keys]])
    big = torch.randn(2, 100_000)  # 400 KB a shard: larger than the lane's read buffer
    dp.kv_batch_put(keys, f"{pid}-big", {"y": big})
    assert torch.equal(dp.kv_batch_get(keys, f"{pid}-big")["y"], big)
    # a small put of a known schema takes one round trip: its shard commits it in the index itself
    before = _ready_puts()
    dp.kv_put("one", pid, {"x": torch.full((4,), 9.0)})
    assert _ready_puts() == before + 1, "the small put did not take the shard's one-round-trip path"
    assert dp.kv_batch_get(["one"], pid)["x"].tolist() == [[9.0] * 4]
    assert dp.next_batch(pid, "reader", 1, ["x"], timeout_s=20).keys == ["one"]
    kept = client.sync._idle  # the call sets kept for reuse hold Unix-lane connections only
    assert kept and all(type(s) is unix.Conn for socks in kept for s in socks.values())


def _without_the_lane(name: str, pid: str, keys: list[str]) -> dict[str, Any]:
    """In a process with DATAPLANE_NO_UNIX_LANE=1: read the driver's rows, write one, take a batch."""
    import torch

    import dataplane as dp
    from dataplane.api import _state

    dp.init(name=name)
    try:
        client = _state.client
        got = dp.kv_batch_get(keys, pid)["x"].tolist()
        dp.kv_batch_put(["from-task"], pid, {"x": torch.full((1, 4), 7.0)})
        dp.kv_put("small-from-task", pid, {"x": torch.full((4,), 8.0)})
        taken = dp.next_batch(pid, "task", 4, ["x"], timeout_s=20).keys
        return {
            "env": os.environ.get("DATAPLANE_NO_UNIX_LANE"),
            "lanes": [ep.unix for ep in client.sync.endpoints.values()],
            "kinds": sorted({type(s).__name__ for socks in client.sync._idle for s in socks.values()}),
            "got": got,
            "taken": sorted(taken),
        }
    finally:
        dp.close()


@pytest.mark.ray
def test_a_process_without_the_unix_lane_uses_zmq_on_the_same_store(store, pid) -> None:
    import ray
    import torch

    import dataplane as dp

    dp.close()
    dp.init(name=STORE)
    try:
        keys = keys_on_shards(pid, 2)
        dp.kv_batch_put(keys, pid, {"x": torch.ones(2, 4)})
        task = ray.remote(num_cpus=0.1, runtime_env={"env_vars": {"DATAPLANE_NO_UNIX_LANE": "1"}})(
            _without_the_lane
        )
        out = ray.get(task.remote(STORE, pid, keys), timeout=120)
        assert out["env"] == "1"
        assert out["lanes"] == [None, None, None], out["lanes"]  # the index and both shards over zmq
        assert out["kinds"] and "Conn" not in out["kinds"], out["kinds"]
        assert out["got"] == [[1.0] * 4] * 2
        assert out["taken"] == sorted([*keys, "from-task", "small-from-task"])
        # and this process, on the lane, sees what that one wrote over zmq
        assert dp.kv_batch_get(["from-task", "small-from-task"], pid)["x"].tolist() == [[7.0] * 4, [8.0] * 4]
        assert all(type(s) is unix.Conn for socks in _client().sync._idle for s in socks.values())
    finally:
        dp.close()
