"""The native transfer engine: large buffers over plain TCP, split across several connections.

One zmq stream moves about half of what the link takes here (its I/O thread reads in small batches
and copies into each message); a buffer split into C ranges, each sent a chunk per call from a
memoryview and received with ``recv_into`` its place in one preallocated buffer, on C connections
and C threads (the socket calls release the GIL), moves at what the link and the cores allow.

``TcpEngineServer`` runs in a shard: it stages the buffers of its replies (``stage``: a ticket a
client then reads, dropped once every byte was read or after ``ttl_s``) and receives the buffers of
requests (``WRITE`` s into a ticket the client chose, ``take`` n by the request that names it).
``TcpEngineClient`` runs in a client: a pool of authenticated connections per server, ``write`` and
``read`` of one buffer split over them. The framing and its checks are ``wire.bulk``'s. Every peer
proves it holds the store's secret first (an HMAC of the server's nonce); a peer that does not, or
declares a size past the server's limits, is closed without a byte moved.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dataplane.codec import buffers as _buffers
from dataplane.errors import WireError
from dataplane.wire import bulk as _bulk

logger = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # a peer must prove itself within this
MAX_CONNECTIONS = 256  # connections one server serves at once; more are closed at accept
MIN_PART = 4 << 20  # no range a connection moves is smaller (but one): fixed costs stay small
_CHUNK = 16 << 20  # bytes one receive call waits for
_SEND = 1 << 20  # bytes one send call hands the kernel (``_send_all``)


@dataclass
class _Ticket:
    size: int
    buf: memoryview | None = None  # None: an incoming buffer still being made, outside the lock
    done: int = 0  # bytes read (outgoing) or written (incoming)
    born: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)  # set once ``buf`` is there
    on_done: Callable[[], None] | None = None  # (outgoing) called once nothing reads ``buf`` any more
    sending: int = 0  # (outgoing) connections sending from ``buf`` now
    gone: bool = False  # (outgoing) out of the table: read whole, reported read, expired or closed


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a blocking ``sock``: each call waits in the kernel for a whole chunk
    (``MSG_WAITALL``), so a fast link costs a few calls a chunk, not one per arriving segment (each
    call takes the GIL, which the other connections' threads want too)."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got : got + _CHUNK], 0, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _send_all(sock: socket.socket, view: memoryview) -> None:
    """Send every byte of ``view``, ``_SEND`` bytes a call: a send holds its socket's lock in the kernel
    for as long as it copies, and the acknowledgements that arrive meanwhile wait behind it, so one
    call of a whole range opens the window late (one connection moved half of what raw TCP does on
    the test bed's link with a single ``sendall`` of 64 MiB)."""
    sent = 0
    while sent < view.nbytes:
        sent += sock.send(view[sent : sent + _SEND])


def _call(fns: Sequence[Callable[[], None] | None]) -> None:
    """Call each of ``fns`` (outside the server's lock: they belong to the shard)."""
    for fn in fns:
        if fn is not None:
            fn()


def _limit(sock: socket.socket, seconds: float | None) -> None:
    """Block in ``sock``'s calls for at most ``seconds`` each (None: for ever), as the kernel's own
    socket timeouts: the socket stays blocking (``MSG_WAITALL`` waits whole), a call past it fails."""
    sock.settimeout(None)
    whole = 0.0 if seconds is None else max(0.001, seconds)
    tv = struct.pack("ll", int(whole), int((whole % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _tune(sock: socket.socket) -> None:
    """No delay for the small frames; the buffer sizes are the kernel's to tune (``tcp_rmem`` /
    ``tcp_wmem``): a size set here turns that off, and the kernel caps it at ``net.core.rmem_max``
    (208 KiB on a stock kernel), far below what a fast link keeps in flight."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpEngineServer:
    """A shard's end: listens on ``host_ip``, serves ``READ`` s of staged buffers and ``WRITE`` s into
    buffers of at most ``max_bytes`` (-1: no limit), at most ``2 * max_bytes`` of them at once.

    A staged buffer's ``on_done`` is called once nothing reads it any more: when its client read it
    whole, or reports it read (``release``, on the shard's loop thread: before that client's next
    request runs), when it expires, or when the server closes; never while a connection is still
    sending from it (its last sender calls it then)."""

    lends = True

    def __init__(self, host_ip: str, secret: str, *, max_bytes: int, ttl_s: float, name: str) -> None:
        self._secret = secret
        self._max = max_bytes
        self._budget = -1 if max_bytes < 0 else 2 * max_bytes
        self._ttl = ttl_s
        self.name = name
        self._lock = threading.Lock()
        self._out: dict[int, _Ticket] = {}
        self._in: dict[int, _Ticket] = {}
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((host_ip, 0), backlog=64)
        self.address = f"{host_ip}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"{name}-engine", daemon=True).start()

    # ---- what the request loop calls -------------------------------------------------------------
    def stage(self, buf: memoryview, on_done: Callable[[], None] | None = None) -> int:
        """Hold ``buf`` for a client to read; returns its ticket (``on_done``: see the class)."""
        ticket = secrets.randbits(63)
        with self._lock:
            ended = self._expire(time.monotonic())
            t = self._out[ticket] = _Ticket(buf.nbytes, buf, on_done=on_done)
        t.ready.set()
        _call(ended)
        return ticket

    def take(self, ticket: int, size: int, origin: str = "") -> memoryview:
        """The buffer a client wrote whole under ``ticket`` (``size`` bytes), no longer held here
        (``origin``: unused, the client pushed it)."""
        with self._lock:
            t = self._in.get(ticket)
            if t is None or t.buf is None or t.size != size or t.done != size:
                raise WireError(
                    f"{self.name}: a request names a buffer of {size} bytes (ticket {ticket}) that was not "
                    "written whole to its transfer engine (expired, or never sent)"
                )
            del self._in[ticket]
        return t.buf

    def release(self, tickets: Sequence[int]) -> None:
        """Staged buffers their client reports read whole (a staged buffer also goes once read whole):
        each one's ``on_done`` is called now, as the client has every byte (a sender still in the
        kernel call that handed over the last ones reads no more of it)."""
        ended = []
        with self._lock:
            for ticket in tickets:
                t = self._out.pop(ticket, None)
                if t is not None:
                    t.gone, t.sending = True, 0
                    ended.append(self._ended(t))
        _call(ended)

    def sweep(self) -> None:
        """Drop what is past the ttl now (else it goes at the next ``stage`` or write)."""
        with self._lock:
            ended = self._expire(time.monotonic())
        _call(ended)

    def forget(self, mapping: memoryview) -> bool:
        """(Nothing: it registers no memory, and what it stages from a segment pins it.)"""
        return True

    def close(self) -> None:
        self._closed = True
        try:  # wakes the accepting thread (closing alone leaves the socket listening under it)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
            staged = list(self._out.values())
            self._out.clear()
            self._in.clear()
        for c in conns:
            c.close()
        for t in staged:  # (its connections are closed: nothing sends from it any more)
            t.gone, t.sending = True, 0
        _call([self._ended(t) for t in staged])

    # ---- its threads -----------------------------------------------------------------------------
    def _expire(self, now: float) -> list[Callable[[], None] | None]:
        """Drop the tickets past the ttl (under the lock); the staged ones' ``on_done`` to call."""
        ended = []
        for ticket in [k for k, t in self._in.items() if now - t.born > self._ttl]:
            del self._in[ticket]
        for ticket in [k for k, t in self._out.items() if now - t.born > self._ttl]:
            t = self._out.pop(ticket)
            t.gone = True
            ended.append(self._ended(t))
        return ended

    @staticmethod
    def _ended(t: _Ticket) -> Callable[[], None] | None:
        """``t``'s ``on_done`` if it is due now (gone, nothing sending; under the lock), once."""
        if not t.gone or t.sending or t.on_done is None:
            return None
        fn, t.on_done = t.on_done, None
        return fn

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # (out of descriptors: let connections close)
                continue
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(sock)
            if full:
                sock.close()
                continue
            threading.Thread(
                target=self._serve, args=(sock,), name=f"{self.name}-engine-c", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self._hello(sock):
                _tune(sock)
                head = bytearray(_bulk.OP.size)
                while True:
                    _limit(sock, None)  # an authenticated client's idle connection stays open
                    try:
                        _recv_exact(sock, memoryview(head))
                    except ConnectionError:
                        return
                    _limit(sock, self._ttl)  # a transfer that stalls past the ttl is dropped
                    if not self._one(sock, *_bulk.OP.unpack(head)):
                        return
        except OSError as exc:
            logger.debug("%s: an engine connection ended: %s", self.name, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _hello(self, sock: socket.socket) -> bool:
        _limit(sock, HANDSHAKE_S)
        nonce = secrets.token_bytes(_bulk.NONCE_BYTES)
        sock.sendall(nonce)
        proof = bytearray(32)
        try:
            _recv_exact(sock, memoryview(proof))
        except ConnectionError:
            return False
        return hmac.compare_digest(bytes(proof), _bulk.hello_proof(self._secret, nonce))

    def _one(self, sock: socket.socket, op: int, ticket: int, total: int, offset: int, length: int) -> bool:
        """Serve one operation; False when the connection must close (refused: its bytes, if any,
        were never read)."""
        status = _bulk.check_op(op, total, offset, length, self._max)
        make = False  # this connection makes the incoming buffer (the ticket's first range to arrive)
        t: _Ticket | None = None
        ended: list[Callable[[], None] | None] = []
        with self._lock:
            if status == _bulk.OK and op == _bulk.READ:
                t = self._out.get(ticket)
                status = _bulk.UNKNOWN if t is None else _bulk.OK if t.size == total else _bulk.OUT_OF_RANGE
                if status == _bulk.OK and t is not None:
                    t.sending += 1
            elif status == _bulk.OK:
                t = self._in.get(ticket)
                if t is None:
                    ended = self._expire(time.monotonic())
                    held = sum(x.size for x in self._in.values())
                    if self._budget >= 0 and held + total > self._budget:
                        status = _bulk.TOO_LARGE
                    else:
                        t = self._in[ticket] = _Ticket(total)
                        make = True
                elif t.size != total:
                    status = _bulk.OUT_OF_RANGE
        _call(ended)
        if status != _bulk.OK or t is None:
            sock.sendall(bytes([status]))
            return False
        if make:  # faulting a large buffer in takes a while: never under the lock, which every op takes
            try:
                t.buf = _buffers.take_faulted(total).data
            finally:  # (failed: the ticket is dropped, and the other ranges' connections are told)
                if t.buf is None:
                    with self._lock:
                        self._in.pop(ticket, None)
                t.ready.set()
        elif not t.ready.wait(self._ttl) or t.buf is None:  # its maker stalled past the ttl, or failed
            sock.sendall(bytes([_bulk.UNKNOWN]))
            return False
        assert t.buf is not None
        part = t.buf[offset : offset + length]
        if op == _bulk.READ:
            sent = 0
            try:
                sock.sendall(b"\x00")
                _send_all(sock, part)
                sent = length
            finally:
                with self._lock:
                    t.sending = max(0, t.sending - 1)
                    t.done += sent
                    if t.done >= t.size and not t.gone:
                        self._out.pop(ticket, None)
                        t.gone = True
                    fn = self._ended(t)
                _call([fn])
            return True
        _recv_exact(sock, part)
        with self._lock:
            t.done += length
        sock.sendall(b"\x00")
        return True


class TcpEngineClient:
    """A client's end: ``write`` and ``read`` of one buffer split over up to ``connections``
    connections (one thread each) to an engine server, from a pool of open ones."""

    name = "native"
    origin = ""  # (it pushes what it writes)

    def __init__(self, secret: str, *, connections: int, max_bytes: int) -> None:
        self._secret = secret
        self.connections = max(1, connections)
        self._max = max_bytes
        self._lock = threading.Lock()
        self._pool: dict[str, list[socket.socket]] = {}
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._read: dict[str, list[int]] = {}  # per server: staged buffers read whole since ``done``

    def write(self, address: str, buf: memoryview, deadline: float) -> int:
        """Send ``buf`` to the server at ``address``; returns the ticket a request names it by."""
        ticket = secrets.randbits(63)
        self._parts(address, _bulk.WRITE, ticket, buf, deadline)
        return ticket

    def read(self, address: str, ticket: int, size: int, deadline: float, at: int = 0) -> memoryview:
        """The ``size`` bytes the server at ``address`` staged under ``ticket`` (``at``: unused, the
        server pushes them)."""
        if self._max >= 0 and size > self._max:
            raise WireError(f"a reply declares a buffer of {size} bytes (at most {self._max})")
        out = _buffers.take_faulted(size).data
        self._parts(address, _bulk.READ, ticket, out, deadline)
        with self._lock:
            self._read.setdefault(address, []).append(ticket)
        return out

    def done(self, address: str) -> list[int]:
        """The buffers read whole from the server at ``address`` since the last call: the next
        request tells it (a shard then lets go of what it lent for them before that request runs)."""
        with self._lock:
            return self._read.pop(address, [])

    def release(self, tickets: Sequence[int]) -> None:
        """(Nothing: a written buffer is the server's once sent.)"""

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, {}
            threads, self._threads = self._threads, None
        for socks in pool.values():
            for s in socks:
                s.close()
        if threads is not None:
            threads.shutdown(wait=False)

    # ----------------------------------------------------------------------------------------------
    def _parts(self, address: str, op: int, ticket: int, buf: memoryview, deadline: float) -> None:
        ranges = _bulk.split(buf.nbytes, self.connections, MIN_PART)
        if len(ranges) == 1:
            self._move(address, op, ticket, buf, 0, buf.nbytes, deadline)
            return
        pool = self._executor()
        futures = [
            pool.submit(self._move, address, op, ticket, buf, off, n, deadline) for off, n in ranges[1:]
        ]
        errors: list[BaseException] = []
        try:
            self._move(address, op, ticket, buf, *ranges[0], deadline)
        except (OSError, WireError) as exc:
            errors.append(exc)
        for f in futures:
            failed = f.exception()
            if failed is not None:
                errors.append(failed)
        if errors:
            raise errors[0]

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(
                    self.connections - 1, thread_name_prefix="dataplane-engine"
                )
            return self._threads

    def _move(
        self, address: str, op: int, ticket: int, buf: memoryview, off: int, n: int, deadline: float
    ) -> None:
        sock = self._checkout(address, deadline)
        ok = False
        try:
            _limit(sock, deadline - time.monotonic())
            sock.sendall(_bulk.OP.pack(op, ticket, buf.nbytes, off, n))
            part = buf[off : off + n]
            if op == _bulk.WRITE:
                _send_all(sock, part)
            status = bytearray(1)
            _recv_exact(sock, memoryview(status))
            if status[0] != _bulk.OK:
                why = _bulk.STATUS.get(status[0], f"status {status[0]}")
                raise WireError(f"the transfer engine at {address} refused a transfer: {why}")
            if op == _bulk.READ:
                _recv_exact(sock, part)
            ok = True
        finally:
            if ok:
                self._checkin(address, sock)
            else:
                sock.close()

    def _checkout(self, address: str, deadline: float) -> socket.socket:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connections stay the parent's
                self._pid, self._pool, self._threads, self._read = os.getpid(), {}, None, {}
            idle = self._pool.get(address)
            if idle:
                return idle.pop()
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=max(0.001, deadline - time.monotonic()))
        try:
            _tune(sock)
            _limit(sock, deadline - time.monotonic())
            nonce = bytearray(_bulk.NONCE_BYTES)
            _recv_exact(sock, memoryview(nonce))
            sock.sendall(_bulk.hello_proof(self._secret, bytes(nonce)))
        except BaseException:
            sock.close()
            raise
        return sock

    def _checkin(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._pool.setdefault(address, [])
            if len(idle) < self.connections:
                idle.append(sock)
                return
        sock.close()


__all__ = ["TcpEngineClient", "TcpEngineServer"]
