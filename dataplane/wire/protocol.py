"""The request and reply bodies of every shard and index operation, as typed msgspec structs.

One definition for both ends: the client's operations (``client.ops``, ``client.stream_ops``)
build the request structs and read the reply structs; the servers decode the request structs
(``decode_body``) and answer with instances of the reply structs (``SHARD_REPLIES`` and
``INDEX_REPLIES`` name each op's; ``server.dispatch`` refuses a core whose ``op_<name>`` is annotated
with another; ``wire.requests.reply`` reads one on the client).

Decoding a body is its first validation: a field of the wrong type, a negative size or a missing
key is refused with a ``WireError`` naming the operation and the field before any handler code
runs. Every number has a range, so no value a peer can send overflows anything the server computes
from it: integers fit int64 (sizes and ids are never negative, a frame index is below
``MAX_FRAMES``, a count of rows or ranks is below 2**31), and a timeout is a finite number of
seconds between 0 and ``MAX_TIMEOUT_S`` (``inf``, ``nan`` and ``1e306`` are refused; ``None`` waits
for ever). What types cannot say (sizes against capacity, frame lengths against declared sizes, unique
keys) the handlers check next, still before they change anything. A body travels as a msgpack map
(field name -> value, defaults left out), so a peer may also send a plain dict of the same names.

    >>> decode_body("clear", msgspec.msgpack.encode({"partition": "p", "keys": ["a"]}), SHARD_OPS)
    Clear(partition='p', keys=['a'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar, cast

import msgspec

from dataplane.config import INT64_MAX, MAX_TIMEOUT_S
from dataplane.errors import WireError
from dataplane.wire.decoders import decoder

MAX_FRAMES = 1 << 16  # buffer frames one request may carry (a put sends at most two per field)
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
Tag = dict[str, Any]  # a key's tag: plain values only (``client.ops._check_tags``)
Tags = list[Tag | None] | None


# Messages never form reference cycles, so the garbage collector need not track them (gc=False); a
# field at its default is not sent (omit_defaults).
class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
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
    partition: str
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
    partition: str
    keys: list[str]
    fields: list[str] | None = None
    shm: bool = False
    export: bool = False
    version: Version = -1


class Clear(_Body):
    partition: str
    keys: list[str]


class OnePartition(_Body):
    partition: str


class Stats(_Body):
    trim: bool = False


TxnId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]


class Prepare(_Body):
    """``txn`` is chosen by the client (at random), so it can abort a prepare whose answer it never saw."""

    partition: str
    specs: dict[str, WireSpec]
    txn: TxnId


class IndexCommit(_Body):
    partition: str
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
    partition: str
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

    partition: str
    task: str
    fields: list[str]
    min_rows: Count = 1
    limit: Positive = 1 << 20
    dp_rank: Count | None = None
    batch_index: NonNegative | None = None  # (the bridge derives 62-bit ones from a hash)
    timeout_s: Timeout | None = None


class Claim(_Body):
    partition: str
    task: str
    fields: list[str]
    keys: list[str]
    dp_rank: Count | None = None
    batch_index: NonNegative | None = None  # (the bridge derives 62-bit ones from a hash)
    take: TakeId | None = None
    lease_s: LeaseS | None = None


class Release(_Body):
    """Give back what take ``take`` got (a call its consumer gave up on, or a lease it lets go)."""

    partition: str
    task: str
    take: TakeId


class Ack(_Body):
    """The consumer is done with ``keys`` of leased take ``take``: they stay taken for good."""

    partition: str
    task: str
    take: TakeId
    keys: list[str]


class Reset(_Body):
    partition: str
    task: str | None = None


class Consumption(_Body):
    partition: str
    task: str
    fields: list[str] | None = None


class Consumed(_Body):
    """The keys ``task`` has taken among ``limit`` keys of the partition from ``cursor`` on (a
    ``ConsumedReply.cursor``; None: its first key): one page, costing the index ``limit`` lookups."""

    partition: str
    task: str
    limit: Positive
    cursor: str | None = None


class Tasks(_Body):
    """The consumer tasks of partition ``partition`` with their counts, and the partition's rows, fields and
    whether it is finished (``rlplane store status --watch``)."""

    partition: str


class ListKeys(_Body):
    """Keys with their tags: of every partition, or of one; with ``limit``, one page of at most
    ``limit`` keys of the named partition from ``cursor`` on (a ``ListReply.cursor``; None: its
    first key). ``limit=0`` with no partition names every partition, with no keys."""

    partition: str | None = None
    limit: Count | None = None
    cursor: str | None = None


class Resolve(_Body):
    partition: str
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
    "put_ready": PutReady,  # reserve and commit inline rows at once, then commit them in the index
    "commit": Commit,
    "abort": Abort,
    "get": Get,
    "clear": Clear,
    "clear_partition": OnePartition,
    "stats": Stats,
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


# ---- replies ------------------------------------------------------------------------------------
# What each op answers: its handler returns an instance (``server.dispatch`` checks the annotation
# against these tables), encoded as a map of its fields, those at their default left out, which the
# client's struct reads back as the same defaults. A reply may carry fields this version does not read
# (a newer peer's): they are ignored, not refused.


class _Reply(msgspec.Struct, omit_defaults=True, gc=False):
    pass


class Done(_Reply):
    """The answer of an op that only says it happened."""


class Pending(_Reply, omit_defaults=False):
    """What a waiting op (``next``, ``ready``) answers when a core runs it once, outside its server, while
    its rows are not ready (the server parks such a request instead: no client is sent this)."""

    pending: bool = True


FileRef = list[int]  # a shared-memory file: [file_id, fd, size, inode, slot, generation]
ErrorFields = list[Any]  # [error class name, message, culprit attributes] (``frames.error_fields``)


class ReserveReply(_Reply):
    """The reservation's id and, per field written through shared memory, the file to write into;
    ``live`` (the shard's live file ids) when the request's ``version`` was not the current one."""

    resv: int
    files: dict[str, FileRef]
    version: int
    live: list[int] | None = None


class CommitReply(_Reply):
    """The index recorded a put: every field its keys now hold, and their merged tags."""

    fields: list[str]
    tags: list[Tag]


class PutReadyReply(_Reply):
    """The index's ``CommitReply`` passed on by the shard, or ``index_error``: the shard stored the
    rows but whether the index recorded them is unknown."""

    fields: list[str] = []
    tags: list[Tag] = []
    index_error: ErrorFields | None = None


class InlineRows(_Reply, tag_field="t", tag="z"):
    """A field's rows sent inline as frames."""

    col: WireColumn


# A segment of a shared-memory answer: its file, bytes, rows, offsets frame (-1: none), whether the
# client may return a view of it (exported), its spec, and its shapes frame (-1: none).
SegmentRef = tuple[FileRef, int, int, int, bool, WireSpec, int]


class SegmentRows(_Reply, tag_field="t", tag="s"):
    """A field's rows where they lie in shared memory: per requested key its segment (``seg``, an
    int64 frame of indexes into ``segs``) and its row there (``row``, another frame)."""

    segs: list[SegmentRef]
    seg: FrameIndex
    row: FrameIndex


class GetReply(_Reply):
    fields: dict[str, InlineRows | SegmentRows]
    version: int
    live: list[int] | None = None


class RemovedReply(_Reply):
    removed: int


class ShardStatsReply(_Reply):
    shard: int
    bytes_used: int
    bytes_reserved: int
    reservations_expired: int
    ready_puts: int
    ready_batches: int
    bytes_resident: int
    bytes_warm: int
    bytes_heap: int
    capacity_bytes: int | None
    shm_files: int
    partitions: dict[str, int]
    partition_bytes: dict[str, int]
    clients: int | None = None  # (added by the shard's server loop: its open connections)


class PrepareReply(_Reply):
    txn: int


class CommitResult(_Reply):
    """One commit of a ``commits`` request: its ``CommitReply``, or the error that refused it."""

    ok: CommitReply | None = None
    err: ErrorFields | None = None


class CommitsReply(_Reply):
    results: list[CommitResult]


class ExistedReply(_Reply):
    existed: bool


class BatchReply(_Reply):
    """Rows handed to a consumer (``next``, ``claim``, a cached ``ready``): their keys, tags and the
    fields asked for; ``lease`` is the take id when they are leased."""

    keys: list[str]
    tags: list[Tag]
    fields: list[str]
    finished: bool = False
    lease: str | None = None


class ReadyReply(_Reply):
    """Ready rows ``[key, tag]`` for a client-side sampler; or, when ``cached``, the batch this rank and
    batch index got before (``keys``, ``tags``, ``fields``, ``lease`` as in ``BatchReply``)."""

    cached: bool = False
    rows: list[tuple[str, Tag]] = []
    finished: bool = False
    keys: list[str] = []
    tags: list[Tag] = []
    fields: list[str] = []
    lease: str | None = None


class ReleaseReply(_Reply):
    released: int
    known: bool


class AckReply(_Reply):
    late: list[str]


class ConsumptionReply(_Reply):
    """A consumer task's progress on a partition (``dp.consumption``)."""

    total: int
    produced: int
    consumed: int
    ready: int
    leased: int
    finished: bool
    fields: list[str]
    drained: bool = False  # finished, nothing ready and nothing leased: ``next_batch`` answers empty at once


class ConsumedReply(_Reply):
    """The page's taken keys, in key order, and where the next page starts (None: this was the last)."""

    keys: list[str]
    cursor: str | None = None


class TaskProgress(_Reply):
    taken: int
    ready: int
    leased: int
    fields: list[str]
    idle_s: float | None = None  # seconds since it last took or acknowledged rows here (or first asked)


class TasksReply(_Reply):
    rows: int
    fields: list[str]
    finished: bool
    tasks: dict[str, TaskProgress]


class ListReply(_Reply):
    """``{partition: {key: tag}}``; for a page, where the next one starts (None: this was the last)."""

    list: dict[str, dict[str, Tag]]
    cursor: str | None = None


class ResolveReply(_Reply):
    """Which asked keys the index knows (with the fields each holds), which it remembers cleared (it
    remembers ``cleared_kept`` per partition); ``error`` when the partition is not there."""

    partition: bool
    known: dict[str, list[str]]
    cleared: list[str] = []
    cleared_kept: int = 0
    error: str | None = None


class IndexStatsReply(_Reply):
    """Rows per partition and the prepared puts' counts; per partition also the seconds since its last
    put, take or ack (``idle``), and which are finished and which drained by every consumer task
    (``rlplane store status --watch`` orders and sums partitions by them)."""

    partitions: dict[str, int]
    puts: dict[str, int]
    idle: dict[str, float] = {}
    finished: list[str] = []
    drained: list[str] = []


FileEntry = dict[str, Any]  # a checkpoint file's manifest entry (``server.checkpoint_files``)


class CheckpointSaveReply(_Reply):
    save: int
    file: FileEntry
    partitions: dict[str, int]


class CheckpointFinishReply(_Reply):
    file: FileEntry
    partitions: dict[str, int]


class CheckpointStageReply(_Reply):
    load: int
    partitions: dict[str, int]
    existing: list[str]


# What a shard answers the checkpoint's Ray calls (``ShardActor.checkpoint_save`` / ``checkpoint_stage``,
# read by ``dataplane.checkpoint``): not wire ops (the shard's request loop keeps serving while a
# checkpoint's files are written or read), but typed here all the same, so mypy checks both ends.


class ShardSaveReply(_Reply):
    """A shard's part of a save: its files' manifest entries, its rows saved per partition, the bytes
    of its data file, and the keys of the index's snapshot it no longer held (cleared meanwhile)."""

    files: dict[str, FileEntry]
    rows: dict[str, int]
    bytes: int
    missing: dict[str, list[str]]


class ShardStageReply(_Reply):
    """A shard's part of a load, staged aside: its rows per partition and the bytes they take."""

    rows: dict[str, int]
    bytes: int


SHARD_REPLIES: dict[str, type[msgspec.Struct]] = {
    "reserve": ReserveReply,
    "put_ready": PutReadyReply,
    "commit": Done,
    "abort": Done,
    "get": GetReply,
    "clear": RemovedReply,
    "clear_partition": RemovedReply,
    "stats": ShardStatsReply,
}

INDEX_REPLIES: dict[str, type[msgspec.Struct]] = {
    "prepare": PrepareReply,
    "commit": CommitReply,
    "commits": CommitsReply,
    "abort": Done,
    "clear": RemovedReply,
    "clear_partition": ExistedReply,
    "list": ListReply,
    "resolve": ResolveReply,
    "stats": IndexStatsReply,
    "next": BatchReply,
    "ready": ReadyReply,
    "claim": BatchReply,
    "release": ReleaseReply,
    "ack": AckReply,
    "finish": Done,
    "reset": Done,
    "consumption": ConsumptionReply,
    "consumed": ConsumedReply,
    "checkpoint_save": CheckpointSaveReply,
    "checkpoint_finish": CheckpointFinishReply,
    "checkpoint_stage": CheckpointStageReply,
    "checkpoint_install": Done,
    "checkpoint_drop": Done,
    "tasks": TasksReply,
}


def decode_body(
    op: str, raw: Any, table: Mapping[str, type[msgspec.Struct]], service: str = "this service"
) -> Any:
    """The typed body of operation ``op`` from its raw msgpack bytes; ``WireError`` naming ``service``
    for an operation ``table`` lacks, and naming the op for a malformed body."""
    cls = table.get(op) if type(op) is str else None
    if cls is None:
        raise WireError(f"unknown operation {op!r}; {service} knows {sorted(table)}")
    try:
        return decoder(cls).decode(raw)
    except msgspec.ValidationError as exc:  # the message names the field: "... - at `$.timeout_s`"
        raise WireError(
            f"malformed {op!r} request: {exc} (every number must be finite and within its range: "
            "sizes and ids in 0..2**63-1, counts in 0..2**31-1, timeouts in seconds 0..1e9)"
        ) from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"malformed {op!r} request: {exc}") from exc


T = TypeVar("T")


def encoded(value: T) -> T:
    """``value`` encoded as msgpack now, standing in for itself in a request struct (the encoder copies
    the bytes as they are): what a client encodes to check that it can be sent, it sends, with no
    second encode. ``TypeError`` / ``OverflowError`` for a value msgpack cannot carry."""
    return cast(T, msgspec.Raw(msgspec.msgpack.encode(value)))


def unique_keys(keys: list[str], op: str) -> list[str]:
    """``keys`` if no key repeats, else ``WireError`` naming the first repeated key."""
    if len(set(keys)) != len(keys):
        raise WireError(f"{op!r} request names key {first_repeat(keys)!r} twice")
    return keys


def first_repeat(items: list[str]) -> str | None:
    """The first item of ``items`` that an earlier one repeats (None: all distinct)."""
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


__all__ = [
    "INDEX_OPS",
    "INDEX_REPLIES",
    "SHARD_OPS",
    "SHARD_REPLIES",
    "WAITING_OPS",
    "WireColumn",
    "decode_body",
    "encoded",
    "unique_keys",
]
