"""The wire format: one msgpack header frame plus N raw buffer frames (sent with ``copy=False``).

A request is ``[header, buf0, buf1, ...]`` where the header is a ``Request`` struct (request id,
operation name, a plain-typed body); a reply is ``[header, buf0, ...]`` with a ``Reply`` struct that
echoes the request id, so a reply is matched to its request by id, never by arrival order.
Column buffers are referenced from the body by frame index, so tensor bytes never pass through
msgpack and never through pickle.

Errors cross the wire as ``[error class name, message, attrs]`` and are rebuilt as the same
``dataplane.errors`` class on the client (unknown names become ``DataplaneError``).

Sharp edges: the codec functions are stateless and thread-safe; decoded buffers are views of the
received zmq frames and keep those frames alive.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from dataplane import errors
from dataplane._layout import Block, Layout

PROTOCOL_VERSION = 1


class Request(msgspec.Struct, array_like=True):
    """Header frame of a request."""

    rid: int
    op: str
    body: dict[str, Any]


class Reply(msgspec.Struct, array_like=True):
    """Header frame of a reply; ``error`` is ``[class name, message, attrs]`` or None."""

    rid: int
    body: dict[str, Any]
    error: list[Any] | None = None


_req_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


class WireError(errors.DataplaneError, ValueError):
    """A frame could not be decoded (a foreign or corrupt message)."""


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def encode_request(rid: int, op: str, body: dict[str, Any], buffers: list[Any] | None = None) -> list[Any]:
    """Frames of a request: the msgpack header, then the buffers as they are (no copy)."""
    return [_req_enc.encode(Request(rid, op, body)), *(buffers or [])]


def decode_request(frames: list[Any]) -> tuple[Request, list[memoryview]]:
    """Parse a request's frames into its header and zero-copy views of its buffers."""
    if not frames:
        raise WireError("empty message")
    try:
        req = _req_dec.decode(_as_buffer(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"undecodable request header: {exc}") from exc
    return req, [_as_buffer(f) for f in frames[1:]]


def encode_reply(rid: int, body: dict[str, Any], buffers: list[Any] | None = None) -> list[Any]:
    """Frames of a successful reply."""
    return [_req_enc.encode(Reply(rid, body)), *(buffers or [])]


def encode_error(rid: int, exc: BaseException) -> list[Any]:
    """Frames of a failed reply carrying ``exc`` (class name, message and culprit attributes)."""
    attrs = {}
    for name in ("key", "partition_id", "field", "shard"):
        if hasattr(exc, name):
            attrs[name] = getattr(exc, name)
    name = type(exc).__name__ if isinstance(exc, errors.DataplaneError) else "DataplaneError"
    msg = str(exc) if isinstance(exc, errors.DataplaneError) else f"{type(exc).__name__}: {exc}"
    return [_req_enc.encode(Reply(rid, {}, [name, msg, attrs]))]


def decode_reply(frames: list[Any]) -> tuple[Reply, list[memoryview]]:
    """Parse a reply's frames; does not raise for a remote error (see ``raise_for_error``)."""
    if not frames:
        raise WireError("empty reply")
    try:
        rep = _rep_dec.decode(_as_buffer(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"undecodable reply header: {exc}") from exc
    return rep, [_as_buffer(f) for f in frames[1:]]


def peek_rid(frame: Any) -> int:
    """The request id of a header frame, or -1 when it is not one of ours."""
    try:
        return int(msgspec.msgpack.decode(_as_buffer(frame))[0])
    except Exception:  # noqa: BLE001 - a foreign frame is simply not ours
        return -1


def rebuild_error(error: list[Any]) -> errors.DataplaneError:
    """The ``dataplane.errors`` exception a reply's ``error`` field describes."""
    name, msg, attrs = error
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DataplaneError)):
        return errors.DataplaneError(msg)
    if cls is errors.KeyNotFoundError:
        return cls(attrs.get("key", "?"), attrs.get("partition_id", "?"), msg)
    if cls is errors.PartitionNotFoundError:
        return cls(attrs.get("partition_id", "?"), msg)
    if cls is errors.SchemaError:
        return cls(attrs.get("field", "?"), msg)
    if cls is errors.ShardUnavailableError:
        return cls(attrs.get("shard", "?"), msg)
    return cls(msg)


# ---- columns <-> frames ---------------------------------------------------------------------


def spec_to_wire(spec: Any) -> list[Any]:
    return [spec.kind, spec.dtype, list(spec.shape)]


def spec_from_wire(d: list[Any]) -> Any:
    return Layout(kind=d[0], dtype=d[1], shape=tuple(d[2]))


def column_to_wire(col: Any, buffers: list[Any]) -> dict[str, Any]:
    """Describe ``col`` in a header, appending its data (and offsets) to ``buffers`` without copying."""
    out = {"spec": spec_to_wire(col.spec), "rows": int(col.num_rows), "data": len(buffers), "offsets": -1}
    buffers.append(col.data)
    if col.offsets is not None:
        out["offsets"] = len(buffers)
        buffers.append(np.ascontiguousarray(col.offsets, dtype=np.int64).data)
    return out


def column_from_wire(d: dict[str, Any], buffers: list[memoryview]) -> Any:
    """The ``Column`` a header entry describes, as a zero-copy view of its frames."""
    try:
        data = buffers[d["data"]]
        offsets = None
        if d["offsets"] >= 0:
            offsets = np.frombuffer(buffers[d["offsets"]], dtype=np.int64)
    except (IndexError, KeyError) as exc:
        raise WireError(f"column refers to a missing frame: {d}") from exc
    return Block(spec=spec_from_wire(d["spec"]), num_rows=d["rows"], data=data.cast("B"), offsets=offsets)


def array_to_wire(arr: np.ndarray, buffers: list[Any]) -> int:
    """Append an int64 array as a frame; returns its frame index."""
    buffers.append(np.ascontiguousarray(arr, dtype=np.int64).data)
    return len(buffers) - 1


def array_from_wire(idx: int, buffers: list[memoryview]) -> np.ndarray:
    return np.frombuffer(buffers[idx], dtype=np.int64)


__all__ = [
    "PROTOCOL_VERSION",
    "Reply",
    "Request",
    "WireError",
    "array_from_wire",
    "array_to_wire",
    "column_from_wire",
    "column_to_wire",
    "decode_reply",
    "decode_request",
    "encode_error",
    "encode_reply",
    "encode_request",
    "peek_rid",
    "rebuild_error",
]
