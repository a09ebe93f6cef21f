"""The request bodies of every shard and index operation, as typed msgspec structs.

Decoding a body is its first validation: a field of the wrong type, a negative size or a missing
key is refused with a ``WireError`` naming the operation and the field before any handler code
runs. Every number has a range, so no value a peer can send overflows anything the server computes
from it: integers fit int64 (sizes and ids are never negative, a frame index is below
``MAX_FRAMES``, a count of rows or ranks is below 2**31), and a timeout is a finite number of
seconds between 0 and ``MAX_TIMEOUT_S`` (``inf``, ``nan`` and ``1e306`` are refused; ``None`` waits
for ever). What types cannot say (sizes against capacity, frame lengths against declared sizes, unique
keys) the handlers check next, still before they change anything. Clients send plain dicts with
the same field names; msgpack encodes both alike.

    >>> decode_body("ping", msgspec.msgpack.encode({}), SHARD_OPS)
    Ping()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from dataplane.config import INT64_MAX, MAX_TIMEOUT_S
from dataplane.errors import WireError
from dataplane.wire.frames import MAX_FRAMES

MAX_COUNT = 2**31 - 1  # rows of a batch, ranks, group sizes: far beyond any real one, far below overflow

Int64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # a byte size, an id
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]  # rows, ranks, batch indexes
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
FrameIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_FRAMES)]
OptionalFrame = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_FRAMES)]  # -1: no such frame
Version = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]  # -1: the client knows no version yet
Timeout = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT_S)]  # nan fails both bounds
WireSpec = tuple[str, str, list[Int64]]  # kind, dtype, shape (see _wire.spec_to_wire; the codec checks dims)
Tags = list[dict[str, Any] | None] | None


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


class WireColumn(_Body):
    """A column sent inline: its spec and the frame indexes of its data (and offsets, or -1)."""

    spec: WireSpec
    rows: NonNegative
    data: FrameIndex
    offsets: OptionalFrame = -1
    shapes: OptionalFrame = -1


class ReserveField(_Body):
    spec: WireSpec
    nbytes: NonNegative
    col: WireColumn | None = None


class Reserve(_Body):
    pid: str
    keys: list[str]
    fields: dict[str, ReserveField]
    version: Version = -1


class PutReady(Reserve):
    """A one-step put (every column inline) that the shard then makes ready in the index itself:
    ``tags`` are passed on to the index's commit."""

    tags: Tags = None


class Commit(_Body):
    resv: NonNegative
    offsets: dict[str, FrameIndex] = {}
    shapes: dict[str, FrameIndex] = {}


class Abort(_Body):
    resv: NonNegative


class Get(_Body):
    pid: str
    keys: list[str]
    fields: list[str] | None = None
    shm: bool = False
    export: bool = False
    version: Version = -1


class Clear(_Body):
    pid: str
    keys: list[str]


class OnePartition(_Body):
    pid: str


class Stats(_Body):
    trim: bool = False


class Ping(_Body):
    pass


TxnId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]


class Prepare(_Body):
    """``txn`` is chosen by the client (at random), so it can abort a prepare whose answer it never saw."""

    pid: str
    specs: dict[str, WireSpec]
    txn: TxnId


class IndexCommit(_Body):
    pid: str
    keys: list[str]
    fields: list[str] = []
    tags: Tags = None
    txn: TxnId | None = None
    specs: dict[str, WireSpec] | None = None  # a put without prepare: the index checks them here


class Commits(_Body):
    """Several independent commits in one request (a shard passing on the puts it stored)."""

    items: list[IndexCommit]


class IndexAbort(_Body):
    txn: TxnId


# A take id: chosen by the consumer's client per call (``uuid4().hex``), so that a call it gave up on
# can be given back by id (``Release``) whether or not its reply ever reached it.
TakeId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
# How long a leased batch stays with its consumer before it is given back unless acknowledged.
MAX_LEASE_S = 7 * 24 * 3600.0
LeaseS = Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_S)]


class Next(_Body):
    pid: str
    task: str
    batch_size: Positive
    fields: list[str]
    sampler: dict[str, Any] | None = None
    dp_rank: Count | None = None
    dp_size: Positive | None = None
    batch_index: NonNegative | None = None  # (the bridge derives 62-bit ones from a hash)
    timeout_s: Timeout | None = None
    take: TakeId | None = None
    lease_s: LeaseS | None = None


class Ready(_Body):
    """Rows ready for a client-side sampler: wait until ``min_rows`` are (or the partition is finished)."""

    pid: str
    task: str
    fields: list[str]
    min_rows: Count = 1
    limit: Positive = 1 << 20
    dp_rank: Count | None = None
    batch_index: NonNegative | None = None  # (the bridge derives 62-bit ones from a hash)
    timeout_s: Timeout | None = None


class Claim(_Body):
    pid: str
    task: str
    fields: list[str]
    keys: list[str]
    dp_rank: Count | None = None
    batch_index: NonNegative | None = None  # (the bridge derives 62-bit ones from a hash)
    take: TakeId | None = None
    lease_s: LeaseS | None = None


class Release(_Body):
    """Give back what take ``take`` got (a call its consumer gave up on, or a lease it lets go)."""

    pid: str
    task: str
    take: TakeId


class Ack(_Body):
    """The consumer is done with ``keys`` of leased take ``take``: they stay taken for good."""

    pid: str
    task: str
    take: TakeId
    keys: list[str]


class Reset(_Body):
    pid: str
    task: str | None = None


class Consumption(_Body):
    pid: str
    task: str
    fields: list[str] | None = None


class Consumed(_Body):
    pid: str
    task: str


class Tasks(_Body):
    """The consumer tasks of partition ``pid`` with their counts, and the partition's rows, fields and
    whether it is finished (``rlplane store status --watch``)."""

    pid: str


class ListKeys(_Body):
    pid: str | None = None


class Resolve(_Body):
    pid: str
    keys: list[str]


class CheckpointSave(_Body):
    """The index writes its metadata into a checkpoint directory being saved (``path``, where the
    saving process created the file ``token``: proof that the index sees the same directory)."""

    path: str
    token: str


class CheckpointFinish(_Body):
    """A save's shards are done: keys a shard no longer held (cleared meanwhile) leave the metadata."""

    save: NonNegative
    missing: dict[str, list[str]] = {}


class CheckpointStage(_Body):
    """The index reads and checks a checkpoint's metadata (``bytes`` / ``crc32`` from its manifest)
    and holds it, installed by ``CheckpointInstall`` once every shard has its rows."""

    path: str
    bytes: NonNegative
    crc32: NonNegative


class CheckpointInstall(_Body):
    load: NonNegative
    overwrite: bool = False


class CheckpointDrop(_Body):
    """Forget a save's snapshot or a staged load (the checkpoint failed elsewhere)."""

    id: NonNegative


SHARD_OPS: dict[str, type[msgspec.Struct]] = {
    "reserve": Reserve,
    "put": Reserve,  # reserve and commit at once: inline columns only
    "put_ready": PutReady,  # the same, then the shard commits the rows in the index (see shard_actor)
    "commit": Commit,
    "abort": Abort,
    "get": Get,
    "clear": Clear,
    "clear_partition": OnePartition,
    "stats": Stats,
    "ping": Ping,
}

INDEX_OPS: dict[str, type[msgspec.Struct]] = {
    "prepare": Prepare,
    "commit": IndexCommit,
    "commits": Commits,
    "abort": IndexAbort,
    "clear": Clear,
    "clear_partition": OnePartition,
    "list": ListKeys,
    "resolve": Resolve,
    "stats": Stats,
    "ping": Ping,
    "next": Next,
    "ready": Ready,
    "claim": Claim,
    "release": Release,
    "ack": Ack,
    "finish": OnePartition,
    "reset": Reset,
    "consumption": Consumption,
    "consumed": Consumed,
    "checkpoint_save": CheckpointSave,
    "checkpoint_finish": CheckpointFinish,
    "checkpoint_stage": CheckpointStage,
    "checkpoint_install": CheckpointInstall,
    "checkpoint_drop": CheckpointDrop,
    "tasks": Tasks,
}
WAITING_OPS = frozenset({"next", "ready"})  # answered when rows are ready (or at their timeout)

_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def decode_body(
    op: str, raw: Any, table: Mapping[str, type[msgspec.Struct]], service: str = "this service"
) -> Any:
    """The typed body of operation ``op`` from its raw msgpack bytes; ``WireError`` naming ``service``
    for an operation ``table`` lacks, and naming the op for a malformed body."""
    cls = table.get(op) if type(op) is str else None
    if cls is None:
        raise WireError(f"unknown operation {op!r}; {service} knows {sorted(table)}")
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return dec.decode(raw)
    except msgspec.ValidationError as exc:  # the message names the field: "... - at `$.timeout_s`"
        raise WireError(
            f"malformed {op!r} request: {exc} (every number must be finite and within its range: "
            "sizes and ids in 0..2**63-1, counts in 0..2**31-1, timeouts in seconds 0..1e9)"
        ) from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"malformed {op!r} request: {exc}") from exc


def unique_keys(keys: list[str], op: str) -> list[str]:
    """``keys`` if no key repeats, else ``WireError`` naming the first repeated key."""
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise WireError(f"{op!r} request names key {dup!r} twice")
    return keys


__all__ = ["INDEX_OPS", "SHARD_OPS", "WAITING_OPS", "WireColumn", "decode_body", "unique_keys"]
