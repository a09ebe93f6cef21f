"""Fuzz the shard's and the index's request handling without Ray or sockets.

``_wire.answer(frames, ...)`` over ``core.decode`` and ``core.run`` is exactly what a server runs on
every message it receives (``RequestServer``),
so driving it with hostile frames checks what any authenticated peer can do to a shard or the index:
random bytes, and valid requests (the bodies the client sends) whose header, body or frames are
mutated. For every case: ``answer`` returns (never raises) reply frames that decode, echoing the
request id whenever the header decoded; every other reply reads back as its op's reply struct, as a
client reads it (``wire.requests.reply``); every error reply names a typed ``dataplane.errors`` class
(an untyped internal exception leaking through as a bare ``DataplaneError`` is a failure); an error
reply changes nothing (except that a failed commit gives its reservation back); and the core's
bookkeeping stays exact (``_check_shard`` / ``_check_index``).

The request sequence is fixed by ``SEED``; each core is fuzzed for ``BUDGET_S`` seconds (or
``MAX_CASES`` cases), so a slower machine runs a shorter prefix of the same sequence. A failure
names the case number, which reproduces it with the same seed.

The five bugs this fuzz found in its first runs (a row-less segment that leaked, a get of no keys,
a commit confirming another partition's schema, an oversized jagged row overflowing int64, strings
that are not UTF-8) each have a regression test at the end of this file.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest

from dataplane import errors
from dataplane.server.index.core import IndexCore
from dataplane.server.shard.core import ShardCore
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import reply

SEED = 20250117
BUDGET_S = 3.0
MAX_CASES = 200_000
CAPACITY = 1 << 20

PIDS = ["p0", "p1", "p2"]
KEYS = [f"k{i}" for i in range(8)]

# field name -> (spec on the wire, bytes per element of a variable-size row, or None for dense)
FIELDS: dict[str, tuple[list, int | None]] = {
    "x": (["dense", "float32", [2]], None),
    "h": (["dense", "int64", []], None),
    "s": (["arrow", "large_string", []], 1),
    "l": (["arrow", "large_list<int32>", []], 4),
    "j": (["jagged", "float32", [3]], 12),
    "o": (["object", "pickle", []], 1),
    "m": (["json", "msgpack", []], 1),
}
ALT_SPECS = {"x": ["dense", "float16", [2]], "h": ["dense", "int32", []], "j": ["jagged", "float32", [2]]}

INTERESTING: list[Any] = [
    0,
    1,
    -1,
    7,
    2**31 - 1,
    2**32,
    2**62,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "x",
    "\x00",
    "k0",
    "p0",
    None,
    True,
    False,
    [],
    [0],
    [-1],
    [2**40, 2**40, 2**40],
    {},
    {"a": 1},
    {"x": {"spec": ["dense", "float32", [2]], "nbytes": 8}},
    b"\x00\xff",
    ["dense", "float32", [2]],
    ["arrow", "large_string", []],
    ["object", "pickle", []],
    ["dense", "float32", [-1]],
    ["dense", "float32", [1] * 40],
    ["dense", "nope", []],
    ["mystery", "float32", []],
]
HUGE = [-1, -(2**31), -(2**63), 2**31, 2**62, 2**63 - 1, 2**64 - 1]


# ---- building valid requests ------------------------------------------------------------------------


def _lengths(rng: random.Random, n: int, unit: int) -> list[int]:
    return [rng.randrange(0, 5) * unit for _ in range(n)]


def _offsets(lengths: list[int]) -> bytes:
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=off[1:])
    return off.tobytes()


def _split(rng: random.Random, n: int, nbytes: int, unit: int) -> bytes:
    """Valid offsets of ``n`` rows sharing ``nbytes`` (on ``unit`` boundaries)."""
    if not 0 < unit <= nbytes:  # a spec from a mutated reserve: any unit that can work
        unit = 1
    units = nbytes // unit
    cuts = sorted(rng.randrange(0, units + 1) for _ in range(max(0, n - 1)))
    bounds = [0, *cuts, units] if n else [0]
    return (np.asarray(bounds, dtype=np.int64) * unit).tobytes()


def _spec_of(rng: random.Random, name: str) -> list:
    if name in ALT_SPECS and rng.random() < 0.05:
        return ALT_SPECS[name]
    return FIELDS[name][0]


def _reserve(rng: random.Random, core: ShardCore) -> tuple[str, dict, list]:
    keys = rng.sample(KEYS, rng.randint(1, 4) if rng.random() < 0.99 else 0)  # no keys: a legal edge
    n = len(keys)
    inline = rng.random() < 0.6
    fields: dict[str, Any] = {}
    frames: list[bytes] = []
    for name in rng.sample(sorted(FIELDS), rng.randint(1, 2)):
        spec = _spec_of(rng, name)
        unit = FIELDS[name][1]
        if unit is None:
            rb = int(np.dtype(spec[1]).itemsize * int(np.prod(spec[2])))
            lengths, offsets = [rb] * n, None
        else:
            if spec[0] == "jagged":
                unit = 4 * int(np.prod(spec[2]))
            lengths = _lengths(rng, n, unit)
            offsets = _offsets(lengths)
        nbytes = sum(lengths)
        entry: dict[str, Any] = {"spec": spec, "nbytes": nbytes}
        if inline:
            col = {"spec": spec, "rows": n, "data": len(frames), "offsets": -1}
            frames.append(rng.randbytes(nbytes))
            if offsets is not None:
                col["offsets"] = len(frames)
                frames.append(offsets)
            entry["col"] = col
        fields[name] = entry
    body = {"partition": rng.choice(PIDS), "keys": keys, "fields": fields, "version": rng.randrange(-1, 3)}
    return "reserve", body, frames


def _commit(rng: random.Random, core: ShardCore) -> tuple[str, dict, list]:
    if not core._resv or rng.random() < 0.05:
        return "commit", {"resv": rng.randrange(0, 1000), "offsets": {}}, []
    rid = rng.choice(sorted(core._resv))
    resv = core._resv[rid]
    offsets: dict[str, int] = {}
    frames: list[bytes] = []
    for name, entry in resv.fields.items():
        spec = entry.spec
        if entry.file is not None:
            if rng.random() < 0.5:  # the writer copies its rows in (bytes only: the shard never looks)
                entry.file.view()[: entry.nbytes] = rng.randbytes(entry.nbytes)
            if spec.row_nbytes() is None:
                unit = spec.row_bytes() if spec.kind == "jagged" else 1
                offsets[name] = len(frames)
                frames.append(_split(rng, len(resv.keys), entry.nbytes, unit))
    return "commit", {"resv": rid, "offsets": offsets}, frames


def _abort(rng: random.Random, core: ShardCore) -> tuple[str, dict, list]:
    rid = rng.choice(sorted(core._resv)) if core._resv and rng.random() < 0.9 else rng.randrange(0, 1000)
    return "abort", {"resv": rid}, []


def _get(rng: random.Random, core: ShardCore) -> tuple[str, dict, list]:
    pid, keys = rng.choice(PIDS), rng.sample(KEYS, rng.randint(1, 4))
    fields = None if rng.random() < 0.5 else rng.sample(sorted(FIELDS), rng.randint(1, 2))
    stored = [p for p in core.partitions.values() if p.rows]
    if stored and rng.random() < 0.8:  # mostly rows that exist, so that gets succeed too
        pid = rng.choice([p for p, part in core.partitions.items() if part.rows])
        rows = core.partitions[pid].rows
        keys = rng.sample(sorted(rows), min(len(rows), rng.randint(1, 3)))
        common = set.intersection(*(set(rows[k]) for k in keys))
        fields = rng.sample(sorted(common), rng.randint(1, len(common))) if common else None
    body = {
        "partition": pid,
        "keys": keys,
        "fields": fields,
        "shm": rng.random() < 0.5,
        "export": rng.random() < 0.3,
        "version": rng.randrange(-1, 3),
    }
    return "get", body, []


def _delete(rng: random.Random, core: Any) -> tuple[str, dict, list]:
    return "clear", {"partition": rng.choice(PIDS), "keys": rng.sample(KEYS, rng.randint(1, 4))}, []


def _drop(rng: random.Random, core: Any) -> tuple[str, dict, list]:
    return "clear_partition", {"partition": rng.choice(PIDS)}, []


def _stats(rng: random.Random, core: Any) -> tuple[str, dict, list]:
    return "stats", {"trim": rng.random() < 0.2}, []


SHARD_BUILDERS = [
    (_reserve, 30),
    (_commit, 22),
    (_abort, 4),
    (_get, 20),
    (_delete, 8),
    (_drop, 3),
    (_stats, 6),
]


def _prepare(rng: random.Random, core: IndexCore) -> tuple[str, dict, list]:
    names = rng.sample(sorted(FIELDS), rng.randint(1, 3))
    specs = {n: _spec_of(rng, n) for n in names}
    return (
        "prepare",
        {"partition": rng.choice(PIDS), "specs": specs, "txn": _txn(rng, core, open_share=0.05)},
        [],
    )


def _txn(rng: random.Random, core: IndexCore, open_share: float = 0.9) -> int:
    """A put id: mostly an open one (``open_share``), else any (some taken, some out of range)."""
    if core.txns and rng.random() < open_share:
        return rng.choice(sorted(core.txns))
    return rng.randrange(0, 1000)


def _index_commit(rng: random.Random, core: IndexCore) -> tuple[str, dict, list]:
    txn = _txn(rng, core) if rng.random() < 0.8 else None
    pid = core.txns[txn][0] if txn in core.txns and rng.random() < 0.9 else rng.choice(PIDS)
    keys = rng.sample(KEYS, rng.randint(1, 4))
    fields = list(core.txns[txn][1]) if txn in core.txns else rng.sample(sorted(FIELDS), rng.randint(0, 2))
    tags = None
    if rng.random() < 0.5:
        tags = [rng.choice([None, {}, {"score": rng.random()}, {"n": rng.randrange(9)}]) for _ in keys]
    return "commit", {"partition": pid, "keys": keys, "fields": fields, "tags": tags, "txn": txn}, []


def _index_abort(rng: random.Random, core: IndexCore) -> tuple[str, dict, list]:
    return "abort", {"txn": _txn(rng, core)}, []


def _list(rng: random.Random, core: IndexCore) -> tuple[str, dict, list]:
    return "list", {"partition": rng.choice([None, *PIDS])}, []


def _resolve(rng: random.Random, core: IndexCore) -> tuple[str, dict, list]:
    return "resolve", {"partition": rng.choice(PIDS), "keys": rng.sample(KEYS, rng.randint(1, 4))}, []


INDEX_BUILDERS = [
    (_prepare, 25),
    (_index_commit, 25),
    (_index_abort, 10),
    (_delete, 8),
    (_drop, 4),
    (_list, 8),
    (_resolve, 8),
    (_stats, 6),
]


# ---- mutations ----------------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.6 or depth > 2:
        return rng.choice(INTERESTING)
    if r < 0.8:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["pid", "keys", "spec", "nbytes", "col", "zz"]): _random_value(rng, depth + 1)}


def _nodes(obj: Any, out: list) -> list:
    """Every (container, key) slot under ``obj``, depth first."""
    if isinstance(obj, dict):
        for k in list(obj):
            out.append((obj, k))
            _nodes(obj[k], out)
    elif isinstance(obj, list):
        for i in range(len(obj)):
            out.append((obj, i))
            _nodes(obj[i], out)
    return out


def _with_header(frames: list[bytes], edit) -> list[bytes]:
    try:
        header = msgspec.msgpack.decode(frames[0])
    except (msgspec.DecodeError, IndexError, UnicodeDecodeError):
        return frames
    if not (isinstance(header, list) and len(header) == 3 and isinstance(header[2], dict)):
        return frames
    edit(header)
    return [msgspec.msgpack.encode(header), *frames[1:]]


def _m_body_value(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    def edit(header: list) -> None:
        slots = _nodes(header[2], [])
        if not slots:
            header[2]["zz"] = _random_value(rng)
            return
        box, k = rng.choice(slots)
        if isinstance(box, dict) and rng.random() < 0.2:
            del box[k]
        else:
            box[k] = _random_value(rng)

    return _with_header(frames, edit)


def _m_unknown_field(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    def edit(header: list) -> None:
        dicts = [header[2]] + [b[k] for b, k in _nodes(header[2], []) if isinstance(b[k], dict)]
        rng.choice(dicts)[rng.choice(["zz", "resv2", "Keys"])] = _random_value(rng)

    return _with_header(frames, edit)


def _m_numbers(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    def edit(header: list) -> None:
        ints = [(b, k) for b, k in _nodes(header[2], []) if type(b[k]) is int]
        for box, k in rng.sample(ints, min(len(ints), rng.randint(1, 3))):
            box[k] = rng.choice(HUGE)

    return _with_header(frames, edit)


def _m_op(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    ops = sorted(set(_protocol.SHARD_OPS) | set(_protocol.INDEX_OPS)) + ["", "__init__", "handle", "op_get"]

    def edit(header: list) -> None:
        header[1] = rng.choice(ops) if rng.random() < 0.9 else _random_value(rng)

    return _with_header(frames, edit)


def _m_rid(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    def edit(header: list) -> None:
        header[0] = rng.choice([*HUGE, 0, "7", None, 1.5, [1]])

    return _with_header(frames, edit)


def _m_header_shape(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    try:
        header = msgspec.msgpack.decode(frames[0])
    except (msgspec.DecodeError, IndexError, UnicodeDecodeError):
        return frames
    if isinstance(header, list) and header:
        choice = rng.randrange(4)
        if choice == 0:
            header = header[:-1]
        elif choice == 1:
            header = [*header, _random_value(rng)]
        elif choice == 2:
            header = {"rid": header[0], "op": header[1] if len(header) > 1 else "", "body": {}}
        else:
            header[2:] = [[header[2]] if len(header) > 2 else []]
    return [msgspec.msgpack.encode(header), *frames[1:]]


def _flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(buf) * 8)
        buf[i // 8] ^= 1 << (i % 8)
    return bytes(buf)


def _m_flip_header(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    return [_flip(rng, frames[0]), *frames[1:]] if frames else frames


def _m_truncate_header(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    return [frames[0][: rng.randrange(len(frames[0]) + 1)], *frames[1:]] if frames else frames


def _m_drop_frame(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if not frames:
        return frames
    i = rng.randrange(1, len(frames)) if len(frames) > 1 and rng.random() < 0.9 else 0
    return frames[:i] + frames[i + 1 :]


def _m_dup_frame(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if not frames:
        return frames
    src = rng.randrange(len(frames))
    out = list(frames)
    out.insert(rng.randrange(1, len(frames) + 1), frames[src])
    return out


def _m_resize_frame(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if len(frames) < 2:
        return [*frames, rng.randbytes(rng.randrange(64))]
    i = rng.randrange(1, len(frames))
    f = frames[i]
    f = f[: rng.randrange(len(f) + 1)] if rng.random() < 0.5 else f + rng.randbytes(rng.randint(1, 24))
    return [*frames[:i], f, *frames[i + 1 :]]


def _m_flip_frame(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if len(frames) < 2:
        return frames
    i = rng.randrange(1, len(frames))
    return [*frames[:i], _flip(rng, frames[i]), *frames[i + 1 :]]


def _m_swap_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    if len(frames) < 3:
        return frames
    i, j = rng.sample(range(1, len(frames)), 2)
    out = list(frames)
    out[i], out[j] = out[j], out[i]
    return out


def _m_extra_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    return [*frames, *(rng.randbytes(rng.randrange(17)) for _ in range(rng.randint(1, 4)))]


MUTATORS = [
    _m_body_value,
    _m_body_value,
    _m_unknown_field,
    _m_numbers,
    _m_numbers,
    _m_op,
    _m_rid,
    _m_header_shape,
    _m_flip_header,
    _m_truncate_header,
    _m_drop_frame,
    _m_dup_frame,
    _m_resize_frame,
    _m_flip_frame,
    _m_swap_frames,
    _m_extra_frames,
]


def _random_frames(rng: random.Random) -> list[bytes]:
    frames = [rng.randbytes(rng.randrange(48)) for _ in range(rng.randint(0, 4))]
    if frames and rng.random() < 0.5:  # valid msgpack of the wrong shape
        frames[0] = msgspec.msgpack.encode(_random_value(rng))
    return frames


def _case(rng: random.Random, builders: list, core: Any) -> tuple[str, list[bytes]]:
    r = rng.random()
    if r < 0.1:
        return "random", _random_frames(rng)
    fns, weights = zip(*builders, strict=True)
    build = rng.choices(fns, weights)[0]
    op, body, bufs = build(rng, core)
    frames = _wire.encode_request(rng.randrange(1, 2**31), op, body, bufs)
    if r < 0.4:
        return op, frames
    for _ in range(rng.randint(1, 3)):
        frames = rng.choice(MUTATORS)(rng, frames)
    return op + "*", frames


# ---- invariants ---------------------------------------------------------------------------------------


# Live segments whose column passed its check, with what the check read: a segment is checked again
# only when one of those changed (most cases leave most segments as they were).
_VALID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _raw(array: np.ndarray | None) -> bytes | None:
    return None if array is None else array.tobytes()


def _check_shard(core: ShardCore) -> list[str]:
    """What is wrong with the shard's bookkeeping (empty when nothing is)."""
    bad = []
    st = core.stats()
    for k in ("bytes_used", "bytes_reserved", "bytes_heap"):
        if getattr(st, k) < 0:
            bad.append(f"{k} = {getattr(st, k)} < 0")
    refs: Counter = Counter()
    segs: dict[int, Any] = {}
    for pid, part in core.partitions.items():
        for key, row in part.rows.items():
            for name, code in row.items():
                seg, i = part.loc(code)
                if seg.live <= 0:
                    bad.append(f"{pid}/{key}/{name} is in a segment with live={seg.live}")
                if not 0 <= i < seg.num_rows:
                    bad.append(f"{pid}/{key}/{name} is row {i} of a segment of {seg.num_rows} rows")
                if part.specs.get(name) is None or part.specs[name].family() != seg.spec.family():
                    bad.append(
                        f"{pid}/{key}/{name}: segment spec {seg.spec} != partition's {part.specs.get(name)}"
                    )
                refs[id(seg)] += 1
                segs[id(seg)] = seg
        kept = [seg for seg in part.segs.values() if id(seg) not in segs or seg.owner is not part]
        if kept:  # (a segment no row of the partition names must be gone from its table)
            bad.append(f"{pid} keeps {len(kept)} segment(s) that none of its rows names")
    for sid, seg in segs.items():
        if seg.live != refs[sid]:
            bad.append(f"a segment has live={seg.live} but {refs[sid]} rows refer to it")
        if seg.data is None and seg.file is None:
            bad.append("a live segment holds no bytes")
            continue
        seen = (
            seg.spec,
            seg.num_rows,
            seg.nbytes,
            None if seg.data is None else seg.data.nbytes,
            seg.file,
            _raw(seg.offsets),
            _raw(seg.shapes),
        )
        if _VALID.get(seg) == seen:  # checked as it is now already: a check costs more than the rest
            continue
        try:
            seg.column().check("<segment>")
        except errors.DataplaneError as exc:
            bad.append(f"a live segment is not a valid column: {exc}")
        else:
            _VALID[seg] = seen
    used = sum(s.accounted for s in segs.values())
    heap = sum(s.heap_bytes for s in segs.values())
    if core.used != used:
        bad.append(f"bytes_used = {core.used} but the live segments account for {used}")
    if core.heap_bytes != heap:
        bad.append(f"bytes_heap = {core.heap_bytes} but the live segments hold {heap} heap bytes")
    pending = sum(r.nbytes for r in core._resv.values())
    if core.pending != pending:
        bad.append(f"bytes_reserved = {core.pending} but the open reservations hold {pending}")
    if core.capacity is not None and core.used + core.pending > core.capacity:
        bad.append(f"used {core.used} + reserved {core.pending} > capacity {core.capacity}")
    files = {s.file.file_id for s in segs.values() if s.file is not None}
    files |= {e.file.file_id for r in core._resv.values() for e in r.fields.values() if e.file is not None}
    if set(core.pool.live) != files:
        bad.append(
            f"shared-memory files held live {sorted(core.pool.live)} != those of live segments and "
            f"reservations {sorted(files)}"
        )
    return bad


def _shard_state(core: ShardCore) -> Any:
    rows = {
        (pid, key, name): code
        for pid, part in core.partitions.items()
        for key, row in part.rows.items()
        for name, code in row.items()
    }
    specs = {pid: dict(part.specs) for pid, part in core.partitions.items()}
    return rows, specs, core.used, core.heap_bytes, core.pending, sorted(core._resv), sorted(core.pool.live)


def _check_index(core: IndexCore) -> list[str]:
    bad = []
    for pid, schema in core.schemas.items():
        for name, entry in schema.items():
            if entry.confirmed and entry.pending:
                bad.append(f"{pid}/{name} is confirmed yet pending on {sorted(entry.pending)}")
            if not entry.confirmed and not entry.pending:
                bad.append(f"{pid}/{name} is neither confirmed nor pending on any put")
            dead = sorted(t for t in entry.pending if t not in core.txns)
            if dead:
                bad.append(f"{pid}/{name} is pending on puts {dead} that are no longer open")
    for txn, (pid, _names) in core.txns.items():
        if pid is None or type(pid) is not str:
            bad.append(f"open put {txn} has partition {pid!r}")
    if core._open_until.keys() != core.txns.keys():
        bad.append(f"open puts {sorted(core.txns)} but deadlines for {sorted(core._open_until)}")
    return bad


def _index_state(core: IndexCore) -> Any:
    parts = {
        pid: {k: (repr(part.keys.tag(k)), sorted(held)) for k, held in part.keys.items()}
        for pid, part in core.partitions.items()
    }
    schemas = {
        pid: {n: (repr(e.family), e.confirmed, sorted(e.pending)) for n, e in s.items()}
        for pid, s in core.schemas.items()
    }
    return parts, schemas, {t: (p, list(n)) for t, (p, n) in core.txns.items()}


def _typed_body(frames: list[bytes], table: dict) -> tuple[str, Any] | None:
    """The request's op and typed body, or None when the server would not read it (it does not
    decode, or it speaks another protocol version: refused before its body is read)."""
    try:
        req, _ = _wire.decode_request(frames)
        if req.version != _wire.PROTOCOL_VERSION:
            return None
        return req.op, _protocol.decode_body(req.op, req.body, table)
    except errors.DataplaneError:
        return None


# ---- the driver ---------------------------------------------------------------------------------------


def _answer(core: Any, frames: list, max_frames: int = _wire.MAX_FRAMES) -> tuple[int, list]:
    """What ``RequestServer`` does with one message (less the ops its subclasses answer later)."""
    rid, out = _wire.answer(
        frames, lambda req, bufs: core.run(req.op, core.decode(req.op, req.body), bufs), max_frames=max_frames
    )
    assert out is not None
    return rid, out


def _committing(core: Any, frames: list[bytes]) -> int | None:
    """The open reservation this request commits (a shard's commit of one that exists), else None."""
    if not isinstance(core, ShardCore):
        return None
    typed = _typed_body(frames, _protocol.SHARD_OPS)
    if typed is not None and typed[0] == "commit" and typed[1].resv in core._resv:
        return typed[1].resv
    return None


def _internal(error: list) -> bool:
    """A bare DataplaneError made from an unexpected exception (``wire.frames.encode_error``)."""
    return error[0] == "DataplaneError"


def _check_reply(core: Any, frames: list[bytes], rid: int, out: list) -> Any:
    try:
        req = _wire.decode_request(frames)[0]
        expect, op = req.rid, req.op
    except errors.DataplaneError:
        expect, op = -1, None
    rep, bufs = _wire.decode_raw_reply(out)
    assert rid == expect and rep.rid == expect, f"reply rid {rid}/{rep.rid}, request rid {expect}"
    if rep.error is not None:
        name = rep.error[0]
        cls = getattr(errors, name, None) if type(name) is str else None
        assert isinstance(cls, type) and issubclass(cls, errors.DataplaneError), f"error class {name!r}"
        assert len(rep.error) == 3 and isinstance(rep.error[1], str), rep.error
        return rep
    typed = reply(rep.body, core.REPLIES[op])  # an answer reads back as its op's reply struct
    for rows in typed.fields.values() if isinstance(typed, _protocol.GetReply) else ():
        if isinstance(rows, _protocol.InlineRows):  # a gathered column: must be a valid one
            _wire.column_from_wire(rows.col, bufs).check("<reply>")
    return rep


def _fuzz(
    make_core,
    builders: list,
    check,
    state,
    max_frames: int,
    seed: int,
) -> tuple[int, Counter]:
    rng = random.Random(seed)
    core = make_core()
    cases, kinds = 0, Counter()
    deadline = time.monotonic() + BUDGET_S
    try:
        while cases < MAX_CASES and time.monotonic() < deadline:
            cases += 1
            if cases % 500 == 0 and isinstance(core, ShardCore):
                core.tick(now=time.monotonic() + 1e6)  # time passes: open reservations expire
                assert not check(core), f"after tick at case {cases}: {check(core)}"
            kind, frames = _case(rng, builders, core)
            try:
                sent = _wire.decode_request(frames)[0].op
            except errors.DataplaneError:
                sent = None
            committing = _committing(core, frames)
            before = state(core)
            try:
                rid, out = _answer(core, frames, max_frames)
            except BaseException as exc:
                pytest.fail(f"case {cases} ({kind}): answer raised {exc!r} for frames {frames!r:.600}")
            try:
                rep = _check_reply(core, frames, rid, out)
            except AssertionError as exc:
                pytest.fail(f"case {cases} ({kind}): bad reply: {exc}; frames {frames!r:.600}")
            kinds[kind + (" err" if rep.error else " ok")] += 1
            problems = check(core)
            if rep.error is not None:
                if _internal(rep.error):
                    problems.append(f"untyped internal error {rep.error[1]!r}")
                after = state(core)
                if after != before and not (sent == "commit" and isinstance(core, ShardCore)):
                    problems.append(f"the error reply {rep.error[:2]} changed the core's state")
            if committing is not None and committing in core._resv:  # done or failed, it is over
                problems.append(f"reservation {committing} is still open after its commit ({rep.error})")
            if problems:
                pytest.fail(
                    f"case {cases} ({kind}, seed {seed}): {problems}; reply "
                    f"{rep.error or bytes(rep.body)!r:.300}; frames {frames!r:.600}"
                )
    finally:
        if isinstance(core, ShardCore):
            core.close()
    return cases, kinds


def _report(what: str, cases: int, kinds: Counter) -> None:
    print(f"\n{what}: {cases} cases in {BUDGET_S:.1f} s (seed {SEED})")
    for k, v in sorted(kinds.items()):
        print(f"  {k:>14}: {v}")


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="dataplane")  # expired reservations are expected here


def test_fuzz_shard():
    cases, kinds = _fuzz(
        lambda: ShardCore(0, capacity_bytes=CAPACITY, warm_idle_s=0.5, warm_retain_bytes=CAPACITY),
        SHARD_BUILDERS,
        _check_shard,
        _shard_state,
        _wire.MAX_FRAMES,
        SEED,
    )
    _report("shard", cases, kinds)
    assert cases >= 200, f"only {cases} cases ran in {BUDGET_S}s"
    # the valid requests must mostly succeed, or the fuzz only ever exercised the refusals
    assert kinds["reserve ok"] and kinds["commit ok"] and kinds["get ok"], kinds


def test_fuzz_index():
    cases, kinds = _fuzz(IndexCore, INDEX_BUILDERS, _check_index, _index_state, 0, SEED + 1)
    _report("index", cases, kinds)
    assert cases >= 200, f"only {cases} cases ran in {BUDGET_S}s"
    assert kinds["prepare ok"] and kinds["commit ok"] and kinds["list ok"], kinds


# ---- regression tests of the bugs the fuzz found ---------------------------------------------------
# Each failed before its fix; each docstring describes the bug as it was.


def _call(core: Any, op: str, body: dict, frames: list | None = None, max_frames: int = _wire.MAX_FRAMES):
    _, out = _answer(core, _wire.encode_request(1, op, body, frames or []), max_frames)
    return _wire.decode_raw_reply(out)[0]


def _resv(rep: Any) -> int:
    """The reservation a successful ``reserve`` reply names."""
    return reply(rep.body, _protocol.ReserveReply).resv


def test_regression_zero_key_commit_leaks():
    """A reserve naming no keys is accepted, and its commit makes a segment no row refers to.

    ``ShardCore.op_commit`` adds the segment's bytes to ``bytes_used`` (and ``bytes_heap``) and keeps
    its shared-memory file, but with no key no row ever references the segment, so ``_unref`` never
    gives either back: not on delete, not on drop. A peer repeating it fills the shard's capacity
    (8 bytes of offsets per variable-size field) and leaks one memfd per shared-memory field.
    """
    core = ShardCore(0, capacity_bytes=CAPACITY)
    try:
        spec = ["arrow", "large_string", []]
        col = {"spec": spec, "rows": 0, "data": 0, "offsets": 1}
        fields = {
            "s": {"spec": spec, "nbytes": 0, "col": col},
            "x": {"spec": ["dense", "uint8", [4]], "nbytes": 0},
        }
        rep = _call(core, "reserve", {"partition": "p", "keys": [], "fields": fields}, [b"", _offsets([])])
        if rep.error is None:  # refused outright is a fix too
            _call(core, "commit", {"resv": _resv(rep)})
        _call(core, "clear_partition", {"partition": "p"})
        st = core.stats()
        assert not _check_shard(core), _check_shard(core)
        assert st.bytes_used == 0 and st.bytes_heap == 0 and st.shm_files == 0, st
    finally:
        core.close()


def test_regression_get_of_no_keys_with_fields():
    """``op_get`` with ``keys=[]`` and explicit ``fields`` indexes ``order[0]`` of an empty list.

    The IndexError leaks to the peer as a bare ``DataplaneError("IndexError: list index out of
    range")`` instead of an empty answer or a typed ``WireError``.
    """
    core = ShardCore(0, capacity_bytes=CAPACITY)
    try:
        col = {"spec": ["dense", "uint8", [1]], "rows": 1, "data": 0}
        fields = {"x": {"spec": ["dense", "uint8", [1]], "nbytes": 1, "col": col}}
        rep = _call(core, "reserve", {"partition": "p", "keys": ["a"], "fields": fields}, [b"z"])
        assert _call(core, "commit", {"resv": _resv(rep)}).error is None
        for shm in (False, True):
            rep = _call(core, "get", {"partition": "p", "keys": [], "fields": ["x"], "shm": shm})
            assert rep.error is None or not _internal(rep.error), rep.error
    finally:
        core.close()


def test_regression_index_commit_with_a_txn_of_another_partition():
    """``IndexCore.op_commit`` pops ``txns[txn]`` but confirms the txn's fields in the *commit's*
    partition, never checking that the txn was prepared for it.

    The fields the txn prepared in its own partition stay pending on a put that no longer exists:
    no abort can take them back, so that partition's new-field schema stays decided by a put that
    never committed (a later put with another dtype gets ``SchemaError``), while the other
    partition's same-named fields are marked confirmed by a put that never wrote there.
    """
    core = IndexCore()
    spec = {"x": ["dense", "float32", []]}
    prepared = _call(core, "prepare", {"partition": "a", "specs": spec, "txn": 1}, max_frames=0)
    txn = reply(prepared.body, _protocol.PrepareReply).txn
    _call(core, "commit", {"partition": "b", "keys": ["k"], "fields": ["x"], "txn": txn}, max_frames=0)
    assert not _check_index(core), _check_index(core)


def test_regression_huge_jagged_row_overflows():
    """``ColumnSpec.check`` accepts a jagged spec whose element row is 2**63 bytes or more (e.g.
    ``["jagged", "float32", [2**61]]``), and ``check_offsets`` then computes ``off % spec.row_bytes()``
    on an int64 array: numpy raises ``OverflowError``, which reaches the peer as a bare
    ``DataplaneError("OverflowError: ...")``, on an inline reserve and on a shared-memory commit.
    The commit is worse: ``op_commit`` gives a bad commit's reservation back only for a
    ``DataplaneError``, so this one stays reserved (``bytes_reserved``) until it expires.
    """
    core = ShardCore(0, capacity_bytes=CAPACITY)
    problems = []
    try:
        spec = ["jagged", "float32", [2**61]]
        col = {"spec": spec, "rows": 1, "data": 0, "offsets": 1}
        fields = {"j": {"spec": spec, "nbytes": 8, "col": col}}
        rep = _call(
            core, "reserve", {"partition": "p", "keys": ["a"], "fields": fields}, [b"\0" * 8, _offsets([8])]
        )
        if rep.error is None or _internal(rep.error):
            problems.append(f"inline reserve: {rep.error}")
        rep = _call(
            core, "reserve", {"partition": "p", "keys": ["a"], "fields": {"j": {"spec": spec, "nbytes": 8}}}
        )
        if rep.error is None:
            rep = _call(core, "commit", {"resv": _resv(rep), "offsets": {"j": 0}}, [_offsets([8])])
        if rep.error is None or _internal(rep.error):
            problems.append(f"shared-memory commit: {rep.error}")
        if core.stats().bytes_reserved:
            problems.append(f"the failed commit kept {core.stats().bytes_reserved} bytes reserved")
    finally:
        core.close()
    assert not problems, problems


def test_regression_invalid_utf8_is_untyped():
    """msgspec raises ``UnicodeDecodeError`` (not ``msgspec.DecodeError``) for a msgpack str that is
    not UTF-8. Neither ``wire.frames._decode`` nor ``wire.protocol.decode_body`` catches it, so the peer
    gets a bare ``DataplaneError("UnicodeDecodeError: ...")`` instead of a ``WireError`` (and a client
    decoding such a reply would get a raw UnicodeDecodeError out of ``wire.frames``' reply decoding).
    """
    core = ShardCore(0, capacity_bytes=CAPACITY)
    try:
        bad_header = b"\x93\x07\xa4pi\xf4g\x80"  # [7, <invalid utf-8>, {}]
        _, out = _answer(core, [bad_header])
        rep = _wire.decode_raw_reply(out)[0]
        assert rep.error[0] == "WireError", rep.error
        # [7, "clear_partition", {"partition": <invalid utf-8>}, version]
        bad_body = b"\x94\x07\xafclear_partition\x81\xa3pid\xa2\xf4g" + bytes([_wire.PROTOCOL_VERSION])
        _, out = _answer(core, [bad_body])
        rep = _wire.decode_raw_reply(out)[0]
        assert rep.rid == 7 and rep.error[0] == "WireError", rep.error
    finally:
        core.close()
