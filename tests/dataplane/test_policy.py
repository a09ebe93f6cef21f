"""The request policy (``wire.policy``): first without a socket (events and times in, decisions out),
then carried out by the transports on real sockets, against a server that never answers."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from dataplane.errors import ShardUnavailableError
from dataplane.server.router import RequestServer
from dataplane.transport.auth import Credentials
from dataplane.transport.clients import AsyncTransport, SyncTransport
from dataplane.transport.liveness import Liveness, Target, process_start
from dataplane.transport.sockets import Endpoint
from dataplane.wire.policy import DEAD, PROBE_S, TIMED_OUT, GiveUp, Probe, RequestPolicy, poll_ms
from dataplane.wire.requests import Call
from tests.dataplane._ping_core import PingIndex

SHARD, OTHER = 0, 1


def test_a_request_answered_in_time_is_handed_over_and_nothing_is_due() -> None:
    p = RequestPolicy()
    assert p.start(1, SHARD, now=10.0, deadline=40.0) is None
    assert len(p) == 1 and 1 in p
    assert p.wake_at() == 10.0 + PROBE_S  # the first probe comes before the deadline
    assert p.due(10.5) == []
    assert p.reply(1) is True
    assert len(p) == 0 and p.wake_at() == math.inf and p.due(100.0) == []


def test_a_request_past_its_deadline_gives_up_with_its_whole_allowance() -> None:
    p = RequestPolicy()
    p.start(1, SHARD, now=10.0, deadline=10.5)
    assert p.wake_at() == 10.5  # the deadline before the probe
    assert p.due(10.4) == []
    assert p.due(10.5) == [GiveUp(1, SHARD, TIMED_OUT, 0.5)]
    assert len(p) == 0


def test_a_reply_after_the_deadline_is_dropped_as_late() -> None:
    p = RequestPolicy()
    p.start(1, SHARD, now=0.0, deadline=0.5)
    p.start(2, SHARD, now=0.0, deadline=5.0)
    assert p.due(0.6) == [GiveUp(1, SHARD, TIMED_OUT, 0.5)]
    assert p.reply(1) is False  # late: drop it, keep waiting for the others
    assert p.reply(2) is True
    assert p.reply(2) is False  # a second reply to the same id is no one's
    assert p.reply(99) is False  # never ours


def test_a_silent_peer_is_probed_then_declared_dead() -> None:
    p = RequestPolicy()
    p.start(1, SHARD, now=0.0, deadline=30.0)
    p.start(2, SHARD, now=0.0, deadline=30.0)
    p.start(3, OTHER, now=0.0, deadline=30.0)
    assert p.due(0.9) == []
    # Each silent peer is probed once, however many of its requests wait.
    assert p.due(PROBE_S) == [Probe(SHARD), Probe(OTHER)]
    assert p.probed(OTHER, dead=False, now=1.2) == []
    ended = p.probed(SHARD, dead=True, now=1.5)
    assert ended == [GiveUp(1, SHARD, DEAD, 1.5), GiveUp(2, SHARD, DEAD, 1.5)]
    assert len(p) == 1 and 3 in p
    # A later request to it is refused up front; the living peer is still waited for.
    assert p.refuses(SHARD) and not p.refuses(OTHER)
    assert p.start(4, SHARD, now=2.0, deadline=30.0) == GiveUp(4, SHARD, DEAD, 0.0)
    assert 4 not in p
    assert p.reply(1) is False  # a reply from the dead (or a reused address) is dropped


def test_a_live_but_slow_peer_is_probed_again_and_waited_for_until_the_deadline() -> None:
    p = RequestPolicy(probe_s=1.0)
    p.start(1, SHARD, now=0.0, deadline=2.5)
    assert p.due(1.0) == [Probe(SHARD)]
    assert p.probed(SHARD, dead=False, now=1.25) == []  # (the next probe counts from its answer)
    assert p.wake_at() == 2.25
    assert p.due(2.0) == []
    assert p.due(2.25) == [Probe(SHARD)]
    assert p.probed(SHARD, dead=False, now=2.3) == []
    assert p.wake_at() == 2.5
    assert p.due(2.5) == [GiveUp(1, SHARD, TIMED_OUT, 2.5)]


def test_a_request_with_no_deadline_is_ended_only_by_its_peers_death() -> None:
    p = RequestPolicy()
    p.start(1, SHARD, now=0.0, deadline=math.inf)
    for t in range(1, 50):
        assert p.due(float(t)) == [Probe(SHARD)]
        assert p.probed(SHARD, dead=False, now=float(t)) == []
    assert p.wake_at() == 50.0
    assert p.due(50.0) == [Probe(SHARD)]
    assert p.probed(SHARD, dead=True, now=50.0) == [GiveUp(1, SHARD, DEAD, 50.0)]


def test_a_peer_known_dead_elsewhere_is_refused_before_anything_is_sent() -> None:
    known: set[int] = set()  # the process's view (``Liveness.known``): another call found it dead
    p = RequestPolicy(known)
    assert p.start(1, SHARD, now=0.0, deadline=1.0) is None
    known.add(SHARD)
    assert p.refuses(SHARD)
    assert p.start(2, SHARD, now=0.0, deadline=1.0) == GiveUp(2, SHARD, DEAD, 0.0)
    assert 2 not in p and 1 in p  # what was already sent is left to its probe or deadline


def test_a_cancelled_request_is_forgotten_and_its_reply_dropped() -> None:
    p = RequestPolicy()
    p.start(7, SHARD, now=0.0, deadline=1.0)
    p.start(8, SHARD, now=0.0, deadline=1.0)
    p.cancel(7)  # its caller was cancelled, or its send failed
    p.cancel(7)  # (twice: no harm)
    assert 7 not in p
    assert p.reply(7) is False
    assert p.due(1.0) == [GiveUp(8, SHARD, TIMED_OUT, 1.0)]  # no decision about 7 ever again


def test_a_lost_connection_ends_exactly_the_requests_it_carried() -> None:
    p = RequestPolicy()
    p.start(1, SHARD, now=0.0, deadline=9.0)
    p.start(2, OTHER, now=0.0, deadline=9.0)
    p.start(3, SHARD, now=0.0, deadline=9.0)
    assert p.lost(SHARD) == [1, 3]
    assert p.lost(SHARD) == []
    assert p.reply(3) is False and p.reply(2) is True
    assert not p.refuses(SHARD)  # closed is not dead: a new connection may be tried


def test_deadlines_and_probes_are_per_request() -> None:
    p = RequestPolicy(probe_s=1.0)
    p.start(1, SHARD, now=0.0, deadline=5.0)
    p.start(2, SHARD, now=0.8, deadline=1.5)
    assert p.wake_at() == 1.0
    assert p.due(1.0) == [Probe(SHARD)]
    assert p.probed(SHARD, dead=False, now=1.0) == []
    assert p.wake_at() == 1.5
    assert p.due(1.5) == [GiveUp(2, SHARD, TIMED_OUT, 0.7)]
    assert p.wake_at() == 2.0


def test_poll_ms_is_whole_milliseconds_never_zero_and_bounded() -> None:
    assert poll_ms(0.0) == 1
    assert poll_ms(-1.0) == 1
    assert poll_ms(0.0101) == 11
    assert poll_ms(0.25, cap_ms=100) == 100
    assert poll_ms(math.inf) == 3_600_000
    assert poll_ms(math.nan, cap_ms=100) == 100


# ---- its drivers: the transports carry its decisions out on real sockets ---------------------------


class _Silent(RequestServer):
    """Never answers a ``stats`` request (a peer that hangs), or with ``late`` set, answers it once
    ``release`` is set (a peer slower than its caller's deadline); counts the requests that reach it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reached = 0
        self.late = False
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def serve(self, sock: Any, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]) -> Any:
        self.reached += 1
        if op == "stats" and not (self.late and self.release.wait(60)):
            return None
        return super().serve(sock, ident, rid, op, body, bufs)


@pytest.fixture
def silent() -> Iterator[tuple[_Silent, Credentials]]:
    creds = Credentials.new(encrypt=False)
    server = _Silent(PingIndex(), "127.0.0.1", f"policy-{uuid.uuid4().hex[:6]}", creds).start()
    try:
        yield server, creds
    finally:
        server.stop()


def _dying_peer() -> tuple[Liveness, Any]:
    """A liveness over a target whose process runs now (so its /proc entry is recognised), and the
    function that ends it (and reaps it): a probe after that finds it dead."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    liveness = Liveness({0: Target("policy-peer", proc.pid, process_start(proc.pid), True)})
    assert liveness.targets[0].local
    return liveness, lambda: proc.communicate(b"", timeout=60)


def _endpoints(server: _Silent, lane: bool) -> dict[int, Endpoint]:
    return {0: Endpoint(server.ipc, server.name, False, server.unix if lane else None)}


@pytest.mark.parametrize("lane", [True, False], ids=["unix-lane", "zmq"])
def test_the_blocking_transport_fails_a_silent_dead_peer_then_refuses_it_unsent(silent, lane) -> None:
    server, creds = silent
    liveness, end = _dying_peer()
    t = SyncTransport(_endpoints(server, lane), creds.for_clients(), 60.0, liveness)
    end()
    try:
        (first,) = t.call_many([Call(0, "stats", {})])  # silent: probed after PROBE_S, found dead
        assert isinstance(first, ShardUnavailableError) and "is dead" in str(first), first
        reached = server.reached
        assert reached == 1
        results = t.call_many([Call(0, "ping", {}), Call(0, "ping", {})])
        assert all(isinstance(r, ShardUnavailableError) and "is dead" in str(r) for r in results), results
        assert server.reached == reached, "a request to a peer known dead was sent"
    finally:
        t.close()


def test_the_asyncio_transport_fails_a_silent_dead_peer_then_refuses_it_unsent(silent) -> None:
    server, creds = silent
    liveness, end = _dying_peer()
    t = AsyncTransport(_endpoints(server, True), creds.for_clients(), 60.0, liveness)
    end()

    async def calls() -> tuple[list[Any], list[Any]]:
        first = await t.call_many([Call(0, "stats", {})])
        return first, await t.call_many([Call(0, "ping", {})])

    try:
        (first,), (second,) = asyncio.run(calls())
    finally:
        t.close()
    assert isinstance(first, ShardUnavailableError) and "is dead" in str(first), first
    assert isinstance(second, ShardUnavailableError) and "is dead" in str(second), second
    assert server.reached == 1, "a request to a peer known dead was sent"


def test_the_asyncio_transport_drops_the_late_reply_of_a_call_that_gave_up(silent) -> None:
    """A call gives up on a slow peer; its reply, arriving later on the shared connection, is not
    taken for the next call's. (The blocking transport closes a connection whose call gave up, so no
    late reply reaches it.)"""
    server, creds = silent
    server.late = True
    me = Target("policy-peer", os.getpid(), process_start(os.getpid()), True)  # alive: never "dead"
    t = AsyncTransport(_endpoints(server, False), creds.for_clients(), 0.2, Liveness({0: me}))

    async def calls() -> tuple[list[Any], list[Any]]:
        gave_up = await t.call_many([Call(0, "stats", {})])
        server.release.set()  # its reply now comes, after the call gave up
        return gave_up, await t.call_many([Call(0, "ping", {})], timeout=60.0)

    try:
        (gave_up,), pinged = asyncio.run(calls())
    finally:
        t.close()
    assert isinstance(gave_up, ShardUnavailableError) and "did not answer within 0.2s" in str(gave_up)
    ((body, bufs),) = pinged  # the ping's own reply, not the late one
    assert msgspec.msgpack.decode(body) == {} and bufs == []
    assert server.reached == 2
