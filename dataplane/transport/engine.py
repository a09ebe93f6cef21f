"""Transfer engines: what moves a message's large buffers between a client and a shard on another
host (or over tcp), beside the message itself.

A message's small frames (the header, offsets, small columns) always travel in it; a buffer frame of
``min_bytes`` or more, to or from a shard that runs an engine, travels through the engine instead:
the sender hands it to its engine and puts a ``wire.bulk`` manifest in front of the message naming
the engine's ticket for it, and the receiver gets it back from its engine before it reads the
message (``offload`` / ``restore`` on the client, ``take_request`` / ``stage_reply`` on the shard).
The operations, the cores and the protocol's bodies see the same frames either way.

An engine is two objects behind these protocols: an ``EngineServer`` in each shard (``stage`` a
reply's buffer, ``take`` a request's) and an ``EngineClient`` in each client (``write`` a buffer to
a server, ``read`` one from it). ``StoreConfig.engine`` picks one (``DATAPLANE_ENGINE``):

* ``native`` (default): ``transport.tcp_engine``, plain TCP split over several connections;
* ``zmq``: no engine, every buffer in the zmq message (one stream per shard pair);
* ``mooncake``: ``transport.mooncake_engine``, Mooncake's Transfer Engine (one-sided reads over
  RDMA where a NIC supports it, its own TCP transport elsewhere), when it is installed
  (``engine_missing`` says what it lacks). Its receiver pulls: a manifest also names the sender's
  engine address, where each buffer lies in the sender's registered memory (its ticket names the
  hold, released on its own) and the buffers the sender has read since its last request (released
  then).

An encrypting store (``encrypt=True``) moves every byte in its CURVE stream: no engine runs.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dataplane.config import ENGINES
from dataplane.errors import EngineUnavailableError, WireError
from dataplane.wire import bulk as _bulk


class EngineServer(Protocol):
    """A shard's end of an engine."""

    address: str  # what clients reach it at (published in the shard's registry entry)
    # Whether ``stage`` calls its ``on_done`` once the buffer is no longer read (read whole, reported
    # read by its client, expired, or the server closed): only then may a shard stage a view of its
    # shared memory instead of a copy (``stage_reply``).
    lends: bool

    # The ticket a client reads ``buf`` by, or (ticket, where it lies) for an engine whose client
    # pulls the bytes from the server's registered memory (``wire.bulk.Ref.at``).
    def stage(self, buf: memoryview, on_done: Callable[[], None] | None = None) -> int | tuple[int, int]: ...

    def take(self, ticket: int, size: int, origin: str) -> memoryview: ...

    def release(self, tickets: Sequence[int]) -> None: ...

    def sweep(self) -> None: ...  # expire what is past its time (the server's tick)

    # The shard's shared-memory mapping ``mapping`` stops holding rows (``ShmPool.on_free``): stop
    # serving it before it is reused; False when a reader may still read it (then never reused).
    def forget(self, mapping: memoryview) -> bool: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """A client's end of an engine."""

    name: str
    origin: str  # where a server pulls what this client wrote from ('' when it need not)

    def write(self, address: str, buf: memoryview, deadline: float) -> int: ...

    def read(self, address: str, ticket: int, size: int, deadline: float, at: int = 0) -> memoryview: ...

    def done(self, address: str) -> list[int]: ...

    def release(self, tickets: Sequence[int]) -> None: ...

    def close(self) -> None: ...


def engine_missing(name: str) -> str:
    """Why engine ``name`` cannot run here ('' when it can)."""
    if name not in ENGINES:
        return f"no transfer engine {name!r}: the engines are {', '.join(ENGINES)}"
    if name != "mooncake":
        return ""
    try:
        importlib.import_module("mooncake.engine")  # (an optional extra)
    except ImportError as exc:
        return (
            f"the mooncake engine needs Mooncake's Transfer Engine, which does not load here ({exc}): "
            "install `pip install mooncake-transfer-engine-non-cuda` (the `rdma` extra) and its system "
            "library libibverbs1 (`apt-get install libibverbs1`)"
        )
    return ""


def require_engine(name: str) -> None:
    """Raise ``EngineUnavailableError`` (saying what is missing) when engine ``name`` cannot run here."""
    why = engine_missing(name)
    if why:
        raise EngineUnavailableError(why)


def start_server(
    name: str, host_ip: str, secret: str, *, max_bytes: int, ttl_s: float, who: str
) -> EngineServer | None:
    """The shard's end of engine ``name`` (None for ``zmq``)."""
    require_engine(name)
    if name == "zmq":
        return None
    if name == "mooncake":
        from dataplane.transport.mooncake_engine import MooncakeEngineServer

        return MooncakeEngineServer(host_ip, max_bytes=max_bytes, ttl_s=ttl_s, name=who)
    from dataplane.transport.tcp_engine import TcpEngineServer

    return TcpEngineServer(host_ip, secret, max_bytes=max_bytes, ttl_s=ttl_s, name=who)


def start_client(name: str, secret: str, *, connections: int, max_bytes: int) -> EngineClient | None:
    """A client's end of engine ``name`` (None for ``zmq``)."""
    require_engine(name)
    if name == "zmq":
        return None
    if name == "mooncake":
        from dataplane.transport.mooncake_engine import MooncakeEngineClient

        return MooncakeEngineClient(max_bytes=max_bytes)
    from dataplane.transport.tcp_engine import TcpEngineClient

    return TcpEngineClient(secret, connections=connections, max_bytes=max_bytes)


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def _lift(
    frames: list[Any], min_bytes: int, hand: Callable[[memoryview], int | tuple[int, int]]
) -> tuple[list[Any], list[_bulk.Ref]]:
    """``frames`` with every buffer frame of ``min_bytes`` or more handed to an engine (``hand``
    returns its ticket, or its ticket and where it lies) and emptied, and the refs naming them."""
    refs: list[_bulk.Ref] = []
    out = list(frames)
    for i in range(1, len(out)):
        if _nbytes(out[i]) >= min_bytes:
            view = memoryview(out[i]).cast("B")
            got = hand(view)
            ticket, at = got if isinstance(got, tuple) else (got, 0)
            refs.append(_bulk.Ref(i, ticket, view.nbytes, at))
            out[i] = b""
    return out, refs


def _land(frames: list[Any], refs: Sequence[_bulk.Ref], fetch: Callable[[_bulk.Ref], Any]) -> list[Any]:
    """``frames`` after their manifest, every frame a ref names filled from an engine (``fetch``); a
    named frame that is not empty is refused."""
    out = frames[1:]
    for ref in refs:
        if _nbytes(out[ref.frame]):
            raise WireError("a bulk manifest names a frame that is not empty")
        out[ref.frame] = fetch(ref)
    return out


def offload(
    engine: EngineClient, address: str, frames: list[Any], min_bytes: int, deadline: float
) -> tuple[list[Any], list[int]]:
    """``frames`` of a request to the server at ``address`` with every buffer of ``min_bytes`` or
    more written through ``engine`` and a manifest in front (which also says large reply buffers may
    come the same way), and the tickets written: ``engine.release`` them once the request is
    answered or given up."""
    out, refs = _lift(frames, min_bytes, lambda view: engine.write(address, view, deadline))
    origin = engine.origin if refs else ""
    manifest = _bulk.encode_manifest(refs, accepts=True, origin=origin, done=engine.done(address))
    return [manifest, *out], [r.ticket for r in refs]


def restore(
    engine: EngineClient, address: str, frames: list[Any], max_bytes: int, deadline: float
) -> list[Any]:
    """A reply's frames as they were sent: its manifest (the first frame) read and dropped, every
    buffer it names read from the server at ``address``."""
    refs, _ = _bulk.decode_manifest(frames[0], len(frames) - 1, max_bytes)
    return _land(frames, refs, lambda ref: engine.read(address, ref.ticket, ref.size, deadline, ref.at))


def take_request(server: EngineServer, frames: list[Any], max_bytes: int) -> tuple[list[Any], bool]:
    """A request's frames as they were sent, and whether its client takes reply buffers by engine:
    the manifest read and dropped, every buffer it names taken from ``server``."""
    m = _bulk.read_manifest(frames[0], len(frames) - 1, max_bytes)
    if m.done:
        server.release(m.done)
    return _land(frames, m.refs, lambda ref: server.take(ref.ticket, ref.size, m.origin)), m.accepts


def stage_reply(
    server: EngineServer, frames: list[Any], min_bytes: int, on_done: Callable[[], None] | None = None
) -> list[Any]:
    """A reply's frames with every buffer of ``min_bytes`` or more staged on ``server`` and a
    manifest in front (the frames unchanged when none is that large). ``on_done`` (a server that
    ``lends`` only) is called once no buffer of the reply is read any more: at once if none was staged."""
    if on_done is None:
        out, refs = _lift(frames, min_bytes, server.stage)
    else:
        left = _Countdown(on_done)
        staging = left.one()  # (held while staging: no buffer's end can end the count before all are staged)
        try:
            out, refs = _lift(frames, min_bytes, lambda view: server.stage(view, left.one()))
        finally:
            staging()
    return [_bulk.encode_manifest(refs, accepts=False), *out] if refs else frames


class _Countdown:
    """Calls ``fn`` when every callback ``one`` handed out was called (each counts once)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._left = 0
        self._lock = threading.Lock()

    def one(self) -> Callable[[], None]:
        with self._lock:
            self._left += 1
        called = threading.Event()

        def done() -> None:
            with self._lock:
                if called.is_set():
                    return
                called.set()
                self._left -= 1
                last = self._left == 0
            if last:
                self._fn()

        return done


def capped(deadline: float) -> float:
    """A call's ``time.monotonic`` deadline for its engine transfers, at most an hour from now: a call
    that may wait for ever (an infinite deadline) still moves its bytes within one, or fails."""
    return min(deadline, time.monotonic() + 3600.0)


__all__ = [
    "EngineClient",
    "EngineServer",
    "engine_missing",
    "require_engine",
    "offload",
    "restore",
    "stage_reply",
    "start_client",
    "start_server",
    "take_request",
]
