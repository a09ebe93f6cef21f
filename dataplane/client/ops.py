"""The KV operations, written once, sans-IO: each is a generator over request batches.

An operation yields a list of ``Call`` s (requests to shards and/or the index that may run in
parallel) and receives the list of results; it returns its value with ``return``. The sync client
drives these generators with blocking sockets, the async client with ``zmq.asyncio``
(``handle.drive`` / ``handle.adrive``), so the two never drift.

Round trips (R = one parallel batch of requests, at most one per shard plus the index):
    put   3R: [index.prepare + shard.reserve], [shard.commit], [index.commit]
          (shared memory: the client copies into the reserved segments after the first; the index
          commits last, so no row is listed or handed out before the shards can serve it)
          1R for a small put to one shard of a known schema: [shard.put_ready] (the shard stores
          the rows, then commits them in the index, then answers)
    get   1R: shard.get per shard (index.resolve only to explain a missing key)
    clear 1R, list 1R (index only), stats 1R.
``dataplane.api`` calls these directly with its client's ``Route``.
Streaming operations are in ``stream_ops``.

Sans-IO for real: nothing here opens a socket or maps a file. Each request is its op's struct from
``dataplane.wire.protocol`` (the one definition the servers decode), each reply is read as the op's
reply struct there (``wire.requests.reply``); calls and results are ``dataplane.wire.requests``'s.
The operations take keys checked once by their caller (``check_keys``). Shared memory is read
and written through the ``SharedMemory`` the route carries (``dataplane.client.memory``), so a
test can step every operation with scripted replies and bytearrays (``tests/dataplane/test_ops.py``).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, TypeVar

import numpy as np

from dataplane.client.memory import SegmentUnavailable, SharedMemory
from dataplane.client.sharding import Placement
from dataplane.codec.column_types import Column
from dataplane.codec.paths import CopyPath
from dataplane.codec.plain import plain_value
from dataplane.codec.rows import assemble, assemble_any, contiguous_view, nbytes_of
from dataplane.errors import (
    BatchSizeError,
    DataplaneError,
    FieldNotFoundError,
    KeyNotFoundError,
    PartitionNotFoundError,
    ReservationExpiredError,
    SchemaError,
    SerializationError,
    ShardUnavailableError,
    WireError,
    did_you_mean,
)
from dataplane.meta import KVBatchMeta, check_partition
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, Call, R, Result, reply

if TYPE_CHECKING:  # (the codec's device module imports torch: only a device copy loads it)
    from dataplane.codec.device import DeviceColumn

T = TypeVar("T")
# An operation: it yields rounds of calls, is sent their results, and returns its result (a T).
Op: TypeAlias = Generator[list[Call], list[Result], T]
# A column of a put or a get: in host memory, or (``codec.device``) on a GPU.
AnyColumn: TypeAlias = "Column | DeviceColumn"


@dataclass
class Route:
    """What an operation needs to know about the store (built by the client at attach time)."""

    placement: Placement
    shm: list[bool]  # per shard: this client maps the shard's segments directly
    memory: SharedMemory  # the shards' files: views are asked for only where ``shm`` is true
    shm_min_bytes: int
    commit_within_s: float  # a put commits only this soon after reserving (< reservation_timeout_s)
    rpc_timeout_s: float = 60.0
    # partition -> its fields' confirmed families
    schemas: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)


def check_keys(keys: Any, partition_id: Any) -> list[str]:
    """``keys`` as a list of distinct str (the operations take keys checked by this, once), else
    ``TypeError`` / ``ValueError`` naming the culprit."""
    check_partition(partition_id)
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of str, not the str {keys!r} (use [key])")
    out: list[str] = list(keys)
    for k in out:
        if type(k) is not str:
            raise TypeError(f"keys must be str, got {k!r} ({type(k).__name__})")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate key {_protocol.first_repeat(out)!r} in one call")
    return out


def _raise_first(results: list[Result]) -> None:
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        raise errs[0]


def _reply(result: Result, cls: type[R]) -> R:
    """The reply struct of a call that succeeded; its error if it failed."""
    if isinstance(result, BaseException):
        raise result
    return reply(result[0], cls)


# ---- put ------------------------------------------------------------------------------------------


def _check_tags(tags: Any, n: int) -> _protocol.Tags:
    """``tags`` as a list of ``n`` plain dicts (or None), refused with TypeError before anything is sent,
    and encoded for the wire (once: ``_protocol.encoded``).

    Tags travel as msgpack to the index, so a value msgpack cannot carry (a numpy scalar, a tensor,
    an int beyond 64 bits) is named here, not discovered after the shards committed.
    """
    if tags is None:
        return None
    if isinstance(tags, (str, bytes, dict)):
        raise TypeError(f"tags must be a list of one dict (or None) per key, not a {type(tags).__name__}")
    tags = list(tags)
    if len(tags) != n:
        raise BatchSizeError(f"{len(tags)} tags for {n} keys; pass one tag dict per key")
    out: list[dict[str, Any] | None] = []
    for i, t in enumerate(tags):
        if t is not None and type(t) is not dict:
            raise TypeError(f"tags[{i}] must be a dict or None, got {type(t).__name__}")
        try:
            out.append(None if t is None else plain_value(t, f"tags[{i}]"))
        except SerializationError:  # plain, but nested too deep: its message says so and names the limit
            raise
        except TypeError as exc:
            culprit = str(exc).split(";")[0]
            raise TypeError(
                f"{culprit}: a tag holds only plain values (str, int, float, bool, None, and lists, tuples "
                "and dicts of them); convert it first (e.g. x.item() for a numpy or torch scalar)"
            ) from None
    try:
        return _protocol.encoded(out)
    except (TypeError, OverflowError, UnicodeEncodeError) as exc:
        raise TypeError(f"tags cannot be stored: {exc}") from exc


def put(
    route: Route, keys: list[str], partition_id: str, columns: dict[str, AnyColumn] | None, tags: Any
) -> Op[KVBatchMeta]:
    """Write ``columns`` (already encoded, one row per key) and/or ``tags`` of ``keys`` (checked:
    ``check_keys``); returns a KVBatchMeta.

    All or nothing: everything is checked before the first request; the index decides new fields'
    schemas in the first round (``prepare``), together with the shards' reservations, and any
    failure there aborts every reservation and the prepare, whether or not the index answered it
    (``_abort_put``): a put that fails before its shards commit decides no schema. A put that stalls
    between reserve and commit past most of ``reservation_timeout_s`` aborts instead of committing
    (the shards would have fenced it, and the index expired its prepare).

    The shards commit before the index does: the index's commit is what makes rows listed and
    ready for consumers (``next_batch``), so a row is never handed out before every shard holding
    it can serve it, and a put whose shard commit failed is never made ready.

    A small put to one shard of fields whose schema this client has seen confirmed takes one round
    trip (``_put_ready``): the shard stores the inline rows at once, then commits them in the index
    itself (which checks the schema again) before it answers.

    A field on a GPU (``codec.device.DeviceColumn``) is copied straight from the device into the
    reserved segment where the route's memory registers that mapping (``SharedMemory.pin``), else
    staged through a pinned buffer; its copies finish before any commit is sent.
    """
    wire_tags = _check_tags(tags, len(keys))
    columns = columns or {}
    for name, col in columns.items():
        if col.num_rows != len(keys):
            raise BatchSizeError(f"field {name!r} has {col.num_rows} rows for {len(keys)} keys")
    if not columns or not keys:
        (res,) = yield [_index_commit(partition_id, keys, list(columns), wire_tags)]
        return _meta(keys, partition_id, _reply(res, _protocol.CommitReply))
    placement = route.placement
    groups = None
    if partition_id in route.schemas:  # perhaps a one-step put (``_put_ready``)
        if placement.num_shards == 1 or len(keys) == 1:
            s = 0 if placement.num_shards == 1 else placement.shard_of(partition_id, keys[0])
        else:
            groups = placement.group(partition_id, keys)
            s = next(iter(groups)) if len(groups) == 1 else -1
        ready = _put_ready_call(route, s, keys, partition_id, columns, wire_tags) if s >= 0 else None
        if ready is not None:
            return (yield from _put_ready(route, ready, keys, partition_id))
    if groups is None:
        groups = placement.group(partition_id, keys)
    shards = sorted(groups)
    specs = {name: _wire.spec_to_wire(col.spec) for name, col in columns.items()}  # (once per put)
    plans: dict[int, dict[str, int]] = {}
    reserves = []
    for s in shards:
        call, plans[s] = _reserve_call(route, s, partition_id, keys, groups[s], columns, specs)
        reserves.append(call)
    txn = secrets.randbits(63) or 1  # this put's id at the index, ours to choose (see _abort_put)
    started = time.monotonic()
    prepare = Call(INDEX, "prepare", _protocol.Prepare(partition_id, specs, txn))
    results = yield [prepare, *reserves]
    prepared, reserved = results[0], dict(zip(shards, results[1:], strict=True))
    replies = {s: _reply(r, _protocol.ReserveReply) for s, r in reserved.items() if _ok(r)}
    aborts = [Call(s, "abort", _protocol.Abort(r.resv)) for s, r in replies.items()]
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        yield from _abort_put(route, aborts, txn, prepared)
        raise errs[0]
    aborts.append(_index_abort(txn))
    commits = []
    try:
        for s in shards:
            got = replies[s]
            if got.live is not None:  # forget mappings of files the shard has closed since we last looked
                route.memory.prune(s, got.version, got.live)
            commits.append(_fill_segments(route, s, got, groups[s], columns, plans[s]))
        _sync(columns)  # device copies into the segments: done before any shard commits them
    except BaseException as exc:  # e.g. a segment could not be mapped: undo every reservation, then raise
        with contextlib.suppress(Exception):  # (the first error is the one raised; the aborts go)
            _sync(columns)  # no copy may still be writing into a segment once its reservation is gone
        yield aborts
        took = time.monotonic() - started
        if isinstance(exc, SegmentUnavailable) and took > route.commit_within_s:
            # The shard expired the reservation (this process stalled past reservation_timeout_s) and
            # closed its segment: the documented error, not the OSError of the closed file.
            raise _expired(keys, partition_id, took, route) from exc
        raise
    took = time.monotonic() - started
    if took > route.commit_within_s:
        yield aborts
        raise _expired(keys, partition_id, took, route)
    results = yield commits
    if not all(_ok(r) for r in results):
        yield [_index_abort(txn)]
        _raise_partial_put([*results, None], shards, groups, keys, partition_id)
    (res,) = yield [_index_commit(partition_id, keys, list(columns), wire_tags, txn)]
    _raise_partial_put([*results, res], shards, groups, keys, partition_id)
    _remember_schema(route, partition_id, columns)
    return _meta(keys, partition_id, _reply(res, _protocol.CommitReply))


def _sync(columns: dict[str, AnyColumn]) -> None:
    """Wait for the device copies of a put's columns (host columns have none)."""
    for col in columns.values():
        if not isinstance(col, Column):
            col.sync()


def _host(col: AnyColumn) -> Column:
    """``col``'s rows in host memory (a device column's are staged through a pinned buffer, once)."""
    return col if isinstance(col, Column) else col.host()


def _index_commit(
    partition: str, keys: list[str], fields: list[str], tags: _protocol.Tags, txn: int | None = None
) -> Call:
    """The index's ``commit`` of a put: ``keys`` now hold ``fields`` and ``tags``; ``txn`` is the prepare
    it completes (None: a put that prepared nothing, of tags only or of no keys). (The one place that
    builds a client's index commit.)"""
    return Call(INDEX, "commit", _protocol.IndexCommit(partition, keys, fields, tags, txn))


def _index_abort(txn: int) -> Call:
    """The index's ``abort`` of put ``txn``'s prepare. (The one place that builds one.)"""
    return Call(INDEX, "abort", _protocol.IndexAbort(txn))


ABORT_WAIT_S = 1.0  # most a failed put waits for an index that did not answer its prepare to take the abort


def _abort_put(route: Route, aborts: list[Call], txn: int, prepared: Result) -> Op[None]:
    """Undo a put that failed in its first round: the reservations that succeeded (``aborts``) and
    the prepare ``txn``, answered or not.

    A prepare the index did not answer (stalled longer than ``rpc_timeout_s``, or its reply lost)
    may still reach it, and would decide the put's new fields: the abort follows it, and the index
    refuses a prepare whose abort came first. That abort goes in a round of its own and waits at
    most ``ABORT_WAIT_S``: a silent index would otherwise hold the put's error back for a second
    ``rpc_timeout_s``, and once sent, the abort reaches a stalled index when it runs again (on the
    Unix lane it is in the kernel's buffer already). If it never does, the prepare expires with
    the reservations, after ``reservation_timeout_s``.
    """
    index_abort = _index_abort(txn)
    answered = _ok(prepared) or not isinstance(prepared, ShardUnavailableError)
    if answered:  # (even refused: the index is answering, so its abort goes with the shards')
        aborts = [*aborts, index_abort]
    if aborts:
        yield aborts
    if not answered:
        index_abort.timeout = min(route.rpc_timeout_s, ABORT_WAIT_S)
        yield [index_abort]


def _expired(keys: list[str], partition: str, took: float, route: Route) -> ReservationExpiredError:
    return ReservationExpiredError(
        f"a put of {len(keys)} keys to partition {partition!r} took {took:.1f}s between reserving space and "
        f"committing, longer than {route.commit_within_s:.1f}s (most of reservation_timeout_s); it was "
        "aborted and nothing was written. Raise reservation_timeout_s if this process is often paused "
        "this long."
    )


def _put_ready_call(
    route: Route, s: int, keys: list[str], partition: str, columns: dict[str, AnyColumn], tags: _protocol.Tags
) -> Call | None:
    """The one-step ``put_ready`` request of a put whose keys all live on shard ``s``, when it can take
    one: every field of a schema this client has seen confirmed and small enough to travel inline
    (below ``shm_min_bytes`` where the shard's memory is mapped here); None when the general path has
    to run. (The one place that builds a ``put_ready``.)"""
    known = route.schemas.get(partition, {})
    inline_below = route.shm_min_bytes if route.shm[s] else None
    for name, col in columns.items():  # (decided before any device column is staged to the host)
        if known.get(name) != col.spec.family() or (inline_below is not None and col.nbytes >= inline_below):
            return None
    fields: dict[str, _protocol.ReserveField] = {}
    bufs: list[Any] = []
    for name, col in columns.items():
        wire = _wire.column_to_wire(_host(col), bufs)
        fields[name] = _protocol.ReserveField(wire.spec, col.nbytes, wire)
    body = _protocol.PutReady(partition, keys, fields, route.memory.version(s), tags)
    return Call(s, "put_ready", body, bufs)


def _put_ready(route: Route, call: Call, keys: list[str], partition: str) -> Op[KVBatchMeta]:
    """One round trip: the shard stores the inline rows at once, then commits them in the index itself
    (``put_ready``, see ``server.shard.actor``), and answers with the index's reply. Only for fields whose
    schema is confirmed, so the index has nothing to decide; if it refuses all the same (the partition
    was dropped and re-created meanwhile with another dtype), the shard takes the rows back and passes
    the refusal on. When the index did not answer, the rows are stored but not ready: said exactly."""
    (res,) = yield [call]
    if isinstance(res, BaseException):
        if isinstance(res, SchemaError):
            _forget_schema(route, partition)
        raise res
    got = _reply(res, _protocol.PutReadyReply)
    if got.index_error is not None:
        _forget_schema(route, partition)
        index_error = _wire.rebuild_error(got.index_error)
        groups = {call.target: np.arange(len(keys))}
        _raise_partial_put([(None, []), index_error], [call.target], groups, keys, partition)
    return KVBatchMeta._trusted(keys, got.tags, partition, got.fields)


def _remember_schema(route: Route, partition: str, columns: dict[str, AnyColumn]) -> None:
    known = route.schemas.setdefault(partition, {})
    for name, col in columns.items():
        known[name] = col.spec.family()
    if len(route.schemas) > SCHEMA_CACHE:  # a client writing many partitions keeps the newest
        route.schemas.pop(next(iter(route.schemas)))


def _forget_schema(route: Route, partition: str) -> None:
    route.schemas.pop(partition, None)


SCHEMA_CACHE = 1024  # partitions whose confirmed schemas a client remembers


def _ok(result: Result) -> bool:
    return not isinstance(result, BaseException)


def _raise_partial_put(
    results: list[Any], shards: list[int], groups: dict[int, np.ndarray], keys: list[str], partition: str
) -> None:
    """Raise, naming exactly what was written, when a put's commit failed anywhere (the shards'
    results, then the index's: None when the index was not asked because a shard failed)."""
    shard_res, index_res = results[:-1], results[-1]
    if index_res is None:
        index_res = DataplaneError("not asked: a shard's commit failed, so the rows were not made ready")
    failed = [(s, r) for s, r in zip(shards, shard_res, strict=True) if not _ok(r)]
    if not failed and _ok(index_res):
        return
    done = [s for s, r in zip(shards, shard_res, strict=True) if _ok(r)]
    first = failed[0][1] if failed else index_res
    if not done and not _ok(index_res):
        raise first  # nothing anywhere was written
    if not failed:  # every shard wrote its rows; the index did not confirm recording them
        raise _with_message(
            first,
            f"a put to partition {partition!r} committed only in part: shards {done} wrote their rows, "
            "but the "
            f"index did not confirm recording them ({index_res}); keys {_preview(keys)} are stored but "
            "may not be listed nor ready for consumers. Write those keys again, or clear them.",
        )
    lost = [keys[i] for s, _ in failed for i in groups[s]]
    index_note = "the index recorded the put" if _ok(index_res) else f"the index did not ({index_res})"
    raise _with_message(
        first,
        f"a put to partition {partition!r} committed only in part: shards {done} wrote their rows and "
        f"{index_note}, but shards {[s for s, _ in failed]} did not ({first}); keys not written there: "
        f"{_preview(lost)}. Write those keys again, or clear them.",
    )


def _with_message(exc: BaseException, message: str) -> BaseException:
    """An exception of ``exc``'s dataplane type (and culprit attributes) carrying ``message``."""
    name, _, attrs = _wire.error_fields(exc)  # the attributes its class declares (wire_attrs)
    return _wire.rebuild_error([name, message, attrs])


def _preview(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


def _meta(keys: list[str], partition_id: str, got: _protocol.CommitReply) -> KVBatchMeta:
    return KVBatchMeta._trusted(keys, got.tags, partition_id, got.fields)


def _reserve_call(
    route: Route,
    s: int,
    partition: str,
    keys: list[str],
    pos: np.ndarray,
    columns: dict[str, AnyColumn],
    specs: dict[str, _protocol.WireSpec],
) -> tuple[Call, dict[str, int]]:
    """Shard ``s``'s ``reserve`` of its rows (``pos``), and the bytes of each field it writes through
    shared memory (the rest travel inline, as frames of this request); ``specs`` are the columns'."""
    n = len(pos)
    whole = n == len(keys)
    fields: dict[str, _protocol.ReserveField] = {}
    bufs: list[Any] = []
    plan: dict[str, int] = {}
    for name, col in columns.items():
        nbytes = col.nbytes if whole else nbytes_of(col, pos)
        if not (route.shm[s] and nbytes >= route.shm_min_bytes):
            host = _host(col)
            piece = host if whole else assemble(col.spec, n, [(host, pos, np.arange(n))])
            fields[name] = _protocol.ReserveField(specs[name], nbytes, _wire.column_to_wire(piece, bufs))
        else:
            plan[name] = nbytes
            fields[name] = _protocol.ReserveField(specs[name], nbytes)
    mine = keys if whole else [keys[i] for i in pos]
    return Call(s, "reserve", _protocol.Reserve(partition, mine, fields, route.memory.version(s)), bufs), plan


def _fill_segments(
    route: Route,
    s: int,
    got: _protocol.ReserveReply,
    pos: np.ndarray,
    columns: dict[str, AnyColumn],
    plan: dict[str, int],
) -> Call:
    """Copy this shard's rows straight into the segments it reserved (one copy per field; a device
    column's copy is in flight on return: ``_sync``)."""
    bufs: list[Any] = []
    offsets: dict[str, int] = {}
    shapes: dict[str, int] = {}
    n = len(pos)
    for name, ref in got.files.items():
        col = columns[name]
        view = route.memory.view(s, ref)[: plan[name]]
        if isinstance(col, Column):
            piece = assemble(col.spec, n, [(col, pos, np.arange(n))], out=view)
        else:
            direct = route.memory.pin(s, ref) is CopyPath.DIRECT
            piece = col.write(view, pos, n == col.num_rows, direct)
        if piece.offsets is not None:
            offsets[name] = _wire.array_to_wire(piece.offsets, bufs)
        if piece.shapes is not None:
            shapes[name] = _wire.array_to_wire(piece.shapes, bufs)
    return Call(s, "commit", _protocol.Commit(got.resv, offsets, shapes), bufs)


# ---- get ------------------------------------------------------------------------------------------

GET_ATTEMPTS = 8  # a read that keeps racing with clears of the same rows gives up after this many


def get(
    route: Route,
    keys: list[str],
    partition_id: str,
    fields: Any,
    copy: bool,
    device: Any = None,
    non_blocking: bool = False,
) -> Op[dict[str, AnyColumn]]:
    """Read rows of ``keys`` (checked: ``check_keys``) in that order; returns ``{field: Column}``.

    What is returned is exactly what completed puts wrote: rows copied out of shared memory are
    checked against the generation of their segment after the copy, and the whole read is retried
    when a concurrent clear freed (and maybe reused) a segment meanwhile (``server.shard.segments``).

    ``device`` (not the CPU): dense and jagged fields are copied straight to it (``codec.device``),
    from the shards' mappings where the route's memory registers them, and come back as
    ``DeviceColumn`` s; their copies finish before the generations are checked (``non_blocking``:
    they run on a stream of their own). A device result is always a private copy.
    """
    if fields is not None:
        if isinstance(fields, str):
            fields = [fields]
        fields = list(fields)
    if not keys:
        return {}
    if device is not None and _device_type(device) == "cpu":
        device = None  # host memory: the rows as without a device (views where ``copy`` allows)
    groups = route.placement.group(partition_id, keys)
    shards = sorted(groups)
    for _ in range(GET_ATTEMPTS):
        export = not copy and len(groups) == 1 and device is None  # only then can it return a view
        calls = []
        for s in shards:
            mine = [keys[i] for i in groups[s]] if len(groups) > 1 else keys
            body = _protocol.Get(partition_id, mine, fields, route.shm[s], export, route.memory.version(s))
            calls.append(Call(s, "get", body))
        results = yield calls
        if any(isinstance(r, (KeyNotFoundError, PartitionNotFoundError)) for r in results):
            yield from _explain_missing(partition_id, keys, shards, groups, results)
        got = [(_reply(r, _protocol.GetReply), r[1]) for r in results if not isinstance(r, BaseException)]
        _raise_first(results)
        names = _field_names([g for g, _ in got])
        try:
            out = _gather(route, names, shards, groups, got, len(keys), copy, device, non_blocking)
        except _Stale:
            out = None
        for s, (answer, _) in zip(shards, got, strict=True):
            if answer.live is not None:
                route.memory.prune(s, answer.version, answer.live)
        if out is not None:
            return out
    raise DataplaneError(
        f"a read of {len(keys)} keys of partition {partition_id!r} raced with clears of the same rows "
        f"{GET_ATTEMPTS} times in a row; nothing was returned. Retry, or stop clearing rows being read."
    )


class _Stale(Exception):
    """A segment a read copied from was freed meanwhile: the read must be retried."""


def _gather(
    route: Route,
    names: list[str],
    shards: list[int],
    groups: dict[int, np.ndarray],
    got: list[tuple[_protocol.GetReply, list[memoryview]]],
    n: int,
    copy: bool,
    device: Any = None,
    non_blocking: bool = False,
) -> dict[str, AnyColumn]:
    out: dict[str, AnyColumn] = {}
    for name in names:
        pieces: list[Any] = []
        sources: list[_Source] = []
        for s, (body, bufs) in zip(shards, got, strict=True):
            _pieces(route, s, name, body.fields[name], bufs, groups[s], pieces, sources)
        col: AnyColumn
        if device is not None and _to_device_ok(pieces):  # (never the CPU: ``get`` passes None then)
            col, viewed = _onto_device(route, pieces, sources, n, device, non_blocking), False
        else:
            col, viewed = _build(pieces, sources, n, copy)
        if not viewed:  # bytes were copied out of shared memory: were they still those rows' bytes?
            for src in sources:
                if src.table is not None and src.table[src.slot] != src.gen:
                    raise _Stale
        out[name] = col
    return out


@dataclass
class _Source:
    """Where a piece's bytes live: a received frame (private), or a shard segment of a generation."""

    viewable: bool  # a frame, or a segment the shard exported for a zero-copy view
    table: Sequence[int] | None = None  # the shard's generation table, read live (None: a private frame)
    slot: int = 0
    gen: int = 0
    shard: int = -1  # the segment's shard and reference (a frame: none)
    ref: Sequence[int] = ()


def _device_type(device: Any) -> str:
    """The device type ``device`` names: "cuda" for ``"cuda:1"``, ``torch.device("cuda", 1)`` or
    ``1`` (a bare index means a CUDA device)."""
    kind = getattr(device, "type", None)
    if isinstance(kind, str):
        return kind
    return "cuda" if isinstance(device, int) else str(device).split(":")[0]


def _to_device_ok(pieces: list[Any]) -> bool:
    from dataplane.codec.device import can_gather_to_device

    return can_gather_to_device(pieces)


def _onto_device(
    route: Route, pieces: list[Any], sources: list[_Source], n: int, device: Any, non_blocking: bool
) -> DeviceColumn:
    """One field's rows copied to ``device``: one DMA per run straight from the shards' mappings
    when every piece is in a registered mapping (``CopyPath.DIRECT``), else staged; synchronised."""
    from dataplane.codec.device import gather_to_device, plan_gather

    plan = plan_gather(pieces, n)  # (too many runs: staged, and nothing is registered for it)
    direct = plan.direct_ok and all(
        src.table is not None and route.memory.pin(src.shard, src.ref) is CopyPath.DIRECT for src in sources
    )
    col = gather_to_device(pieces, n, device, direct, non_blocking, plan)
    col.sync()  # before the generations are checked: the bytes copied must be the ones checked
    return col


def _explain_missing(
    partition: str, keys: list[str], shards: list[int], groups: dict[int, np.ndarray], results: list[Result]
) -> Op[NoReturn]:
    """A shard missed a key or the partition: ask the index what exists and raise the precise error."""
    asked = [
        k
        for s, r in zip(shards, results, strict=True)
        if isinstance(r, DataplaneError)
        for k in (keys[i] for i in groups[s])
    ]
    (res,) = yield [Call(INDEX, "resolve", _protocol.Resolve(partition, asked))]
    body = _reply(res, _protocol.ResolveReply)
    if not body.partition:
        raise PartitionNotFoundError(partition, body.error)  # it says cleared, or what was meant
    cleared = set(body.cleared)
    known = body.known
    for k in asked:
        if k in cleared:
            raise KeyNotFoundError(
                k, partition, f"key {k!r} of partition {partition!r} was cleared (kv_clear); put it again"
            )
        if k not in known:
            kept = body.cleared_kept
            also = f", nor among the last {kept} keys cleared from it" if kept else ", or cleared"
            raise KeyNotFoundError(
                k, partition, f"key {k!r} not found in partition {partition!r} (never written{also})"
            )
    for k in asked:
        if not known[k]:
            raise KeyNotFoundError(
                k, partition, f"key {k!r} in partition {partition!r} holds tags only, no fields"
            )
    for r in results:
        if isinstance(r, FieldNotFoundError) and r.key in known:  # name the fields it holds
            held = known[r.key]
            raise FieldNotFoundError(
                r.key, partition, r.field, f"{r}; it holds {held}{did_you_mean(r.field, held)}"
            ) from None
        if isinstance(r, KeyNotFoundError):
            raise r
    raise KeyNotFoundError(asked[0], partition)


def _field_names(got: list[_protocol.GetReply]) -> list[str]:
    """The fields every shard answered: all requested ones, or (no ``select_fields``) those every
    requested key holds (each shard answers its keys' common fields)."""
    names = list(got[0].fields)
    for body in got[1:]:
        names = [n for n in names if n in body.fields]
    return names


def _pieces(
    route: Route,
    s: int,
    name: str,
    entry: _protocol.InlineRows | _protocol.SegmentRows,
    bufs: list[memoryview],
    pos: np.ndarray,
    pieces: list[Any],
    sources: list[_Source],
) -> None:
    """Append the pieces of one shard's answer for field ``name`` (and where each one's bytes live)."""
    if isinstance(entry, _protocol.InlineRows):
        col = _wire.column_from_wire(entry.col, bufs, name)
        pieces.append((col, np.arange(col.num_rows), pos))
        sources.append(_Source(viewable=True))
        return
    seg_of = _wire.array_from_wire(entry.seg, bufs, len(pos))
    row_of = _wire.array_from_wire(entry.row, bufs, len(pos))
    table = route.memory.generations(s)
    for j, (ref, nbytes, num_rows, off, view, wire_spec, shp) in enumerate(entry.segs):
        spec = _wire.spec_from_wire(wire_spec)
        try:
            mapping = route.memory.view(s, ref)
        except SegmentUnavailable as exc:  # closed since the shard answered: its rows were freed
            raise _Stale from exc
        if nbytes > len(mapping) or not 0 <= int(ref[4]) < len(table):
            raise WireError(
                f"shard {s} answered field {name!r} with {nbytes} bytes in a file of {len(mapping)}"
            )
        offsets = None if off < 0 else _wire.array_from_wire(off, bufs, num_rows + 1)
        shapes = None
        if shp >= 0 and spec.kind == "ragged":
            shapes = _wire.array_from_wire(shp, bufs, num_rows * spec.shape[0]).reshape(num_rows, -1)
        col = Column(spec=spec, num_rows=num_rows, data=mapping[:nbytes], offsets=offsets, shapes=shapes)
        col.check(name)
        mask = seg_of == j if len(entry.segs) > 1 else slice(None)
        src, dst = row_of[mask], pos[mask]
        if len(src) and (int(src.min()) < 0 or int(src.max()) >= num_rows):
            raise WireError(f"shard {s} answered field {name!r} with rows outside a segment of {num_rows}")
        pieces.append((col, src, dst))
        sources.append(_Source(bool(view), table, int(ref[4]), int(ref[5]), s, ref))


def _build(pieces: list[Any], sources: list[_Source], num_rows: int, copy: bool) -> tuple[Any, bool]:
    """The field's column, and whether it is a view (of a private frame or an exported segment)."""
    col, src, dst = pieces[0]
    if len(pieces) == 1 and len(dst) == num_rows and bool(np.all(dst == np.arange(num_rows))):
        source = sources[0]
        private = source.table is None  # a received frame: no need to copy it again
        if source.viewable and (private or not copy):
            view = contiguous_view(col, src)
            if view is not None:
                return view, True
    return assemble_any(num_rows, pieces), False


# ---- clear / list / stats -------------------------------------------------------------------------


def clear(route: Route, keys: list[str], partition_id: str) -> Op[None]:
    """Free ``keys`` (checked: ``check_keys``) of ``partition_id``; unknown keys or partitions are ignored."""
    groups = route.placement.group(partition_id, keys)
    shards = sorted(groups)
    calls = [Call(s, "clear", _protocol.Clear(partition_id, [keys[i] for i in groups[s]])) for s in shards]
    results = yield [*calls, Call(INDEX, "clear", _protocol.Clear(partition_id, keys))]
    _raise_partial_clear(results, shards, f"kv_clear of {len(keys)} keys of partition {partition_id!r}")
    return None


def clear_partition(route: Route, partition_id: str) -> Op[None]:
    check_partition(partition_id, "clear_partition")
    _forget_schema(route, partition_id)
    shards = list(range(route.placement.num_shards))
    body = _protocol.OnePartition(partition_id)
    calls = [Call(s, "clear_partition", body) for s in shards]
    results = yield [*calls, Call(INDEX, "clear_partition", body)]
    _raise_partial_clear(results, shards, f"clear_partition({partition_id!r})")
    return None


def _raise_partial_clear(results: list[Result], shards: list[int], what: str) -> None:
    """Raise, naming exactly where the data was and was not freed, when a clear failed anywhere.

    A shard that died took its memory with it (nothing of it is left); one that did not answer may
    still hold its rows, and calling the same clear again finishes the job.
    """
    failed = [(s, r) for s, r in zip(shards, results[:-1], strict=True) if isinstance(r, BaseException)]
    index_res = results[-1]
    if not failed and not isinstance(index_res, BaseException):
        return
    done = [s for s, r in zip(shards, results[:-1], strict=True) if _ok(r)]
    parts = [f"shards {done} freed their rows" if done else "no shard freed its rows"]
    parts.append("the index forgot them" if _ok(index_res) else f"the index did not answer ({index_res})")
    for s, exc in failed:
        parts.append(f"shard {s}: {exc}")
    first = failed[0][1] if failed else index_res
    assert isinstance(first, BaseException)  # (a shard's error, else the index's: one failed)
    raise _with_message(
        first,
        f"{what} completed only in part: " + "; ".join(parts) + ". Call it again once the store is healthy.",
    )


LIST_PAGE = 16384  # keys per request of a whole listing: no reply (nor the index's work) grows past it


def list_page(
    route: Route, partition_id: str, limit: int, cursor: str | None
) -> Op[tuple[dict[str, dict[str, _protocol.Tag]], str | None]]:
    """``{partition_id: {key: tag}}`` of up to ``limit`` keys from ``cursor`` on (None: the first;
    ``{}`` when the partition is not there), and the cursor of the next page (None: none left). A
    partition cleared since ``cursor`` was given raises ``PartitionNotFoundError``."""
    ask = _protocol.ListKeys(partition_id, limit=limit, cursor=cursor)
    (res,) = yield [Call(INDEX, "list", ask)]
    got = _reply(res, _protocol.ListReply)
    return got.list, got.cursor


def list_keys(route: Route, partition_id: str | None) -> Op[dict[str, dict[str, _protocol.Tag]]]:
    """``{partition: {key: tag}}`` of one partition, or of all (``partition_id`` None), asked for in
    pages of ``LIST_PAGE`` keys. A partition cleared while it is listed is left out, as if cleared
    before."""
    if partition_id is None:
        (res,) = yield [Call(INDEX, "list", _protocol.ListKeys(None, limit=0))]
        names = list(_reply(res, _protocol.ListReply).list)
    else:
        names = [partition_id]
    out: dict[str, dict[str, _protocol.Tag]] = {}
    for pid in names:
        keys: dict[str, _protocol.Tag] = {}
        cursor: str | None = None
        while True:
            try:
                page, nxt = yield from list_page(route, pid, LIST_PAGE, cursor)
            except PartitionNotFoundError:
                if cursor is None:
                    raise
                break  # cleared meanwhile
            if pid not in page:  # not there (never written, or cleared)
                break
            keys.update(page[pid])
            cursor = nxt
            if cursor is None:
                out[pid] = keys
                break
    return out


def stats(
    route: Route, trim: bool = False
) -> Op[tuple[list[_protocol.ShardStatsReply], _protocol.IndexStatsReply]]:
    """Every shard's stats (``ShardStatsReply``) and the index's (``IndexStatsReply``)."""
    n = route.placement.num_shards
    ask = _protocol.Stats(trim)
    results = yield [*(Call(s, "stats", ask) for s in range(n)), Call(INDEX, "stats", _protocol.Stats())]
    _raise_first(results)
    shards = [_reply(r, _protocol.ShardStatsReply) for r in results[:n]]
    return shards, _reply(results[n], _protocol.IndexStatsReply)


__all__ = [
    "AnyColumn",
    "Op",
    "Route",
    "check_keys",
    "clear",
    "clear_partition",
    "LIST_PAGE",
    "get",
    "list_keys",
    "list_page",
    "put",
    "stats",
]
