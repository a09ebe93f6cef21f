"""The files of a store checkpoint: names, checksummed writes and verified reads. No pickle anywhere.

A checkpoint is a directory::

    manifest.json       written last by the process that saved: format, version, the user's metadata,
                        the number of shards, and every other file with its size and checksum
    index.msgpack       the index's metadata (``server.index.checkpoint``): keys, tags, the fields each
                        key holds, schemas, streaming state
    shard-<i>.msgpack   shard i's manifest (``server.shard.checkpoint``): its keys, and per field the
                        chunks of rows, each a column described as the wire describes one
                        (``wire.frames.column_to_wire``: spec, rows, buffer numbers), with every
                        buffer's place in the data file and its checksum
    shard-<i>.bin       shard i's buffers, back to back: row bytes exactly as the shard holds them

Checksums are CRC-32 (ISA-L's: zlib's values at several times zlib's speed; zlib's own when isal is
missing): one per small file in ``manifest.json``, one per buffer of a data file in its shard's
manifest (the buffers tile the data file, so every byte of it is covered, and a shard that reads
part of a file checks the part it reads). Reads never trust a size or offset the files declare: a
buffer must lie inside its file, and a short read, a size that differs from the manifest's or a
checksum that does not match raises ``CheckpointError`` naming the file.

    >>> shard_files(1)
    ('shard-1.msgpack', 'shard-1.bin')
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import msgspec

try:  # ISA-L's CRC-32: the same values as zlib's, several times faster (carry-less multiply)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib's gives the same checksums
    from zlib import crc32

from dataplane.errors import CheckpointError, CheckpointNotFoundError
from dataplane.server.pieces import array_header
from dataplane.wire.decoders import decoder

FORMAT = "rlplane-store-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "index.msgpack"
_TOKEN = re.compile(r"\.rlplane-save-[0-9a-f]{32}")
SLICE = 8 << 20  # bytes checksummed and written (or read and checksummed) at a time


def shard_files(shard: int) -> tuple[str, str]:
    """The manifest and data file names of shard ``shard``."""
    return f"shard-{shard}.msgpack", f"shard-{shard}.bin"


def new_token() -> str:
    """The name of the file a saving process creates in the directory it saves into (``open_dir``)."""
    return f".rlplane-save-{uuid.uuid4().hex}"


def open_dir(directory: str, token: str, who: str) -> int:
    """A descriptor of ``directory``, checked to hold ``token`` (a file the saving process just created
    there): proof that this process sees the same directory, and that the caller could create files in
    it (a store process writes nowhere else). Files are then created relative to the descriptor, so a
    save whose directory was removed meanwhile (its process was killed and a new save began at the
    same path) writes into the removed one, never into the new one. ``CheckpointError`` otherwise."""
    if not os.path.isabs(directory) or not _TOKEN.fullmatch(token):
        raise CheckpointError(directory, f"{directory!r}: not an absolute path and a save token ({token!r})")
    fd = -1
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.stat(token, dir_fd=fd)
    except OSError:
        if fd >= 0:
            os.close(fd)
        raise CheckpointError(
            directory,
            f"{who} cannot reach the checkpoint directory {directory}: the process saving the checkpoint "
            "created it, but it is not there on this node. Put checkpoints on a filesystem every node of "
            "the store mounts at the same path (NFS, Lustre, ...); the previous checkpoint is unchanged",
        ) from None
    return fd


class DataWriter:
    """Appends buffers to a new file, checksumming each one as it goes; ``close`` makes it durable.

    ``append`` returns ``[offset, nbytes, crc32]``, the buffer's entry in a manifest. Each buffer is
    written in slices (``SLICE``), each checksummed just before it is written (while the checksum's
    read left it in the CPU's cache; a helper thread summing beside the I/O measured slower on two
    cores), so a segment goes to the file with one copy (into the page cache) and one extra read.
    """

    def __init__(self, path: str, dir_fd: int | None = None) -> None:
        self.path = path  # relative to ``dir_fd`` when given (``open_dir``)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        self.size = 0

    def append(self, buf: Any) -> list[int]:
        return self.append_all([buf])

    def append_all(self, bufs: list[Any]) -> list[int]:
        """``append`` of the buffers laid end to end, as one (one entry, one checksum)."""
        start, crc = self.size, 0
        for buf in bufs:
            view = memoryview(buf).cast("B")
            for lo in range(0, len(view), SLICE):
                piece = view[lo : lo + SLICE]
                crc = crc32(piece, crc)
                while piece:
                    piece = piece[os.write(self.fd, piece) :]
            self.size += len(view)
        return [start, self.size - start, crc]

    def append_from(self, src_fd: int, src_offset: int, view: memoryview) -> list[int]:
        """``append(view)`` where ``view`` maps the bytes of file ``src_fd`` from ``src_offset`` on (a
        shared-memory segment): the kernel copies them (``sendfile``: no page of ``view`` is touched for
        the copy, only by the checksum beside it)."""
        nbytes, start, crc = len(view), self.size, 0
        for lo in range(0, nbytes, SLICE):
            hi = min(lo + SLICE, nbytes)
            crc = crc32(view[lo:hi], crc)
            while lo < hi:
                sent = _sendfile(self.fd, src_fd, src_offset + lo, hi - lo)
                if sent is None:  # not between these filesystems: through memory
                    sent = os.write(self.fd, view[lo:hi])
                if sent <= 0:
                    raise OSError(errno.EIO, f"writing {self.path} wrote nothing")
                lo += sent
        self.size += nbytes
        return [start, nbytes, crc]

    def close(self) -> int:
        """fsync and close; returns the file's size."""
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = -1
        return self.size

    def abandon(self) -> None:
        """Close without syncing (a failed save: the directory it is in is thrown away)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_small(path: str, data: Any, dir_fd: int | None = None) -> dict[str, int]:
    """Write a small file durably (``data``: a buffer, or a list of them laid end to end); its
    manifest entry ``{"bytes", "crc32"}``."""
    writer = DataWriter(path, dir_fd)
    try:
        _, nbytes, crc = writer.append_all(data if type(data) is list else [data])
        writer.close()
    finally:
        writer.abandon()
    return {"bytes": nbytes, "crc32": crc}


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renamed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_checked(path: str, nbytes: int, who: str = "") -> int:
    """A read-only descriptor of ``path``, checked to hold exactly ``nbytes`` (its manifest's size)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        where = f" ({who} cannot see it: is the directory on a filesystem every node mounts?)" if who else ""
        raise CheckpointNotFoundError(
            path, f"checkpoint file {path} is missing{where}; nothing was loaded"
        ) from None
    except OSError as exc:
        raise CheckpointError(
            path, f"checkpoint file {path} cannot be read ({exc}); nothing was loaded"
        ) from exc
    size = os.fstat(fd).st_size
    if size != nbytes:
        os.close(fd)
        what = "truncated" if size < nbytes else "longer than it was written"
        raise CheckpointError(
            path,
            f"checkpoint file {path} is {what}: {size} bytes, its manifest says {nbytes}; nothing was loaded",
        )
    return fd


_NO_KERNEL_COPY = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int | None:
    """``os.sendfile``, or None where the kernel cannot copy between these two files (the caller then
    copies through memory)."""
    try:
        return os.sendfile(out_fd, in_fd, offset, count)
    except OSError as exc:
        if exc.errno in _NO_KERNEL_COPY:
            return None
        raise


def read_into(
    fd: int, path: str, dst: memoryview, entry: Any, file_size: int, what: str, dst_fd: int = -1
) -> None:
    """Read the buffer ``entry`` (``[offset, nbytes, crc32]`` from a manifest) of the open file ``fd``
    into ``dst`` (exactly ``nbytes`` long), checking its place and its checksum. With ``dst_fd`` (a
    file ``dst`` maps from its start: a shared-memory segment) the kernel copies into it
    (``sendfile``: it allocates the file's pages as it writes them, no zeroing and no page fault of
    ``dst`` for the copy), and the checksum reads ``dst`` beside it."""
    offset, nbytes, crc = _entry(entry, path, what)
    if offset + nbytes > file_size or len(dst) != nbytes:
        raise CheckpointError(
            path, f"checkpoint file {path}: {what} lies outside the file ({offset}+{nbytes} of {file_size})"
        )
    got, done = 0, 0
    if dst_fd >= 0:
        os.lseek(dst_fd, 0, os.SEEK_SET)
    while done < nbytes:
        n = _sendfile(dst_fd, fd, offset + done, min(SLICE, nbytes - done)) if dst_fd >= 0 else None
        if n is None:  # no descriptor, or not between these filesystems: through memory
            dst_fd = -1
            n = os.preadv(fd, [dst[done : done + SLICE]], offset + done)
        if n <= 0:
            raise CheckpointError(path, f"checkpoint file {path} ended early while reading {what}")
        got = crc32(dst[done : done + n], got)  # while the slice is still in the cache
        done += n
    if got != crc:
        raise CheckpointError(
            path,
            f"checkpoint file {path} is corrupted: {what} does not match its checksum; nothing was loaded",
        )


def read_small(path: str, entry: Any, who: str = "") -> bytes:
    """The whole of a small file, checked against its manifest entry ``{"bytes", "crc32"}``."""
    nbytes, crc = _size_crc(entry, path)
    fd = open_checked(path, nbytes, who)
    try:
        buf = bytearray(nbytes)
        read_into(fd, path, memoryview(buf), [0, nbytes, crc], nbytes, "the file")
    finally:
        os.close(fd)
    return bytes(buf)


class _Versioned(Protocol):
    version: int


V = TypeVar("V", bound=_Versioned)


def decode_file(data: bytes, path: str, struct: type[V]) -> V:
    """A msgpack file of a checkpoint decoded as ``struct`` (which has a ``version``), checked."""
    try:
        state = decoder(struct).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            path, f"checkpoint file {path} is malformed ({exc}); nothing was loaded"
        ) from exc
    if state.version != VERSION:
        raise CheckpointError(
            path, f"checkpoint file {path} has format version {state.version}; this release reads {VERSION}"
        )
    return state


def _entry(entry: Any, path: str, what: str) -> tuple[int, int, int]:
    if not (
        isinstance(entry, list | tuple) and len(entry) == 3 and all(type(x) is int and x >= 0 for x in entry)
    ):
        raise CheckpointError(
            path, f"checkpoint manifest entry of {path} ({what}) is malformed: {entry!r:.100}"
        )
    return entry[0], entry[1], entry[2]


def _size_crc(entry: Any, path: str) -> tuple[int, int]:
    try:
        nbytes, crc = entry["bytes"], entry["crc32"]
    except (KeyError, TypeError):
        nbytes = crc = None
    if type(nbytes) is not int or type(crc) is not int or nbytes < 0 or crc < 0:
        raise CheckpointError(
            path, f"the checkpoint manifest's entry for {path} is malformed: {entry!r:.100}"
        )
    return nbytes, crc


# What a shard reads of the index's file (``index.msgpack``, written by ``server.index.checkpoint``)
# to know which rows to load: the two sides share the format, not each other's code.
class PartKeys(msgspec.Struct, kw_only=True):
    """A partition in ``index.msgpack``: its keys and the fields each holds (``layout[i]`` names key
    i's set in ``layouts``: ``check_layout``). ``cuts``: the keys array's encoding as (keys, bytes)
    per slice, so that a shard can decode it a slice at a time (``keys_in_slices``); a file without
    them is read in one slice."""

    pid: str
    keys: list[str]
    layouts: list[list[str]]
    layout: list[int]
    cuts: list[tuple[int, int]] = []


class RawPartKeys(msgspec.Struct):
    """``PartKeys`` with its keys left encoded, to be decoded a slice at a time (``keys_in_slices``)."""

    pid: str
    keys: msgspec.Raw
    layouts: list[list[str]]
    layout: list[int]
    cuts: list[tuple[int, int]] = []


class RawIndexKeys(msgspec.Struct):
    version: int
    partitions: list[RawPartKeys]


def check_layout(keys: int, layouts: list[list[str]], layout: list[int]) -> None:
    """``ValueError`` unless each of ``keys`` keys names one of ``layouts`` (``layout``, by position:
    none past the end, none below zero, which Python would read from the end)."""
    if len(layout) != keys:
        raise ValueError(f"{len(layout)} layouts for {keys} keys")
    if min(layout, default=0) < 0 or max(layout, default=-1) >= len(layouts):
        raise ValueError("a key names a layout that does not exist")


def keys_in_slices(part: RawPartKeys, path: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    """A partition's keys and the fields each holds, a slice (``part.cuts``) at a time: each slice
    is one short C call, so a thread reading a million keys lets other threads run between slices.
    Sizes the file declares are checked, never trusted (``CheckpointError`` naming ``path``).

        >>> from dataplane.server.pieces import encode_list
        >>> from dataplane.server.jobs import run_job
        >>> big = run_job(encode_list(["a", "b", "c"], slice_len=2))
        >>> data = msgspec.msgpack.encode({"pid": "p", "keys": ["a", "b", "c"], "layouts": [["x"]],
        ...                                "layout": [0, 0, 0], "cuts": big.cuts()})
        >>> part = msgspec.msgpack.decode(data, type=RawPartKeys)
        >>> [keys for keys, _ in keys_in_slices(part, "index.msgpack")]
        [['a', 'b'], ['c']]
    """

    def malformed(why: str) -> CheckpointError:
        return CheckpointError(
            path, f"checkpoint file {path} is malformed (partition {part.pid!r}: {why}); nothing was loaded"
        )

    raw = memoryview(part.keys)
    head = raw[0] if len(raw) else -1
    if 0x90 <= head <= 0x9F:
        total, at = head & 0x0F, 1
    elif head in (0xDC, 0xDD):
        width = 2 if head == 0xDC else 4
        total, at = int.from_bytes(raw[1 : 1 + width], "big"), 1 + width
    else:
        raise malformed("its keys are not an array")
    cuts = part.cuts or [(total, len(raw) - at)]
    if any(n < 0 or size < 0 for n, size in cuts) or sum(n for n, _ in cuts) != total:
        raise malformed(f"its cuts do not add up to its {total} keys")
    if sum(size for _, size in cuts) != len(raw) - at:
        raise malformed(f"its cuts do not add up to its keys' {len(raw) - at} bytes")
    try:
        check_layout(total, part.layouts, part.layout)
    except ValueError as exc:
        raise malformed(str(exc)) from None
    done = 0
    for n, size in cuts:
        try:
            keys = decoder(list[str]).decode(array_header(n) + raw[at : at + size])
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise malformed(str(exc)) from exc
        yield keys, list(map(part.layouts.__getitem__, part.layout[done : done + n]))
        at, done = at + size, done + n


__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "PartKeys",
    "RawIndexKeys",
    "RawPartKeys",
    "check_layout",
    "keys_in_slices",
    "MANIFEST",
    "VERSION",
    "DataWriter",
    "open_dir",
    "decode_file",
    "fsync_dir",
    "new_token",
    "open_checked",
    "read_into",
    "read_small",
    "shard_files",
    "write_small",
]
