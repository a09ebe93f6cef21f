"""ShardCore without Ray or sockets: reserve/commit, shared memory, accounting, warm pool, exports."""

from __future__ import annotations

import gc
import os
import threading
import uuid
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from dataplane.client.mappings import MappingCache
from dataplane.codec.columns import encode_fields
from dataplane.errors import KeyNotFoundError, PartitionNotFoundError, SchemaError, StoreFullError
from dataplane.server.jobs import run_job
from dataplane.server.shard import checkpoint as shard_checkpoint
from dataplane.server.shard import core as shard_core
from dataplane.server.shard.actor import ShardServer
from dataplane.server.shard.core import DROP_SLICE, ShardCore
from dataplane.server.shard.segments import ShmPool, size_class
from dataplane.transport.auth import Credentials
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol


def call(core: ShardCore, op: str, body: dict, frames=()) -> tuple[Any, list]:
    """One request as the server runs it: the body msgpack-encoded, then decoded for its op; the reply
    is the op's reply struct (``wire.protocol.SHARD_REPLIES``)."""
    return core.handle(op, msgspec.msgpack.encode(body), list(frames))


def _reserve_inline(core: ShardCore, pid: str, keys: list[str], fields: dict) -> int:
    cols = encode_fields(fields, len(keys))
    bufs: list = []
    body = {
        "partition": pid,
        "keys": keys,
        "fields": {
            n: {
                "spec": _wire.spec_to_wire(c.spec),
                "nbytes": len(c.data),
                "col": _wire.column_to_wire(c, bufs),
            }
            for n, c in cols.items()
        },
    }
    frames = [memoryview(np.frombuffer(b, np.uint8).copy()) for b in bufs]  # as if received
    return call(core, "reserve", body, frames)[0].resv


def _put_shm(core: ShardCore, pid: str, keys: list[str], x: torch.Tensor, maps: MappingCache) -> None:
    (col,) = encode_fields({"x": x}, len(keys)).values()
    body = {
        "partition": pid,
        "keys": keys,
        "fields": {"x": {"spec": _wire.spec_to_wire(col.spec), "nbytes": len(col.data)}},
    }
    reply, _ = call(core, "reserve", body, [])
    view = maps.view(core.shard_id, os.getpid(), reply.files["x"])
    view[: len(col.data)] = col.data
    call(core, "commit", {"resv": reply.resv, "offsets": {}}, [])


def _get(
    core: ShardCore, pid: str, keys: list[str], fields=None, shm=False, export=False
) -> tuple[Any, list]:
    body, frames = call(
        core, "get", {"partition": pid, "keys": keys, "fields": fields, "shm": shm, "export": export}, []
    )
    return body, [memoryview(f).cast("B") for f in frames]


def test_inline_put_get_and_accounting():
    core = ShardCore(0)
    rid = _reserve_inline(core, "p", ["a", "b"], {"x": torch.tensor([[1, 2], [3, 4]]), "s": ["hi", "there"]})
    assert core.stats().bytes_used == 0 and core.stats().bytes_reserved > 0
    call(core, "commit", {"resv": rid}, [])
    st = core.stats()
    assert st.bytes_reserved == 0 and st.bytes_used > 0 and st.partitions == {"p": 2}
    body, frames = _get(core, "p", ["b", "a"])
    x = _wire.column_from_wire(body.fields["x"].col, frames)
    assert np.frombuffer(x.data, np.int64).tolist() == [3, 4, 1, 2]  # request order
    call(core, "clear", {"partition": "p", "keys": ["a", "b", "zz"]}, [])
    assert core.stats().bytes_used == 0 and core.stats().bytes_resident == 0


def test_errors_name_the_culprit():
    core = ShardCore(3, capacity_bytes=100)
    call(core, "commit", {"resv": _reserve_inline(core, "p", ["a"], {"x": torch.zeros(1, 2)})}, [])
    with pytest.raises(PartitionNotFoundError, match="'q'"):
        _get(core, "q", ["a"])
    with pytest.raises(KeyNotFoundError, match="'b'"):
        _get(core, "p", ["b"])
    with pytest.raises(KeyNotFoundError, match="'y'"):
        _get(core, "p", ["a"], fields=["y"])
    with pytest.raises(SchemaError, match="'x'"):
        _reserve_inline(core, "p", ["b"], {"x": torch.zeros(1, 3, dtype=torch.int64)})  # another dtype
    with pytest.raises(StoreFullError, match="shard 3.*capacity"):
        _reserve_inline(core, "p", ["b"], {"y": torch.zeros(1, 64)})
    assert core.stats().bytes_reserved == 0


def test_abort_and_expired_reservations_free_everything():
    core = ShardCore(0, reservation_timeout_s=0.0)
    pool_before = core.pool.bytes_resident
    body = {
        "partition": "p",
        "keys": ["a"],
        "fields": {"x": {"spec": ["dense", "float32", [1 << 18]], "nbytes": 1 << 20}},
    }
    rid = call(core, "reserve", body, [])[0].resv
    call(core, "abort", {"resv": rid}, [])
    call(core, "reserve", body, [])
    core.tick(now=1e12)  # the client vanished: undone, its files fenced (closed, never reused)
    st = core.stats()
    assert st.bytes_reserved == 0 and st.bytes_warm == 0 and core.pool.bytes_resident == pool_before
    assert st.reservations_expired == 1


def test_shared_memory_put_get_and_warm_reuse():
    core = ShardCore(0, warm_idle_s=60)
    maps = MappingCache()
    x = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    keys = [f"k{i}" for i in range(64)]
    _put_shm(core, "p", keys, x, maps)
    body, frames = _get(core, "p", keys[10:20], shm=True)
    entry = body.fields["x"]
    assert isinstance(entry, _protocol.SegmentRows) and len(entry.segs) == 1
    ref, nbytes, rows, _, view, _, _ = entry.segs[0]
    assert not view  # not asked for a view: the client copies (and checks the generation)
    seg = np.frombuffer(maps.view(0, os.getpid(), ref)[:nbytes], np.float32).reshape(rows, 1024)
    assert np.array_equal(seg[_wire.array_from_wire(entry.row, frames)], x[10:20].numpy())
    first_file = ref[0]
    call(core, "clear_partition", {"partition": "p"}, [])
    st = core.stats()
    assert st.bytes_used == 0 and st.bytes_warm > 0  # kept warm for the next put
    _put_shm(core, "p", keys, x + 1, maps)
    body, _ = _get(core, "p", keys, shm=True)
    assert body.fields["x"].segs[0][0][0] == first_file, "a warm segment was not reused"
    assert len(maps) == 1


def test_exported_segment_is_never_recycled():
    core = ShardCore(0, warm_idle_s=60)
    maps = MappingCache()
    keys = [f"k{i}" for i in range(16)]
    _put_shm(core, "p", keys, torch.ones(16, 4096), maps)
    body, _ = _get(core, "p", keys, shm=True, export=True)
    ref = body.fields["x"].segs[0][0]
    view = np.frombuffer(maps.view(0, os.getpid(), ref), np.float32)[: 16 * 4096]
    call(core, "clear", {"partition": "p", "keys": keys}, [])
    assert core.stats().bytes_warm == 0  # closed, not pooled
    _put_shm(core, "p", keys, torch.zeros(16, 4096), maps)
    assert float(view.min()) == 1.0, "an exported view was overwritten"
    maps.prune(0, core.pool.version, core.pool.live_ids())
    assert float(view.max()) == 1.0  # our view keeps its pages after the cache forgets the file


def test_pool_trim_policy():
    pool = ShmPool(warm_idle_s=10.0, warm_retain_bytes=3 << 20)
    files = [pool.acquire(1 << 20) for _ in range(5)]
    for f in files:
        pool.release(f)
    assert pool.bytes_warm <= 3 << 20  # above the watermark: the oldest were given back
    assert pool.trim(everything=True) > 0 and pool.bytes_resident == 0
    assert size_class(1) == 4096 and size_class((1 << 20) + 1) <= (1 << 20) * 1.125 + 4096


def test_the_pool_says_when_a_mapped_file_is_freed_and_closes_one_still_read():
    """``on_free`` runs with a file's mapping before its memory is reused or closed (a transfer engine
    unregisters it there); a file it answers False for (something may still read it) is closed, never
    reused. A file the shard never mapped has nothing to tell."""
    seen: list[int] = []
    still_read: set[int] = set()

    def on_free(mapping: memoryview) -> bool:
        addr = np.frombuffer(mapping, np.uint8).ctypes.data
        seen.append(addr)
        return addr not in still_read

    pool = ShmPool(warm_idle_s=60.0, warm_retain_bytes=1 << 30)
    pool.on_free = on_free
    a, b, unmapped = (pool.acquire(1 << 20) for _ in range(3))
    addr_a, addr_b = (np.frombuffer(f.view(), np.uint8).ctypes.data for f in (a, b))
    still_read.add(addr_b)
    pool.release(a)
    pool.release(b)
    pool.release(unmapped)
    assert seen == [addr_a, addr_b]
    assert a in pool.warm and unmapped in pool.warm and b not in pool.warm and b.fd < 0  # b: closed
    c = pool.acquire(1 << 20)
    c.view()
    pool.fence(c)
    pool.close_all()  # (warm files were told when freed)
    assert len(seen) == 3


def test_shard_side_modules_do_not_import_torch():
    # Shards, the index and the wire share the codec's Column/ColumnSpec, yet must stay torch-free.
    import subprocess
    import sys

    mods = (
        "dataplane.server.shard.core, dataplane.server.shard.actor, dataplane.server.index.actor, "
        "dataplane.wire.frames, dataplane.codec.rows"
    )
    code = f"import sys, {mods}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _put_ready(core: ShardCore, pid: str, keys: list[str], fields: dict, tags=None):
    """A ``put_ready`` as ``ShardServer`` serves it: the rows stored, the index commit to send on."""
    return run_job(_put_ready_job(core, pid, keys, fields, tags))


def _put_ready_job(core: ShardCore, pid: str, keys: list[str], fields: dict, tags=None):
    """The job storing a ``put_ready`` in steps (``ShardCore.job_put_ready``), not started."""
    cols = encode_fields(fields, len(keys))
    bufs: list = []
    body = {
        "partition": pid,
        "keys": keys,
        "fields": {
            n: {
                "spec": _wire.spec_to_wire(c.spec),
                "nbytes": len(c.data),
                "col": _wire.column_to_wire(c, bufs),
            }
            for n, c in cols.items()
        },
        "tags": tags,
    }
    frames = [memoryview(np.frombuffer(b, np.uint8).copy()) for b in bufs]
    typed = _protocol.decode_body("put_ready", msgspec.msgpack.encode(body), _protocol.SHARD_OPS)
    return core.job_put_ready(typed, frames)


def _serve_put_ready(core: ShardCore, body: dict, frames=()):
    """``body`` decoded as a ``put_ready`` (as ``ShardServer`` does), then stored by ``core``."""
    typed = _protocol.decode_body("put_ready", msgspec.msgpack.encode(body), _protocol.SHARD_OPS)
    return core.put_ready(typed, list(frames))


def test_put_ready_stores_at_once_and_a_refused_put_is_taken_back_exactly():
    core = ShardCore(0)
    with pytest.raises(Exception, match="served by the shard's server"):  # never through ShardCore.handle
        call(core, "put_ready", {"partition": "p", "keys": ["a"], "fields": {}}, [])
    commit, _ = _put_ready(core, "p", ["a", "b"], {"x": torch.tensor([1, 2])}, tags=[{"t": 1}, None])
    # the index commit names what this shard stored, with the client's tags, nothing else
    assert msgspec.structs.asdict(commit) == {
        "partition": "p",
        "keys": ["a", "b"],
        "fields": ["x"],
        "tags": [{"t": 1}, None],
        "txn": None,
        "specs": {"x": ("dense", "int64", [])},
    }
    body, frames = _get(core, "p", ["a", "b"])  # readable before the index is asked
    assert np.frombuffer(_wire.column_from_wire(body.fields["x"].col, frames).data, np.int64).tolist() == [
        1,
        2,
    ]
    used = core.stats().bytes_used
    # a refused put of a new field y to "a" and a new key "c": only what that put wrote goes
    _, undo = _put_ready(core, "p", ["a", "c"], {"y": torch.tensor([1.5, 2.5])})
    # meanwhile a later put replaced "c"'s y: the undo must leave that one alone
    _, later = _put_ready(core, "p", ["c"], {"y": torch.tensor([9.0])})
    core.undo_put(undo)
    assert set(core.partitions["p"].rows["a"]) == {"x"} and set(core.partitions["p"].rows["c"]) == {"y"}
    assert "y" in core.partitions["p"].specs  # still held by "c"
    core.undo_put(later)
    assert "c" not in core.partitions["p"].rows and "y" not in core.partitions["p"].specs
    assert core.stats().bytes_used == used
    # a refused put into a partition it created leaves no partition behind
    _, undo = _put_ready(core, "q", ["a"], {"x": torch.tensor([1.0])})
    core.undo_put(undo)
    assert "q" not in core.partitions and core.stats().partitions == {"p": 2}


def test_a_one_step_put_is_checked_like_a_reserve_and_accounted_like_a_commit():
    """``put_ready`` stores inline rows with no reservation between the checks and the attach: what a
    reserve refuses it refuses, changing nothing, and what it stores costs what a reserve + commit of
    the same rows costs."""
    from dataplane.errors import WireError

    two_step, one_step = ShardCore(0), ShardCore(1, capacity_bytes=64)
    rows = {"x": torch.tensor([[1, 2], [3, 4]]), "s": ["hi", "there"]}
    call(two_step, "commit", {"resv": _reserve_inline(two_step, "p", ["a", "b"], rows)}, [])
    _put_ready(one_step, "p", ["a", "b"], rows)
    for st in (two_step.stats(), one_step.stats()):
        assert st.bytes_reserved == 0 and st.partitions == {"p": 2}
    assert two_step.stats().bytes_used == one_step.stats().bytes_used > 0
    before = one_step.stats()
    with pytest.raises(SchemaError, match="'x'"):  # another dtype for a stored field
        _put_ready(one_step, "p", ["c"], {"x": torch.zeros(1, 2)})
    with pytest.raises(StoreFullError, match="shard 1.*capacity"):
        _put_ready(one_step, "p", ["c"], {"y": torch.zeros(1, 64)})
    with pytest.raises(WireError, match="twice"):
        _put_ready(one_step, "p", ["c", "c"], {"x": torch.tensor([[1, 2], [3, 4]])})
    cols = encode_fields({"x": torch.tensor([[5, 6]])}, 1)
    bufs: list = []
    wire = {
        "spec": _wire.spec_to_wire(cols["x"].spec),
        "nbytes": 16,
        "col": _wire.column_to_wire(cols["x"], bufs),
    }
    with pytest.raises(WireError, match="frame"):  # a declared frame that was not sent
        _serve_put_ready(one_step, {"partition": "p", "keys": ["c"], "fields": {"x": wire}})
    del wire["col"]
    with pytest.raises(WireError, match="inline"):
        _serve_put_ready(one_step, {"partition": "p", "keys": ["c"], "fields": {"x": wire}})
    assert one_step.stats() == before and "c" not in one_step.partitions["p"].rows


def test_unbounded_shards_on_one_host_admit_against_its_available_memory_together(monkeypatch):
    """Two unbounded shards of one store on one host: what a put allocates must fit the host's
    available memory less what the other shard is allocating at that moment (the old code let each
    shard admit up to the host's total memory on its own).

    The host's available memory is pinned at 64 MiB here (``available_bytes``): a full host cannot be
    made for real on a machine others share. Everything else is real: two cores, the second opening
    the first's ledger through ``/proc`` as a peer shard does, its lock, and real reservations.
    """
    from dataplane.server.shard import host_memory
    from dataplane.server.shard.host_memory import HostMemory
    from dataplane.transport.locality import Locality

    mib = 1 << 20
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 64 * mib)
    a = ShardCore(0, name="t-host-a", host=HostMemory.for_shard("t-host", 0))
    b = ShardCore(1, name="t-host-b", host=HostMemory.for_shard("t-host", 1))
    here = Locality.here()
    peers = [{"shard": c.shard_id, "locality": here.to_dict(), "host_ledger": c.host.ref()} for c in (a, b)]
    for c in (a, b):  # what the store's starter tells each shard (``ShardActor.link_index``)
        c.host.share(peers, here)
    theirs, mine = a.host.ref(), b.host.ref()
    assert theirs is not None and mine is not None and mine[2] == theirs[2], "b does not use a's ledger"

    def reserve(core: ShardCore, nbytes: int) -> _protocol.ReserveReply:
        body = {
            "partition": "p",
            "keys": ["k"],
            "fields": {"x": {"spec": ["arrow", "large_binary", []], "nbytes": nbytes}},
        }
        return call(core, "reserve", body, [])[0]

    try:
        with pytest.raises(StoreFullError, match=r"available \(67108864 bytes\).*nothing was written"):
            reserve(a, 65 * mib)  # more than the host has available, though far less than its RAM
        with a.host.admit(48 * mib, "shard 0's put"):  # shard 0 is allocating 48 MiB right now
            with pytest.raises(StoreFullError, match="less 50331648 bytes the store's other shards"):
                reserve(b, 32 * mib)
            assert b.stats().bytes_reserved == 0
            reserve(b, 8 * mib)  # what is left beside shard 0's allocation
        resv = reserve(b, 32 * mib).resv  # shard 0 is done allocating: admitted
        assert b.stats().bytes_reserved >= 32 * mib
        call(b, "abort", {"resv": resv}, [])
    finally:
        a.close()
        b.close()


def test_rows_are_no_objects_to_the_collector_and_a_cleared_partition_goes_at_once_freed_in_slices():
    """A million rows must not make the shard's garbage collector walk a million objects, nor a clear of
    them hold up its loop: a row is a dict of ints (never tracked); a cleared partition's segments and
    bytes go at once, its rows a slice at a time, and the shard serves meanwhile."""
    core = ShardCore(0)
    n = 2 * DROP_SLICE + 7
    keys = [f"k{i}" for i in range(n)]
    _put_ready(core, "warm", ["w"], {"x": torch.tensor([0])})
    gc.collect()
    before = len(gc.get_objects())
    for i in range(0, n, 5000):
        chunk = keys[i : i + 5000]
        _put_ready(core, "big", chunk, {"x": torch.arange(len(chunk)), "y": torch.ones(len(chunk))})
    _put_ready(core, "big", keys[:10], {"x": torch.arange(10) + 100})  # (replacing rows: the other path)
    gc.collect()
    assert len(gc.get_objects()) - before < 500  # (a tracked object per row would be tens of thousands)
    body, frames = _get(core, "big", [keys[3], keys[-1], keys[5001]], ["x"])
    got = np.frombuffer(_wire.column_from_wire(body.fields["x"].col, frames).data, np.int64).tolist()
    assert got == [103, (n - 1) % 5000, 1]
    assert call(core, "clear_partition", {"partition": "big"})[0].removed == n
    st = core.stats()
    assert "big" not in st.partitions and st.bytes_used == core.partitions["warm"].nbytes  # at once
    assert core.dropped  # the rows themselves: later, between requests
    freed = []
    while core.dropped:
        _put_ready(core, "other", [f"o{len(freed)}"], {"x": torch.tensor([len(freed)])})  # served between
        freed.append(core.free_some())
        assert freed[-1] <= DROP_SLICE
    assert sum(freed) == n and len(freed) >= 3 and core.stats().partitions["other"] == len(freed)


def test_the_shard_loop_frees_one_slice_per_pass_and_does_not_wait_meanwhile():
    core = ShardCore(0)
    server = ShardServer(
        core, "127.0.0.1", f"sh-{uuid.uuid4().hex[:6]}", Credentials.new(encrypt=False),
        rpc_timeout_s=10.0, lock=threading.Lock(),
    )  # fmt: skip
    try:
        assert server.poll_timeout_ms() > 0  # idle: the loop waits for requests
        _put_ready(
            core, "big", [f"k{i}" for i in range(2 * DROP_SLICE + 1)], {"x": torch.zeros(2 * DROP_SLICE + 1)}
        )
        call(core, "clear_partition", {"partition": "big"})
        passes = 0
        while core.dropped:
            assert server.poll_timeout_ms() == 0  # rows left to free: poll for requests, do not wait
            left = len(core.dropped[0])
            server.after_poll()  # one pass of the loop after its poll: one slice, then requests again
            assert not core.dropped or left - len(core.dropped[0]) == DROP_SLICE
            passes += 1
        assert passes == 3 and server.poll_timeout_ms() > 0
    finally:
        server.start()  # (its loop closes the sockets as it stops)
        server.stop()
        core.close()


def test_a_put_attached_in_slices_replaces_and_accounts_exactly_even_when_cleared_midway(monkeypatch):
    """A put's rows are attached ``ATTACH_SLICE`` at a time: over keys that exist (their old values
    let go) and new ones alike; a partition cleared between two slices takes the rows not attached
    yet with it, and once it is freed nothing is left in use."""
    monkeypatch.setattr(shard_core, "ATTACH_SLICE", 3)
    core = ShardCore(0)
    _put_ready(core, "p", ["a", "b"], {"x": torch.tensor([1, 2])})
    keys = ["a", "b", *[f"k{i}" for i in range(8)]]
    _put_ready(core, "p", keys, {"x": torch.arange(10, 20)})
    body, frames = _get(core, "p", ["k7", "a", "b"])
    assert np.frombuffer(_wire.column_from_wire(body.fields["x"].col, frames).data, np.int64).tolist() == [
        19,
        10,
        11,
    ]
    assert len(core.partitions["p"].segs) == 1  # the first put's segment let go with its last row
    job = _put_ready_job(core, "q", [f"q{i}" for i in range(10)], {"x": torch.arange(10)})
    assert next(job) is None and len(core.partitions["q"].rows) == 3  # one slice attached
    call(core, "clear_partition", {"partition": "q"}, [])
    run_job(job)
    while core.dropped:
        core.free_some()
    call(core, "clear_partition", {"partition": "p"}, [])
    while core.dropped:
        core.free_some()
    assert core.stats().bytes_used == 0 and core.stats().bytes_resident == 0


@pytest.mark.parametrize(
    "case",
    ["one field", "two fields", "a key gone", "a field gone", "field sets differ"],
)
def test_a_save_finds_its_rows_at_c_speed_or_key_by_key_alike(case):
    """A save's lookup of a slice of keys (``_lookup``): the usual slice (every key held, one field
    set) without a step per key, any other key by key; both give the rows kept, their codes per field
    and the keys gone."""
    keys = [f"k{i}" for i in range(6)]
    fields = [["x"]] * 6 if case == "one field" else [["x", "y"]] * 6
    rows: list[Any] = [{"x": 10 + i, "y": 20 + i} for i in range(6)]
    if case == "a key gone":
        rows[2] = None
    elif case == "a field gone":
        del rows[4]["y"]
    elif case == "field sets differ":
        fields = [["x"], ["x", "y"]] * 3
    gone: list[str] = []
    kept, codes = shard_checkpoint._lookup(keys, rows, fields, gone)
    expect_gone = {"a key gone": ["k2"], "a field gone": ["k4"]}.get(case, [])
    assert gone == expect_gone and kept == [k for k in keys if k not in expect_gone]
    for name, (code, pos) in codes.items():
        want = [(j, rows[keys.index(k)][name]) for j, k in enumerate(kept) if name in fields[keys.index(k)]]
        assert list(zip(pos.tolist(), code.tolist(), strict=True)) == want
    assert set(codes) == {f for k in kept for f in fields[keys.index(k)]}


def test_a_load_checks_what_the_files_say_of_its_keys():
    """A load attaches a chunk's rows to their keys at C speed (new keys) or key by key, and refuses
    by name, with a ``CheckpointError``, a key given a field twice (within a chunk or across two), a
    key position outside its partition, a listed field no file holds and rows the index does not
    list; a chunk partly wanted gives only the rows wanted."""
    from dataplane.errors import CheckpointError
    from dataplane.server.shard.core import Segment, _Partition
    from dataplane.wire.protocol import WireColumn

    ck = shard_checkpoint
    part, seg = _Partition(), Segment(None, 2, 0, None, None, None, sid=7)  # type: ignore[arg-type]
    ck._attach_loaded(part, ["a", "b"], "x", seg, "f", "p")
    ck._attach_loaded(part, ["b", "a"], "y", seg, "f", "p")  # (existing keys: key by key)
    assert part.rows == {"a": {"x": 7 << 32, "y": (7 << 32) + 1}, "b": {"x": (7 << 32) + 1, "y": 7 << 32}}
    for keys, name in ((["c", "c"], "x"), (["a"], "x")):
        with pytest.raises(CheckpointError, match="holds 'x' twice"):
            ck._attach_loaded(part, keys, name, seg, "f", "p")

    col = WireColumn(spec=["dense", "int64", []], rows=3, data=0)
    x, xy = ["x"], ["x", "y"]
    want = {"p": {"k0": x, "k1": xy, "k2": xy}}

    def manifest(positions: list[int], field: str = "y") -> ck.ShardManifest:
        chunk = ck.Chunk(field=field, col=col, bufs=[(0, 0, 0)], keys=positions)
        return ck.ShardManifest(1, 0, 0, [ck.ShardPart("p", ["k0", "k1", "k2"], [chunk])])

    ((_, _, keys, rows),) = ck._select(manifest([0, 1, 2]), want, "m")
    assert keys == ["k0", "k1", "k2"] and rows.tolist() == [1, 2]  # (k0 holds no y)
    assert ck._select(manifest([0, 1, 2], "x"), want, "m")[0][3] is None  # (all of them)
    for outside in ([0, 3], [-1], [1 << 63]):  # (msgspec reads ints up to 2**64 - 1)
        with pytest.raises(CheckpointError, match="malformed"):
            ck._select(manifest(outside), want, "m")

    staged = ck._Load(["p"], {"p": _Partition(rows={"k0": {"x": 1}, "k1": {"x": 2, "y": 3}})}, [], [], 0, 0.0)
    staged.pairs["p"] = 3
    with pytest.raises(CheckpointError, match=r"'k2' of partition 'p' with fields \['x', 'y'\]"):
        ck._check_complete(staged, want, "c")
    staged.parts["p"].rows["k2"] = {"x": 4, "y": 5}
    staged.parts["p"].rows["k9"] = {"x": 6}
    staged.pairs["p"] = 6
    with pytest.raises(CheckpointError, match="the index does not list"):
        ck._check_complete(staged, want, "c")
    del staged.parts["p"].rows["k9"]
    staged.pairs["p"] = 5
    ck._check_complete(staged, want, "c")


def test_a_save_looks_up_its_rows_a_slice_per_hold_of_the_lock(monkeypatch):
    """A shard's checkpoint save finds its rows ``PIN_SLICE`` keys per hold of the shard's lock (the
    request loop takes it for every request, so a million-key save would hold it for seconds), and
    reports the keys it no longer holds."""
    monkeypatch.setattr(shard_checkpoint, "PIN_SLICE", 2)
    core = ShardCore(0)
    _put_ready(core, "p", [f"k{i}" for i in range(7)], {"x": torch.arange(7)})
    holds = [0]
    lock = threading.Lock()

    class Counting:
        def __enter__(self) -> None:
            lock.acquire()
            holds[0] += 1

        def __exit__(self, *exc: Any) -> None:
            lock.release()

    saver = shard_checkpoint.ShardCheckpoints(core, Counting(), "here", 1 << 20)  # type: ignore[arg-type]
    # The keys in parts, as the checkpoint's index is decoded (k7: never put).
    wanted = {"p": ([("k0", "k1", "k2"), ("k3", "k4", "k5", "k6", "k7")], [(["x"],) * 3, (["x"],) * 5])}
    plan, missing, pinned = saver._pin(wanted)
    assert holds[0] == 5 and missing == {"p": ["k7"]}  # (slices of 2 within each part)
    assert plan[0][1] == [("k0", "k1"), ("k2",), ("k3", "k4"), ("k5", "k6"), ()]  # a tuple per hold
    for seg in pinned:
        seg.pins -= 1
        core._unref(seg)
