"""Client transports: send a batch of requests to shards / the index and collect the replies by id.

What they carry (``Call``, ``Result``, ``INDEX``) and how a reply is decoded are in ``requests``,
which knows nothing of zmq: the operations that yield calls never import this module.

``SyncTransport`` uses blocking DEALER sockets and a poller with a deadline: no event-loop thread,
so a round trip costs only the sockets; to a target on this host it uses the Unix lane instead
(``wire.unix``: the same frames, without zmq's I/O threads, so a small request costs a fifth of
the CPU). Its sockets live in a small pool of per-call sets (zmq
sockets are not thread-safe, so a call owns its set while it runs): a process keeps at most
``MAX_IDLE_SETS`` sets however many threads ever called the store. ``AsyncTransport`` uses
``zmq.asyncio`` with one reader task per socket that resolves futures by request id, so many
coroutines share one connection (requests are pipelined).

Both return, per call, either ``(body, buffers)`` or the exception the call ended with: a rebuilt
remote error, or ``ShardUnavailableError`` naming the target. A reply that is late for more than
``PROBE_S`` makes the transport ask whether its target died (``wire.liveness``): a dead target fails
its calls at once, and every later call to it fails without being sent; a live but slow one is
waited for until the deadline. Sends are inside the deadline too, and a socket that timed out
is closed, so nothing queued for a dead peer lingers. Replies to requests that already timed out
are recognised by id and dropped.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from dataplane.errors import RequestTooLargeError, ShardUnavailableError
from dataplane.wire import auth as _auth
from dataplane.wire import frames as _wire
from dataplane.wire import unix as _unix
from dataplane.wire.liveness import Liveness
from dataplane.wire.requests import Call, Result, deadline_of, decode_result, next_rid
from dataplane.wire.shm import fd_limit_error

PROBE_S = 1.0  # a reply this late makes the transport ask whether its target died
_forks = [0]  # bumped in a forked child: the sockets it inherited are its parent's, never to be used
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))
MAX_IDLE_SETS = 8
# Plain ints: pyzmq's flag enums cost microseconds per operation, and a small request pays several.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_poll = zmq.zmq_poll


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message as zero-copy ``Frame`` s.

    ``Socket.recv_multipart`` asks the socket (``RCVMORE``) after every frame; a received frame
    already says whether more follow (``Frame.more``), which saves a socket call per frame: about
    half the cost of receiving a small message here.
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send a multipart message on a blocking (not ``zmq.asyncio``) socket: copied when small, zero-copy
    when large (``wire.frames.zero_copy``).

    ``Socket.send_multipart`` does the same with a type check of every frame and enum arithmetic per
    frame, which costs more than the send itself for a small request.
    """
    copy = not _wire.zero_copy(frames)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, flags | _SNDMORE if i < last else flags, copy)


# The backend's send: ``zmq.Socket.send`` only adds draft-socket options (routing_id, group) on top of
# it, at the cost of one more Python call per frame; a small put's request and replies are 5 frames.
_send = zmq.backend.Socket.send if issubclass(zmq.Socket, zmq.backend.Socket) else zmq.Socket.send


@dataclass
class Endpoint:
    """Where a target listens and how to authenticate to it."""

    address: str
    name: str
    curve: bool = False  # CURVE (encrypted tcp) rather than PLAIN
    unix: str | None = None  # the same-host Unix lane (``wire.unix``), used by blocking clients
    max_frame: int = -1  # the largest frame the target takes (-1: no limit known)


class _Endpoints:
    def __init__(
        self,
        endpoints: dict[int, Endpoint],
        creds: _auth.Credentials,
        timeout: float,
        liveness: Liveness,
        max_message_bytes: int = -1,
    ) -> None:
        self.endpoints = endpoints
        self.creds = creds
        self.timeout = timeout
        self.liveness = liveness
        self.max_message_bytes = max_message_bytes

    def _dealer(self, ctx: zmq.Context, target: int) -> zmq.Socket:
        ep = self.endpoints[target]
        try:
            sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(f"opening a socket to {ep.name}", OSError(exc.errno, str(exc))) from exc
            raise
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        _auth.secure_client(sock, self.creds, ep.curve)
        sock.connect(ep.address)
        return sock

    def _unix_conn(self, target: int, timeout: float = 0.0) -> _unix.Conn:
        """A Unix-lane connection to ``target``; ``ConnectionError`` when it cannot be made within
        ``timeout`` seconds (0: at once, for a server's loop, which must never block)."""
        ep = self.endpoints[target]
        assert ep.unix is not None
        try:
            return _unix.connect(
                ep.unix,
                self.creds.secret,
                max_frames=_wire.MAX_FRAMES + 1,
                max_bytes=self.max_message_bytes,
                timeout=timeout,
            )
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(f"opening a socket to {ep.name}", exc) from exc
            raise

    def too_large(self, target: int, op: str, frames: list[Any]) -> RequestTooLargeError | None:
        """The refusal of a request with a frame its target does not take, or None.

        The target drops such a frame unread (libzmq's ``MAXMSGSIZE``, the Unix lane's frame limit:
        the connection is closed), so the call would only end at its deadline, blamed on the target;
        refused here, before it is sent, it ends at once and says why.
        """
        ep = self.endpoints[target]
        limit = ep.max_frame
        if limit < 0:
            return None
        for i, frame in enumerate(frames):
            size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
            if size > limit:
                what = "its header (keys, tags and column descriptions)" if i == 0 else f"buffer frame {i}"
                return RequestTooLargeError(
                    f"a {op!r} request to {ep.name} was not sent: {what} is {size} bytes, more than the "
                    f"{limit} bytes that service takes in one frame (the store's max_message_bytes; a shard "
                    "with a capacity takes no frame larger than its capacity plus 1 MiB); nothing was "
                    "written. Send fewer keys (or smaller rows) per call, or start the store with a larger "
                    "max_message_bytes (and capacity_bytes)"
                )
        return None

    def gone(self, target: int, waited: float, why: str) -> ShardUnavailableError:
        """The error for a target whose connection closed or could not be made: dead, or unavailable."""
        return self.died(target) if self.liveness.dead(target) else self.unavailable(target, waited, why)

    uses_lane = False  # whether calls to a target with a Unix-lane address go over it (errors name it)

    def _where(self, ep: Endpoint) -> str:
        return f"unix:{ep.unix}" if self.uses_lane and ep.unix is not None else ep.address

    def unavailable(self, target: int, waited: float, why: str = "") -> ShardUnavailableError:
        ep = self.endpoints[target]
        return ShardUnavailableError(
            ep.name,
            f"{ep.name} at {self._where(ep)} did not answer within {waited:.1f}s{why}; it may be overloaded "
            "or unreachable (check `rlplane store status` / the Ray dashboard), or rpc_timeout_s may be "
            "too small",
        )

    def died(self, target: int) -> ShardUnavailableError:
        ep = self.endpoints[target]
        return ShardUnavailableError(
            ep.name,
            f"{ep.name} at {self._where(ep)} is dead (its process is gone); its data went with it. The "
            "rest of the store keeps working; `rlplane store stop` and a new store bring it back whole",
        )


class SyncTransport(_Endpoints):
    """Blocking request/reply over DEALER sockets from a small pool of per-call socket sets."""

    uses_lane = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx = zmq.Context.instance()
        self._idle: list[dict[int, zmq.Socket]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._forks = _forks[0]

    def _checkout(self) -> dict[int, zmq.Socket]:
        with self._lock:
            if self._forks != _forks[0]:  # a forked child: its parent's connections stay its parent's
                for socks in self._idle:  # (closing a copy of a Unix-lane socket leaves the parent's
                    for sock in socks.values():  # open; zmq sockets must not even be closed here)
                        if type(sock) is _unix.Conn:
                            sock.close()
                self._forks, self._idle = _forks[0], []
            return self._idle.pop() if self._idle else {}

    def _checkin(self, socks: dict[int, zmq.Socket]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_SETS:
                self._idle.append(socks)
                return
        for sock in socks.values():
            close_socket(sock)

    def call_many(self, calls: list[Call], timeout: float | None = None) -> list[Result]:
        timeout = self.timeout if timeout is None else timeout
        one = calls[0] if len(calls) == 1 else None
        if one is not None:
            timeout = timeout if one.timeout is None else one.timeout
        else:
            timeout = deadline_of(calls, timeout)
        socks = self._checkout()
        try:
            if one is not None:
                results = [self._call_one(socks, one, timeout)]
            else:
                results = self._call_many(socks, calls, timeout)
        except BaseException:
            # Interrupted (e.g. KeyboardInterrupt) with requests outstanding: close the sockets, so
            # no late reply reaches a later call and the index sees its consumer leave (a batch it
            # would have handed out is given back instead).
            for sock in socks.values():
                close_socket(sock)
            raise
        self._checkin(socks)
        return results

    def _socket(self, socks: dict[int, Any], target: int, deadline: float) -> Any:
        """The call set's socket to ``target``: a Unix-lane connection when it has one, else a DEALER."""
        sock = socks.get(target)
        if sock is None:
            if self.endpoints[target].unix is not None:
                # (a call that may wait for ever still connects within an hour, or fails)
                wait = min(max(0.0, deadline - time.monotonic()), 3600.0)
                sock = socks[target] = self._unix_conn(target, wait)
            else:
                sock = socks[target] = self._dealer(self._ctx, target)
        return sock

    def _send(self, socks: dict[int, Any], c: Call, rid: int, deadline: float) -> Any:
        """Send ``c``; returns its socket, or the error the call ends with (nothing was sent)."""
        frames = _wire.encode_request(rid, c.op, c.body, c.bufs)
        refused = self.too_large(c.target, c.op, frames)
        if refused is not None:
            return refused
        started = time.monotonic()
        try:
            sock = self._socket(socks, c.target, deadline)
        except ConnectionError as exc:  # the Unix lane refused: its process is gone, or not ours
            return self.gone(c.target, time.monotonic() - started, f" (connecting failed: {exc})")
        if type(sock) is _unix.Conn:
            try:
                sent = sock.send_all(frames, deadline)
            except TimeoutError:
                self._drop(socks, None, c.target)
                waited = time.monotonic() - started
                return self.unavailable(c.target, waited, " (it did not take the request)")
            if not sent:
                self._drop(socks, None, c.target)
                return self.gone(c.target, 0.0, " (the connection was closed)")
            return sock
        try:
            send_frames(sock, frames, _NOBLOCK)
        except zmq.Again:
            return self.unavailable(c.target, 0.0, " (its send queue is full)")
        return sock

    def _receive(self, socks: dict[int, Any], target: int, sock: Any, started: float) -> list[Any]:
        """The messages ``sock`` has now (it polled readable); a closed Unix-lane connection is
        dropped and comes back as a ``ShardUnavailableError`` in place of the list."""
        if type(sock) is _unix.Conn:
            try:
                return sock.read()
            except _unix.ConnectionClosed as exc:
                self._drop(socks, None, target)
                raise self.gone(target, time.monotonic() - started, f" ({exc})") from None
        frames = []
        while True:  # drain without an exception at the end: the poll said a message is there
            try:
                frames.append(recv_frames(sock, _NOBLOCK))
            except zmq.Again:
                break
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break
        return frames

    def _call_many(self, socks: dict[int, Any], calls: list[Call], timeout: float) -> list[Result]:
        results: list[Result | None] = [None] * len(calls)
        waiting: dict[int, int] = {}  # rid -> call position
        targets: dict[Any, int] = {}  # what the poller reports -> target
        poller = zmq.Poller()
        start = time.monotonic()
        deadline = start + timeout
        for i, c in enumerate(calls):
            if self.liveness.known_dead(c.target):
                results[i] = self.died(c.target)
                continue
            rid = next_rid()
            sock = self._send(socks, c, rid, deadline)
            if isinstance(sock, BaseException):
                results[i] = sock
                if c.target not in socks:  # its connection was dropped: so were earlier calls on it
                    self._forget(poller, targets, waiting, calls, results, c.target, sock)
                continue
            waiting[rid] = i
            handle = _handle(sock)
            if handle not in targets:
                targets[handle] = c.target
                poller.register(handle, _POLLIN)
        next_probe = start + PROBE_S
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_probe:
                next_probe = now + PROBE_S
                self._fail_dead(socks, poller, calls, waiting, results)
                continue
            for handle, _ in poller.poll(max(1, int((min(deadline, next_probe) - now) * 1000))):
                target = targets.get(handle)
                if target is None:  # forgotten earlier in this pass
                    continue
                sock = socks.get(target)
                if sock is None:  # dropped in this pass (its calls were failed then)
                    self._forget(poller, targets, waiting, calls, results, target, None)
                    continue
                try:
                    messages = self._receive(socks, target, sock, start)
                except ShardUnavailableError as exc:
                    self._forget(poller, targets, waiting, calls, results, target, exc)
                    continue
                for frames in messages:
                    rid, result = decode_result(frames)
                    i = waiting.pop(rid, None)
                    if i is not None:  # else: a late reply to a request that already timed out
                        results[i] = result
        for i in waiting.values():
            results[i] = self.unavailable(calls[i].target, timeout)
            self._drop(socks, poller, calls[i].target)  # drop what is queued for it
        return results  # type: ignore[return-value]

    def _call_one(self, socks: dict[int, zmq.Socket], c: Call, timeout: float) -> Result:
        """``_call_many`` of one call (most operations' every step), with no poller object: one socket
        polled directly, and no socket query at all once the reply is in."""
        if self.liveness.known_dead(c.target):
            return self.died(c.target)
        start = time.monotonic()
        deadline = start + timeout
        rid = next_rid()
        sock = self._send(socks, c, rid, deadline)
        if isinstance(sock, BaseException):
            return sock
        unix = type(sock) is _unix.Conn
        items = [(sock, _POLLIN)]
        next_probe = start + PROBE_S
        now = time.monotonic()
        while now < deadline:
            if now >= next_probe:
                next_probe = now + PROBE_S
                if self.liveness.dead(c.target):
                    self._drop(socks, None, c.target)
                    return self.died(c.target)
            wait_ms = max(1, int((min(deadline, next_probe) - now) * 1000))
            if sock.wait(wait_ms) if unix else _poll(items, wait_ms):
                if unix:
                    try:
                        messages = self._receive(socks, c.target, sock, start)
                    except ShardUnavailableError as exc:  # the connection closed
                        return exc
                else:
                    try:
                        messages = [recv_frames(sock, _NOBLOCK)]
                    except zmq.Again:
                        messages = []
                for frames in messages:
                    got, result = decode_result(frames)
                    if got == rid:
                        return result
                    # else: a late reply to a request that already timed out; keep waiting for ours
            now = time.monotonic()
        self._drop(socks, None, c.target)  # drop what is queued for it
        return self.unavailable(c.target, timeout)

    @staticmethod
    def _forget(
        poller: zmq.Poller,
        targets: dict,
        waiting: dict,
        calls: list[Call],
        results: list,
        target: int,
        exc: Any,
    ) -> None:
        """Stop polling ``target``'s dropped socket; its waiting calls end with ``exc`` (if given)."""
        for handle in [h for h, t in targets.items() if t == target]:
            del targets[handle]
            try:
                poller.unregister(handle)
            except KeyError:
                pass
        if exc is not None:
            for rid in [r for r, i in waiting.items() if calls[i].target == target]:
                results[waiting.pop(rid)] = exc

    def _fail_dead(
        self, socks: dict, poller: zmq.Poller, calls: list[Call], waiting: dict, results: list
    ) -> None:
        for target in {calls[i].target for i in waiting.values()}:
            if self.liveness.dead(target):
                for rid in [r for r, i in waiting.items() if calls[i].target == target]:
                    results[waiting.pop(rid)] = self.died(target)
                self._drop(socks, poller, target)

    @staticmethod
    def _drop(socks: dict, poller: zmq.Poller | None, target: int) -> None:
        sock = socks.pop(target, None)
        if sock is not None:
            if poller is not None:
                try:
                    poller.unregister(_handle(sock))
                except KeyError:
                    pass
            close_socket(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for socks in idle:
            for sock in socks.values():
                close_socket(sock)


def _handle(sock: Any) -> Any:
    """What a zmq poller registers and reports for ``sock``: a Unix-lane connection by its fd."""
    return sock.fd if type(sock) is _unix.Conn else sock


def close_socket(sock: Any) -> None:
    """Close a DEALER (dropping what it still queues) or a Unix-lane connection."""
    if type(sock) is _unix.Conn:
        sock.close()
    else:
        sock.close(linger=0)


class _AsyncChannel:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self.futures: dict[int, asyncio.Future] = {}
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            rid, result = decode_result(await self.sock.recv_multipart(copy=False))
            fut = self.futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(result)

    def close(self) -> None:
        self.reader.cancel()
        for fut in self.futures.values():  # wake every call still waiting on this channel
            if not fut.done():
                fut.set_result(None)
        self.futures.clear()
        self.sock.close(linger=0)


class AsyncTransport(_Endpoints):
    """Pipelined request/reply on ``zmq.asyncio``; one channel per target per event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx = zmq.asyncio.Context.instance()
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _channel(self, target: int) -> _AsyncChannel:
        loop = asyncio.get_running_loop()
        chans = self._loops.get(loop)
        if chans is None:
            self._forget_closed_loops()
            chans = self._loops[loop] = {}
        ch = chans.get(target)
        if ch is None:
            ch = chans[target] = _AsyncChannel(self._dealer(self._ctx, target))
        return ch

    def _drop_channel(self, target: int) -> None:
        chans = self._loops.get(asyncio.get_running_loop(), {})
        ch = chans.pop(target, None)
        if ch is not None:
            ch.close()

    def _forget_closed_loops(self) -> None:
        """Close the sockets of event loops that have ended (e.g. after each ``asyncio.run``)."""
        for loop in [lp for lp in list(self._loops.keys()) if lp.is_closed()]:
            for ch in self._loops.pop(loop, {}).values():
                ch.sock.close(linger=0)

    async def _dead(self, target: int) -> bool:
        if self.liveness.known_dead(target):
            return True
        t = self.liveness.targets.get(target)
        if t is not None and t.local:  # a /proc read: cheap enough for the event loop
            return self.liveness.dead(target)
        return await asyncio.to_thread(self.liveness.dead, target)

    async def _call(self, c: Call, timeout: float) -> Result:
        if self.liveness.known_dead(c.target):
            return self.died(c.target)
        if not c.exclusive:
            return await self._exchange(c, timeout, self._channel(c.target), shared=True)
        # A socket of its own, closed however the call ends: a waiting call that is cancelled or
        # times out leaves the index nobody to hand a batch to, so it gives the rows back.
        ch = _AsyncChannel(self._dealer(self._ctx, c.target))
        try:
            return await self._exchange(c, timeout, ch, shared=False)
        finally:
            ch.close()

    async def _exchange(self, c: Call, timeout: float, ch: _AsyncChannel, shared: bool) -> Result:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout
        rid = next_rid()
        fut = loop.create_future()
        ch.futures[rid] = fut
        try:
            frames = _wire.encode_request(rid, c.op, c.body, c.bufs)
            refused = self.too_large(c.target, c.op, frames)
            if refused is not None:
                return refused
            try:  # the send is inside the deadline: a dead peer's full queue must not hang us
                send = ch.sock.send_multipart(frames, copy=not _wire.zero_copy(frames))
                await asyncio.wait_for(send, min(timeout, 3600.0))
            except TimeoutError:
                if shared:
                    self._drop_channel(c.target)
                return self.unavailable(c.target, timeout, " (its send queue stayed full)")
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    return self.unavailable(c.target, timeout)
                try:
                    reply = await asyncio.wait_for(asyncio.shield(fut), min(left, PROBE_S))
                except TimeoutError:
                    if await self._dead(c.target):
                        if shared:
                            self._drop_channel(c.target)
                        return self.died(c.target)
                    continue
                if reply is None:  # the channel was closed under us (its target died, or a send stalled)
                    if self.liveness.known_dead(c.target):
                        return self.died(c.target)
                    return self.unavailable(c.target, loop.time() - start, " (connection reset)")
                return reply
        finally:
            ch.futures.pop(rid, None)

    async def call_many(self, calls: list[Call], timeout: float | None = None) -> list[Result]:
        timeout = self.timeout if timeout is None else timeout
        return list(await asyncio.gather(*(self._call(c, deadline_of([c], timeout)) for c in calls)))

    def close(self) -> None:
        for chans in list(self._loops.values()):
            for ch in chans.values():
                try:
                    ch.close()
                except RuntimeError:  # its loop is already closed
                    pass
        self._loops = weakref.WeakKeyDictionary()


__all__ = ["AsyncTransport", "Endpoint", "SyncTransport", "close_socket", "recv_frames", "send_frames"]
