"""The KV operations, written once, sans-IO: each is a generator over request batches.

An operation yields a list of ``Call`` s (requests to shards and/or the index that may run in
parallel) and receives the list of results; it returns its value with ``return``. The sync client
drives these generators with blocking sockets, the async client with ``zmq.asyncio``
(``_client.drive`` / ``_client.adrive``), so the two never drift.

Round trips (R = one parallel batch of requests, at most one per shard plus the index):
    put   2R: [index.prepare + shard.reserve] then [shard.commit + index.commit]
          (shared memory: the client copies into the reserved segments between the two)
    get   1R: shard.get per shard (index.resolve only to explain a missing key)
    clear 1R, list 1R (index only), stats 1R.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataplane import _wire
from dataplane._column_types import Column
from dataplane._placement import Placement
from dataplane._rows import assemble, contiguous_view, nbytes_of
from dataplane._segments import MappingCache
from dataplane._transport import INDEX, Call, Result
from dataplane.errors import (
    BatchSizeError,
    DataplaneError,
    KeyNotFoundError,
    PartitionNotFoundError,
)
from dataplane.meta import KVBatchMeta

Op = Generator[list[Call], list[Result], Any]


@dataclass
class Route:
    """What an operation needs to know about the store (built by the client at attach time)."""

    placement: Placement
    shm: list[bool]  # per shard: this client maps the shard's segments directly
    shard_pids: list[int]
    maps: MappingCache
    shm_min_bytes: int
    allow_pickle: bool


def _check_keys(keys: Any, partition_id: Any) -> list[str]:
    if not isinstance(partition_id, str):
        raise TypeError(f"partition_id must be a str, not {type(partition_id).__name__}")
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of str, not the str {keys!r} (use [key])")
    keys = list(keys)
    for k in keys:
        if type(k) is not str:
            raise TypeError(f"keys must be str, got {k!r} ({type(k).__name__})")
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r} in one call")
    return keys


def _raise_first(results: list[Result]) -> None:
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        raise errs[0]


# ---- put ------------------------------------------------------------------------------------------


def put(route: Route, keys: Sequence[str], partition_id: str, columns: dict[str, Any] | None, tags) -> Op:
    """Write ``columns`` (already encoded, one row per key) and/or ``tags``; returns a KVBatchMeta."""
    keys = _check_keys(keys, partition_id)
    if tags is not None:
        tags = list(tags)
        if len(tags) != len(keys):
            raise BatchSizeError(f"{len(tags)} tags for {len(keys)} keys; pass one tag dict per key")
        for t in tags:
            if t is not None and not isinstance(t, dict):
                raise TypeError(f"each tag must be a dict or None, got {type(t).__name__}")
    columns = columns or {}
    for name, col in columns.items():
        if col.num_rows != len(keys):
            raise BatchSizeError(f"field {name!r} has {col.num_rows} rows for {len(keys)} keys")
    specs = {name: _wire.spec_to_wire(col.spec) for name, col in columns.items()}
    body = {"pid": partition_id, "keys": keys, "fields": list(columns), "tags": tags, "specs": specs}
    commit_idx = Call(INDEX, "commit", body)
    if not columns or not keys:
        (res,) = yield [commit_idx]
        _raise_first([res])
        return _meta(keys, partition_id, res[0])
    groups = route.placement.group(partition_id, keys)
    shards = sorted(groups)
    calls = [Call(INDEX, "prepare", {"pid": partition_id, "specs": specs})]
    parts: dict[int, dict[str, Any]] = {}
    for s in shards:
        call, parts[s] = _reserve_call(route, s, partition_id, keys, groups[s], columns)
        calls.append(call)
    results = yield calls
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        aborts = [
            Call(s, "abort", {"resv": r[0]["resv"]})
            for s, r in zip(shards, results[1:], strict=True)
            if not isinstance(r, BaseException)
        ]
        if aborts:
            yield aborts
        raise errs[0]
    commits = []
    try:
        for s, (body, _) in zip(shards, results[1:], strict=True):
            if "live" in body:  # forget mappings of files the shard has closed since we last looked
                route.maps.prune(s, body["version"], body["live"])
            commits.append(_fill_segments(route, s, body, groups[s], columns, parts[s]))
    except BaseException:  # e.g. a segment could not be mapped: undo every reservation, then raise
        yield [Call(s, "abort", {"resv": r[0]["resv"]}) for s, r in zip(shards, results[1:], strict=True)]
        raise
    results = yield [*commits, commit_idx]
    _raise_first(results)
    return _meta(keys, partition_id, results[-1][0])


def _meta(keys: list[str], partition_id: str, body: dict[str, Any]) -> KVBatchMeta:
    return KVBatchMeta(keys=keys, tags=body["tags"], partition_id=partition_id, fields=body["fields"])


def _reserve_call(route: Route, s: int, pid: str, keys: list[str], pos: np.ndarray, columns: dict) -> tuple:
    n = len(pos)
    whole = n == len(keys)
    fields: dict[str, Any] = {}
    bufs: list[Any] = []
    plan: dict[str, Any] = {}
    for name, col in columns.items():
        nbytes = len(col.data) if whole else nbytes_of(col, pos)
        entry: dict[str, Any] = {"spec": _wire.spec_to_wire(col.spec), "nbytes": nbytes, "col": None}
        if not (route.shm[s] and nbytes >= route.shm_min_bytes):
            piece = col if whole else assemble(col.spec, n, [(col, pos, np.arange(n))])
            entry["col"] = _wire.column_to_wire(piece, bufs)
        else:
            plan[name] = nbytes
        fields[name] = entry
    body = {
        "pid": pid,
        "keys": [keys[i] for i in pos] if not whole else keys,
        "fields": fields,
        "version": route.maps.version(s),
    }
    return Call(s, "reserve", body, bufs), plan


def _fill_segments(route: Route, s: int, reply: dict, pos: np.ndarray, columns: dict, plan: dict) -> Call:
    """Copy this shard's rows straight into the segments it reserved (one copy per field)."""
    bufs: list[Any] = []
    offsets: dict[str, int] = {}
    n = len(pos)
    for name, ref in reply["files"].items():
        col = columns[name]
        view = route.maps.view(s, route.shard_pids[s], ref)[: plan[name]]
        piece = assemble(col.spec, n, [(col, pos, np.arange(n))], out=view)
        if piece.offsets is not None:
            offsets[name] = _wire.array_to_wire(piece.offsets, bufs)
    return Call(s, "commit", {"resv": reply["resv"], "offsets": offsets}, bufs)


# ---- get ------------------------------------------------------------------------------------------


def get(route: Route, keys: Sequence[str], partition_id: str, fields: list[str] | None, copy: bool) -> Op:
    """Read rows of ``keys`` (in that order); returns ``{field: Column}``."""
    keys = _check_keys(keys, partition_id)
    if fields is not None:
        if isinstance(fields, str):
            fields = [fields]
        fields = list(fields)
    if not keys:
        return {}
    groups = route.placement.group(partition_id, keys)
    shards = sorted(groups)
    calls = []
    for s in shards:
        body = {
            "pid": partition_id,
            "keys": [keys[i] for i in groups[s]] if len(groups) > 1 else keys,
            "fields": fields,
            "shm": route.shm[s],
            "export": not copy and len(groups) == 1,  # only then can the client return a view
            "version": route.maps.version(s),
        }
        calls.append(Call(s, "get", body))
    results = yield calls
    if any(isinstance(r, (KeyNotFoundError, PartitionNotFoundError)) for r in results):
        yield from _explain_missing(partition_id, keys, shards, groups, results)
    _raise_first(results)
    names = _field_names(results, shards, groups, keys, partition_id)
    out = {}
    for name in names:
        pieces = []
        for s, (body, bufs) in zip(shards, results, strict=True):
            pieces.extend(_pieces(route, s, body["fields"][name], bufs, groups[s]))
        out[name] = _build(pieces, len(keys), copy)
    for s, (body, _) in zip(shards, results, strict=True):
        if "live" in body:
            route.maps.prune(s, body["version"], body["live"])
    return out


def _explain_missing(pid: str, keys: list[str], shards: list[int], groups: dict, results: list) -> Op:
    """A shard missed a key or the partition: ask the index what exists and raise the precise error."""
    asked = [
        k
        for s, r in zip(shards, results, strict=True)
        if isinstance(r, DataplaneError)
        for k in (keys[i] for i in groups[s])
    ]
    (res,) = yield [Call(INDEX, "resolve", {"pid": pid, "keys": asked})]
    if isinstance(res, BaseException):
        raise res
    body = res[0]
    if not body["partition"]:
        raise PartitionNotFoundError(pid)
    for k in asked:
        if k not in body["known"]:
            raise KeyNotFoundError(k, pid)
    for k in asked:
        if not body["known"][k]:
            raise KeyNotFoundError(k, pid, f"key {k!r} in partition {pid!r} holds tags only, no fields")
    for r in results:
        if isinstance(r, KeyNotFoundError):
            raise r
    raise KeyNotFoundError(asked[0], pid)


def _field_names(results: list, shards: list[int], groups: dict, keys: list[str], pid: str) -> list[str]:
    names = list(results[0][0]["fields"])
    for s, (body, _) in zip(shards, results, strict=True):
        got = list(body["fields"])
        if set(got) != set(names):
            missing = sorted(set(names) ^ set(got))[0]
            culprit = keys[groups[s][0]] if missing not in got else keys[groups[shards[0]][0]]
            raise KeyNotFoundError(
                culprit,
                pid,
                f"key {culprit!r} in partition {pid!r} has no field {missing!r} (not written yet)",
            )
    return names


def _pieces(route: Route, s: int, entry: dict, bufs: list, pos: np.ndarray) -> list:
    if entry["t"] == "z":
        col = _wire.column_from_wire(entry["col"], bufs)
        return [(col, np.arange(col.num_rows), pos)]
    spec = _wire.spec_from_wire(entry["spec"])
    seg_of = _wire.array_from_wire(entry["seg"], bufs)
    row_of = _wire.array_from_wire(entry["row"], bufs)
    pieces = []
    for j, (ref, nbytes, num_rows, off) in enumerate(entry["segs"]):
        data = route.maps.view(s, route.shard_pids[s], ref)[:nbytes]
        offsets = None if off < 0 else _wire.array_from_wire(off, bufs)
        col = Column(spec=spec, num_rows=num_rows, data=data, offsets=offsets)
        mask = seg_of == j if len(entry["segs"]) > 1 else slice(None)
        pieces.append((col, row_of[mask], pos[mask]))
    return pieces


def _build(pieces: list, num_rows: int, copy: bool) -> Any:
    col, src, dst = pieces[0]
    if len(pieces) == 1 and len(dst) == num_rows and bool(np.all(dst == np.arange(num_rows))):
        frame = isinstance(col.data, memoryview) and not _is_mapped(col.data)
        if frame or not copy:  # a received frame is already private: no need to copy it again
            view = contiguous_view(col, src)
            if view is not None:
                return view
    return assemble(col.spec, num_rows, pieces)


def _is_mapped(buf: memoryview) -> bool:
    import mmap

    return isinstance(buf.obj, mmap.mmap)


# ---- clear / list / stats -------------------------------------------------------------------------


def clear(route: Route, keys: Sequence[str], partition_id: str) -> Op:
    """Free ``keys`` of ``partition_id``; unknown keys or partitions are ignored."""
    keys = _check_keys(keys, partition_id)
    groups = route.placement.group(partition_id, keys)
    calls = [
        Call(s, "delete", {"pid": partition_id, "keys": [keys[i] for i in pos]}) for s, pos in groups.items()
    ]
    results = yield [*calls, Call(INDEX, "delete", {"pid": partition_id, "keys": keys})]
    _raise_first(results)
    return None


def drop_partition(route: Route, partition_id: str) -> Op:
    if not isinstance(partition_id, str):
        raise TypeError(f"partition_id must be a str, not {type(partition_id).__name__}")
    calls = [Call(s, "drop", {"pid": partition_id}) for s in range(route.placement.num_shards)]
    results = yield [*calls, Call(INDEX, "drop", {"pid": partition_id})]
    _raise_first(results)
    return None


def list_keys(route: Route, partition_id: str | None) -> Op:
    (res,) = yield [Call(INDEX, "list", {"pid": partition_id})]
    _raise_first([res])
    return res[0]["list"]


def stats(route: Route, trim: bool = False) -> Op:
    n = route.placement.num_shards
    results = yield [*(Call(s, "stats", {"trim": trim}) for s in range(n)), Call(INDEX, "stats", {})]
    _raise_first(results)
    return [r[0] for r in results[:n]], results[n][0]


__all__ = ["Op", "Route", "clear", "drop_partition", "get", "list_keys", "put", "stats"]
