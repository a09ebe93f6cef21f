"""The transfer engine (``transport.engine``, ``transport.tcp_engine``, ``wire.bulk``): large buffers
beside the message, split over several connections, every declared size checked, nothing moved for a
peer without the store's secret; and the store's large columns over tcp going through it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dataplane.errors import WireError
from dataplane.transport.tcp_engine import MIN_PART, TcpEngineClient, TcpEngineServer
from dataplane.wire import bulk

from .conftest import wait_for

SECRET = "s3cret"


# ---- the manifest (pure) ---------------------------------------------------------------------------
def test_a_manifest_round_trips() -> None:
    refs = [bulk.Ref(1, 5, 10), bulk.Ref(3, 2**63 - 1, 1 << 30)]
    frame = bulk.encode_manifest(refs, accepts=True)
    assert bulk.is_manifest(frame) and not bulk.is_manifest(b"\x94\x01\x02")
    assert bulk.decode_manifest(frame, frames=4, max_bytes=1 << 30) == (refs, True)


@pytest.mark.parametrize(
    ("frame", "frames", "match"),
    [
        (bulk.encode_manifest([bulk.Ref(0, 1, 8)], False), 2, "not a buffer frame"),
        (bulk.encode_manifest([bulk.Ref(2, 1, 8)], False), 2, "not a buffer frame"),
        (bulk.encode_manifest([bulk.Ref(1, 1, 8), bulk.Ref(1, 2, 8)], False), 3, "not a buffer frame"),
        (bulk.encode_manifest([bulk.Ref(1, 1, 65)], False), 2, "at most 64"),
        (bulk.encode_manifest([bulk.Ref(1, 1, 0)], False), 2, "0 bytes"),
        (bulk.encode_manifest([bulk.Ref(1, 1, 8)], False)[:-1], 2, "declaring 1 buffers"),
        (bulk.MAGIC + b"\x08\x00\x00", 2, "another format"),
        (bulk.MAGIC + b"\x00\xff\xff", 2, "declaring 65535"),
    ],
)
def test_a_manifest_that_does_not_hold_is_refused(frame: bytes, frames: int, match: str) -> None:
    with pytest.raises(WireError, match=match):
        bulk.decode_manifest(frame, frames=frames, max_bytes=64)


def test_a_manifest_carries_its_origin_and_released_tickets() -> None:
    frame = bulk.encode_manifest([bulk.Ref(1, 9, 64)], accepts=True, origin="10.0.0.7:1234", done=[3, 4])
    m = bulk.read_manifest(frame, frames=2, max_bytes=64)
    assert (m.refs, m.accepts, m.origin, m.done) == ([bulk.Ref(1, 9, 64)], True, "10.0.0.7:1234", (3, 4))
    assert bulk.decode_manifest(frame, frames=2, max_bytes=64) == ([bulk.Ref(1, 9, 64)], True)
    with pytest.raises(WireError, match="released buffers"):  # a done list cut short
        bulk.read_manifest(frame[:-1], frames=2, max_bytes=64)
    with pytest.raises(WireError, match="released buffers"):  # bytes past its end
        bulk.read_manifest(frame + b"\0", frames=2, max_bytes=64)
    with pytest.raises(WireError, match="at most 255"):
        bulk.encode_manifest([], accepts=False, origin="x" * 256)


def test_a_manifest_names_where_a_pulled_buffer_is_beside_its_ticket() -> None:
    """An engine whose reader pulls (mooncake) names each buffer by its hold (the ticket its reader
    reports read) and by where it lies: two holds of one region share the place, never the ticket."""
    refs = [bulk.Ref(1, 5, 10, at=0x7F00_0000_1000), bulk.Ref(2, 6, 10, at=0x7F00_0000_1000)]
    frame = bulk.encode_manifest(refs, accepts=False)
    assert bulk.read_manifest(frame, frames=3, max_bytes=64).refs == refs
    plain = bulk.encode_manifest([bulk.Ref(1, 5, 10)], accepts=False)  # (the native engine's: as before)
    assert len(plain) == len(bulk.encode_manifest([], False)) + 18
    with pytest.raises(WireError, match="declaring 2 buffers"):  # cut short
        bulk.read_manifest(frame[:-1], frames=3, max_bytes=64)


def test_split_covers_the_buffer_once() -> None:
    for size, parts, least in [(1, 4, 1), (10, 3, 1), (100, 4, 30), (1 << 20, 8, 1 << 10)]:
        ranges = bulk.split(size, parts, least)
        assert sum(n for _, n in ranges) == size and ranges[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
        assert len(ranges) <= parts and (len(ranges) == 1 or min(n for _, n in ranges) >= least)


# ---- the native engine on loopback -----------------------------------------------------------------
@pytest.fixture
def server():
    srv = TcpEngineServer("127.0.0.1", SECRET, max_bytes=64 << 20, ttl_s=30.0, name="t-engine")
    yield srv
    srv.close()


def _payload(n: int) -> memoryview:
    return memoryview(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))


def test_buffers_cross_whole_both_ways_over_several_connections(server) -> None:
    client = TcpEngineClient(SECRET, connections=4, max_bytes=64 << 20)
    try:
        x = _payload(20 << 20)
        deadline = time.monotonic() + 60
        ticket = client.write(server.address, x, deadline)
        assert bytes(server.take(ticket, x.nbytes, "")) == bytes(x)
        # Four ranges, each on a connection of its own or one a finished range gave back.
        assert len(bulk.split(x.nbytes, 4, MIN_PART)) == 4 and 1 <= len(client._pool[server.address]) <= 4
        y = _payload(9 << 20)
        t = server.stage(y)
        assert bytes(client.read(server.address, t, y.nbytes, deadline)) == bytes(y)
        with pytest.raises(WireError, match="no such ticket"):  # read once, then no longer held
            client.read(server.address, t, y.nbytes, deadline)
        with pytest.raises(WireError, match="not written whole"):  # taken once
            server.take(ticket, x.nbytes, "")
    finally:
        client.close()


def test_a_staged_buffer_is_let_go_once_exactly_when_nothing_reads_it_any_more(server) -> None:
    """``on_done``: after a whole read, after its client reports it read, past its ttl, at close;
    once each, and never while it is being sent."""
    client = TcpEngineClient(SECRET, connections=4, max_bytes=64 << 20)
    calls: list[str] = []
    deadline = time.monotonic() + 60
    try:
        y = _payload(9 << 20)
        let_go = threading.Event()
        whole = server.stage(y, lambda: (calls.append("whole"), let_go.set()))
        assert calls == [] and bytes(client.read(server.address, whole, y.nbytes, deadline)) == bytes(y)
        # Read whole: let go by its last sender, once its send returns (which may be just after the
        # client has the bytes).
        assert let_go.wait(10) and calls == ["whole"]
        assert client.done(server.address) == [whole] and client.done(server.address) == []
        server.release([whole])  # reported too (the client's next request): once is once
        reported = server.stage(y, lambda: calls.append("reported"))
        server.release([reported])  # reported read: let go at once
        assert calls == ["whole", "reported"]
        with pytest.raises(WireError, match="no such ticket"):
            client.read(server.address, reported, y.nbytes, deadline)
        late = server.stage(y, lambda: calls.append("expired"))
        server._out[late].born -= 31.0  # (its ttl is 30 s)
        server.sweep()
        assert calls[-1] == "expired" and late not in server._out
        server.stage(y, lambda: calls.append("closed"))
        server.close()
        assert calls == ["whole", "reported", "expired", "closed"]
    finally:
        client.close()


def test_what_a_reply_lent_is_given_back_once_all_its_buffers_are_done_and_not_before() -> None:
    from dataplane.transport import engine as _engine

    events: list[tuple] = []

    class Instant:  # a server whose reader takes each buffer the moment it is staged
        lends = True

        def stage(self, buf: memoryview, on_done=None) -> int:
            events.append(("staged", bytes(buf[:1])))
            on_done()
            return len(events)

    frames = [b"header", bytes([1]) * 2048, bytes([2]) * 2048]
    reply = _engine.stage_reply(Instant(), frames, 1024, lambda: events.append(("back",)))
    assert events == [("staged", b"\x01"), ("staged", b"\x02"), ("back",)]
    assert bulk.is_manifest(reply[0]) and reply[1:] == [b"header", b"", b""]
    events.clear()
    assert _engine.stage_reply(Instant(), [b"header", b"x"], 1024, lambda: events.append(("back",))) == [
        b"header",
        b"x",
    ]
    assert events == [("back",)]  # nothing staged: given back at once


def test_rows_lent_from_shared_memory_are_read_whole_though_cleared_and_written_over(server) -> None:
    """A remote reader's rows are staged from the shard's shared memory as they are (no copy), their
    segment pinned: a clear and a new put that would reuse the segment while the reply waits to be
    read leave its bytes alone, and the segment is freed once the engine is done."""
    import torch

    from dataplane.client.mappings import MappingCache
    from dataplane.server.shard.core import ShardCore
    from dataplane.transport import engine as _engine

    from .test_shard import _put_shm, call

    core, maps = ShardCore(0, warm_idle_s=60), MappingCache()
    keys = [f"k{i}" for i in range(16)]
    x = torch.arange(16 * 65536, dtype=torch.float32).reshape(16, 65536)  # 4 MiB: lent
    _put_shm(core, "p", keys, x, maps)
    core.lend_min_bytes = 1 << 20  # (the server's, for a client that takes buffers by engine)
    body, frames = call(core, "get", {"partition": "p", "keys": keys, "shm": False})
    core.lend_min_bytes = 0
    give_back = core.take_lent()
    assert give_back is not None and core.take_lent() is None  # lent, once
    reply = _engine.stage_reply(server, [b"header", *frames], 1 << 20, give_back)
    refs, _ = bulk.decode_manifest(reply[0], len(reply) - 1, 64 << 20)
    (ref,) = refs
    call(core, "clear_partition", {"partition": "p"}, [])
    assert core.stats().bytes_used > 0 and core.stats().bytes_warm == 0  # pinned, not warm
    _put_shm(core, "p", keys, x + 1, maps)  # same size: would take the warm segment
    client = TcpEngineClient(SECRET, connections=4, max_bytes=64 << 20)
    try:
        got = client.read(server.address, ref.ticket, ref.size, time.monotonic() + 60)
        assert np.array_equal(np.frombuffer(got, np.float32), x.numpy().ravel()), "lent rows written over"
        server.release(client.done(server.address))  # the client's next request reports it
    finally:
        client.close()
    call(core, "clear_partition", {"partition": "p"}, [])
    st = core.stats()  # (the op gives back first)
    assert st.bytes_used == 0 and st.bytes_warm > 0  # both segments freed, kept warm


def _connect(server, secret: str = SECRET) -> socket.socket:
    host, _, port = server.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    nonce = b""
    while len(nonce) < bulk.NONCE_BYTES:
        nonce += sock.recv(bulk.NONCE_BYTES - len(nonce))
    sock.sendall(bulk.hello_proof(secret, nonce))
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sent on ``sock`` before it closed it (a reset, which closing with unread bytes
    sends, counts as closed)."""
    out = b""
    while True:
        try:
            got = sock.recv(1 << 16)
        except ConnectionResetError:
            return out
        if not got:
            return out
        out += got


def _closed(sock: socket.socket) -> bool:
    """The server closed ``sock`` (whatever it sent first)."""
    _until_closed(sock)
    return True


def test_a_peer_without_the_secret_is_closed_and_moves_no_byte(server) -> None:
    sock = _connect(server, secret="wrong")
    sock.sendall(bulk.OP.pack(bulk.WRITE, 1, 1024, 0, 1024) + b"x" * 1024)
    assert _until_closed(sock) == b""  # closed without a status
    sock.close()
    with pytest.raises(WireError):
        server.take(1, 1024, "")


@pytest.mark.parametrize(
    ("op", "total", "offset", "length", "status"),
    [
        (bulk.WRITE, (64 << 20) + 1, 0, 1, 3),  # larger than the server takes: never allocated
        (bulk.WRITE, 100, 90, 20, 2),  # past its end
        (bulk.WRITE, 100, 0, 0, 2),
        (bulk.READ, 100, 0, 100, 1),  # nothing staged under that ticket
        (9, 100, 0, 100, 4),
    ],
)
def test_declared_sizes_are_checked_before_anything_moves(server, op, total, offset, length, status) -> None:
    sock = _connect(server)
    sock.sendall(bulk.OP.pack(op, 7, total, offset, length))
    assert sock.recv(1) == bytes([status])
    assert _closed(sock)
    sock.close()
    assert not server._in  # nothing was set aside for it


def test_the_server_holds_at_most_twice_its_largest_buffer_for_writers(server) -> None:
    socks = []
    for ticket in (1, 2):  # two buffers of the largest size, each begun and never finished
        s = _connect(server)
        s.sendall(bulk.OP.pack(bulk.WRITE, ticket, 64 << 20, 0, 1 << 20) + b"\0" * (1 << 20))
        assert s.recv(1) == b"\x00"
        socks.append(s)
    third = _connect(server)
    third.sendall(bulk.OP.pack(bulk.WRITE, 3, 1 << 20, 0, 1 << 20))
    assert third.recv(1) == bytes([3]) and _closed(third)
    for s in [*socks, third]:
        s.close()
    with pytest.raises(WireError, match="not written whole"):  # a buffer begun and not finished
        server.take(1, 64 << 20, "")


def test_a_write_to_a_closed_server_is_an_os_error(server) -> None:
    address = server.address
    server.close()
    client = TcpEngineClient(SECRET, connections=2, max_bytes=1 << 20)
    with pytest.raises(OSError):
        client.write(address, _payload(1 << 10), time.monotonic() + 5)
    client.close()


# ---- the mooncake engine on loopback (where Mooncake's Transfer Engine is installed) -------------
def _mooncake():
    from dataplane.transport.engine import engine_missing

    why = engine_missing("mooncake")
    if why:
        pytest.skip(why)
    from dataplane.transport import mooncake_engine

    return mooncake_engine


def test_mooncake_moves_buffers_both_ways_and_releases_what_was_read() -> None:
    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake")
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    try:
        deadline = time.monotonic() + 60
        x = _payload(12 << 20)
        ticket = client.write(server.address, x, deadline)  # lent: the server pulls it
        assert bytes(server.take(ticket, x.nbytes, client.origin)) == bytes(x)
        client.release([ticket])
        with pytest.raises(WireError, match="could not read"):  # no longer registered
            server.take(ticket, x.nbytes, client.origin)
        y = _payload(5 << 20)
        t, at = server.stage(y)  # (a hold: its ticket, and where its bytes are)
        assert bytes(client.read(server.address, t, y.nbytes, deadline, at)) == bytes(y)
        assert client.done(server.address) == [t] and client.done(server.address) == []
        server.release([t])  # (what the next request's manifest does)
        with pytest.raises(WireError, match="could not read"):
            client.read(server.address, t, y.nbytes, deadline, at)
        with pytest.raises(WireError, match="at most"):  # a declared size past the limit: nothing read
            server.take(ticket, (64 << 20) + 1, client.origin)
    finally:
        client.close()
        server.close()


def test_a_mooncake_read_from_a_silent_peer_ends_at_its_deadline() -> None:
    """A peer that accepts the engine's connection and never answers holds Mooncake's submitting
    thread a minute in its handshake: the read is given up at the caller's deadline, a
    ``TimeoutError`` (what the client turns into ``ShardUnavailableError``) naming the peer."""
    mc = _mooncake()
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    silent = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"did not read 4096 bytes from {address} in time"):
            client.read(address, 1, 4096, started + 1.0)
        assert time.monotonic() - started < 30  # (its deadline, not the handshake's minute)
    finally:
        client.close()
        silent.close()


_STOPPED_PEER = """
import sys, numpy as np
from dataplane.transport import mooncake_engine as mc
server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=300.0, name="peer")
y = np.full(8 << 20, 7, dtype=np.uint8)
holds = [server.stage(memoryview(y)) for _ in range(3)]
print(server.address, *(f"{t}:{at}" for t, at in holds), flush=True)
sys.stdin.read()
"""


def test_a_mooncake_read_from_a_stopped_peer_is_given_up_at_its_deadline_and_let_go_later() -> None:
    """A peer read from once, then stopped (SIGSTOP) mid-run: the next read is given up at its
    deadline (``TimeoutError``), its buffer kept registered while the engine may still write it; once
    the peer runs again, the read ends in the engine and a later read lets the buffer go."""
    mc = _mooncake()
    peer = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    try:
        address, *holds = peer.stdout.readline().split()
        (t1, at1), (t2, at2), (t3, at3) = (map(int, h.split(":")) for h in holds)
        size = 8 << 20
        assert set(bytes(client.read(address, t1, size, time.monotonic() + 60, at1))) == {7}
        os.kill(peer.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError, match=f"did not read {size} bytes from {address} in time"):
            client.read(address, t2, size, time.monotonic() + 0.5)
        reader = client._reader
        assert len(reader._given_up) == 1  # (registered and kept: the engine may still write it)
        os.kill(peer.pid, signal.SIGCONT)

        def let_go() -> bool:
            reader._reap()  # (what each read does first)
            return not reader._given_up

        wait_for(let_go, 60, "the given-up read to end in the engine, and its buffer to be let go")
        assert set(bytes(client.read(address, t3, size, time.monotonic() + 60, at3))) == {7}
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait()
        client.close()


def test_mooncake_staged_buffers_are_released_past_the_budget_oldest_first() -> None:
    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=8 << 20, ttl_s=30.0, name="t-mooncake")
    try:
        bufs = [_payload((6 << 20) + i) for i in range(3)]  # 18 MiB staged; the budget is 16
        tickets = [server.stage(b)[0] for b in bufs[:2]]
        assert set(server._holds) == set(tickets) and server.stats()["registered_buffers"] == 2
        server.stage(bufs[2])  # the oldest goes
        assert tickets[0] not in server._holds and tickets[1] in server._holds
        assert server.stats()["registered_buffers"] == 2
    finally:
        server.close()


def test_mooncake_registers_a_pooled_buffer_once_and_lets_it_go_with_the_pool() -> None:
    """Rows a shard holds in a pooled buffer (a put from another host lands in one): replies that
    stage slices of it read from one registration of the whole buffer, none per reply and no copy;
    a hold keeps the buffer out of the pool; the pool letting it go unregisters it; a hold that
    expires unreported unregisters it with its last hold (a late reader reads nothing)."""
    from dataplane.codec import buffers

    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake")
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    try:
        rows = buffers.take(8 << 20)
        rows[:] = np.arange(8 << 20) % 251
        deadline = time.monotonic() + 60
        for a, b in ((0, 1 << 20), (1 << 20, 3 << 20), (512, 4096), (0, 8 << 20)):
            t, at = server.stage(memoryview(rows.data)[a:b])
            assert bytes(client.read(server.address, t, b - a, deadline, at)) == bytes(rows[a:b])
            server.release(client.done(server.address))
        st = server.stats()
        assert (st["registrations"], st["registered_pooled"], st["pooled"], st["copied"]) == (1, 1, 4, 0), st
        st_base = buffers.pooled(memoryview(rows.data))[1]
        idle = buffers._pool.idle_bytes
        t, at = server.stage(memoryview(rows.data)[:4096])
        del rows  # (the shard frees them)
        assert buffers._pool.idle_bytes == idle  # held: not back in the pool
        server.release([t])
        assert buffers._pool.idle_bytes == idle + (8 << 20)
        assert server.stats()["registered_pooled"] == 1  # (kept registered while the pool has it)
        x = _payload(8 << 20)  # a request's buffer, read into that pooled buffer, registered already
        ticket = client.write(server.address, x, deadline)
        got = server.take(ticket, x.nbytes, client.origin)
        assert bytes(got) == bytes(x) and buffers.pooled(got)[1] == st_base
        assert server.stats()["registrations"] == 1 and server._regions[st_base].holds == 0
        client.release([ticket])
        del got
        buffers._pool.clear()
        server.sweep()
        assert server.stats()["registered_pooled"] == 0
    finally:
        client.close()
        server.close()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=0.0, name="t-mooncake")
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    try:
        rows = buffers.take(4 << 20)
        t, at = server.stage(memoryview(rows.data)[: 1 << 20])
        server.sweep()  # (its ttl of 0 is past: the hold expires unreported)
        assert server.stats()["registered_pooled"] == 0
        with pytest.raises(WireError, match="could not read"):
            client.read(server.address, t, 1 << 20, time.monotonic() + 60, at)
    finally:
        client.close()
        server.close()


def _segment(nbytes: int, fill: int) -> memoryview:
    """A shared-memory mapping as a shard's segment is (``transport.shm.map_fd`` of a memfd)."""
    import os

    from dataplane.transport.shm import map_fd

    fd = os.memfd_create("t-seg")
    try:
        os.ftruncate(fd, nbytes)
        view = map_fd(fd, nbytes)
    finally:
        os.close(fd)
    view[:] = np.full(nbytes, fill, np.uint8).tobytes()
    view[:8] = np.arange(8, dtype=np.uint8).tobytes()
    return view


def test_mooncake_lends_shared_memory_registered_once_per_segment_and_released_per_hold() -> None:
    """A lent view of a shard's segment is staged as a place in the segment's mapping, registered the
    first time and kept registered while the segment lives: no copy, one registration for many holds;
    each hold has a ticket of its own and its ``on_done`` runs when that hold is reported read."""
    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake")
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    calls: list[str] = []
    seg = _segment(16 << 20, 7)
    try:
        assert server.lends
        deadline = time.monotonic() + 60
        a = server.stage(seg[: 8 << 20], lambda: calls.append("a"))
        b = server.stage(seg[: 8 << 20], lambda: calls.append("b"))  # the same rows, another reply
        c = server.stage(seg[8 << 20 :], lambda: calls.append("c"))
        (ta, at_a), (tb, at_b), (tc, at_c) = a, b, c
        base = np.frombuffer(seg, np.uint8).ctypes.data
        assert at_a == at_b == base and at_c == base + (8 << 20) and len({ta, tb, tc}) == 3
        assert server.stats()["registered_segments"] == 1 and server.stats()["copied"] == 0
        got = client.read(server.address, ta, 8 << 20, deadline, at=at_a)
        assert bytes(got) == bytes(seg[: 8 << 20])
        server.release(client.done(server.address))  # (the next request's manifest)
        assert calls == ["a"]  # that hold alone: the other reply's still reads
        assert bytes(client.read(server.address, tb, 8 << 20, deadline, at=at_b)) == bytes(seg[: 8 << 20])
        assert bytes(client.read(server.address, tc, 8 << 20, deadline, at=at_c)) == bytes(seg[8 << 20 :])
        assert client.done(server.address) == [tb, tc]
        server.release([tb, tc, ta])  # (a ticket released twice is released once)
        assert calls == ["a", "b", "c"] and server.stats()["registered_segments"] == 1  # kept registered
        again = server.stage(seg[:4096], lambda: calls.append("again"))  # no new registration
        assert server.stats()["registrations"] == 1
        server.release([again[0]])
        assert server.forget(seg)  # its segment is freed: unregistered, and nothing may still read it
        assert server.stats()["registered_segments"] == 0
        with pytest.raises(WireError, match="could not read"):
            client.read(server.address, tb, 8 << 20, deadline, at=at_b)
    finally:
        client.close()
        server.close()


def test_mooncake_holds_end_at_their_ttl_and_at_close_and_an_expired_ones_segment_is_never_reused() -> None:
    """A hold no client reports read is let go past its ttl (its segment unpinned) and at close; a
    reader past its ttl may still be reading, so its segment is closed when freed, never reused."""
    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake")
    calls: list[str] = []
    seg, other = _segment(8 << 20, 1), _segment(8 << 20, 2)
    try:
        late, _ = server.stage(seg[: 4 << 20], lambda: calls.append("expired"))
        server._holds[late].born -= 31.0  # (its ttl is 30 s)
        server.sweep()
        assert calls == ["expired"]
        assert not server.forget(seg)  # a late reader may still read it: not to be reused
        server.stage(other[: 4 << 20], lambda: calls.append("closed"))
    finally:
        server.close()
    assert calls == ["expired", "closed"] and server.stats()["registered_segments"] == 0


@pytest.mark.parametrize("why", ["cap", "refused"])
def test_mooncake_copies_what_it_cannot_register_and_gives_the_rows_back_at_once(why: str) -> None:
    """Past its cap on registered bytes, or when Mooncake refuses the registration (here: a region
    overlapping the segment is registered already), a lent view is staged as a copy, as before:
    its rows are given back at once and the client reads the same bytes."""
    mc = _mooncake()
    cap = (4 << 20) if why == "cap" else (1 << 30)
    server = mc.MooncakeEngineServer(
        "127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake", max_registered_bytes=cap
    )
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    calls: list[str] = []
    seg = _segment(8 << 20, 3)
    base = np.frombuffer(seg, np.uint8).ctypes.data
    try:
        if why == "refused":
            assert server._engine.register_memory(base + 4096, 4096) == 0
        ticket, at = server.stage(seg[: 6 << 20], lambda: calls.append("back"))
        assert calls == ["back"] and at != base  # copied: nothing of the segment is held
        st = server.stats()
        assert st["copied"] == 1 and st["registered_segments"] == 0 and st["registration_failures"] == 1
        got = client.read(server.address, ticket, 6 << 20, time.monotonic() + 60, at=at)
        assert bytes(got) == bytes(seg[: 6 << 20])
        server.release(client.done(server.address))
        assert not server._holds
    finally:
        if why == "refused":
            server._engine.unregister_memory(base + 4096)
        client.close()
        server.close()


def test_mooncake_reads_rows_lent_from_a_shards_segment_though_cleared_and_written_over() -> None:
    """The store's lending over mooncake: a get's rows are staged as their place in the segment (the
    segment pinned, registered once); a clear and a put that would reuse it leave them alone; once
    the client reports them read and they are cleared, the segment is unregistered before it is
    reused (the pool's ``on_free``)."""
    import torch

    from dataplane.client.mappings import MappingCache
    from dataplane.server.shard.core import ShardCore
    from dataplane.transport import engine as _engine

    from .test_shard import _put_shm, call

    mc = _mooncake()
    server = mc.MooncakeEngineServer("127.0.0.1", max_bytes=64 << 20, ttl_s=30.0, name="t-mooncake")
    core, maps = ShardCore(0, warm_idle_s=60), MappingCache()
    core.pool.on_free = server.forget  # (what the shard actor wires)
    client = mc.MooncakeEngineClient(max_bytes=64 << 20)
    try:
        keys = [f"k{i}" for i in range(16)]
        x = torch.arange(16 * 65536, dtype=torch.float32).reshape(16, 65536)  # 4 MiB: lent
        _put_shm(core, "p", keys, x, maps)
        core.lend_min_bytes = 1 << 20
        _, frames = call(core, "get", {"partition": "p", "keys": keys, "shm": False})
        core.lend_min_bytes = 0
        give_back = core.take_lent()
        assert give_back is not None
        reply = _engine.stage_reply(server, [b"header", *frames], 1 << 20, give_back)
        (ref,) = bulk.read_manifest(reply[0], len(reply) - 1, 64 << 20).refs
        assert server.stats()["registered_segments"] == 1 and server.stats()["copied"] == 0
        call(core, "clear_partition", {"partition": "p"}, [])
        assert core.stats().bytes_used > 0 and core.stats().bytes_warm == 0  # pinned, not warm
        _put_shm(core, "p", keys, x + 1, maps)  # same size: would take the warm segment
        got = client.read(server.address, ref.ticket, ref.size, time.monotonic() + 60, at=ref.at)
        assert np.array_equal(np.frombuffer(got, np.float32), x.numpy().ravel()), "lent rows written over"
        server.release(client.done(server.address))  # the client's next request reports it
        call(core, "clear_partition", {"partition": "p"}, [])
        st = core.stats()
        assert st.bytes_used == 0 and st.bytes_warm > 0  # both segments freed, kept warm
        assert server.stats()["registered_segments"] == 0  # unregistered before any reuse
        with pytest.raises(WireError, match="could not read"):
            client.read(server.address, ref.ticket, ref.size, time.monotonic() + 60, at=ref.at)
    finally:
        client.close()
        server.close()
        core.close()


# ---- the store over tcp ----------------------------------------------------------------------------
def _rows(n: int) -> dict:
    """Rows of every column kind, the tensor large enough (8 MiB) to go through the engine."""
    import torch

    return {
        "x": torch.arange(n * 131072, dtype=torch.float32).reshape(n, 131072),
        "ids": [torch.arange(i % 7 + 1) for i in range(n)],
        "img": [torch.full((i % 3 + 1, 2 + i % 2), float(i)) for i in range(n)],
        "text": [f"row {i}" for i in range(n)],
        "chat": [{"role": "user", "turn": i} for i in range(n)],
    }


def test_a_mooncake_store_lends_rows_a_same_host_writer_put_to_a_remote_reader(ray_cluster) -> None:
    """Rows in a shard's shared memory (put through it by a writer on its host) read by a client over
    tcp: the mooncake engine stages them where they are, their segment registered once, and lets go
    of every hold and registration once they are reported read and cleared."""
    import ray
    import torch

    _mooncake()
    import dataplane as dp

    from .conftest import start_store

    dp.close()
    name = "t-engine-mooncake-lends"
    _, _, handle = start_store(name=name, num_shards=1, engine="mooncake", engine_min_bytes=1 << 20)
    try:
        keys = [f"k{i}" for i in range(16)]
        x = torch.arange(16 * 131072, dtype=torch.float32).reshape(16, 131072)  # 8 MiB
        dp.init(name=name)  # (this host: the rows go into the shard's shared memory)
        dp.kv_batch_put(keys, "p", {"x": x})
        dp.close()
        dp.init(name=name, transport="tcp")  # a reader as on another host
        for _ in range(2):
            assert torch.equal(dp.kv_batch_get(keys, "p")["x"], x)
        (shard,) = handle.shards
        st = ray.get(shard.engine_stats.remote(), timeout=60)
        assert (st["lent"], st["copied"], st["registrations"], st["registered_segments"]) == (2, 0, 1, 1), st
        dp.clear_partition("p")  # (its request reports the last read first)
        st = ray.get(shard.engine_stats.remote(), timeout=60)
        assert (st["holds"], st["registered_segments"]) == (0, 0), st
        assert dp.stats()["bytes_used"] == 0
    finally:
        dp.close()
        handle.stop()


@pytest.mark.parametrize("engine", ["native", "zmq", "mooncake"])
def test_large_columns_cross_tcp_through_the_engine_exactly(ray_cluster, engine) -> None:
    import torch

    if engine == "mooncake":
        _mooncake()
    import dataplane as dp
    from dataplane.wire.requests import INDEX

    from .conftest import start_store

    dp.close()
    name = f"t-engine-{engine}"
    _, registry, handle = start_store(name=name, num_shards=2, engine=engine, engine_min_bytes=1 << 20)
    try:
        dp.init(name=name, transport="tcp")
        sync = dp.api.current_client().sync
        engines = [ep.engine for i, ep in sync.endpoints.items() if i != INDEX]
        assert (None in engines) == (engine == "zmq") and sync.endpoints[INDEX].engine is None, engines
        keys = [f"k{i}" for i in range(16)]
        want = _rows(16)
        dp.kv_batch_put(keys, "p", want)
        got = dp.kv_batch_get(keys[::-1], "p")  # (reversed: rows gathered from both shards)
        assert torch.equal(got["x"], want["x"].flip(0))
        assert [t.tolist() for t in got["ids"]] == [t.tolist() for t in want["ids"][::-1]]
        assert [t.tolist() for t in got["img"]] == [t.tolist() for t in want["img"][::-1]]
        assert list(got["text"]) == want["text"][::-1] and list(got["chat"]) == want["chat"][::-1]
        one = dp.kv_batch_get(keys[:1], "p")  # one row (512 KiB): in the message either way
        assert torch.equal(one["x"][0], want["x"][0])
        ordered = dp.kv_batch_get(keys, "p")  # (each shard's rows a run of its segment: lent, native)
        assert torch.equal(ordered["x"], want["x"]) and list(ordered["text"]) == want["text"]
        del ordered
        dp.clear_partition("p")  # (its requests report the reads: what was lent goes before it runs)
        assert dp.stats()["bytes_used"] == 0
        # The large buffers crossed through the engine (its connections are open, its reads of
        # replies reported back), or not at all; nothing the client lent stays registered.
        if engine == "native":
            assert sum(len(s) for s in sync.engine._pool.values()) > 0, sync.engine._pool
        elif engine == "mooncake":  # (every read reported by the clear's requests; a put's buffers released)
            assert sync.engine.name == "mooncake" and not sync.engine._done and not sync.engine._lent.regions
        else:
            assert sync.engine is None
    finally:
        dp.close()
        handle.stop()
