"""Typed msgpack decoders, one per type, each built by one thread at a time.

msgspec prepares a Struct type for decoding the first time a ``Decoder``, ``convert`` or typed
``decode`` meets it, and stores the plan on the type before it has filled in the plans of the type's
fields (so that a type may contain itself). Filling them in runs Python code (reading annotations),
so another thread may run in between, and a thread that decodes the type in that window follows a
field plan that is not there yet: SIGSEGV (msgspec 0.22 on CPython with the GIL; seen when a
consumer's two threads made their first ``get`` at once).

So every typed decode of this package goes through ``decoder(cls)``: the first call for a type builds
its ``Decoder``, and with it the plan of every type it contains, under one lock; later calls read the
finished decoder without locking. ``convert`` is ``msgspec.convert`` behind the same guarantee.

    >>> class Point(msgspec.Struct):
    ...     x: int
    >>> decoder(Point).decode(msgspec.msgpack.encode(Point(1)))
    Point(x=1)
    >>> decoder(Point) is decoder(Point)
    True
    >>> convert({"x": 2}, Point)
    Point(x=2)
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
# Reentrant: building a plan evaluates annotations, which may import a module that builds its own.
_build = threading.RLock()


def decoder(cls: type[T]) -> msgspec.msgpack.Decoder[T]:
    """The msgpack decoder of ``cls``, built once per process, by one thread at a time."""
    dec = _decoders.get(cls)
    if dec is None:
        with _build:
            dec = _decoders.get(cls)
            if dec is None:
                dec = _decoders[cls] = msgspec.msgpack.Decoder(cls)
    return dec


def convert(obj: Any, cls: type[T]) -> T:
    """``msgspec.convert(obj, cls)`` once ``cls`` has its finished plan (``decoder``)."""
    decoder(cls)
    return msgspec.convert(obj, cls)


__all__ = ["convert", "decoder"]
