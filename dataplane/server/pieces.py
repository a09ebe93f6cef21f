"""msgpack written as a list of pieces, a big array a slice per step: how the index encodes a
checkpoint of millions of keys between requests (``server.index.checkpoint``), and a shard its
manifest beside its request loop (``server.shard.checkpoint``), without one long call that holds the
interpreter and without building the file in one buffer.

``encode_list`` encodes a big list a slice per step (a generator, for ``server.jobs``) into a
``Big``: its items' encodings, not joined. ``pieces`` then lays out a structure of dicts and lists
holding ``Big`` values as the buffers of one msgpack document, in order (``b"".join`` of them is
what ``msgspec.msgpack.encode`` would give for the same values):

    >>> from dataplane.server.jobs import run_job
    >>> big = run_job(encode_list(["a", "b", "c"], slice_len=2))
    >>> doc = pieces({"keys": big, "n": 3})
    >>> b"".join(doc) == msgspec.msgpack.encode({"keys": ["a", "b", "c"], "n": 3})
    True
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

_ENCODER = msgspec.msgpack.Encoder()


def _header(n: int, small: int, tag16: int) -> bytes:
    """msgpack's header of an array (``small`` 0x90, ``tag16`` 0xdc) or a map (0x80, 0xde) of ``n``."""
    if n < 16:
        return bytes([small | n])
    if n < 1 << 16:
        return bytes([tag16]) + n.to_bytes(2, "big")
    return bytes([tag16 + 1]) + n.to_bytes(4, "big")


def array_header(n: int) -> bytes:
    return _header(n, 0x90, 0xDC)


def map_header(n: int) -> bytes:
    return _header(n, 0x80, 0xDE)


@dataclass
class Big:
    """An array of ``n`` items, as the encodings of its slices (each without an array header)."""

    n: int
    parts: list[memoryview]
    counts: list[int] = field(default_factory=list)  # items per part

    def extend(self, values: Sequence[Any]) -> None:
        """Append ``values``' encodings (one C call)."""
        self.parts.append(memoryview(_ENCODER.encode(values))[len(array_header(len(values))) :])
        self.counts.append(len(values))
        self.n += len(values)

    def cuts(self) -> list[tuple[int, int]]:
        """(items, bytes) of each part: where a reader can cut the array's encoding to decode it a
        slice at a time (``checkpoint_files.keys_in_slices``)."""
        return [(n, len(part)) for n, part in zip(self.counts, self.parts, strict=True)]


def encode_list(values: Sequence[Any] | np.ndarray, slice_len: int) -> Generator[None, None, Big]:
    """``values`` (a list or a tuple, or a 1-d array: encoded as a list of numbers) encoded
    ``slice_len`` items per step."""
    return encode_parts(values[at : at + slice_len] for at in range(0, len(values), slice_len))


def encode_parts(parts: Iterable[Sequence[Any] | np.ndarray]) -> Generator[None, None, Big]:
    """One list made of ``parts``, in order, encoded a part per step."""
    out = Big(0, [])
    for part in parts:
        if len(part):
            out.extend(part.tolist() if isinstance(part, np.ndarray) else part)
            yield None
    return out


def pieces(value: Any) -> list[bytes | memoryview]:
    """The buffers of ``value``'s msgpack document, in order. Dicts, and lists of dicts, are laid
    out here (they may hold ``Big`` values); anything else is encoded whole."""
    out: list[bytes | memoryview] = []
    _lay_out(value, out)
    return out


def _lay_out(value: Any, out: list[bytes | memoryview]) -> None:
    if type(value) is Big:
        out.append(array_header(value.n))
        out.extend(value.parts)
    elif type(value) is dict:
        out.append(map_header(len(value)))
        for key, item in value.items():
            out.append(_ENCODER.encode(key))
            _lay_out(item, out)
    elif type(value) is list and value and all(type(item) is dict for item in value):
        out.append(array_header(len(value)))
        for item in value:
            _lay_out(item, out)
    else:
        out.append(_ENCODER.encode(value))


__all__ = ["Big", "array_header", "encode_list", "encode_parts", "map_header", "pieces"]
