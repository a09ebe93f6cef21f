"""The one way a service core turns a request into a call: its op table, then ``op_<name>``.

``Operations`` is the base of ``ShardCore`` and ``IndexCore``. A subclass names its tables
(``SHARD_OPS`` / ``INDEX_OPS`` and ``SHARD_REPLIES`` / ``INDEX_REPLIES`` in ``dataplane.wire.protocol``)
and defines one ``op_<name>`` method per operation, whose return annotation names the op's reply
struct (``Reply``, ``Reply | None`` for an op that may wait, or ``tuple[Reply, list[...]]`` with
buffer frames). The class is refused at import if a table entry has no method, or a method's
annotation names another struct (or none), so an op the table accepts can never fail to dispatch,
and mypy holds each handler to the reply its op's clients read. Both cores refuse alike, with a
``WireError``: an unknown op or a malformed body (``decode``, before any handler runs), and an op that
only the service's server can answer because its reply waits on something else (``SERVER_OPS``).

    >>> class Ping(msgspec.Struct):
    ...     pass
    >>> class Pong(msgspec.Struct):
    ...     shard: int
    >>> class Pings(Operations):
    ...     OPS = {"ping": Ping}
    ...     REPLIES = {"ping": Pong}
    ...     SERVICE = "the pinger"
    ...     def op_ping(self, body: Ping, bufs: list[memoryview]) -> tuple[Pong, list[Any]]:
    ...         return Pong(shard=7), []
    >>> Pings().handle("ping", msgspec.msgpack.encode({}), [])
    (Pong(shard=7), [])
    >>> Pings().handle("pong", msgspec.msgpack.encode({}), [])
    Traceback (most recent call last):
    ...
    dataplane.errors.WireError: unknown operation 'pong'; the pinger knows ['ping']
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec

from dataplane.errors import WireError
from dataplane.server.jobs import Job
from dataplane.wire import protocol as _protocol

OpReply = tuple[msgspec.Struct, list[Any]]  # a reply body (the op's reply struct) and its buffer frames


class Operations:
    """Decode a request body against the op table, and run the op's ``op_<name>`` method."""

    OPS: ClassVar[Mapping[str, type[msgspec.Struct]]] = {}
    REPLIES: ClassVar[Mapping[str, type[msgspec.Struct]]] = {}  # op -> the struct its handler returns
    SERVER_OPS: ClassVar[frozenset[str]] = frozenset()  # answered by the server, never by the core
    SERVICE: ClassVar[str] = "this service"  # names the service in refusals
    # Ops whose work can grow with what the service holds: its server answers them in steps
    # (``server.jobs``), serving other requests between; op -> the method making the job.
    JOBS: ClassVar[Mapping[str, str]] = {}
    _methods: ClassVar[dict[str, str]] = {}
    # The smallest reply buffer worth lending to the engine that stages the reply at hand (0: none;
    # set by the server per request, for a core that lends: ``ShardCore``).
    lend_min_bytes: int = 0

    def take_lent(self) -> Callable[[], None] | None:
        """The callback that takes back what the op just run lent to the reply's engine (called once
        the engine is done, on any thread); None when nothing was lent, as here."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        served = [op for op in cls.OPS if op not in cls.SERVER_OPS]
        missing = [op for op in served if not callable(getattr(cls, f"op_{op}", None))]
        if missing:
            raise TypeError(f"{cls.__name__} serves {missing} but defines no op_<name> method for them")
        wrong = [why for op in served if (why := _reply_mismatch(cls, op))]
        if wrong:
            raise TypeError(f"{cls.__name__}: " + "; ".join(wrong))
        cls._methods = {op: f"op_{op}" for op in served}

    def decode(self, op: str, raw: Any) -> msgspec.Struct:
        """The typed body of ``op``; ``WireError`` for an op the table lacks or a malformed body."""
        body: msgspec.Struct = _protocol.decode_body(op, raw, self.OPS, self.SERVICE)
        return body

    def operation(self, op: str) -> Callable[..., Any]:
        """The bound ``op_<op>`` method; ``WireError`` for an op the core does not answer itself."""
        name = self._methods.get(op)
        if name is None:
            if op in self.SERVER_OPS:  # its reply waits on something only the server can wait for
                raise WireError(f"{op!r} is served by {self.SERVICE}'s server, not by its core")
            raise WireError(f"unknown operation {op!r}; {self.SERVICE} knows {sorted(self.OPS)}")
        method: Callable[..., Any] = getattr(self, name)
        return method

    def job(self, op: str, body: Any, bufs: list[memoryview]) -> Job[OpReply]:
        """The job answering ``op`` (one of ``JOBS``) in steps; its ``op_<name>`` runs it whole."""
        job: Job[OpReply] = getattr(self, self.JOBS[op])(body, bufs)
        return job

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        """Run ``op`` on its decoded ``body`` and the request's buffer frames: the reply."""
        out: OpReply = self.operation(op)(body, bufs)
        return out

    def handle(self, op: str, raw: Any, bufs: list[memoryview]) -> OpReply:
        """Decode ``raw`` as ``op``'s body and run it (what the server does for every plain op)."""
        return self.run(op, self.decode(op, raw), bufs)


def _reply_mismatch(cls: type[Operations], op: str) -> str | None:
    """Why ``cls.op_<op>`` does not answer ``op``'s reply struct (``cls.REPLIES``); None when it does."""
    want = cls.REPLIES.get(op)
    if want is None:
        return f"{op!r} has no reply struct in {cls.__name__}.REPLIES"
    method = getattr(cls, f"op_{op}")
    try:
        hint = typing.get_type_hints(method).get("return")
    except Exception as exc:  # noqa: BLE001 - an annotation that does not resolve names no struct
        return f"op_{op}'s return annotation does not resolve ({exc})"
    got = _declared_reply(hint)
    if got is not want:
        named = "no reply struct" if got is None else got.__name__
        return f"op_{op} is annotated to answer {named}, but {op!r} answers {want.__name__}"
    return None


def _declared_reply(hint: Any) -> type | None:
    """The struct a handler's return annotation names: ``R``, ``R | None`` or ``tuple[R, list[...]]``."""
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    return hint if isinstance(hint, type) and issubclass(hint, msgspec.Struct) else None


__all__ = ["Operations", "OpReply"]
