"""Requests and replies as a client operation sees them, with no socket in sight.

A sans-IO operation (``dataplane.client.ops``) yields batches of ``Call`` s and receives one
``Result`` per call: ``(body, buffers)`` on success, or the exception the call ended with (a rebuilt
remote error, or the transport's ``ShardUnavailableError``). ``INDEX`` is the target that names the
index service; shards are named by their index ``0 .. N-1``.

The pure helpers every driver of those operations shares live here too: ``next_rid`` (request ids,
unique in the process), ``deadline_of`` (how long a batch of calls may take) and ``decode_result``
(a reply's frames -> its request id and ``Result``). The zmq transport (``transport``) is one such
driver; a test that serves calls from in-process cores is another.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from dataplane.errors import WireError
from dataplane.wire import frames as _wire

INDEX = -1

Result = tuple[dict[str, Any], list[memoryview]] | BaseException


@dataclass
class Call:
    """One request of an operation step: ``target`` is a shard index, or ``INDEX``."""

    target: int
    op: str
    body: dict[str, Any]
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
        rep, bufs = _wire.decode_reply(frames)
    except WireError as exc:
        return -1, exc
    if rep.error is not None:
        try:
            return rep.rid, _wire.rebuild_error(rep.error)
        except (TypeError, ValueError, AttributeError):
            return rep.rid, WireError(f"a reply carried a malformed error {rep.error!r}")
    return rep.rid, (rep.body, bufs)


__all__ = ["INDEX", "Call", "Result", "deadline_of", "decode_result", "next_rid"]
