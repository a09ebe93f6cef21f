"""Large buffers moved beside a message: the descriptors that stand in for them, and the transfer
engine's stream framing (sans-IO).

A message whose large buffer frames travel through a transfer engine (``transport.engine``) is sent
with a **manifest** in front of its frames: ``[manifest, header, buf0, ...]``, each moved buffer
left empty in place and described in the manifest by its frame position, the engine's ticket for it
and its size. The manifest also says whether the sender takes large reply buffers the same way
(``accepts``) and, for an engine whose receiver pulls the bytes itself (``transport.mooncake_engine``),
where it can read them from (``origin``, the sender's engine address) and which of the receiver's
staged buffers the sender has read since (``done``, so they are released before they expire). Such
an engine's ticket names a *hold* (one staging of a buffer, released on its own) and a ref also says
where the bytes lie in the sender's registered memory (``Ref.at``): two holds of one region share the
place, never the ticket (flag ``AT``; refs without it are as before). Its first byte is 0, which no
header (a msgpack array) starts with, so a message with a manifest is never misread as one without.

The native engine's stream (``transport.tcp_engine``): after the hello (a nonce from the server, the
client's HMAC of it under the store's secret), each operation is one fixed header (``OP``: op,
ticket, total size, offset, length) answered by one status byte; a ``WRITE`` carries its ``length``
bytes after the header, a ``READ``'s answer is followed by them. Every size a peer declares is
checked against the limits of the side that reads it before anything is allocated or read.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dataplane.errors import WireError
from dataplane.wire.protocol import MAX_FRAMES

MAGIC = b"\x00dpbulk1"
_HEAD = struct.Struct("<8sBH")  # magic, flags, count
_REF = struct.Struct("<HQQ")  # frame position (1 = the header's first buffer), ticket, size
_REF_AT = struct.Struct("<HQQQ")  # the same, and where the bytes are (``AT``)
_LEN = struct.Struct("<H")
_TICKET = struct.Struct("<Q")
ACCEPTS = 1
EXTRA = 2  # an origin and a done list follow the refs
AT = 4  # every ref also says where its bytes are (``Ref.at``)
MAX_ORIGIN = 255  # bytes of an engine address
MAX_DONE = 4096  # released tickets one manifest carries

OP = struct.Struct("<BQQQQ")  # op, ticket, total, offset, length
READ, WRITE = 1, 2
OK, UNKNOWN, OUT_OF_RANGE, TOO_LARGE, BAD_OP = 0, 1, 2, 3, 4
STATUS = {
    UNKNOWN: "no such ticket (expired, already read, or never staged)",
    OUT_OF_RANGE: "a range outside the buffer",
    TOO_LARGE: "a buffer larger than the service takes",
    BAD_OP: "an unknown operation",
}
NONCE_BYTES = 32
_HELLO_DOMAIN = b"dataplane-bulk-hello"


@dataclass(frozen=True)
class Ref:
    """A buffer frame moved through the engine: its position in the message, ticket and size; ``at``:
    where a reader that pulls it finds its bytes (an address in the sender's registered memory), 0
    when the ticket says (the native engine)."""

    frame: int
    ticket: int
    size: int
    at: int = 0


def is_manifest(frame: Any) -> bool:
    """Whether a message's first frame is a manifest (a header never starts with byte 0)."""
    view = memoryview(frame)
    return view.nbytes >= _HEAD.size and view[0] == 0 and bytes(view[: len(MAGIC)]) == MAGIC


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest: the moved buffers, whether the sender takes reply buffers by engine, the
    sender's engine address ('' when the receiver need not reach it) and tickets it has read."""

    refs: list[Ref]
    accepts: bool
    origin: str = ""
    done: tuple[int, ...] = ()


def encode_manifest(refs: list[Ref], accepts: bool, origin: str = "", done: Sequence[int] = ()) -> bytes:
    """The manifest frame of ``refs``; ``accepts``: the sender takes large reply buffers by engine;
    ``origin`` and ``done``: see the module's docstring (at most ``MAX_DONE`` are sent).

    Example:
        >>> m = encode_manifest([Ref(1, 7, 100)], accepts=True)
        >>> decode_manifest(m, frames=2, max_bytes=1 << 20)
        ([Ref(frame=1, ticket=7, size=100)], True)
    """
    extra = bool(origin or done)
    at = any(r.at for r in refs)
    flags = (ACCEPTS if accepts else 0) | (EXTRA if extra else 0) | (AT if at else 0)
    out = [_HEAD.pack(MAGIC, flags, len(refs))]
    if at:
        out += [_REF_AT.pack(r.frame, r.ticket, r.size, r.at) for r in refs]
    else:
        out += [_REF.pack(r.frame, r.ticket, r.size) for r in refs]
    if extra:
        name = origin.encode()
        if len(name) > MAX_ORIGIN:
            raise WireError(f"an engine address of {len(name)} bytes (at most {MAX_ORIGIN})")
        done = list(done)[:MAX_DONE]
        out += [_LEN.pack(len(name)), name, _LEN.pack(len(done))]
        out += [_TICKET.pack(t) for t in done]
    return b"".join(out)


def decode_manifest(frame: Any, frames: int, max_bytes: int) -> tuple[list[Ref], bool]:
    """A manifest's refs and ``accepts`` flag (``read_manifest``).

    Example:
        >>> decode_manifest(encode_manifest([Ref(0, 1, 8)], False), frames=2, max_bytes=64)
        Traceback (most recent call last):
        ...
        dataplane.errors.WireError: a bulk manifest names frame 0: not a buffer frame of a message of 2
    """
    m = read_manifest(frame, frames, max_bytes)
    return m.refs, m.accepts


def read_manifest(frame: Any, frames: int, max_bytes: int) -> Manifest:
    """A manifest, every field checked: ``frames`` is how many frames
    follow the manifest (header included), ``max_bytes`` the largest buffer the reader takes (-1:
    no limit). ``WireError`` names what is wrong.

    Example:
        >>> read_manifest(encode_manifest([], True, "10.0.0.2:7", [5]), frames=1, max_bytes=64)
        Manifest(refs=[], accepts=True, origin='10.0.0.2:7', done=(5,))
    """
    view = memoryview(frame)
    if view.nbytes < _HEAD.size:
        raise WireError(f"a bulk manifest of {view.nbytes} bytes")
    magic, flags, count = _HEAD.unpack_from(view)
    if magic != MAGIC or flags & ~(ACCEPTS | EXTRA | AT):
        raise WireError("a bulk manifest of another format")
    ref = _REF_AT if flags & AT else _REF
    end = _HEAD.size + count * ref.size
    if count > MAX_FRAMES or view.nbytes < end or (view.nbytes != end and not flags & EXTRA):
        raise WireError(f"a bulk manifest of {view.nbytes} bytes declaring {count} buffers")
    origin, done = _extra(view, end) if flags & EXTRA else ("", ())
    refs: list[Ref] = []
    seen: set[int] = set()
    for i in range(count):
        pos, ticket, size, *at = ref.unpack_from(view, _HEAD.size + i * ref.size)
        if not 1 <= pos < frames or pos in seen:
            raise WireError(f"a bulk manifest names frame {pos}: not a buffer frame of a message of {frames}")
        if size == 0 or (max_bytes >= 0 and size > max_bytes):
            raise WireError(f"a bulk manifest declares a buffer of {size} bytes (at most {max_bytes})")
        seen.add(pos)
        refs.append(Ref(pos, ticket, size, at[0] if at else 0))
    return Manifest(refs, bool(flags & ACCEPTS), origin, done)


def _extra(view: memoryview, at: int) -> tuple[str, tuple[int, ...]]:
    """The origin and done list that follow a manifest's refs at ``at``, their sizes checked."""
    try:
        (n,) = _LEN.unpack_from(view, at)
        if n > MAX_ORIGIN:
            raise WireError(f"a bulk manifest names an engine address of {n} bytes (at most {MAX_ORIGIN})")
        origin = bytes(view[at + 2 : at + 2 + n]).decode()
        (k,) = _LEN.unpack_from(view, at + 2 + n)
    except (struct.error, UnicodeDecodeError) as exc:
        raise WireError(f"a bulk manifest whose origin does not decode ({exc})") from None
    start = at + 4 + n
    if k > MAX_DONE or view.nbytes != start + k * _TICKET.size:
        raise WireError(f"a bulk manifest of {view.nbytes} bytes declaring {k} released buffers")
    return origin, tuple(_TICKET.unpack_from(view, start + i * _TICKET.size)[0] for i in range(k))


def hello_proof(secret: str, nonce: bytes) -> bytes:
    """What a client answers the engine server's ``nonce`` with: proof it holds the store's secret."""
    return hmac.new(secret.encode(), _HELLO_DOMAIN + nonce, hashlib.sha256).digest()


def check_op(op: int, total: int, offset: int, length: int, max_bytes: int) -> int:
    """The status a server answers an operation header with before any byte moves (``OK`` or why
    not), from the sizes the peer declared; ``max_bytes``: the largest buffer it takes (-1: none).

    Example:
        >>> check_op(WRITE, 100, 90, 20, 1 << 20) == OUT_OF_RANGE
        True
    """
    if op not in (READ, WRITE):
        return BAD_OP
    if total == 0 or (max_bytes >= 0 and total > max_bytes):
        return TOO_LARGE
    if length == 0 or offset + length > total:
        return OUT_OF_RANGE
    return OK


def split(size: int, parts: int, min_part: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of at most ``parts`` nearly equal ranges covering ``size`` bytes, none
    under ``min_part`` (but one) bytes.

    Example:
        >>> split(10, 3, 1), split(10, 4, 8)
        ([(0, 4), (4, 3), (7, 3)], [(0, 10)])
    """
    n = max(1, min(parts, size // max(1, min_part)))
    base, extra = divmod(size, n)
    out, at = [], 0
    for i in range(n):
        length = base + (1 if i < extra else 0)
        out.append((at, length))
        at += length
    return out


__all__ = [
    "ACCEPTS",
    "AT",
    "EXTRA",
    "MAGIC",
    "Manifest",
    "NONCE_BYTES",
    "OP",
    "READ",
    "STATUS",
    "WRITE",
    "Ref",
    "check_op",
    "decode_manifest",
    "encode_manifest",
    "hello_proof",
    "is_manifest",
    "read_manifest",
    "split",
]
