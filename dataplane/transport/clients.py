"""Client transports: send a batch of requests to shards / the index and collect the replies by id.

What they carry (``Call``, ``Result``, ``INDEX``) and how a reply is decoded are in ``requests``,
which knows nothing of zmq: the operations that yield calls never import this module.

``SyncTransport`` uses blocking DEALER sockets and a poller with a deadline: no event-loop thread,
so a round trip costs only the sockets; to a target on this host it uses the Unix lane instead
(``transport.unix``: the same frames, without zmq's I/O threads, so a small request costs a fifth of
the CPU). Its sockets live in a small pool of per-call sets (zmq
sockets are not thread-safe, so a call owns its set while it runs): a process keeps at most
``MAX_IDLE_SETS`` sets however many threads ever called the store. ``AsyncTransport`` uses
``zmq.asyncio`` with one reader task per socket that resolves futures by request id, so many
coroutines share one connection (requests are pipelined).

Both return, per call, either ``(body, buffers)`` or the exception the call ended with: a rebuilt
remote error, or ``ShardUnavailableError`` naming the target. When a call ends is decided by
``wire.policy.RequestPolicy`` (the deadline, the probe of a target silent for ``PROBE_S`` through
``transport.liveness``, a dead target's calls failed at once and later ones not even sent, late replies
dropped); the transports only carry its decisions out. Sends are inside the deadline too, and a
socket that timed out is closed, so nothing queued for a dead peer lingers.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any

import zmq
import zmq.asyncio

from dataplane.errors import ShardUnavailableError, WireError
from dataplane.transport import engine as _engine
from dataplane.transport import unix as _unix
from dataplane.transport.sockets import (
    EVENTS,
    NOBLOCK,
    POLLIN,
    Connection,
    Endpoints,
    close_socket,
    recv_frames,
    send_frames,
)
from dataplane.wire import bulk as _bulk
from dataplane.wire import frames as _wire
from dataplane.wire.policy import DEAD, GiveUp, Probe, RequestPolicy, poll_ms
from dataplane.wire.requests import Call, Result, deadline_of, decode_result, next_rid

_forks = [0]  # bumped in a forked child: the sockets it inherited are its parent's, never to be used
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))
MAX_IDLE_SETS = 8
_poll = zmq.zmq_poll


class SyncTransport(Endpoints):
    """Blocking request/reply over DEALER sockets (Unix-lane connections to a target that has one)
    from a small pool of per-call socket sets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, lane=True, **kwargs)
        self._ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
        self._idle: list[dict[int, Connection]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._forks = _forks[0]
        self._lent = threading.local()  # .tickets: what this thread's call set wrote through the engine

    def _checkout(self) -> dict[int, Connection]:
        with self._lock:
            if self._forks != _forks[0]:  # a forked child: its parent's connections stay its parent's
                for socks in self._idle:  # (closing a copy of a Unix-lane socket leaves the parent's
                    for sock in socks.values():  # open; zmq sockets must not even be closed here)
                        if type(sock) is _unix.Conn:
                            sock.close()
                self._forks, self._idle = _forks[0], []
            return self._idle.pop() if self._idle else {}

    def _checkin(self, socks: dict[int, Connection]) -> None:
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
        lent: list[int] = []
        self._lent.tickets = lent
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
        finally:
            if lent and self.engine is not None:  # every request of the set answered or given up
                self.engine.release(lent)
        self._checkin(socks)
        return results

    def _socket(self, socks: dict[int, Any], target: int, deadline: float) -> Any:
        """The call set's socket to ``target``: a Unix-lane connection when it has one, else a DEALER."""
        sock = socks.get(target)
        if sock is None:
            # (a call that may wait for ever still connects within an hour, or fails)
            wait = min(max(0.0, deadline - time.monotonic()), 3600.0)
            sock = socks[target] = self.connect(self._ctx, target, wait)
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
        there = self.endpoints[c.target].engine
        if there is not None and self.engine is not None:
            try:
                frames, lent = _engine.offload(
                    self.engine, there, frames, self.engine_min_bytes, _engine.capped(deadline)
                )
                self._lent.tickets.extend(lent)
            except (OSError, WireError) as exc:
                waited = time.monotonic() - started
                return self.unavailable(c.target, waited, f" (its transfer engine at {there}: {exc})")
        try:
            send_frames(sock, frames, NOBLOCK)
        except zmq.Again:
            return self.unavailable(c.target, 0.0, " (its send queue is full)")
        return sock

    def _receive(
        self, socks: dict[int, Any], target: int, sock: Any, started: float, deadline: float
    ) -> list[Any]:
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
                frames.append(self._restored(target, recv_frames(sock, NOBLOCK), started, deadline))
            except zmq.Again:
                break
            if not sock.getsockopt(EVENTS) & POLLIN:
                break
        return frames

    def _restored(self, target: int, frames: list[Any], started: float, deadline: float) -> list[Any]:
        """A reply's frames with the buffers its manifest names read through the engine (the frames
        as they are when it has none), within the call's ``deadline``; ``ShardUnavailableError`` when
        they cannot be read."""
        if self.engine is None or not _bulk.is_manifest(frames[0]):
            return frames
        there = self.endpoints[target].engine
        try:
            if there is None:
                raise WireError("a reply names a transfer engine this target does not run")
            limit = _engine.capped(deadline)
            return _engine.restore(self.engine, there, frames, self.max_message_bytes, limit)
        except (OSError, WireError) as exc:
            waited = time.monotonic() - started
            raise self.unavailable(target, waited, f" (its reply's buffers did not arrive: {exc})") from None

    def _call_many(self, socks: dict[int, Any], calls: list[Call], timeout: float) -> list[Result]:
        results: list[Result | None] = [None] * len(calls)
        at: dict[int, int] = {}  # rid -> call position
        targets: dict[Any, int] = {}  # what the poller reports -> target
        poller = zmq.Poller()
        policy = RequestPolicy(self.liveness.known)
        start = time.monotonic()
        deadline = start + timeout
        for i, c in enumerate(calls):
            rid = next_rid()
            refused = policy.start(rid, c.target, start, deadline)
            if refused is not None:
                results[i] = self.give_up(refused)
                continue
            at[rid] = i
            sock = self._send(socks, c, rid, deadline)
            if isinstance(sock, BaseException):
                policy.cancel(rid)
                results[i] = sock
                if c.target not in socks:  # its connection was dropped: so were earlier calls on it
                    self._forget(poller, targets, policy, at, results, c.target, sock)
                continue
            handle = _handle(sock)
            if handle not in targets:
                targets[handle] = c.target
                poller.register(handle, POLLIN)
        while policy:
            now = time.monotonic()
            wake = policy.wake_at()
            if now >= wake:
                for ended in self._decide(policy, now):
                    results[at[ended.rid]] = self.give_up(ended)
                    self._drop(socks, poller, ended.peer)  # drop what is queued for it
                continue
            for handle, _ in poller.poll(poll_ms(wake - now)):
                target = targets.get(handle)
                if target is None:  # forgotten earlier in this pass
                    continue
                sock = socks.get(target)
                if sock is None:  # dropped in this pass (its calls were failed then)
                    self._forget(poller, targets, policy, at, results, target, None)
                    continue
                try:
                    messages = self._receive(socks, target, sock, start, deadline)
                except ShardUnavailableError as exc:
                    self._forget(poller, targets, policy, at, results, target, exc)
                    continue
                for frames in messages:
                    rid, result = decode_result(frames)
                    if policy.reply(rid):  # else: a late reply to a request that already gave up
                        results[at[rid]] = result
        return results  # type: ignore[return-value]

    def _call_one(self, socks: dict[int, Connection], c: Call, timeout: float) -> Result:
        """``_call_many`` of one call (most operations' every step), with no poller object: one socket
        polled directly, and no socket query at all once the reply is in."""
        policy = RequestPolicy(self.liveness.known)
        start = time.monotonic()
        deadline = start + timeout
        rid = next_rid()
        refused = policy.start(rid, c.target, start, deadline)
        if refused is not None:
            return self.give_up(refused)
        sock = self._send(socks, c, rid, deadline)
        if isinstance(sock, BaseException):
            return sock
        unix = type(sock) is _unix.Conn
        items = [(sock, POLLIN)]
        while True:
            now = time.monotonic()
            wake = policy.wake_at()
            if now >= wake:
                for ended in self._decide(policy, now):  # (of one request: at most one)
                    self._drop(socks, None, c.target)  # drop what is queued for it
                    return self.give_up(ended)
                continue
            wait_ms = poll_ms(wake - now)
            if sock.wait(wait_ms) if unix else _poll(items, wait_ms):
                if unix:
                    try:
                        messages = self._receive(socks, c.target, sock, start, deadline)
                    except ShardUnavailableError as exc:  # the connection closed
                        return exc
                else:
                    try:
                        messages = [self._restored(c.target, recv_frames(sock, NOBLOCK), start, deadline)]
                    except zmq.Again:
                        messages = []
                    except ShardUnavailableError as exc:
                        return exc
                for frames in messages:
                    got, result = decode_result(frames)
                    if policy.reply(got):
                        return result
                    # else: a late reply to a request that already gave up; keep waiting for ours

    def _decide(self, policy: RequestPolicy, now: float) -> list[GiveUp]:
        """Carry out what ``policy`` says is due at ``now``: probe each silent target (``Liveness.dead``,
        blocking); returns the requests that give up."""
        ended: list[GiveUp] = []
        for decision in policy.due(now):
            if isinstance(decision, Probe):
                dead = self.liveness.dead(decision.peer)
                ended += policy.probed(decision.peer, dead, time.monotonic())
            else:
                ended.append(decision)
        return ended

    @staticmethod
    def _forget(
        poller: zmq.Poller,
        targets: dict[Any, int],
        policy: RequestPolicy,
        at: dict[int, int],
        results: list[Result | None],
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
            for rid in policy.lost(target):
                results[at[rid]] = exc

    @staticmethod
    def _drop(socks: dict[int, Connection], poller: zmq.Poller | None, target: int) -> None:
        sock = socks.pop(target, None)
        if sock is not None:
            if poller is not None:
                try:
                    poller.unregister(_handle(sock))
                except KeyError:
                    pass
            close_socket(sock)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for socks in idle:
            for sock in socks.values():
                close_socket(sock)


def _handle(sock: Any) -> Any:
    """What a zmq poller registers and reports for ``sock``: a Unix-lane connection by its fd."""
    return sock.fd if type(sock) is _unix.Conn else sock


class _AsyncChannel:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self.futures: dict[int, asyncio.Future[Result | None]] = {}  # None: the channel was closed
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


class AsyncTransport(Endpoints):
    """Pipelined request/reply on ``zmq.asyncio``; one channel per target per event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx = zmq.asyncio.Context.instance()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, _AsyncChannel]] = (
            weakref.WeakKeyDictionary()
        )

    def _channel(self, target: int) -> _AsyncChannel:
        loop = asyncio.get_running_loop()
        chans = self._loops.get(loop)
        if chans is None:
            self._forget_closed_loops()
            chans = self._loops[loop] = {}
        ch = chans.get(target)
        if ch is None:
            ch = chans[target] = _AsyncChannel(self.dealer(self._ctx, target))
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
        loop = asyncio.get_running_loop()
        policy = RequestPolicy(self.liveness.known)
        rid = next_rid()
        start = loop.time()
        refused = policy.start(rid, c.target, start, start + timeout)
        if refused is not None:
            return self.give_up(refused)
        if not c.exclusive:
            return await self._exchange(c, timeout, policy, rid, self._channel(c.target), shared=True)
        # A socket of its own, closed however the call ends: a waiting call that is cancelled or
        # times out leaves the index nobody to hand a batch to, so it gives the rows back.
        ch = _AsyncChannel(self.dealer(self._ctx, c.target))
        try:
            return await self._exchange(c, timeout, policy, rid, ch, shared=False)
        finally:
            ch.close()

    async def _exchange(
        self, c: Call, timeout: float, policy: RequestPolicy, rid: int, ch: _AsyncChannel, shared: bool
    ) -> Result:
        loop = asyncio.get_running_loop()
        start = loop.time()
        fut: asyncio.Future[Result | None] = loop.create_future()
        ch.futures[rid] = fut  # the channel's reader drops a reply to a request no longer here (late)
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
                now = loop.time()
                wake = policy.wake_at()
                if now < wake:
                    try:
                        reply = await asyncio.wait_for(asyncio.shield(fut), wake - now)
                    except TimeoutError:
                        continue
                    policy.reply(rid)
                    if reply is None:  # the channel was closed under us (its target died, or a send stalled)
                        if self.liveness.known_dead(c.target):
                            return self.died(c.target)
                        return self.unavailable(c.target, loop.time() - start, " (connection reset)")
                    return reply
                for decision in policy.due(now):  # (of one request: a deadline, or a probe)
                    if isinstance(decision, Probe):
                        dead = await self._dead(decision.peer)
                        ended = policy.probed(decision.peer, dead, loop.time())
                        if not ended:
                            continue
                        decision = ended[0]
                    if decision.reason == DEAD and shared:
                        self._drop_channel(c.target)
                    return self.give_up(decision)
        finally:
            ch.futures.pop(rid, None)
            policy.cancel(rid)  # (cancelled while waiting: gone from both)

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


__all__ = ["AsyncTransport", "SyncTransport"]
