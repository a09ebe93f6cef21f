"""The same-host lane: framed messages over a Unix stream socket, with no zmq in between.

A zmq message between two processes wakes four threads (each side's application thread and zmq I/O
thread); on a small VM that costs more CPU per message than a small put's own work. Here a message
is one ``sendmsg`` and one ``recv_into`` on each side: a fraction of zmq's CPU and latency
(bench/RESULTS.md, 2026-12-02). The blocking client (``SyncTransport``) and a shard's
link to its index use it for every peer on their host; ``zmq.asyncio`` clients and other hosts keep
zmq. Every service listens on both.

Framing: ``[u32 n][u64 length] * n`` then the ``n`` frames' bytes (little endian): the same frames
as a zmq multipart message (``wire.frames``), so one request path serves both lanes.

Who may talk (the same rule as ``transport.auth``'s PLAIN over ipc): the listener is in the abstract
namespace (nothing in the file system, so reachable from every uid), and ``accept`` closes a peer
whose uid (``SO_PEERCRED``, what the kernel recorded at its connect) is not allowed at once, before
it is given anything. The first message on a connection must be ``[HELLO, secret]`` with the store's
secret (compared in constant time). A peer is closed, having been served nothing, when that first
message is anything else, when it does not arrive within ``HANDSHAKE_S``, and at any time when a
message breaks the limits (frame count, total bytes): a declared size is never trusted with memory
before the bytes arrive (``_Reader`` grows a large message's buffer as its bytes come in). A server
holds at most ``max_unauthenticated()`` connections that have not said hello and drops the oldest
beyond that (``server.router``): a client sends its hello the moment it connects, so only peers that
keep silent are ever dropped. A peer that does not read its replies is closed once
``MAX_PENDING_BYTES`` would wait behind the message being sent, so it cannot make a service buffer
without bound (one message of any size may wait for the socket).

    >>> conn = connect("@dataplane-shard0-3f2a", creds.secret)   # client side, blocking use
    >>> conn.send_all(frames, deadline)
    >>> messages = conn.read()                                  # after a poll said readable
"""

from __future__ import annotations

import errno
import hmac
import resource
import select
import socket
import struct
import time
from collections import deque
from typing import Any, final

HELLO = b"dataplane-unix-1"
HANDSHAKE_S = 10.0  # an accepted peer that has not said hello by then is closed
HELLO_MAX_BYTES = 256  # each frame of the hello: an unauthenticated peer cannot make us buffer more
MAX_PENDING_BYTES = 256 << 20  # replies a peer has not read: past this it is closed
READ_CHUNK = 1 << 16
IOV_MAX = 512  # buffers per sendmsg call (the kernel allows 1024)
MAX_UNAUTHENTICATED = 1024  # connections a listener keeps before their hello (see max_unauthenticated)
ACCEPTS_PER_WAKE = 64  # a flood of connects cannot keep a server's loop from its other sockets
CONNECT_BACKOFF_S = (0.001, 0.025)  # first and longest pause between connects to a full backlog
_FRAMES = struct.Struct("<I")
_NOSIGNAL = socket.MSG_NOSIGNAL  # a peer that closed its end is an error to us, never a signal
_LENGTHS = [struct.Struct(f"<{n}Q") for n in range(8)]  # cached formats of the common frame counts
_HEADERS = [struct.Struct(f"<I{n}Q") for n in range(8)]
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


class ConnectionClosed(Exception):
    """The peer closed the connection, or broke the framing or limits (``str`` says which)."""


class PeerRefused(Exception):
    """``accept`` closed a connection from a process of a uid that may not talk to this listener."""

    def __init__(self, uid: int, pid: int) -> None:
        self.uid = uid
        self.pid = pid
        super().__init__(f"a connection from uid {uid} (pid {pid}) was refused: that uid is not allowed")


def _lengths_format(n: int) -> struct.Struct:
    return _LENGTHS[n] if n < len(_LENGTHS) else struct.Struct(f"<{n}Q")


def frame_header(sizes: list[int]) -> bytes:
    """The prefix of a message of frames of ``sizes`` bytes: their count, then each length."""
    n = len(sizes)
    return (_HEADERS[n] if n < len(_HEADERS) else struct.Struct(f"<I{n}Q")).pack(n, *sizes)


class _Reader:
    """Splits a byte stream into messages of at most ``max_frames`` frames of ``max_bytes`` bytes each.

    Small messages are parsed out of one reused read buffer and copied into a bytes object of their
    own (their frames are views of it, kept alive by whoever holds them). A message larger than the
    read buffer is received straight into a buffer of its own, grown as its bytes arrive.
    """

    def __init__(self, max_frames: int, max_bytes: int, size: int = READ_CHUNK) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes  # < 0: no limit
        self.buf = bytearray(size)
        self.start = 0  # unparsed bytes are buf[start:end]
        self.end = 0
        self.big: bytearray | None = None  # a large message being received whole
        self.big_filled = 0
        self.big_total = 0
        self.big_sizes: tuple[int, ...] = ()
        self.one = False  # stop after one message (a peer's hello: what follows waits for its limits)

    def read(self, sock: socket.socket) -> list[list[memoryview]]:
        """What one non-blocking read completes (maybe nothing); ``ConnectionClosed`` on EOF or abuse."""
        if self.big is not None:
            return self._read_big(sock)
        size = len(self.buf)
        if self.start and self.start == self.end:
            self.start = self.end = 0
        elif size - self.end < min(4096, size // 2):  # make room: move the unparsed tail to the front
            tail = self.buf[self.start : self.end]
            self.buf[: len(tail)] = tail
            self.start, self.end = 0, len(tail)
        n = _recv_into(sock, memoryview(self.buf)[self.end :])
        if n == 0:
            return []
        self.end += n
        return self._parse()

    def _parse(self) -> list[list[memoryview]]:
        out: list[list[memoryview]] = []
        buf = self.buf
        while self.end - self.start >= 4:
            (count,) = _FRAMES.unpack_from(buf, self.start)
            if count < 1 or count > self.max_frames:
                raise ConnectionClosed(f"a message of {count} frames (at most {self.max_frames})")
            head = 4 + 8 * count
            if head > len(buf):  # a header this long needs a larger read buffer (bounded by max_frames)
                self._grow(head)
                buf = self.buf
            if self.end - self.start < head:
                break
            sizes = _lengths_format(count).unpack_from(buf, self.start + 4)
            total = sum(sizes)
            if self.max_bytes >= 0 and max(sizes) > self.max_bytes:  # per frame, as zmq's MAXMSGSIZE
                raise ConnectionClosed(f"a frame of {max(sizes)} bytes (at most {self.max_bytes})")
            body = self.start + head
            if self.end - body >= total:
                out.append(_split(bytes(buf[body : body + total]), sizes))
                self.start = body + total
                if self.one:
                    break
                continue
            if head + total > len(buf):  # received whole into its own buffer, from what is here on
                have = self.end - body
                self.big = bytearray(max(have, min(total, 1 << 20)))
                self.big[:have] = buf[body : self.end]
                self.big_filled, self.big_total, self.big_sizes = have, total, sizes
                self.start = self.end = 0
            break
        return out

    def buffered(self) -> list[list[memoryview]]:
        """Messages already received but not yet parsed (after ``one`` is lifted)."""
        return self._parse() if self.big is None else []

    def _grow(self, size: int) -> None:
        grown = bytearray(max(size, 2 * len(self.buf)))
        tail = self.buf[self.start : self.end]
        grown[: len(tail)] = tail
        self.buf, self.start, self.end = grown, 0, len(tail)

    def _read_big(self, sock: socket.socket) -> list[list[memoryview]]:
        big = self.big
        assert big is not None
        if self.big_filled == len(big):  # grown only as bytes arrive: a lying size costs no memory
            grown = bytearray(min(self.big_total, 2 * len(big)))
            grown[: len(big)] = big
            self.big = big = grown
        n = _recv_into(sock, memoryview(big)[self.big_filled :])
        self.big_filled += n
        if self.big_filled < self.big_total:
            return []
        self.big = None
        return [_split(big, self.big_sizes)]


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    try:
        n = sock.recv_into(view)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as exc:
        raise ConnectionClosed(f"connection reset ({exc})") from exc
    if n == 0:
        raise ConnectionClosed("the peer closed the connection")
    return n


def _split(data: bytes | bytearray, sizes: tuple[int, ...]) -> list[memoryview]:
    view = memoryview(data)
    frames, at = [], 0
    for size in sizes:
        frames.append(view[at : at + size])
        at += size
    return frames


@final  # callers tell a connection from a zmq socket by ``type(sock) is Conn``: no subclass may exist
class Conn:
    """One framed connection, non-blocking, for either side: ``read`` what arrived, ``write`` frames
    (what the socket does not take at once waits in ``pending`` until ``flush``)."""

    def __init__(
        self, sock: socket.socket, *, max_frames: int, max_bytes: int, buffer: int = READ_CHUNK
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()  # what a poller reports (and unregisters, even after close)
        self._readable: Any = None  # a poll object on ``fd``, made at the first ``wait``
        self.reader = _Reader(max_frames, max_bytes, buffer)
        self.pending: deque[memoryview] = deque()
        self.pending_bytes = 0
        self.closed = False  # no longer usable: the peer went away, broke a limit, or ``close`` ran
        self._open = True  # the socket itself: closed only by ``close`` (its owner unregisters it first)
        self.authenticated = False
        self.since = time.monotonic()

    def wait(self, timeout_ms: int) -> bool:
        """Blocking use: whether the connection became readable (or closed) within ``timeout_ms``."""
        if self._readable is None:
            self._readable = select.poll()
            self._readable.register(self.fd, select.POLLIN)
        return bool(self._readable.poll(timeout_ms))

    def read(self) -> list[list[memoryview]]:
        """Complete messages now readable (non-blocking); ``ConnectionClosed`` when the peer is gone."""
        if self.closed:
            raise ConnectionClosed("the connection is closed")
        return self.reader.read(self.sock)

    def write(self, frames: list[Any]) -> bool:
        """Send ``frames`` as one message, or queue what the socket does not take now; False when the
        connection is closed (the peer went away) or the peer left too much unread."""
        if self.closed:
            return False
        sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        header = frame_header(sizes)
        bufs = [header, *frames]
        if self.pending:  # behind what is already waiting: only so much may wait unread
            if self.pending_bytes + len(header) + sum(sizes) > MAX_PENDING_BYTES:
                self._fail()
                return False
            self._queue(bufs, 0)
            return True
        try:
            if len(bufs) <= IOV_MAX:  # the usual case: one call, and it takes everything
                try:
                    sent = self.sock.sendmsg(bufs, (), _NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent == len(header) + sum(sizes):
                    return True
            else:
                sent = _sendmsg(self.sock, bufs)
        except OSError:  # EPIPE / ECONNRESET: the peer closed its end
            self._fail()
            return False
        self._queue(bufs, sent)  # one message of any size may wait for the socket, however large
        return True

    def _queue(self, bufs: list[Any], skip: int) -> None:
        for b in bufs:
            view = b if type(b) is memoryview else memoryview(b)
            if view.ndim != 1 or view.itemsize != 1:
                view = view.cast("B")
            if skip >= view.nbytes:
                skip -= view.nbytes
                continue
            view = view[skip:]
            skip = 0
            self.pending.append(view)
            self.pending_bytes += view.nbytes

    def flush(self) -> bool:
        """Send what is pending as far as the socket takes it; True when nothing is left."""
        while self.pending and not self.closed:
            bufs = [self.pending[i] for i in range(min(IOV_MAX, len(self.pending)))]
            try:
                sent = self.sock.sendmsg(bufs, (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self._fail()
                return True
            self.pending_bytes -= sent
            while sent:
                head = self.pending[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    self.pending.popleft()
                else:
                    self.pending[0] = head[sent:]
                    sent = 0
        return not self.pending

    def send_all(self, frames: list[Any], deadline: float) -> bool:
        """Blocking use: send ``frames`` whole before ``deadline`` (monotonic); False when the peer
        is gone, ``TimeoutError`` when it did not take the bytes in time."""
        if not self.write(frames):
            return False
        while self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not take the request in time")
            wait_writable(self.sock, min(left, 1.0))  # (a deadline may be infinite)
            self.flush()
            if self.closed:
                return False
        return True

    def _fail(self) -> None:
        """Unusable from now on; the socket stays open until its owner, who may have it registered
        with a poller, calls ``close``."""
        self.closed = True
        self.pending.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        self._fail()
        if self._open:
            self._open = False
            self.sock.close()


def _sendmsg(sock: socket.socket, bufs: list[Any]) -> int:
    """Bytes of ``bufs`` the socket took now (0 when it takes none), over as many calls as IOV_MAX
    makes necessary; stops at the first partial send."""
    total = 0
    for i in range(0, len(bufs), IOV_MAX):
        part = bufs[i : i + IOV_MAX]
        try:
            sent = sock.sendmsg(part, (), _NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return total
        total += sent
        if sent < sum(len(b) if type(b) is bytes else memoryview(b).nbytes for b in part):
            return total
    return total


def wait_writable(sock: socket.socket, timeout: float) -> None:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    poller.poll(max(1, int(timeout * 1000)))


def abstract(address: str) -> str:
    """The socket address of ``@name`` (the abstract namespace: a leading NUL, no file)."""
    if not address.startswith("@"):
        raise ValueError(f"not an abstract unix address: {address!r}")
    return "\0" + address[1:]


def listen(name: str) -> tuple[socket.socket, str]:
    """A non-blocking listener in the abstract namespace; returns it and its ``@name`` address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = "@" + name
    sock.bind(abstract(address))
    sock.listen(512)
    sock.setblocking(False)
    return sock, address


def connect(address: str, secret: str, *, max_frames: int, max_bytes: int, timeout: float = 0.0) -> Conn:
    """A client connection to ``address``, its hello queued first (no round trip of its own: a wrong
    secret shows as the service closing the connection). ``ConnectionError`` when nobody listens,
    or when the service's backlog stays full for ``timeout`` seconds (0: do not wait at all).

    A full backlog (a busy or flooded service) is retried until ``timeout``, pausing between tries
    (from 1 ms, doubling up to 25 ms): a connect that waits costs next to no CPU."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)  # a blocking connect to a full backlog would wait without any limit
    where = abstract(address)
    deadline = time.monotonic() + timeout
    pause = CONNECT_BACKOFF_S[0]
    try:
        while True:
            try:
                _attempt(sock, where)
                break
            except BlockingIOError as exc:  # EAGAIN: the backlog is full
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionRefusedError(errno.EAGAIN, f"its backlog stayed full ({exc})") from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, CONNECT_BACKOFF_S[1])
    except OSError:
        sock.close()
        raise
    conn = Conn(sock, max_frames=max_frames, max_bytes=max_bytes)
    conn.authenticated = True  # a client trusts the service it was given the address of
    if not conn.write([HELLO, secret.encode()]):
        raise ConnectionResetError("the service closed the connection at once")
    return conn


def _attempt(sock: socket.socket, where: str) -> None:
    """One non-blocking connect (a Unix socket connects at once, or fails: EAGAIN when the backlog is
    full, ECONNREFUSED when nobody listens)."""
    sock.connect(where)


def accept(listener: socket.socket, uids: frozenset[int]) -> Conn | None:
    """One pending connection of ``listener`` (None when there is none), not yet authenticated: until
    its hello it may send one message of at most ``HELLO_MAX_BYTES``. A peer whose uid is not in
    ``uids`` is closed at once and ``PeerRefused`` raised (call again for the next one)."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return None
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid not in uids:
        sock.close()
        raise PeerRefused(uid, pid)
    conn = Conn(sock, max_frames=2, max_bytes=HELLO_MAX_BYTES, buffer=1024)
    conn.reader.one = True
    return conn


def max_unauthenticated() -> int:
    """How many connections that have not said hello one listener keeps: ``MAX_UNAUTHENTICATED``, or
    an eighth of this process's descriptors when that is less (never under 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    share = soft // 8 if soft != resource.RLIM_INFINITY else MAX_UNAUTHENTICATED
    return max(16, min(MAX_UNAUTHENTICATED, share))


def check_hello(conn: Conn, frames: list[memoryview], secret: str, max_frames: int, max_bytes: int) -> bool:
    """Authenticate ``conn`` by its first message; on success lift its limits to the service's (the
    messages it sent right after the hello are then ``conn.reader.buffered()``)."""
    ok = (
        len(frames) == 2
        and hmac.compare_digest(bytes(frames[0]), HELLO)
        and hmac.compare_digest(bytes(frames[1]), secret.encode())
    )
    if ok:
        conn.authenticated = True
        conn.reader.max_frames = max_frames
        conn.reader.max_bytes = max_bytes
        conn.reader.one = False
        if len(conn.reader.buf) < READ_CHUNK:  # a peer gets a full read buffer only once it is known
            conn.reader._grow(READ_CHUNK)
    return ok


__all__ = [
    "HELLO",
    "Conn",
    "ConnectionClosed",
    "PeerRefused",
    "accept",
    "check_hello",
    "connect",
    "listen",
    "max_unauthenticated",
]
