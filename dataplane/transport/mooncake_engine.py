"""The mooncake transfer engine: large buffers moved by Mooncake's Transfer Engine (one-sided reads;
RDMA where the NICs support it, its own TCP transport elsewhere).

Every move is a pull by the side that needs the bytes, from memory the other side registered:

* a reply's buffer: the shard registers it (``stage``: the ticket is its address) and the client
  reads it into a warm buffer it registers for the read (``read``), then names it in the manifest
  of its next request to that shard (``done``), which releases it; a staged buffer no client
  releases is released after ``ttl_s``, or earlier, oldest first, when the staged bytes pass twice
  the largest buffer the shard takes;
* a request's buffer: the client registers it (``write``) and the manifest names the client's
  engine address (``origin``); the shard reads it (``take``), and the client releases it once its
  call set is answered (``release``).

Each process runs one engine in Mooncake's peer-to-peer mode (no metadata server: a peer's address
is its host and the port of its engine's handshake listener), on the transport that
``DATAPLANE_MOONCAKE_PROTOCOL`` names ("tcp" by default; "rdma" on an RDMA NIC, with
``DATAPLANE_MOONCAKE_DEVICE`` naming it). Mooncake authenticates no peer: any process that reaches
the engine's ports can read what is registered while it is, so run it only on a trusted network
(the native engine proves the store's secret on every connection).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane import config
from dataplane.codec import buffers as _buffers
from dataplane.errors import EngineUnavailableError, WireError

logger = logging.getLogger(__name__)


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
    born: float = field(default_factory=time.monotonic)


class _Registry:
    """Registered regions by address, counted (one buffer may be lent twice). Thread-safe."""

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
        copy = _buffers.take(view.nbytes).data
        copy[:] = view
        addr = _address_of(copy)
        with self._lock:
            if self._engine.register_memory(addr, copy.nbytes) != 0:
                raise WireError(f"{self._who}: Mooncake's engine refused to register {copy.nbytes} bytes")
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

    def expire(self, ttl_s: float, budget: int) -> None:
        """Release regions older than ``ttl_s``, then the oldest until at most ``budget`` bytes stay."""
        now = time.monotonic()
        with self._lock:
            order = sorted(self.regions.items(), key=lambda kv: kv[1].born)
            held = sum(r.size for _, r in order)
            for addr, r in order:
                if now - r.born <= ttl_s and (budget < 0 or held <= budget):
                    break
                del self.regions[addr]
                held -= r.size
                self._engine.unregister_memory(addr)

    def clear(self) -> None:
        with self._lock:
            regions, self.regions = self.regions, {}
        for addr in regions:
            self._engine.unregister_memory(addr)


def _pull(engine: Any, who: str, peer: str, ticket: int, size: int, max_bytes: int) -> memoryview:
    """``size`` bytes read from ``peer``'s registered memory at ``ticket`` into a warm buffer."""
    if max_bytes >= 0 and size > max_bytes:
        raise WireError(f"{who}: a buffer of {size} bytes is declared (at most {max_bytes})")
    out = _buffers.take_faulted(size).data  # (filled by the engine's own threads)
    addr = _address_of(out)
    if engine.register_memory(addr, size) != 0:
        raise WireError(f"{who}: Mooncake's engine refused to register {size} bytes")
    try:
        rc = engine.transfer_sync_read(peer, addr, ticket, size)
    finally:
        engine.unregister_memory(addr)
    if rc < 0:
        raise WireError(
            f"{who}: Mooncake's engine could not read {size} bytes from {peer} (code {rc}: released, "
            "expired, or the peer is gone)"
        )
    return out


class MooncakeEngineServer:
    """A shard's end: stages reply buffers for clients to read, reads request buffers from them."""

    def __init__(self, host_ip: str, *, max_bytes: int, ttl_s: float, name: str) -> None:
        self._engine, self.address = _new_engine(host_ip)
        self._max = max_bytes
        self._budget = -1 if max_bytes < 0 else 2 * max_bytes
        self._ttl = ttl_s
        self.name = name
        self._staged = _Registry(self._engine, name)

    lends = False  # (its client reads a staged buffer through a registration of it: always a copy)

    def stage(self, buf: memoryview, on_done: Callable[[], None] | None = None) -> int:
        if on_done is not None:
            raise ValueError("the mooncake engine does not lend: stage a copy, without on_done")
        room = -1 if self._budget < 0 else max(0, self._budget - memoryview(buf).nbytes)
        self._staged.expire(self._ttl, room)  # (what it stages counts too)
        return self._staged.hold(buf)

    def take(self, ticket: int, size: int, origin: str) -> memoryview:
        if not origin:
            raise WireError(f"{self.name}: a request names a buffer to read but not where from")
        return _pull(self._engine, self.name, origin, ticket, size, self._max)

    def release(self, tickets: Sequence[int]) -> None:
        for t in tickets:
            self._staged.drop(t)

    def sweep(self) -> None:
        """(Its staged buffers expire as others are staged, or past its budget.)"""

    def close(self) -> None:
        self._staged.clear()


class MooncakeEngineClient:
    """A client's end: lends request buffers for shards to read, reads reply buffers from them."""

    name = "mooncake"

    def __init__(self, *, max_bytes: int) -> None:
        self._max = max_bytes
        self._lock = threading.Lock()
        self._engine: Any = None
        self._lent: _Registry | None = None
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
            return self._engine

    def write(self, address: str, buf: memoryview, deadline: float) -> int:
        self._start(address)
        lent = self._lent
        if lent is None:  # (closed under a caller)
            raise WireError("the mooncake engine's client is closed")
        return lent.hold(buf)

    def read(self, address: str, ticket: int, size: int, deadline: float) -> memoryview:
        engine = self._start(address)
        try:
            return _pull(engine, "the mooncake engine's client", address, ticket, size, self._max)
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
