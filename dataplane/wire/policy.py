"""When a request to a store actor ends: its deadline, the probe of a silent peer, a late reply, a dead peer.

``RequestPolicy`` decides and does nothing else (sans-IO, in the manner of h11): its driver tells it
what happened (a request is about to go, a reply arrived, the clock reads ``now``, a probe answered)
and it answers with what to do next:

* ``start`` a request: ``GiveUp`` (reason ``DEAD``) when its peer is known dead, so nothing is sent
  to it; else the request is waited for until its deadline.
* ``reply`` to a request id: True when it is one the driver waits for (hand it over), False when it
  is late or unknown (its request gave up, was cancelled, or was never ours): drop it.
* ``wake_at``: the time the next decision is due; the driver waits for replies until then.
* ``due(now)``: what is due now: ``GiveUp`` (reason ``TIMED_OUT``) for a request past its deadline,
  ``Probe`` of a peer whose request has been silent for ``probe_s`` (ask whether it died).
* ``probed(peer, dead, now)``: a dead peer's requests all give up (reason ``DEAD``) and later
  requests to it are refused; a live one is probed again ``probe_s`` later, and waited for until
  each request's deadline (busy is not dead).
* ``cancel(rid)`` / ``lost(peer)``: a request the driver abandoned (its send failed, its caller was
  cancelled) or every request on a connection that closed: no longer waited for, and a reply to any
  of them is dropped as late.

Its drivers: the blocking transport (``transport.SyncTransport``, one policy per call of a batch),
the asyncio transport (``transport.AsyncTransport``, one per request) and the shard's link to its
index (``server.shard.actor.ShardServer``, one for the link's life). They differ only in their I/O:
how they wait, how they ask (``transport.liveness``), and the error each decision becomes
(``sockets.Endpoints.give_up``). ``tests/dataplane/test_policy.py`` feeds it events and times.
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import NamedTuple

PROBE_S = 1.0  # a request silent this long makes its driver ask whether its peer died
TIMED_OUT = "timed out"
DEAD = "dead"


class Probe(NamedTuple):
    """Decision: ask whether ``peer`` died (then tell ``RequestPolicy.probed``)."""

    peer: int


class GiveUp(NamedTuple):
    """Decision: request ``rid`` to ``peer`` ends with an error: its peer is ``DEAD``, or it
    ``TIMED_OUT`` after ``waited`` seconds (its whole allowance)."""

    rid: int
    peer: int
    reason: str
    waited: float


class _Waiting:
    __slots__ = ("deadline", "peer", "probe_at", "started")

    def __init__(self, peer: int, started: float, deadline: float, probe_at: float) -> None:
        self.peer = peer
        self.started = started
        self.deadline = deadline
        self.probe_at = probe_at


class RequestPolicy:
    """The requests one driver waits for, and what to do about them (see the module docstring).

    Not thread-safe: one driver owns it. ``dead`` is a live view of the peers known dead process-wide
    (``Liveness.known``); a peer this policy was told is dead is refused too.
    """

    __slots__ = ("_dead", "_died", "_waiting", "probe_s")

    def __init__(self, dead: Container[int] = frozenset(), probe_s: float = PROBE_S) -> None:
        self.probe_s = probe_s
        self._dead = dead
        self._died: set[int] = set()
        self._waiting: dict[int, _Waiting] = {}

    def __len__(self) -> int:
        """How many requests are waited for."""
        return len(self._waiting)

    def __contains__(self, rid: object) -> bool:
        return rid in self._waiting

    def refuses(self, peer: int) -> bool:
        """Whether ``peer`` is known dead (a request to it is not sent)."""
        return peer in self._died or peer in self._dead

    def start(self, rid: int, peer: int, now: float, deadline: float) -> GiveUp | None:
        """Request ``rid`` to ``peer`` is about to be sent (its send, too, must end by ``deadline``):
        None, and it is waited for; or ``GiveUp`` when its peer is known dead (do not send it)."""
        if peer in self._died or peer in self._dead:
            return GiveUp(rid, peer, DEAD, 0.0)
        self._waiting[rid] = _Waiting(peer, now, deadline, now + self.probe_s)
        return None

    def reply(self, rid: int) -> bool:
        """A reply to ``rid`` arrived: True to hand it over, False to drop it (late or not ours)."""
        return self._waiting.pop(rid, None) is not None

    def cancel(self, rid: int) -> None:
        """Request ``rid`` ends without its reply: a reply to it that comes anyway is dropped."""
        self._waiting.pop(rid, None)

    def lost(self, peer: int) -> list[int]:
        """The connection to ``peer`` closed: the requests it carried, no longer waited for."""
        rids = [rid for rid, w in self._waiting.items() if w.peer == peer]
        for rid in rids:
            del self._waiting[rid]
        return rids

    def wake_at(self) -> float:
        """When the next decision is due (``math.inf`` when nothing is waited for)."""
        if len(self._waiting) == 1:  # (most calls: no generator)
            for w in self._waiting.values():
                return w.deadline if w.deadline < w.probe_at else w.probe_at
        return min((min(w.deadline, w.probe_at) for w in self._waiting.values()), default=math.inf)

    def due(self, now: float) -> list[Probe | GiveUp]:
        """What is due at ``now``: requests past their deadline give up (and are forgotten), and each
        peer with a request silent since its probe time is to be probed (once per peer)."""
        decisions: list[Probe | GiveUp] = []
        probing: set[int] = set()
        for rid, w in list(self._waiting.items()):
            if now >= w.deadline:
                del self._waiting[rid]
                decisions.append(GiveUp(rid, w.peer, TIMED_OUT, w.deadline - w.started))
            elif now >= w.probe_at and w.peer not in probing:
                probing.add(w.peer)
                decisions.append(Probe(w.peer))
        return decisions

    def probed(self, peer: int, dead: bool, now: float) -> list[GiveUp]:
        """A probe of ``peer`` answered at ``now``: if it is dead, every request to it gives up (and
        later ones are refused); if alive, its requests are probed again ``probe_s`` from now."""
        if dead:
            self._died.add(peer)
            return [GiveUp(rid, peer, DEAD, now - self._waiting.pop(rid).started) for rid in self._of(peer)]
        for rid in self._of(peer):
            self._waiting[rid].probe_at = now + self.probe_s
        return []

    def _of(self, peer: int) -> list[int]:
        return [rid for rid, w in self._waiting.items() if w.peer == peer]


def poll_ms(seconds: float, cap_ms: int | None = None) -> int:
    """A poll timeout in whole milliseconds for a wait of ``seconds``: at least 1 (a wait that is due
    now still lets a ready socket be seen; 0 would spin), at most ``cap_ms`` when given; an infinite
    or ``nan`` wait is ``cap_ms`` (or an hour)."""
    limit = 3_600_000 if cap_ms is None else cap_ms
    if not seconds * 1000 < limit:  # (inf and nan end here, never in an integer conversion)
        return limit
    return max(1, math.ceil(seconds * 1000))


__all__ = ["DEAD", "PROBE_S", "TIMED_OUT", "GiveUp", "Probe", "RequestPolicy", "poll_ms"]
