"""The wire format: one msgpack header frame plus N raw buffer frames (sent with ``copy=False``).

A request is ``[header, buf0, buf1, ...]`` where the header is a ``Request`` struct (request id,
operation name, a plain-typed body, protocol version); a reply is ``[header, buf0, ...]`` whose
header (``RawReply`` as a client reads it) echoes the request id, so a reply is matched to its request
by id, never by arrival order. Column buffers are referenced from the body by frame index, so tensor
bytes never pass through msgpack and never through pickle.

Versions: every header ends with ``PROTOCOL_VERSION``. The envelope (``[rid, op, body, version]``
and ``[rid, body, error, version]``) is the one part every version keeps, so a peer of any version
can read a header far enough to refuse it: a service answers a request of another version with
``ProtocolVersionError`` (naming both versions, reading nothing past the header) and goes on
serving everyone else; a client turns a reply of another version into the same error for its
request. A header without a version is version 1 (headers before the version was sent). The cost
is one small integer per message.

Errors cross the wire as ``[error class name, message, attrs]`` and are rebuilt as the same
``dataplane.errors`` class on the client (unknown names become ``DataplaneError``); ``attrs`` are
the attributes the class declares in ``wire_attrs``.

Sharp edges: the codec functions are stateless and thread-safe; decoded buffers are views of the
received zmq frames and keep those frames alive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from dataplane import errors
from dataplane.codec.column_types import Column, ColumnSpec
from dataplane.errors import ProtocolVersionError, WireError
from dataplane.wire.decoders import decoder
from dataplane.wire.protocol import MAX_FRAMES, WireColumn, WireSpec

logger = logging.getLogger(__name__)

# 2: client-chosen put ids (prepare.txn), take ids and leases on next/claim. 3: typed bodies (fields
# at their default left out), no one-step "put" op. 4: a body names its partition "partition" (was
# "pid", which also meant a process id in the same modules).
PROTOCOL_VERSION = 4
"""Bump when a change makes peers of the old and new code misread each other's messages."""


class Request(msgspec.Struct, array_like=True, gc=False):
    """Header frame of a request (the encoder's form: the body is the op's ``wire.protocol`` struct)."""

    rid: int
    op: str
    body: Any
    version: int = PROTOCOL_VERSION


class _RawRequest(msgspec.Struct, array_like=True):
    """Header frame of a request as a server decodes it: the body stays raw until its op is known
    (``wire.protocol.decode_body`` then decodes it into the op's typed struct)."""

    rid: int
    op: str
    body: msgspec.Raw
    version: int = 1  # absent: a peer from before the version was sent


class _OutReply(msgspec.Struct, array_like=True, gc=False):
    """Header frame of a reply as a server encodes it: the body is the op's reply struct, which msgpack
    carries as a map of its fields (those at their default left out, as the client's struct reads them
    back); a test playing a server may pass a dict of the same fields."""

    rid: int
    body: Any
    error: list[Any] | None
    version: int


class RawReply(msgspec.Struct, array_like=True, gc=False):
    """A reply header as a client decodes it (``decode_raw_reply``): the body stays raw until the
    operation that asked reads it as its op's reply struct (``wire.requests.reply``); ``error`` is
    ``[class name, message, attrs]`` or None."""

    rid: int
    body: msgspec.Raw
    error: list[Any] | None = None
    version: int = 1  # absent: a peer from before the version was sent (encoders pass PROTOCOL_VERSION)


class _ReplyEnvelope(msgspec.Struct, array_like=True):
    """What every version's reply header keeps: enough to refuse a reply this version cannot read."""

    rid: int
    body: msgspec.Raw
    error: msgspec.Raw
    version: int = 1


_req_enc = msgspec.msgpack.Encoder()
_req_dec = decoder(_RawRequest)
_raw_rep_dec = decoder(RawReply)
_envelope_dec = decoder(_ReplyEnvelope)

SMALL_MESSAGE = 1 << 16  # below this many bytes, copying a frame is cheaper than sending it zero-copy


def zero_copy(frames: list[Any]) -> bool:
    """Whether to send ``frames`` without copying (only worth it for large buffers)."""
    size = 0
    for f in frames:  # (every request and reply asks: no generator, and no view of a header's bytes)
        size += len(f) if type(f) is bytes else memoryview(f).nbytes
    return size >= SMALL_MESSAGE


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def encode_request(rid: int, op: str, body: Any, buffers: list[Any] | None = None) -> list[Any]:
    """Frames of a request: the msgpack header, then the buffers as they are (no copy)."""
    return [_req_enc.encode(Request(rid, op, body)), *(buffers or [])]


def _decode(
    frames: list[Any], decoder: msgspec.msgpack.Decoder[Any], empty: str, what: str
) -> tuple[Any, list[memoryview]]:
    """Header (decoded by ``decoder``) and zero-copy buffer views of a message's frames."""
    if not frames:
        raise WireError(empty)
    try:
        header = decoder.decode(_as_buffer(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise WireError(f"undecodable {what} header: {exc}") from exc
    return header, [_as_buffer(f) for f in frames[1:]]


def decode_request(frames: list[Any]) -> tuple[_RawRequest, list[memoryview]]:
    """Parse a request's frames into its header (body still raw) and zero-copy views of its buffers."""
    return _decode(frames, _req_dec, "empty message", "request")


def encode_reply(
    rid: int, body: msgspec.Struct | dict[str, Any], buffers: list[Any] | None = None
) -> list[Any]:
    """Frames of a successful reply: ``body`` is the op's reply struct (``wire.protocol``)."""
    return [_req_enc.encode(_OutReply(rid, body, None, PROTOCOL_VERSION)), *(buffers or [])]


_PLAIN = (str, int, float, bool, type(None))


def error_fields(exc: BaseException) -> list[Any]:
    """``[class name, message, culprit attributes]``: how ``exc`` crosses the wire (``rebuild_error``).

    The attributes are the ones its class declares (``DataplaneError.wire_attrs``); any other
    exception crosses as a plain ``DataplaneError`` whose message names its type.
    """
    if not isinstance(exc, errors.DataplaneError):
        return ["DataplaneError", f"{type(exc).__name__}: {exc}", {}]
    attrs = {}
    for name in exc.wire_attrs:
        value = getattr(exc, name, None)
        attrs[name] = value if isinstance(value, _PLAIN) else repr(value)  # always encodable
    return [type(exc).__name__, str(exc), attrs]


def encode_error(rid: int, exc: BaseException) -> list[Any]:
    """Frames of a failed reply carrying ``exc`` (class name, message and culprit attributes)."""
    return [_req_enc.encode(_OutReply(rid, {}, error_fields(exc), PROTOCOL_VERSION))]


def _version_error(client: int, service: int, who: str) -> ProtocolVersionError:
    """The refusal of a message of another protocol version: both versions, and who refused it."""
    return ProtocolVersionError(
        client,
        service,
        f"wire protocol mismatch: the client speaks version {client}, {who} speaks version {service}; "
        "run the same dataplane release in every process of the store (restart the store or the client)",
    )


_EMPTY_BODY = msgspec.Raw(msgspec.msgpack.encode({}))


def decode_raw_reply(frames: list[Any]) -> tuple[RawReply, list[memoryview]]:
    """Parse a reply's frames: its header, the body left raw for the caller to read as its op's reply
    struct (``wire.requests.reply``), and zero-copy views of its buffers. Does not raise for a remote
    error (see ``rebuild_error``).

    A reply of another protocol version is not read past its envelope: it comes back as a
    ``ProtocolVersionError`` reply to the same request id (an empty body, no buffers), so the call
    fails at once.
    """
    try:
        rep, bufs = _decode(frames, _raw_rep_dec, "empty reply", "reply")
    except WireError:
        # Only on this error path: the envelope of a reply whose body another version laid out.
        try:
            rep, bufs = _envelope_dec.decode(_as_buffer(frames[0])), []
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            rep = None
        if rep is None or rep.version == PROTOCOL_VERSION:
            raise
    if rep.version != PROTOCOL_VERSION:
        err = _version_error(PROTOCOL_VERSION, rep.version, "the service")
        return RawReply(rep.rid, _EMPTY_BODY, error_fields(err), PROTOCOL_VERSION), []
    return rep, bufs


Handler = Callable[[_RawRequest, list[memoryview]], "tuple[msgspec.Struct, list[Any]] | None"]


def answer(
    frames: list[Any],
    handler: Handler,
    *,
    max_frames: int = MAX_FRAMES,
    who: str = "this service",
    refused: Callable[[BaseException], None] | None = None,
) -> tuple[int, list[Any] | None]:
    """Serve one request: ``(request id, reply frames)``; every request gets an answer, even a bad one.

    The header is checked first (``_check_request``: decodable, this protocol version, at most
    ``max_frames`` buffer frames; ``who`` names the service in refusals). Then
    ``handler(request, buffers)`` decodes the body for its op and returns the reply body and
    buffers, or None when it answers that request id itself later. Any exception becomes an error
    reply echoing the request id (-1 when the header did not decode). ``refused(exc)`` is told of a
    request refused before its handler ran (the server counts them by cause).
    """
    rid = -1
    checked = False
    try:
        req, bufs = decode_request(frames)
        rid = req.rid
        _check_request(req, bufs, max_frames, who)
        checked = True
        out = handler(req, bufs)
        return rid, None if out is None else encode_reply(rid, *out)
    except Exception as exc:  # noqa: BLE001 - every request gets an answer
        if not isinstance(exc, errors.DataplaneError):
            logger.debug("%s: request %d failed", who, rid, exc_info=True)
        if not checked and refused is not None:
            refused(exc)
        return rid, encode_error(rid, exc)


def _check_request(req: _RawRequest, bufs: list[memoryview], max_frames: int, who: str) -> None:
    """Refuse a request of another protocol version, or with more buffer frames than ``who`` takes."""
    if req.version != PROTOCOL_VERSION:
        raise _version_error(req.version, PROTOCOL_VERSION, who)
    if len(bufs) > max_frames:
        if max_frames == 0:
            raise WireError(
                f"{who} takes metadata only: the {req.op!r} request carried {len(bufs)} buffer "
                "frame(s); tensor bytes go to the shards"
            )
        raise WireError(f"{who}: a request carries at most {max_frames} buffer frames, got {len(bufs)}")


def rebuild_error(error: Any) -> errors.DataplaneError:
    """The ``dataplane.errors`` exception a reply's ``error`` field describes (``error_fields``).

    The class is looked up by name and built from the attributes it declares (``wire_attrs``, "?"
    for one the peer left out) and the message; a name that is no data plane error gives a
    ``DataplaneError``. ``WireError`` when ``error`` is not ``[str, str, dict]``.
    """
    if not (isinstance(error, list | tuple) and len(error) == 3):
        raise WireError(f"malformed error {error!r:.200}: not [class name, message, attributes]")
    name, msg, attrs = error
    if type(name) is not str or type(msg) is not str or type(attrs) is not dict:
        raise WireError(f"malformed error {error!r:.200}: not [class name, message, attributes]")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DataplaneError)):
        return errors.DataplaneError(msg)
    return cls(*(attrs.get(a, "?") for a in cls.wire_attrs), msg)


# ---- columns <-> frames ---------------------------------------------------------------------


def spec_to_wire(spec: ColumnSpec) -> WireSpec:
    return (spec.kind, spec.dtype, list(spec.shape))


def spec_from_wire(d: Any) -> ColumnSpec:
    try:
        kind, dtype, shape = d
        return ColumnSpec(kind=str(kind), dtype=str(dtype), shape=tuple(int(x) for x in shape))
    except (TypeError, ValueError) as exc:
        raise WireError(f"malformed column spec {d!r}") from exc


def column_to_wire(col: Column, buffers: list[Any]) -> WireColumn:
    """Describe ``col`` in a header, appending its data (offsets, shapes) to ``buffers`` without copying."""
    out = WireColumn(spec_to_wire(col.spec), int(col.num_rows), len(buffers))
    buffers.append(col.data)
    if col.offsets is not None:
        out.offsets = len(buffers)
        buffers.append(np.ascontiguousarray(col.offsets, dtype=np.int64).data)
    if col.shapes is not None:
        out.shapes = array_to_wire(col.shapes, buffers)
    return out


def column_from_wire(d: Any, buffers: list[memoryview], field: str = "<column>") -> Column:
    """The ``Column`` a header entry describes, as a zero-copy view of its frames, checked.

    ``d`` is a dict (a reply) or a ``wire.protocol.WireColumn`` (a request). The frames must exist and
    hold exactly the rows the entry declares (``Column.check``): a peer's declared sizes are
    never trusted.
    """
    spec: Any
    rows: Any
    data_i: Any
    off_i: Any
    shapes_i: Any
    if isinstance(d, dict):
        spec, rows, data_i = d.get("spec"), d.get("rows"), d.get("data")
        off_i, shapes_i = d.get("offsets", -1), d.get("shapes", -1)
    else:
        spec, rows, data_i, off_i, shapes_i = d.spec, d.rows, d.data, d.offsets, d.shapes
    spec = spec_from_wire(spec)
    try:
        data = buffers[data_i].cast("B")
        offsets = None
        if off_i >= 0:
            raw = buffers[off_i].cast("B")
            if raw.nbytes % 8:
                raise WireError(f"field {field!r}: offsets frame of {raw.nbytes} bytes is not int64")
            offsets = np.frombuffer(raw, dtype=np.int64)
    except (IndexError, TypeError) as exc:
        raise WireError(f"field {field!r}: column refers to a missing frame") from exc
    shapes = None
    if shapes_i >= 0:
        ndim = spec.shape[0] if spec.kind == "ragged" and spec.shape else 1
        shapes = array_from_wire(shapes_i, buffers, rows * ndim if type(rows) is int else None)
        shapes = shapes.reshape(-1, ndim)
    col = Column(spec=spec, num_rows=rows, data=data, offsets=offsets, shapes=shapes)
    col.check(field)
    return col


def array_to_wire(arr: np.ndarray, buffers: list[Any]) -> int:
    """Append an int64 array as a frame (flattened, C order); returns its frame index."""
    buffers.append(np.ascontiguousarray(arr, dtype=np.int64).reshape(-1).data.cast("B"))
    return len(buffers) - 1


def array_from_wire(idx: int, buffers: list[memoryview], length: int | None = None) -> np.ndarray:
    """The int64 array in frame ``idx``; ``WireError`` if the frame is missing or of another length."""
    try:
        raw = buffers[idx].cast("B")
    except (IndexError, TypeError) as exc:
        raise WireError(f"array refers to a missing frame {idx!r}") from exc
    if raw.nbytes % 8 or (length is not None and raw.nbytes != 8 * length):
        raise WireError(f"array frame of {raw.nbytes} bytes; expected {length} int64 values")
    return np.frombuffer(raw, dtype=np.int64)


__all__ = [
    "PROTOCOL_VERSION",
    "Handler",
    "answer",
    "RawReply",
    "Request",
    "array_from_wire",
    "array_to_wire",
    "column_from_wire",
    "column_to_wire",
    "decode_raw_reply",
    "decode_request",
    "encode_error",
    "encode_reply",
    "error_fields",
    "encode_request",
    "rebuild_error",
]
