"""The raw TCP reference of the transport benchmark: the same bytes over bare sockets, 1 or C connections.

The far end is a Ray actor (``TcpPeer``) on the other node: it listens on its node's IP and serves
every accepted connection in a thread of its own. The near end (``RawTcp``) is the calling process,
as the store's client is: it opens its connections once and keeps them, so a timed transfer is only
the bytes, as a store call on a warm connection is. On each connection a transfer is a 17-byte
request (``!cQQ``: op, offset, length) and then

- ``W`` (near -> far, as a put): the near end ``sendmsg``s ``length`` bytes of memoryview chunks, the
  far end ``recv_into``s its preallocated buffer at ``offset`` and answers one byte when all arrived;
- ``R`` (far -> near, as a get): the far end ``sendmsg``s ``length`` bytes from ``offset`` of its
  buffer, the near end ``recv_into``s its own preallocated buffer.

C connections split the payload into C contiguous parts, one per connection, each moved by its own
thread (socket calls release the GIL). No framing beyond the request, no copies in Python: what the
link carries at best, the limit the store is measured against. Every socket has a timeout, so every
wait has a deadline.

Used by ``bench._transport_run`` (the near end) and run in an actor (the far end).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CHUNK = 4 << 20  # bytes per sendmsg / recv_into call: a few MiB, large enough that calls cost nothing
_REQ = struct.Struct("!cQQ")
_WRITE, _READ = b"W", b"R"


class RawTcpError(RuntimeError):
    """A raw TCP transfer failed (a peer closed, a timeout): names the side and the endpoint."""


def send_all(sock: socket.socket, view: memoryview) -> None:
    """Send every byte of ``view`` with ``sendmsg`` of memoryview chunks (a partial send is resumed)."""
    sent, n = 0, len(view)
    while sent < n:
        sent += sock.sendmsg([view[sent : sent + CHUNK]])


def recv_all(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` with ``recv_into`` (in chunks); a peer that closes early is an error."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got : got + CHUNK])
        if k == 0:
            raise RawTcpError(f"peer closed after {got} of {n} bytes")
        got += k


def split(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``nbytes`` cut into ``parts`` contiguous (offset, length) pieces, the last taking the rest.

    Example:
        >>> split(10, 3)
        [(0, 3), (3, 3), (6, 4)]
    """
    size = nbytes // parts
    return [(i * size, size if i < parts - 1 else nbytes - i * size) for i in range(parts)]


class TcpPeer:
    """Actor body: the far end. Wrap with ``ray.remote(TcpPeer)``; ``listen`` then ``prepare``."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None
        self.buf: memoryview = memoryview(bytearray(0))
        self.timeout_s = 60.0
        self.closed = threading.Event()
        self.errors: list[str] = []
        self.conns: list[socket.socket] = []

    def listen(self, ip: str | None, timeout_s: float) -> tuple[str, int]:
        """Listen on ``ip`` (default: this node's IP), any port; serve each connection in a thread."""
        import ray

        self.timeout_s = timeout_s
        ip = ip or ray.util.get_node_ip_address()
        self.listener = socket.create_server((ip, 0), backlog=64)
        self.listener.settimeout(0.5)  # the accept loop looks at `closed` this often
        threading.Thread(target=self._accept, name="rawtcp-accept", daemon=True).start()
        return ip, self.listener.getsockname()[1]

    def prepare(self, nbytes: int) -> int:
        """Allocate and touch the far end's buffer (so no page fault is timed); returns its size."""
        import numpy as np

        self.buf = np.ones(nbytes, dtype=np.uint8).data.cast("B")
        return nbytes

    def errors_seen(self) -> list[str]:
        return list(self.errors)

    def close(self) -> None:
        self.closed.set()
        for sock in [*self.conns, *([self.listener] if self.listener else [])]:
            sock.close()

    def _accept(self) -> None:
        assert self.listener is not None
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="rawtcp-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(_REQ.size)
        try:
            while not self.closed.is_set():
                # Idle between transfers for as long as the run lasts; `closed` is looked at twice a
                # second, and a transfer once begun has the socket's timeout.
                if not select.select([conn], [], [], 0.5)[0]:
                    continue
                if conn.recv_into(head, 1) == 0:
                    return  # the near end closed: the run is over
                recv_all(conn, memoryview(head)[1:])
                op, offset, length = _REQ.unpack(head)
                view = self.buf[offset : offset + length]
                if op == _WRITE:
                    recv_all(conn, view)
                    conn.sendall(b"k")
                elif op == _READ:
                    send_all(conn, view)
                else:
                    raise RawTcpError(f"unknown request {op!r}")
        except (OSError, RawTcpError) as exc:
            if not self.closed.is_set():
                self.errors.append(repr(exc))
        finally:
            conn.close()


class RawTcp:
    """The near end: ``max_conns`` connections to a ``TcpPeer`` at ``endpoint``, kept open.

    Example (``peer``: a ``TcpPeer`` actor, listening and prepared for ``len(buf)`` bytes)::

        raw = RawTcp(ray.get(peer.listen.remote(None, 120)), max_conns=4, timeout_s=120)
        seconds = raw.write(memoryview(buf), conns=2)   # buf's bytes to the far end
        seconds = raw.read(memoryview(out), conns=2)    # as many back into out
        raw.close()
    """

    def __init__(self, endpoint: tuple[str, int], max_conns: int, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.socks: list[socket.socket] = []
        for _ in range(max_conns):
            sock = socket.create_connection(endpoint, timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(sock)
        # Threads made once, so a timed transfer never pays for starting one; the caller's own thread
        # moves the first part (one connection: no thread hand-off at all, as a store call).
        self.pool = ThreadPoolExecutor(max_workers=max(1, max_conns - 1), thread_name_prefix="rawtcp")

    def write(self, view: memoryview, conns: int) -> float:
        """Send ``view`` to the far end over ``conns`` connections; seconds until every part is acked."""
        return self._timed(view, conns, self._write_part)

    def read(self, view: memoryview, conns: int) -> float:
        """Fill ``view`` from the far end's buffer over ``conns`` connections; seconds it took."""
        return self._timed(view, conns, self._read_part)

    def _timed(self, view: memoryview, conns: int, part: Any) -> float:
        if not 1 <= conns <= len(self.socks):
            raise ValueError(f"conns must be 1..{len(self.socks)}, got {conns}")
        pieces = split(len(view), conns)
        start = time.perf_counter()
        futures = [self.pool.submit(part, self.socks[i], view, *pieces[i]) for i in range(1, conns)]
        part(self.socks[0], view, *pieces[0])
        for f in futures:
            f.result()  # (each socket has its timeout: this returns or raises within it)
        return time.perf_counter() - start

    @staticmethod
    def _write_part(sock: socket.socket, view: memoryview, offset: int, length: int) -> None:
        sock.sendall(_REQ.pack(_WRITE, offset, length))
        send_all(sock, view[offset : offset + length])
        if sock.recv(1) != b"k":
            raise RawTcpError("the far end closed before acknowledging a write")

    @staticmethod
    def _read_part(sock: socket.socket, view: memoryview, offset: int, length: int) -> None:
        sock.sendall(_REQ.pack(_READ, offset, length))
        recv_all(sock, view[offset : offset + length])

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.pool.shutdown(wait=False)
