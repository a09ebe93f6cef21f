"""The store's request loop on its own thread, serving a service core (``dispatch.Operations``) on zmq
ROUTER sockets and on the Unix lane alike.

``RequestServer`` is the one request loop of the store: the shard (``shard.actor.ShardServer``) and the
index (``index.actor.IndexServer``) subclass it and change only how a decoded request is answered
(``serve``): a few of their ops are answered later, the rest run on the core at once. So both
bind, authenticate, check and refuse alike: every request gets an answer, success or error,
echoing its request id (``frames.answer``: a header of another protocol version, too many
frames, an unknown op or a malformed body are refused before any handler runs); a foreign or
undecodable message gets an error reply when it carries an identity, and the loop never dies of
a handler exception. It listens on tcp (other hosts) and on an abstract-namespace ipc socket
(same host; nothing is left in the file system, even after a crash), and on the same-host Unix
lane (``transport.unix``: the same frames without zmq's threads, for blocking clients and a shard's
link to its index; other uids are closed at accept, and at most ``transport.unix.max_unauthenticated()``
connections that have not said hello are kept, the oldest dropped first). Polls are bounded, so
``stop()`` returns within one poll interval, and ``tick`` runs between requests.

The loop cannot die of an exception: every step of it (a handler, the poll timeout a subclass
computes, its after-poll timers, the tick, draining a socket) runs guarded, so a failing step is
logged and the loop goes on serving. A request whose handler raised is answered with the error
(``frames.answer``: a ``dataplane.errors`` class, or ``DataplaneError`` naming the exception's
type); a subclass answers the requests its own timers fail on (``IndexServer``, ``ShardServer``).

Metrics (``dataplane.telemetry``): the loop counts what it refuses, by cause (``refusals``: a
connection that failed authentication, a Unix-lane peer of another uid, one silent past the
handshake deadline or evicted for a newer one, a request of another protocol version or malformed).
When its process exports metrics (``metrics`` is set), it also times every request it serves, and
every ``RECORDER.interval_s`` publishes a snapshot of its counters and gauges (``metrics_snapshot``,
taken on this thread, under the server's lock), so the exporter never touches the core.

Every connection is authenticated before it can deliver a message (``dataplane.transport.auth``): the
loop also serves the ZAP handler of its own zmq context. With ``encrypt=True`` the tcp endpoint is
a second ROUTER socket speaking CURVE, while the same-host ipc endpoint stays PLAIN (its bulk bytes
go through shared memory). Inbound frames are capped at ``max_message_bytes``: libzmq drops a peer
that sends a bigger one before it is ever buffered whole.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import select
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dataplane.config import unix_peer_uids
from dataplane.errors import DataplaneError, ProtocolVersionError, WireError
from dataplane.server.dispatch import Operations, OpReply
from dataplane.server.jobs import Jobs
from dataplane.telemetry.recorder import RECORDER, Key, ServerMetrics
from dataplane.transport import auth as _auth
from dataplane.transport import engine as _engine
from dataplane.transport import unix as _unix
from dataplane.transport.engine import EngineServer
from dataplane.transport.sockets import EVENTS, NOBLOCK, POLLIN, recv_frames, send_frames
from dataplane.wire import bulk as _bulk
from dataplane.wire import frames as _wire
from dataplane.wire.protocol import MAX_FRAMES

logger = logging.getLogger(__name__)

POLL_MS = 100
FREEZE_S = 1.0  # how often a server freezes its process's heap (``freeze_heap``)
TICK_S = 0.25
_CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# Frames a Unix-lane message may have before the connection is dropped as broken: well above what
# a request may carry, so a request with too many frames gets the same typed refusal (``answer``)
# as on zmq, while the header a peer can make us hold stays bounded (8 bytes a frame).
_LANE_FRAMES = 2 * MAX_FRAMES + 2
_LOG_EVERY_S = 10.0  # a loop step that keeps failing logs its traceback at most this often

# What the loop serves a request from: a ROUTER socket, or a Unix-lane connection.
Peer = zmq.Socket[bytes] | _unix.Conn

# ``getsockopt`` unbound and typed for the one option the drains read, ZMQ_EVENTS (an int): pyzmq's
# stubs give every option's value as ``int | bytes``. (Unbound, it costs a drain no more than the method.)
_events: Callable[[zmq.Socket[bytes], int], int] = zmq.Socket.getsockopt  # type: ignore[assignment]


def _poll_seconds(timeout_ms: Any) -> float:
    """A poll timeout in seconds from a subclass's ``poll_timeout_ms``: 0..POLL_MS whatever it said
    (a negative value polls at once, anything else outside the range, ``nan`` included, POLL_MS)."""
    if type(timeout_ms) in (int, float) and timeout_ms < 0:
        return 0.0
    if type(timeout_ms) not in (int, float) or not timeout_ms <= POLL_MS:
        return POLL_MS / 1000
    seconds: float = timeout_ms / 1000  # (an int or a float, checked above)
    return seconds


# Why a connection or a request was refused (``RequestServer.refusals``; the ``reason`` label).
REFUSALS = ("auth", "uid", "handshake_timeout", "evicted", "protocol_version", "malformed")


def _refuse(exc: WireError) -> _wire.Handler:
    """A handler that answers every request with ``exc``."""

    def handler(req: Any, bufs: list[memoryview]) -> None:
        raise exc

    return handler


def freeze_heap() -> None:
    """Collect what came since the last call, then move every live object out of the collector's
    sight (``gc.freeze``): a full collection then scans only the objects of the last ``FREEZE_S``,
    not a million keys' records (the shard's rows, the index's key tables): a shard's full
    collections grew to 18 ms a million rows in, each one a stall of every request. What is frozen
    is freed by its reference count as ever; only a reference cycle that becomes garbage after it
    was frozen is never freed (the records hold none)."""
    gc.collect()
    gc.freeze()


class RequestServer:
    """Serves ``core``'s operations on authenticated ROUTER sockets and Unix-lane connections from a
    daemon thread."""

    def __init__(
        self,
        core: Operations,
        host_ip: str,
        name: str,
        creds: _auth.Credentials,
        *,
        tick: Callable[[], None] | None = None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
        max_message_bytes: int = -1,
        max_frames: int = MAX_FRAMES,
        mandatory: bool = False,
    ) -> None:
        self.core = core
        self._tick = tick
        # Held around every core call; only needed when threads besides this loop's use the core.
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._creds = creds
        self._max_frames = max_frames
        self._mandatory = mandatory  # replies to a peer that left raise (see ``deliver``)
        self.name = name
        self._ctx = zmq.Context()  # its own: one ZAP handler per context
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_auth.ZAP_ENDPOINT)  # before any ROUTER binds: no unauthenticated window
        self._socks: list[zmq.Socket[bytes]] = []
        self.ipc, self.tcp = self._bind(host_ip, max_message_bytes)
        self._max_message_bytes = max_message_bytes
        # The transfer engine's server end (``transport.engine``), set before the loop starts by a
        # service that runs one (a shard); buffers of ``engine_min_bytes`` or more of a reply to a
        # client that takes them so go through it.
        self.engine: EngineServer | None = None
        self.engine_min_bytes = 1 << 62
        self._listener, self.unix = _unix.listen(f"{name}-{uuid.uuid4().hex[:12]}-u")
        self._listening = False  # (``_listen`` below)
        self._conns: dict[int, _unix.Conn] = {}  # accepted Unix-lane connections, by file descriptor
        # Those of them that have not said hello yet, oldest first: at most ``_unauth_cap`` of them.
        self._unauth: dict[int, _unix.Conn] = {}
        self._unauth_cap = _unix.max_unauthenticated()
        self._peer_uids = unix_peer_uids()  # other uids are closed at accept
        self.refusals = dict.fromkeys(REFUSALS, 0)  # what was refused, by cause (module docstring)
        # Set by the actor when this process exports metrics: then requests are timed and snapshots
        # published (both skipped while it is None or the recorder is off).
        self.metrics: ServerMetrics | None = None
        self._publish_due = 0.0
        self._freeze_due = 0.0
        self._stop = threading.Event()
        self._jobs = Jobs(self._lock)  # requests answered in steps (``core.JOBS``, ``server.jobs``)
        self._logged: dict[str, float] = {}  # loop step -> when its last failure was logged in full
        self._thread = threading.Thread(target=self._run, name=f"{name}-server", daemon=True)
        # One epoll for everything: a zmq socket is watched through its ZMQ_FD, which signals "look at
        # ZMQ_EVENTS" (edge-like: see ``_run``), a Unix-lane connection through its own descriptor. One
        # syscall per wake-up where zmq_poll made two and asked every zmq socket for its events twice.
        self._ep = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}  # fd -> handler(epoll events)
        self._drains: dict[zmq.Socket[bytes], Callable[[], None]] = {}  # every zmq socket -> its drain
        self._touched: set[zmq.Socket[bytes]] = set()  # zmq sockets sent on since the loop last drained them
        # Open connections (``rlplane store status`` shows a shard's as its clients), counted from
        # each socket's accept/disconnect events, whose value is the connection's file descriptor,
        # and from the Unix lane's accepted connections. A router's drain reads the monitors first,
        # so a connection is counted before its first request is answered (its accept came first).
        self._peers: set[tuple[int, int]] = set()
        self.connections = 0
        self._monitors: list[Callable[[], None]] = []
        for which, sock in enumerate(self._socks):
            mon = sock.get_monitor_socket(_CONNECTION_EVENTS)
            count = functools.partial(self._count_connections, which, mon)
            self._monitors.append(count)
            self.watch(mon, count)  # the thread has not started: registering from here is safe
        self._add_zmq(self._zap, self._drain_zap)
        for sock in self._socks:
            self._add_zmq(sock, functools.partial(self._drain_router, sock))
        self._listen()

    def _bind(self, host_ip: str, max_message_bytes: int) -> tuple[str, str]:
        """Bind the ROUTER sockets: PLAIN on a same-host ipc endpoint and on tcp, or CURVE on tcp when
        the store encrypts; returns the (ipc, tcp) addresses."""
        plain = self._router(curve=False, max_message_bytes=max_message_bytes)
        ipc = f"ipc://@{self.name}-{uuid.uuid4().hex[:12]}"
        plain.bind(ipc)
        tcp_sock = plain
        if self._creds.encrypt:  # tcp crosses hosts: its own socket, speaking CURVE
            tcp_sock = self._router(curve=True, max_message_bytes=max_message_bytes)
        port = tcp_sock.bind_to_random_port(f"tcp://{host_ip}")
        return ipc, f"tcp://{host_ip}:{port}"

    def _router(self, curve: bool, max_message_bytes: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1 if self._mandatory else 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # A peer that does not finish zmq's handshake (and ZAP) in time is dropped: the Unix lane's
        # deadline, where libzmq's default is 30 s. Nothing in libzmq caps how many there are at once.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(_unix.HANDSHAKE_S * 1000))
        _auth.secure_server(sock, self._creds, curve)
        self._socks.append(sock)
        return sock

    def start(self) -> RequestServer:
        self._thread.start()
        return self

    # ---- what the loop watches -------------------------------------------------------------------
    def _add(self, fd: int, handler: Callable[[int], None], events: int = select.EPOLLIN) -> None:
        self._handlers[fd] = handler
        self._ep.register(fd, events)

    def _remove(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            try:
                self._ep.unregister(fd)
            except OSError:  # already closed (and so already out of the epoll): nothing to undo
                logger.debug("%s: fd %d was closed before it was unregistered", self.name, fd)

    def _add_zmq(self, sock: zmq.Socket[bytes], drain: Callable[[], None]) -> None:
        """Watch a zmq socket: ``drain()`` must consume every message its ZMQ_EVENTS shows (the fd
        signals again only after that)."""
        self._drains[sock] = drain
        self._add(sock.fileno(), lambda ev: drain())

    def touch(self, sock: zmq.Socket[bytes]) -> None:
        """Say a zmq socket was sent on outside its drain: a send may consume the signal of a message
        that arrived meanwhile, so the loop drains it before it blocks again."""
        self._touched.add(sock)

    def watch(self, sock: Peer, on_readable: Callable[[], None]) -> None:
        """Serve ``sock`` (a zmq socket or a ``transport.unix.Conn``) from the loop too: ``on_readable()``
        runs when it may have messages and must take all there are (for a zmq socket: until its
        ZMQ_EVENTS shows none). Call on the server thread (from a handler or ``after_poll``);
        ``unwatch`` before closing the socket; ``touch`` a zmq socket after sending on it."""
        if type(sock) is _unix.Conn:
            self._add(sock.fd, lambda ev: on_readable())
        else:
            self._add_zmq(sock, on_readable)

    def _count_connections(self, which: int, mon: zmq.Socket[bytes]) -> None:
        while _events(mon, EVENTS) & POLLIN:
            event = recv_monitor_message(mon, NOBLOCK)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._peers.add((which, event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._peers.discard((which, event["value"]))
        self._count()

    def _count(self) -> None:
        self.connections = len(self._peers) + len(self._conns)  # read by other threads: one int

    def unwatch(self, sock: Peer) -> None:
        if type(sock) is _unix.Conn:
            self._remove(sock.fd)
        elif self._drains.pop(sock, None) is not None:
            self._touched.discard(sock)
            self._remove(sock.fileno())

    @property
    def refused(self) -> int:
        """Unix-lane connections closed at accept for their uid."""
        return self.refusals["uid"]

    @property
    def evicted(self) -> int:
        """Unix-lane connections dropped, silent, for newer ones."""
        return self.refusals["evicted"]

    def _drain_zap(self) -> None:
        zap = self._zap
        while _events(zap, EVENTS) & POLLIN:
            reply = _auth.zap_reply(zap.recv_multipart(), self._creds)
            if reply[2] != b"200":
                self.refusals["auth"] += 1
            zap.send_multipart(reply)

    def _drain_router(self, sock: zmq.Socket[bytes]) -> None:
        for count in self._monitors:  # a connection is counted before its first request is answered
            count()
        while _events(sock, EVENTS) & POLLIN:
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                break
            self._serve_guarded(sock, frames)
        self._touched.discard(sock)  # drained after its replies went: its signal is re-armed

    def _serve_guarded(self, sock: Peer, msg: list[Any]) -> None:
        """``_serve_one``, whose failures end with this message: the messages queued behind it are
        still served (``_serve_one`` answers a handler's exception itself; what can reach here is a
        subclass's work after the answer, such as re-trying parked requests)."""
        try:
            self._serve_one(sock, msg)
        except Exception:  # noqa: BLE001 - the messages behind it are served all the same
            self._failed("serving a request")

    def _guarded(self, step: str, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """Run one step of the loop: an exception is logged (``_failed``) and the loop goes on;
        returns ``default`` then."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - no exception of any step may end the loop
            self._failed(step)
            return default

    def _failed(self, step: str) -> None:
        """Log the exception being handled: its traceback at most once per ``_LOG_EVERY_S`` per step,
        so a step failing on every pass cannot flood the log."""
        now = time.monotonic()
        if now - self._logged.get(step, -math.inf) >= _LOG_EVERY_S:
            self._logged[step] = now
            logger.exception("%s: %s failed; the loop serves on", self.name, step)
        else:
            logger.debug("%s: %s failed again", self.name, step, exc_info=True)

    def _run(self) -> None:
        ep, handlers = self._ep, self._handlers
        last_tick = time.monotonic()
        while not self._stop.is_set():
            # A zmq socket's fd signals only a change, and a send on the socket can consume the
            # signal of a message that arrived meanwhile: every socket sent on is drained before
            # blocking (the drains re-arm the signal), and a wake-up with nothing to do drains all
            # (a missed signal could delay a message by one poll interval, never lose it).
            while self._touched:
                drain = self._drains.get(self._touched.pop())
                if drain is not None:
                    self._guarded("draining a socket", drain)
            timeout = self._guarded("computing the poll timeout", self.poll_timeout_ms, default=POLL_MS)
            jobs_ms = self._jobs.poll_ms()
            if jobs_ms is not None:
                timeout = min(timeout, jobs_ms)
            events = self._guarded("polling", ep.poll, _poll_seconds(timeout), default=[])
            for fd, ev in events:
                handler = handlers.get(fd)
                if handler is None:  # removed by an earlier handler of this pass
                    continue
                try:
                    handler(ev)
                except Exception:  # noqa: BLE001 - the loop serves everyone else all the same
                    self._failed(f"serving fd {fd}")
            if not events:
                for drain in list(self._drains.values()):
                    self._guarded("draining a socket", drain)
            if self._jobs:  # (before the timers: the index re-tries parked requests after them)
                self._guarded("a step of a request answered in steps", self._jobs.step)
            self._guarded("the after-poll timers", self.after_poll)
            now = time.monotonic()
            if now >= self._freeze_due:
                self._freeze_due = now + FREEZE_S
                self._guarded("freezing the heap", freeze_heap)
            if self.metrics is not None and now >= self._publish_due:
                self._publish_due = now + RECORDER.interval_s
                self._publish()
            if now - last_tick >= TICK_S:
                last_tick = now
                self._guarded("checking connections", self._check_conns, now)
                if self.engine is not None:
                    self._guarded("expiring staged buffers", self.engine.sweep)
                if self._tick is not None:
                    with self._lock:
                        self._guarded("the server tick", self._tick)
        if self.metrics is not None:
            self.metrics.rec.withdraw(self.name)
        for conn in self._conns.values():
            conn.close()
        self._listener.close()
        for sock in [*self._socks, self._zap, *self._drains]:
            sock.close(linger=0)
        self._ep.close()
        self._ctx.term()

    # ---- the Unix lane ---------------------------------------------------------------------------
    def _listen(self) -> None:
        self._listening = True
        self._add(self._listener.fileno(), lambda ev: self._accept())

    def _accept(self) -> None:
        # Bounded per wake-up (the listener stays readable): a flood of connects leaves the loop time
        # for the connections it already has.
        for _ in range(_unix.ACCEPTS_PER_WAKE):
            try:
                conn = _unix.accept(self._listener, self._peer_uids)
            except _unix.PeerRefused as exc:
                if not self.refused:  # once: a flood would fill the log
                    logger.warning("%s: %s (DATAPLANE_UNIX_PEER_UIDS allows others)", self.name, exc)
                self.refusals["uid"] += 1
                continue
            except OSError as exc:  # out of file descriptors: stop accepting until the next tick
                logger.warning("%s: cannot accept a connection (%s); retrying shortly", self.name, exc)
                self._remove(self._listener.fileno())
                self._listening = False
                return
            if conn is None:
                return
            self._conns[conn.fd] = conn
            self._unauth[conn.fd] = conn
            self._add(conn.fd, functools.partial(self._on_conn, conn))
            if len(self._unauth) > self._unauth_cap:
                self._evict_oldest()
            self._count()

    def _evict_oldest(self) -> None:
        """Drop the oldest connection that has not said hello, unless its hello has arrived by now
        (read here, before the loop got to it: then it is served like any other)."""
        conn = next(iter(self._unauth.values()))
        self._on_conn(conn, select.EPOLLIN)
        if self._unauth.get(conn.fd) is conn:  # still silent
            self.refusals["evicted"] += 1
            self._close_conn(conn)

    def _on_conn(self, conn: _unix.Conn, ev: int) -> None:
        if ev & select.EPOLLOUT and conn.flush():
            if conn.closed:  # the peer went away
                self._close_conn(conn)
                return
            self._ep.modify(conn.fd, select.EPOLLIN)
        if not ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
            return
        try:
            messages = conn.read()
            while messages:
                frames = messages.pop(0)
                if conn.authenticated:
                    self._serve_guarded(conn, [None, *frames])
                elif _unix.check_hello(
                    conn, frames, self._creds.secret, _LANE_FRAMES, self._max_message_bytes
                ):
                    self._unauth.pop(conn.fd, None)
                    messages.extend(conn.reader.buffered())  # what the peer sent right after its hello
                else:
                    self.refusals["auth"] += 1
                    raise _unix.ConnectionClosed("not a peer of this store")
                if conn.closed:  # a reply found the peer gone, or it left too much unread
                    break
        except _unix.ConnectionClosed:
            pass
        else:
            if not conn.closed:
                return
        self._close_conn(conn)

    def _close_conn(self, conn: _unix.Conn) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
            self._unauth.pop(conn.fd, None)
            self._remove(conn.fd)
            self._count()
        conn.close()

    def _check_conns(self, now: float) -> None:
        """Close peers that have not said hello in time; resume accepting after running out of fds."""
        for conn in list(self._unauth.values()):  # oldest first: the first one in time ends the sweep
            if now - conn.since <= _unix.HANDSHAKE_S:
                break
            self.refusals["handshake_timeout"] += 1
            self._close_conn(conn)
        for conn in [c for c in self._conns.values() if c.closed]:  # closed while answering
            self._close_conn(conn)
        if not self._listening:
            self._listen()

    def poll_timeout_ms(self) -> int:
        """How long the loop may block in one poll (subclasses with deadlines shorten it)."""
        return POLL_MS

    def after_poll(self) -> None:
        """Runs after every poll, on the server thread (subclasses: expire deadlines)."""

    def _serve_one(self, sock: Peer, msg: list[Any]) -> None:
        if len(msg) < 2:
            return
        ident = msg[0]
        metrics = self.metrics
        started = time.perf_counter() if metrics is not None else 0.0
        op = None  # once the header is read
        frames = msg[1:]
        accepts = False  # its client takes large reply buffers through the engine
        if _bulk.is_manifest(frames[0]):
            frames, accepts, failed = self._take(frames)
            if failed is not None:
                _, reply = _wire.answer(frames, _refuse(failed), who=self.name, refused=self._refused)
                if reply is not None:
                    self.deliver(sock, ident, reply)
                return

        def handler(req: Any, bufs: list[memoryview]) -> OpReply | None:
            nonlocal op
            op = req.op
            try:
                body = self.core.decode(req.op, req.body)
            except WireError:  # an unknown op, or a body its op cannot read
                self.refusals["malformed"] += 1
                raise
            return self.serve(sock, ident, req.rid, req.op, body, bufs)

        # A client that takes large reply buffers by an engine that lends: the core may stage rows
        # of its shared memory as they are, pinned until the engine is done with them.
        engine = self.engine if accepts else None
        lend = engine is not None and engine.lends
        if lend:
            self.core.lend_min_bytes = self.engine_min_bytes
        try:
            _, reply = _wire.answer(
                frames, handler, max_frames=self._max_frames, who=self.name, refused=self._refused
            )
        finally:
            if lend:
                self.core.lend_min_bytes = 0
        give_back = self.core.take_lent() if lend else None
        try:
            if reply is not None:
                if engine is not None:  # (from here the staged buffers' engine calls it, once)
                    hand, give_back = give_back, None
                    reply = _engine.stage_reply(engine, reply, self.engine_min_bytes, hand)
                self.deliver(sock, ident, reply)
        finally:
            if give_back is not None:  # nothing was staged: nothing reads what was lent
                give_back()
        if metrics is not None:
            metrics.served(op, time.perf_counter() - started)

    def _take(self, frames: list[Any]) -> tuple[list[Any], bool, WireError | None]:
        """A request sent with a manifest (``wire.bulk``): its frames as they were sent, its buffers
        taken from this server's engine; whether its client takes reply buffers the same way; or the
        error it is answered with (a server with no engine, a manifest that does not hold)."""
        rest = frames[1:] or [b""]
        if self.engine is None:
            return rest, False, WireError(f"{self.name} runs no transfer engine: a request named one")
        try:
            out, accepts = _engine.take_request(self.engine, frames, self._max_message_bytes)
        except WireError as exc:
            return rest, False, exc
        return out, accepts, None

    def _refused(self, exc: BaseException) -> None:
        """A request refused before its op ran: of another protocol version, or malformed (a header
        that does not decode, too many frames)."""
        self.refusals["protocol_version" if isinstance(exc, ProtocolVersionError) else "malformed"] += 1

    # ---- metrics ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        metrics = self.metrics
        if metrics is None or not metrics.rec.on:
            return
        try:
            with self._lock:
                counters, gauges = self.metrics_snapshot(metrics.labels)
        except Exception:  # noqa: BLE001 - a metric must never stop the loop
            logger.exception("%s: taking a metrics snapshot failed", self.name)
            return
        metrics.rec.publish(self.name, counters, gauges)

    def metrics_snapshot(self, labels: tuple[str, ...]) -> tuple[dict[Key, float], dict[Key, float]]:
        """This server's cumulative counters and gauges, keyed for the catalog (``labels``: the values
        of the metrics' first labels, e.g. store and shard). Runs on the loop thread, under the lock;
        subclasses add their core's."""
        prefix = self.metrics.prefix if self.metrics is not None else "dataplane_server"
        counters: dict[Key, float] = {
            (prefix + "_refused", *labels, reason): n for reason, n in self.refusals.items() if n
        }
        gauges: dict[Key, float] = {(prefix + "_clients", *labels): self.connections}
        return counters, gauges

    def serve(
        self, sock: Peer, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]
    ) -> OpReply | None:
        """The reply to one checked and decoded request, or None when it is answered later (a job,
        answered once its last step has run; or a subclass keeps ``sock``, ``ident`` and ``rid`` and
        ``deliver`` s the reply itself)."""
        if op in self.core.JOBS:  # answered in steps, other requests served between them
            self._jobs.start(
                self.core.job(op, body, bufs), functools.partial(self._answer_job, sock, ident, rid)
            )
            return None
        with self._lock:
            return self.core.run(op, body, bufs)

    def _answer_job(
        self, sock: Peer, ident: Any, rid: int, reply: OpReply | None, exc: BaseException | None
    ) -> None:
        """Answer a request answered in steps: its reply, or the error its job ended with."""
        if exc is not None or reply is None:
            if not isinstance(exc, DataplaneError):  # (as ``wire.frames.answer`` logs a plain op's)
                logger.debug("%s: request %d failed", self.name, rid, exc_info=exc)
            frames = _wire.encode_error(rid, exc or WireError("a job ended with no reply"))
        else:
            frames = _wire.encode_reply(rid, reply[0], reply[1])
        self.deliver(sock, ident, frames)

    def deliver(self, sock: Peer, ident: Any, reply: list[Any]) -> bool:
        """Send ``reply`` to the peer ``ident`` (on a ROUTER socket) or on a Unix-lane connection;
        False when it cannot be delivered (the peer left)."""
        if type(sock) is _unix.Conn:
            if not sock.write(reply):
                self._close_conn(sock)
                return False
            if sock.pending:  # the rest goes when the socket is writable
                self._ep.modify(sock.fd, select.EPOLLIN | select.EPOLLOUT)
            return True
        self.touch(sock)
        try:
            send_frames(sock, [ident, *reply])
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (mandatory routing): the peer disconnected
            logger.debug("%s: a reply could not be delivered: %s", self.name, exc)
            return False

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


__all__ = ["FREEZE_S", "Peer", "RequestServer", "freeze_heap"]
