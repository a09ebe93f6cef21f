"""Socket helpers that the store's clients and its servers share.

* ``recv_frames`` / ``send_frames``: one multipart message on a blocking zmq socket, cheaper than
  pyzmq's own (``*_multipart``), which a small request pays several times over.
* ``close_socket``: close a DEALER (dropping what it still queues) or a Unix-lane connection.
* ``Endpoint`` / ``Endpoints``: where each target of a caller listens, and the caller's side of a
  connection to it: authenticated sockets (``connect``, a DEALER or a Unix-lane connection), the
  refusal of a request with a frame the target does not take (``too_large``), and the errors that
  name the target and the address the caller uses (``unavailable``, ``died``, ``gone``, and
  ``give_up`` for a decision of ``wire.policy``).

The client transports (``transport.clients``) and a shard's link to its index
(``server.shard.actor``) are built on these; neither imports the other.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from dataplane.errors import RequestTooLargeError, ShardUnavailableError
from dataplane.transport import auth as _auth
from dataplane.transport import unix as _unix
from dataplane.transport.engine import EngineClient
from dataplane.transport.liveness import Liveness
from dataplane.transport.shm import fd_limit_error
from dataplane.wire import frames as _wire
from dataplane.wire.policy import DEAD, GiveUp
from dataplane.wire.protocol import MAX_FRAMES

# Plain ints: pyzmq's flag enums cost microseconds per operation, and a small request pays several.
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)
_SNDMORE = int(zmq.SNDMORE)

S = TypeVar("S", bound=zmq.Socket[Any])  # a context's sockets: blocking, or ``zmq.asyncio``'s
Connection = zmq.Socket[Any] | _unix.Conn  # a caller's connection to a target (``Endpoints.connect``)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
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


def send_frames(sock: zmq.Socket[Any], frames: list[Any], flags: int = 0) -> None:
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


def close_socket(sock: Connection) -> None:
    """Close a DEALER (dropping what it still queues) or a Unix-lane connection."""
    if type(sock) is _unix.Conn:
        sock.close()
    else:
        sock.close(linger=0)


@dataclass
class Endpoint:
    """Where a target listens and how to authenticate to it."""

    address: str
    name: str
    curve: bool = False  # CURVE (encrypted tcp) rather than PLAIN
    unix: str | None = None  # the same-host Unix lane (``transport.unix``), for callers that use it
    max_frame: int = -1  # the largest frame the target takes (-1: no limit known)
    engine: str | None = None  # its transfer engine's address, for callers that move large buffers so


@dataclass(eq=False, repr=False)  # (no repr: it would print the credentials)
class Endpoints:
    """A caller's targets (``endpoints``, by target id), its credentials, default timeout and
    ``liveness``; ``lane``: whether it reaches a target with a Unix-lane address over the lane
    (``connect``), which is then the address its errors name."""

    endpoints: dict[int, Endpoint]
    creds: _auth.Credentials
    timeout: float
    liveness: Liveness
    max_message_bytes: int = -1
    lane: bool = field(default=False, kw_only=True)
    # What moves buffers of ``engine_min_bytes`` or more to and from a target with an engine address
    # (``transport.engine``); None: every buffer in the message.
    engine: EngineClient | None = field(default=None, kw_only=True)
    engine_min_bytes: int = field(default=4 << 20, kw_only=True)

    def connect(self, ctx: zmq.Context[Any], target: int, timeout: float = 0.0) -> Any:
        """A connection to ``target``: over the Unix lane when this caller uses it and the target has
        one (``ConnectionError`` when it cannot be made within ``timeout`` seconds; 0: at once, for a
        server's loop, which must never block), else a DEALER socket of ``ctx``."""
        if self.lane and self.endpoints[target].unix is not None:
            return self.unix_conn(target, timeout)
        return self.dealer(ctx, target)

    def dealer(self, ctx: zmq.Context[S], target: int) -> S:
        """An authenticated DEALER socket of ``ctx`` (of its kind: blocking or asyncio) connected to
        ``target``."""
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

    def unix_conn(self, target: int, timeout: float = 0.0) -> _unix.Conn:
        """A Unix-lane connection to ``target``; ``ConnectionError`` when it cannot be made within
        ``timeout`` seconds."""
        ep = self.endpoints[target]
        assert ep.unix is not None
        try:
            return _unix.connect(
                ep.unix,
                self.creds.secret,
                max_frames=MAX_FRAMES + 1,
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

    def give_up(self, decision: GiveUp) -> ShardUnavailableError:
        """The error a request ends with when the policy gives up on it (``wire.policy``)."""
        if decision.reason == DEAD:
            return self.died(decision.peer)
        return self.unavailable(decision.peer, decision.waited)

    def gone(self, target: int, waited: float, why: str) -> ShardUnavailableError:
        """The error for a target whose connection closed or could not be made: dead, or unavailable."""
        return self.died(target) if self.liveness.dead(target) else self.unavailable(target, waited, why)

    def _where(self, ep: Endpoint) -> str:
        return f"unix:{ep.unix}" if self.lane and ep.unix is not None else ep.address

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


__all__ = [
    "EVENTS",
    "NOBLOCK",
    "POLLIN",
    "Endpoint",
    "Endpoints",
    "close_socket",
    "recv_frames",
    "send_frames",
]
