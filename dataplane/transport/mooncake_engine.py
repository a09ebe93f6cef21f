"""The mooncake transfer engine: large buffers moved by Mooncake's Transfer Engine (one-sided reads;
RDMA where the NICs support it, its own TCP transport elsewhere).

Every move is a pull by the side that needs the bytes, from memory the other side registered:

* a reply's buffer: the shard stages it as a *hold* (``stage``: its ticket names the hold, the
  manifest also says where the bytes are, ``wire.bulk.Ref.at``) and the client reads it into a warm
  buffer it registers for the read (``read``), then names the hold in the manifest of its next
  request to that shard (``done``), which releases that hold alone (two holds of one region share
  its address, never a ticket); a hold no client releases ends after ``ttl_s``;
* rows lent from a shard's shared memory (``lends``: a get's run of one segment, pinned until its
  hold ends, ``ShardCore.take_lent``) are staged where they are: the segment's whole mapping is
  registered the first time a reply lends from it and stays registered while the segment holds
  rows, however many replies lend from it; the shard's pool tells the engine before the segment's
  memory is reused or closed (``forget``, ``ShmPool.on_free``), and it is unregistered then. A
  segment a hold of which expired unreported (its reader may still be reading) is closed when
  freed, never reused, and its mapping is kept one more ttl after it is unregistered. Registered
  segments are bounded (``DATAPLANE_MOONCAKE_REGISTERED_BYTES``, idle ones unregistered oldest
  first to make room); a view that cannot be registered (past the bound, refused by Mooncake, not a
  segment's mapping) is staged as a copy and its rows given back at once;
* rows in a pooled buffer (``codec.buffers``: where a put from another host lands) are staged
  where they are too: the whole buffer is registered the first time a reply stages from it or a
  request is read into it, and stays registered until the pool lets it go (``buffers.on_drop``),
  within the same bound; a hold keeps its view, so the buffer is not pooled again while it is read;
  a hold that expires unreported unregisters the buffer with its last hold;
* any other reply buffer (rows the shard gathered, small ones) is registered as it is, or a copy of
  it when its memory overlaps a region registered with another size; its registration ends with its
  last hold, or earlier, oldest first, when such staged bytes pass twice the largest buffer the
  shard takes;
* a request's buffer: the client registers it (``write``) and the manifest names the client's
  engine address (``origin``); the shard reads it (``take``), and the client releases it once its
  call set is answered (``release``).

Every read has a deadline (the call's; a shard's ``take``: its ttl), which Mooncake's own API does
not give: a read is submitted and polled, and the first from a peer runs on a thread of its own,
as its handshake blocks the submitting thread (``_Reader``).

Each process runs one engine in Mooncake's peer-to-peer mode (no metadata server: a peer's address
is its host and the port of its engine's handshake listener), on the transport that
``DATAPLANE_MOONCAKE_PROTOCOL`` names ("tcp" by default; "rdma" on an RDMA NIC, with
``DATAPLANE_MOONCAKE_DEVICE`` naming it). Mooncake authenticates no peer: any process that reaches
the engine's ports can read what is registered while it is, so run it only on a trusted network
(the native engine proves the store's secret on every connection).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane import config
from dataplane.codec import buffers as _buffers
from dataplane.errors import EngineUnavailableError, WireError
from dataplane.transport.shm import mapping_of

logger = logging.getLogger(__name__)

Pin = Callable[[], None]  # what lets go of memory registered for a read

MAX_FIRST_READS = 64  # first reads from Mooncake peers under way at once per process (``_Reader``)
_FIRST_READS = threading.BoundedSemaphore(MAX_FIRST_READS)
POLL_SPINS = 20  # a read's status looked at this often, yielding the interpreter between, before sleeps
POLL_FIRST_S = 50e-6  # then sleeps, doubling from this
POLL_MAX_S = 1e-3  # up to this


def _new_engine(host_ip: str) -> tuple[Any, str]:
    """A Mooncake engine listening on ``host_ip`` and its peer address."""
    from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]

    protocol, device = config.env_mooncake()
    engine = TransferEngine()
    rc = engine.initialize(host_ip, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise EngineUnavailableError(
            f"Mooncake's Transfer Engine did not start on {host_ip} over {protocol!r} (code {rc}): "
            "check DATAPLANE_MOONCAKE_PROTOCOL / DATAPLANE_MOONCAKE_DEVICE"
        )
    return engine, f"{host_ip}:{engine.get_rpc_port()}"


def _address_of(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


@dataclass
class _Region:
    """Memory registered with the engine: the buffer it keeps alive and how many hold it."""

    buf: Any
    size: int
    holders: int = 1


class _Registry:
    """A client's registered regions (a put's buffers) by address, counted (one buffer may be lent
    twice). Thread-safe."""

    def __init__(self, engine: Any, who: str) -> None:
        self._engine = engine
        self._who = who
        self._lock = threading.Lock()
        self.regions: dict[int, _Region] = {}

    def hold(self, buf: Any) -> int:
        """Register ``buf`` (or a copy, when its memory cannot be: it overlaps a region registered
        with another size); returns the address a peer reads it at."""
        view = memoryview(buf).cast("B")
        addr = _address_of(view)
        with self._lock:
            r = self.regions.get(addr)
            if r is not None and r.size == view.nbytes:
                r.holders += 1
                return addr
            if r is None and self._engine.register_memory(addr, view.nbytes) == 0:
                self.regions[addr] = _Region(view, view.nbytes)
                return addr
        addr, copy = _registered_copy(self._engine, view, self._who)
        with self._lock:
            self.regions[addr] = _Region(copy, copy.nbytes)
        return addr

    def drop(self, addr: int) -> None:
        with self._lock:
            r = self.regions.get(addr)
            if r is None:
                return
            r.holders -= 1
            if r.holders <= 0:
                del self.regions[addr]
                self._engine.unregister_memory(addr)

    def clear(self) -> None:
        with self._lock:
            regions, self.regions = self.regions, {}
        for addr in regions:
            self._engine.unregister_memory(addr)


def _registered_copy(engine: Any, view: memoryview, who: str) -> tuple[int, Any]:
    """A copy of ``view`` in a warm buffer, registered with ``engine``: its address and the buffer."""
    out = _buffers.take(view.nbytes).data
    out[:] = view
    addr = _address_of(out)
    if engine.register_memory(addr, out.nbytes) != 0:
        raise WireError(f"{who}: Mooncake's engine refused to register {out.nbytes} bytes")
    return addr, out


def _register_for_read(engine: Any, out: memoryview) -> Pin | None:
    """``out`` registered with ``engine`` for one read; what unregisters it (None: refused)."""
    addr = _address_of(out)
    if engine.register_memory(addr, out.nbytes) != 0:
        return None
    return lambda: engine.unregister_memory(addr)


class _Reader:
    """Reads from peers' registered memory into warm buffers, each by a deadline
    (``time.monotonic()``) or ``TimeoutError``. Mooncake gives a read no deadline of its own: a peer
    that accepts its connection and stays silent holds the submitting thread a minute in the
    handshake, and a transfer times out after ``MC_TRANSFER_TIMEOUT`` (30 s by default).

    So a read is submitted and its status polled up to the deadline; the first read from a peer
    (its handshake) runs on a thread of its own, waited for up to the deadline (at most
    ``MAX_FIRST_READS`` of those under way per process). A read given up keeps its buffer
    registered and alive until the engine reports it ended (looked at before each later read)."""

    def __init__(
        self, engine: Any, who: str, max_bytes: int, pin: Callable[[memoryview], Pin | None] | None = None
    ) -> None:
        self._engine = engine
        self._who = who
        self._max = max_bytes
        self._pin = pin or (lambda out: _register_for_read(engine, out))
        self._met: set[str] = set()  # peers a read from which ended well: their handshake is done
        self._lock = threading.Lock()
        self._given_up: list[tuple[int, Pin, Any]] = []  # (batch id, its unpin, buffer) still in flight

    def read(self, peer: str, ticket: int, size: int, deadline: float) -> memoryview:
        """``size`` bytes of ``peer``'s registered memory at ``ticket``."""
        who = self._who
        if self._max >= 0 and size > self._max:
            raise WireError(f"{who}: a buffer of {size} bytes is declared (at most {self._max})")
        self._reap()
        out = _buffers.take_faulted(size).data  # (filled by the engine's own threads)
        addr = _address_of(out)
        if peer not in self._met:
            return self._first(peer, ticket, size, deadline, out, addr)
        unpin = self._pin(out)
        if unpin is None:
            raise WireError(f"{who}: Mooncake's engine refused to register {size} bytes")
        batch = self._engine.batch_transfer_async_read(peer, [addr], [ticket], [size])
        status = -1 if batch == 0 else self._wait(batch, deadline)
        if status == 0:
            with self._lock:
                self._given_up.append((batch, unpin, out))
            raise TimeoutError(self._late(peer, size))
        unpin()
        if status < 0:
            raise WireError(self._failed(peer, size, status))
        return out

    def _wait(self, batch: int, deadline: float) -> int:
        """The batch's status once it ended (1: done, < 0: failed), or 0 at ``deadline``."""
        check, pause = self._engine.transfer_check_status, POLL_FIRST_S
        for _ in range(POLL_SPINS):  # (a small read ends within a few scheduler turns)
            status = check(batch)
            if status:
                return int(status)
            time.sleep(0)
        while not (status := check(batch)):
            left = deadline - time.monotonic()
            if left <= 0:
                return 0
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_MAX_S)
        return int(status)

    def _first(
        self, peer: str, ticket: int, size: int, deadline: float, out: memoryview, addr: int
    ) -> memoryview:
        """The first read from ``peer``, on a thread of its own (its handshake may block it)."""
        if not _FIRST_READS.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(
                f"{self._who}: {MAX_FIRST_READS} first reads from Mooncake peers are under way"
            )
        unpin = self._pin(out)
        if unpin is None:
            _FIRST_READS.release()
            raise WireError(f"{self._who}: Mooncake's engine refused to register {size} bytes")
        ended = threading.Event()
        rc: list[int] = []

        def run() -> None:
            try:
                rc.append(self._engine.transfer_sync_read(peer, addr, ticket, size))
            finally:  # (after the engine is done with ``out``, whether or not its caller still waits)
                unpin()
                _FIRST_READS.release()
                ended.set()

        threading.Thread(target=run, name="dataplane-mooncake-first-read", daemon=True).start()
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(self._late(peer, size))
        if not rc or rc[0] < 0:
            raise WireError(self._failed(peer, size, rc[0] if rc else None))
        self._met.add(peer)
        return out

    def _reap(self) -> None:
        """Let go of the buffers of reads given up whose transfer has ended since."""
        with self._lock:
            pending, self._given_up = self._given_up, []
        left = []
        for batch, unpin, buf in pending:
            if self._engine.transfer_check_status(batch):
                unpin()
            else:
                left.append((batch, unpin, buf))
        with self._lock:
            self._given_up.extend(left)

    def _late(self, peer: str, size: int) -> str:
        return (
            f"{self._who}: Mooncake's engine did not read {size} bytes from {peer} in time (given up; "
            "the read goes on in the engine until it ends, its buffer kept till then)"
        )

    def _failed(self, peer: str, size: int, code: int | None) -> str:
        return (
            f"{self._who}: Mooncake's engine could not read {size} bytes from {peer} (code {code}: "
            "released, expired, or the peer is gone)"
        )


@dataclass
class _Held:
    """Memory the server registered for readers: what keeps it alive, its size, the holds on it."""

    buf: Any
    size: int
    segment: bool  # a whole mapping (a segment's, a pooled buffer's): not unregistered with its last hold
    holds: int = 0
    pooled: bool = False  # a pooled buffer's: unregistered when the pool lets it go (``_forget_dropped``)
    doomed: bool = False  # a hold of it expired: unregistered with its last hold, as a buffer's
    used: float = field(default_factory=time.monotonic)  # last staged from (idle segments go oldest first)


@dataclass
class _Hold:
    """One staging of a buffer: its region's address, size, when, and what it hands back when it ends."""

    region: int
    size: int
    on_done: Callable[[], None] | None
    born: float = field(default_factory=time.monotonic)
    keep: Any = None  # what the hold keeps alive (a pooled buffer's view: not back in the pool while held)


class MooncakeEngineServer:
    """A shard's end: stages reply buffers for clients to read (lending segments' rows where they
    are), reads request buffers from them. Thread-safe: the loop stages and releases, the shard's
    core (also a checkpoint's Ray call) frees segments (``forget``)."""

    lends = True

    def __init__(
        self,
        host_ip: str,
        *,
        max_bytes: int,
        ttl_s: float,
        name: str,
        max_registered_bytes: int | None = None,
    ) -> None:
        self._engine, self.address = _new_engine(host_ip)
        self._max = max_bytes
        self._reader = _Reader(self._engine, name, max_bytes, self._pin_read)
        self._budget = -1 if max_bytes < 0 else 2 * max_bytes
        self._ttl = ttl_s
        self.name = name
        cap = config.mooncake_registered_bytes() if max_registered_bytes is None else max_registered_bytes
        self._cap = max(0, cap)
        self._lock = threading.Lock()
        self._regions: dict[int, _Held] = {}  # by address
        self._holds: dict[int, _Hold] = {}  # by ticket
        self._ids = itertools.count(1)
        self._tainted: set[int] = set()  # segments a hold of which expired unreported (``forget``)
        self._graves: list[tuple[float, Any]] = []  # (until, mapping): kept mapped past unregistering
        self._segment_bytes = 0
        self._counts = {"registrations": 0, "lent": 0, "pooled": 0, "copied": 0, "registration_failures": 0}
        self._dropped: deque[int] = deque()  # pooled buffers the pool let go of (``_forget_dropped``)
        self._unhook = _buffers.on_drop(self._dropped.append)

    def stage(self, buf: memoryview, on_done: Callable[[], None] | None = None) -> tuple[int, int]:
        """Hold ``buf`` for a client to read: its ticket and address. With ``on_done`` (``buf`` a view
        of a segment, lent) it is called when the hold ends, or at once when ``buf`` had to be copied."""
        view = memoryview(buf).cast("B")
        with self._lock:
            room = -1 if self._budget < 0 else max(0, self._budget - view.nbytes)
            ended = self._expire(time.monotonic(), room)  # (what it stages counts too)
            placed = self._lend(view, on_done) if on_done is not None else None
        _call(ended)
        if placed is not None:
            return placed
        try:
            return self._stage_buffer(view, copy=on_done is not None)
        finally:
            if on_done is not None:  # copied (or failed): nothing reads the segment
                on_done()

    def take(self, ticket: int, size: int, origin: str) -> memoryview:
        if not origin:
            raise WireError(f"{self.name}: a request names a buffer to read but not where from")
        return self._reader.read(origin, ticket, size, time.monotonic() + self._ttl)

    def release(self, tickets: Sequence[int]) -> None:
        """End the holds a client reports read (one it reports twice, or that ended, is skipped)."""
        with self._lock:
            ended = [self._end(t, expired=False) for t in tickets]
        _call(ended)

    def sweep(self) -> None:
        """End the holds past the ttl; let go of unregistered mappings kept past theirs; unregister
        the pooled buffers the pool let go of."""
        now = time.monotonic()
        with self._lock:
            ended = self._expire(now, -1)
            self._graves = [g for g in self._graves if g[0] > now]
            self._forget_dropped()
        _call(ended)

    def forget(self, mapping: memoryview) -> bool:
        """The segment ``mapping`` maps stops holding rows: unregistered now, before its memory is
        reused; False when a reader of it may still be reading (a hold expired unreported)."""
        addr = _address_of(mapping)
        with self._lock:
            quiet = addr not in self._tainted
            self._tainted.discard(addr)
            r = self._regions.get(addr)
            if r is None or not r.segment:
                return quiet
            quiet = quiet and r.holds == 0  # (a held segment is pinned: not freed while held)
            self._unregister(addr, r)
            if not quiet:  # a read in flight keeps its pages mapped till it must have failed
                self._graves.append((time.monotonic() + self._ttl, r.buf))
        return quiet

    def stats(self) -> dict[str, int]:
        """Holds and registrations now, and counts of registrations, lends and copies."""
        with self._lock:
            return {
                "holds": len(self._holds),
                "registered_segments": sum(1 for r in self._regions.values() if r.segment and not r.pooled),
                "registered_pooled": sum(1 for r in self._regions.values() if r.pooled),
                "registered_segment_bytes": self._segment_bytes,
                "registered_buffers": sum(1 for r in self._regions.values() if not r.segment),
                **self._counts,
            }

    def close(self) -> None:
        self._unhook()
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
            regions, self._regions = list(self._regions.items()), {}
            self._segment_bytes = 0
            self._graves = []
        for addr, _ in regions:
            self._engine.unregister_memory(addr)
        _call([h.on_done for h in holds])

    # ---- under the lock --------------------------------------------------------------------------
    def _lend(self, view: memoryview, on_done: Callable[[], None]) -> tuple[int, int] | None:
        """A hold of ``view`` where it lies, its segment's mapping registered if it is not yet; None
        when it cannot be (then it is copied)."""
        mapping = mapping_of(view)
        if mapping is None:
            self._counts["registration_failures"] += 1
            return None
        base = _address_of(mapping)
        r = self._regions.get(base)
        if r is None or not r.segment or r.size != mapping.nbytes:
            if r is not None or not self._room(mapping.nbytes):
                self._counts["registration_failures"] += 1
                return None
            r = self._register_whole(mapping, base, pooled=False)
            if r is None:
                return None
        ticket = next(self._ids)
        r.holds += 1
        r.used = time.monotonic()
        self._holds[ticket] = _Hold(base, view.nbytes, on_done)
        self._counts["lent"] += 1
        return ticket, _address_of(view)

    def _register_whole(self, mapping: memoryview, base: int, pooled: bool) -> _Held | None:
        """``mapping`` (at ``base``) registered whole, as a region that outlives its holds (a
        segment's, or a pooled buffer's); None when Mooncake refuses it."""
        if self._engine.register_memory(base, mapping.nbytes) != 0:
            self._counts["registration_failures"] += 1
            logger.debug("%s: Mooncake refused a mapping of %d bytes", self.name, mapping.nbytes)
            return None
        r = self._regions[base] = _Held(mapping, mapping.nbytes, segment=True, pooled=pooled)
        self._segment_bytes += r.size
        self._counts["registrations"] += 1
        return r

    def _room(self, size: int) -> bool:
        """Whether a segment of ``size`` bytes fits the bound, idle segments unregistered (oldest
        first) to make room."""
        if self._segment_bytes + size <= self._cap:
            return True
        idle = sorted(
            ((a, r) for a, r in self._regions.items() if r.segment and not r.holds), key=lambda ar: ar[1].used
        )
        for addr, r in idle:
            if self._segment_bytes + size <= self._cap:
                break
            self._unregister(addr, r)
        return self._segment_bytes + size <= self._cap

    def _unregister(self, addr: int, r: _Held) -> None:
        del self._regions[addr]
        if r.segment:
            self._segment_bytes -= r.size
        self._engine.unregister_memory(addr)

    def _end(self, ticket: int, expired: bool) -> Callable[[], None] | None:
        """End hold ``ticket`` (a buffer's registration goes with its last hold); its ``on_done``."""
        h = self._holds.pop(ticket, None)
        if h is None:
            return None
        r = self._regions.get(h.region)
        if r is not None:
            if r.pooled and expired:  # (its reader may read late: not left registered for a later use)
                r.doomed = True
            elif r.segment and expired:
                self._tainted.add(h.region)
            self._let_go(h.region, r)
        return h.on_done

    def _let_go(self, addr: int, r: _Held) -> None:
        """One hold of region ``r`` (at ``addr``) gone: with its last, a buffer's registration goes,
        and a whole mapping's once doomed (a segment's and a pooled buffer's otherwise stay)."""
        r.holds -= 1
        if (not r.segment or r.doomed) and r.holds <= 0:
            self._unregister(addr, r)

    def _expire(self, now: float, room: int) -> list[Callable[[], None] | None]:
        """End the holds past the ttl, then the oldest holds of staged buffers (not segments) until
        at most ``room`` bytes of them stay (-1: no limit); their ``on_done``."""
        ended = [self._end(t, expired=True) for t, h in list(self._holds.items()) if now - h.born > self._ttl]
        if room >= 0:
            staged = [(t, h) for t, h in self._holds.items() if h.region in self._regions]
            staged = [(t, h) for t, h in staged if not self._regions[h.region].segment]
            held = sum(self._regions[a].size for a in {h.region for _, h in staged})
            for t, h in sorted(staged, key=lambda th: th[1].born):
                if held <= room:
                    break
                r = self._regions.get(h.region)
                if r is not None and r.holds == 1:  # (its registration goes with this hold)
                    held -= r.size
                ended.append(self._end(t, expired=True))
        return ended

    # ---- a buffer registered per reply -----------------------------------------------------------
    def _stage_buffer(self, view: memoryview, copy: bool) -> tuple[int, int]:
        """A hold of ``view``: where it lies in a pooled buffer (the whole buffer registered once,
        while it lives), or registered as it is (or a copy: ``copy``, or its memory overlaps a region
        registered with another size)."""
        if not copy:
            pooled = _buffers.pooled(view)
            if pooled is not None:
                with self._lock:
                    placed = self._hold_pooled(view, *pooled)
                if placed is not None:
                    return placed
            addr = _address_of(view)
            with self._lock:
                r = self._regions.get(addr)
                if r is not None and not r.segment and r.size == view.nbytes:
                    return self._hold(addr, r, view.nbytes)
                if r is None and self._engine.register_memory(addr, view.nbytes) == 0:
                    return self._hold(addr, self._new(addr, view), view.nbytes)
        addr, out = _registered_copy(self._engine, view, self.name)
        with self._lock:
            if copy:
                self._counts["copied"] += 1
            return self._hold(addr, self._new(addr, out), out.nbytes)

    def _hold_pooled(self, view: memoryview, mapping: memoryview, base: int) -> tuple[int, int] | None:
        """A hold of ``view`` where it lies in the pooled buffer ``mapping`` (at ``base``): the hold
        keeps ``view`` (so the buffer is not back in the pool while it is read). None when the buffer
        cannot be registered."""
        r = self._pooled_region(mapping, base)
        if r is None:
            return None
        ticket = next(self._ids)
        self._holds[ticket] = _Hold(base, view.nbytes, None, keep=view)
        self._counts["pooled"] += 1
        return ticket, _address_of(view)

    def _pooled_region(self, mapping: memoryview, base: int) -> _Held | None:
        """The pooled buffer ``mapping`` (at ``base``) registered whole, the first time and until the
        pool lets it go, with one more hold on it (None: it cannot be registered)."""
        self._forget_dropped()
        r = self._regions.get(base)
        if r is None or not r.pooled or r.doomed or r.size != mapping.nbytes:
            if r is not None or not self._room(mapping.nbytes):
                return None
            r = self._register_whole(mapping, base, pooled=True)
            if r is None:
                return None
        r.holds += 1
        r.used = time.monotonic()
        return r

    def _pin_read(self, out: memoryview) -> Pin | None:
        """``out`` registered for a request buffer's read (``_Reader``): a pooled buffer's whole
        registration, held for the read (it may be registered already, from a reply staged from it
        before it was pooled again); any other, as it is. What lets it go (None: refused)."""
        pooled = _buffers.pooled(out)
        if pooled is not None:
            with self._lock:
                r = self._pooled_region(*pooled)
            if r is not None:
                base = pooled[1]
                return lambda: self._unpin(base)
        return _register_for_read(self._engine, out)

    def _unpin(self, base: int) -> None:
        with self._lock:
            r = self._regions.get(base)
            if r is not None:
                self._let_go(base, r)

    def _forget_dropped(self) -> None:
        """Unregister the pooled buffers the pool let go of (none is held: a hold keeps its buffer)."""
        while self._dropped:
            addr = self._dropped.popleft()
            r = self._regions.get(addr)
            if r is not None and r.pooled and r.holds <= 0:
                self._unregister(addr, r)

    def _new(self, addr: int, buf: Any) -> _Held:
        r = self._regions[addr] = _Held(buf, memoryview(buf).nbytes, segment=False)
        return r

    def _hold(self, addr: int, r: _Held, size: int) -> tuple[int, int]:
        ticket = next(self._ids)
        r.holds += 1
        self._holds[ticket] = _Hold(addr, size, None)
        return ticket, addr


def _call(fns: Sequence[Callable[[], None] | None]) -> None:
    """Call each of ``fns`` (outside the server's lock: they belong to the shard)."""
    for fn in fns:
        if fn is not None:
            fn()


class MooncakeEngineClient:
    """A client's end: lends request buffers for shards to read, reads reply buffers from them."""

    name = "mooncake"

    def __init__(self, *, max_bytes: int) -> None:
        self._max = max_bytes
        self._lock = threading.Lock()
        self._engine: Any = None
        self._lent: _Registry | None = None
        self._reader: _Reader | None = None
        self.origin = ""
        self._done: dict[str, list[int]] = {}

    def _start(self, address: str) -> Any:
        """This process's engine, started on the address it reaches ``address`` from."""
        with self._lock:
            if self._engine is None:
                host, _, port = address.rpartition(":")
                probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:  # (a datagram socket's connect sends nothing: it only picks the route)
                    probe.connect((host, int(port)))
                    here = probe.getsockname()[0]
                finally:
                    probe.close()
                self._engine, self.origin = _new_engine(here)
                self._lent = _Registry(self._engine, "the mooncake engine's client")
                self._reader = _Reader(self._engine, "the mooncake engine's client", self._max)
            return self._engine

    def write(self, address: str, buf: memoryview, deadline: float) -> int:
        self._start(address)
        lent = self._lent
        if lent is None:  # (closed under a caller)
            raise WireError("the mooncake engine's client is closed")
        return lent.hold(buf)

    def read(self, address: str, ticket: int, size: int, deadline: float, at: int = 0) -> memoryview:
        """The ``size`` bytes of hold ``ticket`` the server at ``address`` staged at ``at`` (0: at
        ``ticket``); the hold is reported read in the next request to it (``done``)."""
        self._start(address)
        try:
            assert self._reader is not None  # (made with the engine)
            return self._reader.read(address, at or ticket, size, deadline)
        finally:
            with self._lock:
                self._done.setdefault(address, []).append(ticket)

    def done(self, address: str) -> list[int]:
        with self._lock:
            return self._done.pop(address, [])

    def release(self, tickets: Sequence[int]) -> None:
        if self._lent is not None:
            for t in tickets:
                self._lent.drop(t)

    def close(self) -> None:
        if self._lent is not None:
            self._lent.clear()


__all__ = ["MooncakeEngineClient", "MooncakeEngineServer"]
