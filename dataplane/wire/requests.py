"""Requests and replies as a client operation sees them, with no socket in sight.

A sans-IO operation (``dataplane.client.ops``) yields batches of ``Call`` s (each with its op's
request struct from ``wire.protocol``) and receives one ``Result`` per call: ``(body, buffers)`` on
success, or the exception the call ended with (a rebuilt remote error, or the transport's
``ShardUnavailableError``). The body is left raw by the wire; the operation reads it as the reply
struct it expects (``reply``). ``INDEX`` is the target that names the index service; shards are
named by their index ``0 .. N-1``.

The pure helpers every driver of those operations shares live here too: ``next_rid`` (request ids,
unique in the process), ``deadline_of`` (how long a batch of calls may take) and ``decode_result``
(a reply's frames -> its request id and ``Result``). The zmq transport (``transport``) is one such
driver; a test that serves calls from in-process cores is another.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from dataplane.errors import WireError
from dataplane.wire import frames as _wire
from dataplane.wire.decoders import convert, decoder

INDEX = -1

# A reply's body (raw msgpack from the wire; a test or an in-process core may hand over a dict or the
# struct itself) and its buffer frames, or the exception the call ended with.
Result = tuple[Any, list[memoryview]] | BaseException
R = TypeVar("R", bound=msgspec.Struct)


@dataclass
class Call:
    """One request of an operation step: ``target`` is a shard index, or ``INDEX``."""

    target: int
    op: str
    body: msgspec.Struct  # the op's request struct (``wire.protocol``)
    bufs: list[Any] = field(default_factory=list)
    timeout: float | None = None  # seconds (``math.inf``: no limit, only death ends it); None: rpc_timeout_s
    exclusive: bool = False  # async: on a socket of its own (waiting calls, see AsyncTransport)


_rids = itertools.count(1)
_rid_lock = threading.Lock()


def next_rid() -> int:
    """A request id no other request of this process carries (replies are matched by it)."""
    with _rid_lock:
        return next(_rids)


def deadline_of(calls: list[Call], default: float) -> float:
    """The seconds a batch of calls may take: the longest any of them asks for (``default`` if unset)."""
    return max((default if c.timeout is None else c.timeout) for c in calls) if calls else default


def decode_result(frames: list[Any]) -> tuple[int, Result]:
    """A reply's request id and result (one decode of its header); -1 when it is not one of ours.

    A remote error comes back as the same ``dataplane.errors`` class, and a malformed reply as a
    ``WireError``: an operation sees either as a failed call, never as an exception of the driver.
    """
    try:
        rep, bufs = _wire.decode_raw_reply(frames)
    except WireError as exc:
        return -1, exc
    if rep.error is not None:
        try:
            return rep.rid, _wire.rebuild_error(rep.error)
        except (TypeError, ValueError, AttributeError):
            return rep.rid, WireError(f"a reply carried a malformed error {rep.error!r}")
    return rep.rid, (rep.body, bufs)


def reply(body: Any, cls: type[R]) -> R:
    """A successful call's reply ``body`` read as ``cls`` (its op's reply struct in ``wire.protocol``);
    ``WireError`` naming the struct when the peer answered something else."""
    if type(body) is cls:
        return body
    try:
        if isinstance(body, dict):  # from an in-process core, or a test playing the store
            return convert(body, cls)
        return decoder(cls).decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"a malformed reply: not a {cls.__name__} ({exc})") from exc


__all__ = ["INDEX", "Call", "Result", "deadline_of", "decode_result", "next_rid", "reply"]
