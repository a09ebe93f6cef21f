"""The one way a service core turns a request into a call: its op table, then ``op_<name>``.

``Operations`` is the base of ``ShardCore`` and ``IndexCore``. A subclass names its table
(``SHARD_OPS`` / ``INDEX_OPS`` in ``dataplane.wire.protocol``) and defines one ``op_<name>``
method per operation; the class is refused at import if a table entry has no method, so an op
the table accepts can never fail to dispatch. Both cores refuse alike, with a ``WireError``:
an unknown op or a malformed body (``decode``, before any handler runs), and an op that only
the service's server can answer because its reply waits on something else (``SERVER_OPS``).

    >>> from dataplane.wire.protocol import INDEX_OPS
    >>> class Pings(Operations):
    ...     OPS = {"ping": INDEX_OPS["ping"]}
    ...     SERVICE = "the pinger"
    ...     def op_ping(self, body, bufs):
    ...         return {"pong": True}, []
    >>> Pings().handle("ping", msgspec.msgpack.encode({}), [])
    ({'pong': True}, [])
    >>> Pings().handle("pong", msgspec.msgpack.encode({}), [])
    Traceback (most recent call last):
    ...
    dataplane.errors.WireError: unknown operation 'pong'; the pinger knows ['ping']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec

from dataplane.errors import WireError
from dataplane.wire import protocol as _protocol

OpReply = tuple[dict[str, Any], list[Any]]  # a reply body and its buffer frames


class Operations:
    """Decode a request body against the op table, and run the op's ``op_<name>`` method."""

    OPS: ClassVar[Mapping[str, type[msgspec.Struct]]] = {}
    SERVER_OPS: ClassVar[frozenset[str]] = frozenset()  # answered by the server, never by the core
    SERVICE: ClassVar[str] = "this service"  # names the service in refusals
    _methods: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        served = [op for op in cls.OPS if op not in cls.SERVER_OPS]
        missing = [op for op in served if not callable(getattr(cls, f"op_{op}", None))]
        if missing:
            raise TypeError(f"{cls.__name__} serves {missing} but defines no op_<name> method for them")
        cls._methods = {op: f"op_{op}" for op in served}

    def decode(self, op: str, raw: Any) -> msgspec.Struct:
        """The typed body of ``op``; ``WireError`` for an op the table lacks or a malformed body."""
        return _protocol.decode_body(op, raw, self.OPS, self.SERVICE)

    def operation(self, op: str) -> Callable[..., Any]:
        """The bound ``op_<op>`` method; ``WireError`` for an op the core does not answer itself."""
        name = self._methods.get(op)
        if name is None:
            if op in self.SERVER_OPS:  # its reply waits on something only the server can wait for
                raise WireError(f"{op!r} is served by {self.SERVICE}'s server, not by its core")
            raise WireError(f"unknown operation {op!r}; {self.SERVICE} knows {sorted(self.OPS)}")
        return getattr(self, name)

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        """Run ``op`` on its decoded ``body`` and the request's buffer frames: the reply."""
        return self.operation(op)(body, bufs)

    def handle(self, op: str, raw: Any, bufs: list[memoryview]) -> OpReply:
        """Decode ``raw`` as ``op``'s body and run it (what the server does for every plain op)."""
        return self.run(op, self.decode(op, raw), bufs)


__all__ = ["Operations", "OpReply"]
