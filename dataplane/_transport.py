"""Client transports: send a batch of requests to shards / the index and collect the replies by id.

``SyncTransport`` uses blocking DEALER sockets (one set per thread, since zmq sockets are not
thread-safe) and a poller with a deadline: no event-loop thread, so a round trip costs only the
sockets. ``AsyncTransport`` uses ``zmq.asyncio`` with one reader task per socket that resolves
futures by request id, so many coroutines share one connection (requests are pipelined).

Both return, per call, either ``(body, buffers)`` or the exception the call ended with: a
rebuilt remote error, or ``ShardUnavailableError`` naming the target when no reply came before the
deadline. Replies to requests that already timed out are recognised by id and dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from dataplane import _wire
from dataplane.errors import ShardUnavailableError

_rids = itertools.count(1)
_rid_lock = threading.Lock()


def next_rid() -> int:
    with _rid_lock:
        return next(_rids)


@dataclass
class Call:
    """One request of an operation step: ``target`` is a shard index, or ``INDEX``."""

    target: int
    op: str
    body: dict[str, Any]
    bufs: list[Any] = field(default_factory=list)


INDEX = -1

Result = tuple[dict[str, Any], list[memoryview]] | BaseException


def _unpack(frames: list[Any]) -> Result:
    rep, bufs = _wire.decode_reply(frames)
    if rep.error is not None:
        return _wire.rebuild_error(rep.error)
    return rep.body, bufs


class _Endpoints:
    def __init__(self, endpoints: dict[int, str], names: dict[int, str], timeout: float) -> None:
        self.endpoints = endpoints
        self.names = names
        self.timeout = timeout

    def unavailable(self, target: int, waited: float, why: str = "") -> ShardUnavailableError:
        name = self.names[target]
        return ShardUnavailableError(
            name,
            f"{name} at {self.endpoints[target]} did not answer within {waited:.1f}s{why}; it may have died "
            "(check `rlplane store status` / the Ray dashboard) or rpc_timeout_s may be too small",
        )


class SyncTransport(_Endpoints):
    """Blocking request/reply over per-thread DEALER sockets."""

    def __init__(self, endpoints: dict[int, str], names: dict[int, str], timeout: float) -> None:
        super().__init__(endpoints, names, timeout)
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._all: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def _socket(self, target: int) -> zmq.Socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.get(target)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints[target])
            socks[target] = sock
            with self._lock:
                self._all.append(sock)
        return sock

    def _reset(self, target: int) -> None:
        sock = self._local.socks.pop(target, None)
        if sock is not None:
            sock.close(linger=0)

    def call_many(self, calls: list[Call], timeout: float | None = None) -> list[Result]:
        timeout = self.timeout if timeout is None else timeout
        results: list[Result | None] = [None] * len(calls)
        waiting: dict[int, int] = {}  # rid -> call position
        by_sock: dict[zmq.Socket, int] = {}
        for i, c in enumerate(calls):
            rid = next_rid()
            sock = self._socket(c.target)
            try:
                sock.send_multipart(
                    _wire.encode_request(rid, c.op, c.body, c.bufs), copy=False, flags=zmq.NOBLOCK
                )
            except zmq.Again:
                results[i] = self.unavailable(c.target, 0.0, " (its send queue is full)")
                continue
            waiting[rid] = i
            by_sock[sock] = by_sock.get(sock, 0) + 1
        poller = zmq.Poller()
        for sock in by_sock:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    i = waiting.pop(_wire.peek_rid(frames[0]), None)
                    if i is not None:  # else: a late reply to a request that already timed out
                        results[i] = _unpack(frames)
        for i in waiting.values():
            results[i] = self.unavailable(calls[i].target, timeout)
            self._reset(calls[i].target)  # drop queued requests to a dead peer
        return results  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            for sock in self._all:
                sock.close(linger=0)
            self._all.clear()
        self._local = threading.local()


class _AsyncChannel:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.futures: dict[int, asyncio.Future] = {}
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            fut = self.futures.pop(_wire.peek_rid(frames[0]), None)
            if fut is not None and not fut.done():
                fut.set_result(frames)

    def close(self) -> None:
        self.reader.cancel()
        self.sock.close(linger=0)


class AsyncTransport(_Endpoints):
    """Pipelined request/reply on ``zmq.asyncio``; one channel per target per event loop."""

    def __init__(self, endpoints: dict[int, str], names: dict[int, str], timeout: float) -> None:
        super().__init__(endpoints, names, timeout)
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
            ch = chans[target] = _AsyncChannel(self._ctx, self.endpoints[target])
        return ch

    def _forget_closed_loops(self) -> None:
        """Close the sockets of event loops that have ended (e.g. after each ``asyncio.run``)."""
        for loop in [lp for lp in list(self._loops.keys()) if lp.is_closed()]:
            for ch in self._loops.pop(loop, {}).values():
                ch.sock.close(linger=0)

    async def _call(self, c: Call, timeout: float) -> Result:
        ch = self._channel(c.target)
        rid = next_rid()
        fut = asyncio.get_running_loop().create_future()
        ch.futures[rid] = fut
        try:
            await ch.sock.send_multipart(_wire.encode_request(rid, c.op, c.body, c.bufs), copy=False)
            frames = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return self.unavailable(c.target, timeout)
        finally:
            ch.futures.pop(rid, None)
        return _unpack(frames)

    async def call_many(self, calls: list[Call], timeout: float | None = None) -> list[Result]:
        timeout = self.timeout if timeout is None else timeout
        return list(await asyncio.gather(*(self._call(c, timeout) for c in calls)))

    def close(self) -> None:
        for chans in list(self._loops.values()):
            for ch in chans.values():
                try:
                    ch.close()
                except RuntimeError:  # its loop is already closed
                    pass
        self._loops = weakref.WeakKeyDictionary()


__all__ = ["INDEX", "AsyncTransport", "Call", "SyncTransport", "next_rid"]
