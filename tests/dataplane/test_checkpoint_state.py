"""The pieces of a checkpoint without Ray: the index's metadata through its file, the streaming
state's snapshot, and the checked file reads (``server.checkpoint_files``)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import msgspec
import pytest

from dataplane.errors import CheckpointError
from dataplane.server import pieces
from dataplane.server.checkpoint_files import (
    INDEX_FILE,
    DataWriter,
    RawIndexKeys,
    keys_in_slices,
    new_token,
    open_checked,
    open_dir,
    read_into,
)
from dataplane.server.index import checkpoint as index_checkpoint
from dataplane.server.index.core import IndexCore
from dataplane.server.index.streams import PartitionStreams
from dataplane.server.jobs import run_job

F32 = ["dense", "float32", [4]]


def call(core: IndexCore, op: str, body: dict) -> Any:
    """One request as the index serves it; the reply is the op's reply struct."""
    return core.handle(op, msgspec.msgpack.encode(body), [])[0]


def _busy_index() -> IndexCore:
    core = IndexCore()
    keys = [f"k{i}" for i in range(12)]
    tags = [{"uid": i // 3, "n": [i, {"x": i}]} for i in range(12)]
    call(core, "commit", {"partition": "p", "keys": keys, "fields": ["a"], "tags": tags, "specs": {"a": F32}})
    call(core, "commit", {"partition": "p", "keys": keys[:8], "fields": ["b"], "specs": {"b": F32}})
    call(core, "next", {"partition": "p", "task": "t", "batch_size": 3, "fields": ["a"]})
    group = {"name": "group", "group_tag": "uid", "group_size": 3}
    call(
        core, "next", {"partition": "p", "task": "g", "batch_size": 3, "fields": ["a", "b"], "sampler": group}
    )
    call(
        core,
        "next",
        {"partition": "p", "task": "r", "batch_size": 2, "fields": ["a"], "dp_rank": 1, "batch_index": 4},
    )
    lease = {"partition": "p", "task": "l", "batch_size": 4, "fields": ["a"], "take": "L1", "lease_s": 600}
    call(core, "next", lease)
    call(core, "ack", {"partition": "p", "task": "l", "take": "L1", "keys": ["k0"]})  # 3 keys stay leased
    call(core, "commit", {"partition": "q", "keys": ["gone"]})
    call(core, "clear", {"partition": "q", "keys": ["gone"]})
    call(core, "finish", {"partition": "q"})  # an empty, finished partition
    return core


def _state(core: IndexCore) -> dict:
    """Every partition's saved state; a lease's seconds left to the second (read at two instants)."""
    state = {pid: core.saved_partition(pid) for pid in core.partitions}
    for part in state.values():
        for task in part["streams"]["tasks"]:
            task["consumed"] = sorted(task["consumed"])  # (a set: saved in no particular order)
            task["leases"] = [[take, keys, round(left)] for take, keys, left in task["leases"]]
    return state


def test_the_index_metadata_round_trips_through_its_file(tmp_path):
    core = _busy_index()
    token = new_token()
    (tmp_path / token).touch()
    saved = call(core, "checkpoint_save", {"path": str(tmp_path), "token": token})
    assert saved.partitions == {"p": 12, "q": 0}
    call(core, "clear", {"partition": "p", "keys": ["k4"]})  # cleared while the shards saved: left out
    done = call(core, "checkpoint_finish", {"save": saved.save, "missing": {"p": ["k4"]}})
    assert done.partitions == {"p": 11, "q": 0}
    fresh = IndexCore()
    call(fresh, "commit", {"partition": "q", "keys": ["z"]})
    staged = call(fresh, "checkpoint_stage", {"path": str(tmp_path), **done.file})
    assert staged.existing == ["q"] and fresh.partitions["q"].keys.keys() == {"z"}  # nothing changed yet
    with pytest.raises(CheckpointError, match=r"now holds partitions \['q'\]"):
        call(fresh, "checkpoint_install", {"load": staged.load})
    call(fresh, "checkpoint_install", {"load": staged.load, "overwrite": True})
    assert _state(fresh) == _state(core)
    again = {"partition": "p", "task": "t", "batch_size": 2, "fields": ["a"]}
    assert call(fresh, "next", again) == call(core, "next", again)
    leased = fresh.partitions["p"].streams.tasks["l"].leased
    assert sorted(leased) == ["k1", "k2", "k3"] and [e[4] for e in fresh.lease_due] == ["L1"]
    fresh.expire_leases(time.monotonic() + 601)  # the lease runs out in the loaded store too
    assert call(fresh, "consumption", {"partition": "p", "task": "l"}).ready == 11 - 1
    assert fresh.schemas["p"].keys() == {"a", "b"} and all(e.confirmed for e in fresh.schemas["p"].values())


def test_a_damaged_index_file_is_refused_by_name(tmp_path):
    core = _busy_index()
    token = new_token()
    (tmp_path / token).touch()
    saved = call(core, "checkpoint_save", {"path": str(tmp_path), "token": token})
    path = tmp_path / "index.msgpack"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="index.msgpack is corrupted"):
        call(IndexCore(), "checkpoint_stage", {"path": str(tmp_path), **saved.file})


@pytest.mark.parametrize("lie", ["a key twice", "a layout past the end", "a negative layout", "a tag short"])
def test_an_index_file_that_lies_about_its_keys_loads_nothing(tmp_path, lie):
    """A well-formed ``index.msgpack`` whose keys, layouts and tags disagree (a writer's bug or a
    hand-edited file; its checksum matches) is a ``CheckpointError`` naming the file and the
    partition; the keys are restored at C speed, never trusted."""
    from dataplane.server.checkpoint_files import write_small

    core = IndexCore()
    call(core, "commit", {"partition": "p", "keys": ["a", "b", "c"], "fields": ["x"], "specs": {"x": F32}})
    token = new_token()
    (tmp_path / token).touch()
    saved = call(core, "checkpoint_save", {"path": str(tmp_path), "token": token})
    path = tmp_path / INDEX_FILE
    doc = msgspec.msgpack.decode(path.read_bytes())
    (part,) = doc["partitions"]
    if lie == "a key twice":
        part["keys"][2] = "a"
    elif lie == "a layout past the end":
        part["layout"][1] = 5
    elif lie == "a negative layout":
        part["layout"][1] = -1
    else:
        part["tags"].pop()
    del part["cuts"]
    path.unlink()
    entry = write_small(str(path), msgspec.msgpack.encode(doc))
    fresh = IndexCore()
    with pytest.raises(CheckpointError, match=f"{path}: partition 'p' is inconsistent"):
        call(fresh, "checkpoint_stage", {"path": str(tmp_path), **entry})
    assert saved.partitions == {"p": 3} and not fresh.partitions


def test_the_index_writes_only_where_the_saver_proved_it_can(tmp_path):
    core = _busy_index()
    with pytest.raises(CheckpointError, match="cannot reach the checkpoint directory"):
        call(core, "checkpoint_save", {"path": str(tmp_path), "token": new_token()})
    with pytest.raises(CheckpointError, match="not an absolute path and a save token"):
        call(core, "checkpoint_save", {"path": str(tmp_path), "token": "../etc"})
    assert os.listdir(tmp_path) == []


def test_stream_state_refuses_keys_the_partition_does_not_hold():
    keys = {"a": object()}
    streams = PartitionStreams(keys)
    state = {
        "finished": False,
        "tasks": [
            {
                "name": "t",
                "consumed": [],
                "streams": [{"fields": ["x"], "ready": ["a", "ghost"]}],
                "cache": [],
            }
        ],
    }
    with pytest.raises(ValueError, match="ghost"):
        streams.restore(state, 0.0)
    assert streams.tasks == {}  # unchanged


def test_file_reads_check_place_size_and_checksum(tmp_path):
    writer = DataWriter(str(tmp_path / "d.bin"))
    first = writer.append(b"hello world")
    second = writer.append(bytes(range(256)) * 100)
    size = writer.close()
    fd = open_checked(str(tmp_path / "d.bin"), size)
    try:
        out = memoryview(bytearray(second[1]))
        read_into(fd, "d.bin", out, second, size, "the second buffer")
        assert bytes(out) == bytes(range(256)) * 100
        with pytest.raises(CheckpointError, match="does not match its checksum"):
            read_into(fd, "d.bin", memoryview(bytearray(11)), [first[0], first[1], first[2] ^ 1], size, "x")
        with pytest.raises(CheckpointError, match="outside the file"):
            read_into(fd, "d.bin", memoryview(bytearray(11)), [size - 5, 11, first[2]], size, "x")
    finally:
        os.close(fd)
    with pytest.raises(CheckpointError, match="truncated"):
        open_checked(str(tmp_path / "d.bin"), size + 1)
    with pytest.raises(CheckpointError, match="missing"):
        open_checked(str(tmp_path / "nope.bin"), 1)


def test_open_dir_names_who_cannot_reach_the_directory(tmp_path):
    with pytest.raises(
        CheckpointError, match=f"shard 3 on node n1 cannot reach the checkpoint directory {tmp_path}"
    ):
        open_dir(str(tmp_path), new_token(), "shard 3 on node n1")


def test_a_read_copies_through_memory_where_the_kernel_cannot_copy(tmp_path):
    data = bytes(range(256)) * 40_000
    writer = DataWriter(str(tmp_path / "d.bin"))
    entry = writer.append(data)
    size = writer.close()
    sink = os.open(tmp_path / "sink", os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # sendfile refuses O_APPEND
    fd = open_checked(str(tmp_path / "d.bin"), size)
    try:
        out = memoryview(bytearray(len(data)))
        read_into(fd, "d.bin", out, entry, size, "the buffer", dst_fd=sink)
        assert bytes(out) == data and os.fstat(sink).st_size == 0
    finally:
        os.close(fd)
        os.close(sink)


def test_a_partition_saved_in_many_slices_reads_back_whole(tmp_path, monkeypatch):
    """A save encodes each partition a slice at a time (``SLICE`` keys per step): with holes left by
    cleared keys, tags on some keys, field sets that change between slices and a consumer's state,
    what is loaded is what was saved."""
    monkeypatch.setattr(index_checkpoint, "SLICE", 5)
    core = IndexCore()
    keys = [f"k{i}" for i in range(23)]
    tags = [{"uid": i} if i % 3 else None for i in range(23)]
    call(core, "commit", {"partition": "p", "keys": keys, "fields": ["a"], "tags": tags, "specs": {"a": F32}})
    call(core, "commit", {"partition": "p", "keys": keys[::2], "fields": ["b"], "specs": {"b": F32}})
    call(core, "clear", {"partition": "p", "keys": ["k3", "k4", "k11"]})
    call(core, "next", {"partition": "p", "task": "t", "batch_size": 7, "fields": ["a"]})
    token = new_token()
    (tmp_path / token).touch()
    saved = call(core, "checkpoint_save", {"path": str(tmp_path), "token": token})
    done = call(core, "checkpoint_finish", {"save": saved.save, "missing": {}})
    assert saved.partitions == done.partitions == {"p": 20}
    fresh = IndexCore()
    staged = call(fresh, "checkpoint_stage", {"path": str(tmp_path), **done.file})
    call(fresh, "checkpoint_install", {"load": staged.load})
    assert _state(fresh) == _state(core)
    assert list(fresh.partitions["p"].keys) == [k for k in keys if k not in ("k3", "k4", "k11")]


def _consumed_saved(state: dict) -> dict[str, set[str]]:
    return {
        t["name"]: set(msgspec.msgpack.decode(b"".join(pieces.pieces(t["consumed"]))))
        for t in state["streams"]["tasks"]
    }


@pytest.mark.parametrize("seed", range(30))
def test_consumed_keys_read_in_slices_are_those_of_the_instant_the_partition_was_copied(monkeypatch, seed):
    """A save reads each task's consumed keys a slice per step (a million-key set copied in one step
    held the index 35-190 ms); takes, give-backs, acknowledgements, clears, new keys, resets and a
    dropped partition between its steps do not show in what it saves, and when it ends (or is
    abandoned) the tasks no longer tell it of their changes."""
    monkeypatch.setattr(index_checkpoint, "SLICE", 3)
    rng = random.Random(seed)
    core = IndexCore()
    keys = [f"k{i}" for i in range(40)]
    call(core, "commit", {"partition": "p", "keys": keys, "fields": ["a"], "specs": {"a": F32}})
    takes: list[tuple[str, str]] = []

    def take() -> None:
        task, name = rng.choice("tu"), f"T{len(takes)}"
        body = {"partition": "p", "task": task, "batch_size": rng.randint(1, 6), "fields": ["a"]}
        call(core, "next", {**body, "take": name, "lease_s": 600})
        takes.append((task, name))

    def give_back() -> None:
        if takes:
            task, name = takes.pop(rng.randrange(len(takes)))
            call(core, "release", {"partition": "p", "task": task, "take": name})

    def clear() -> None:
        call(core, "clear", {"partition": "p", "keys": rng.sample(keys, 3)})

    def put() -> None:
        call(core, "commit", {"partition": "p", "keys": [f"n{rng.random()}"], "fields": ["a"]})

    def reset() -> None:
        call(core, "reset", {"partition": "p", "task": rng.choice(["t", "u", None])})

    for _ in range(8):
        take()
    part = core.partitions["p"]
    tasks = dict(part.streams.tasks)
    instant = {name: set(task.consumed) for name, task in tasks.items()}
    job = index_checkpoint._encode_part("p", part, [])
    next(job)  # (the partition copied)
    dropped = False
    with pytest.raises(StopIteration) as done:
        while True:
            if not dropped:
                op = rng.choice([take, take, give_back, clear, put, reset, "drop"])
                if op == "drop":
                    call(core, "clear_partition", {"partition": "p"})
                    dropped = True
                    while core.free_some():
                        pass
                else:
                    op()
            next(job)
    state, _ = done.value.value
    assert _consumed_saved(state) == instant
    assert all(not task.frozen for task in tasks.values())
    abandoned = index_checkpoint._encode_part("p", part, [])
    next(abandoned)
    abandoned.close()
    assert all(not task.frozen for task in part.streams.tasks.values())


def _cut(part: RawIndexKeys, how: str) -> None:
    (n0, b0), (n1, b1), (n2, b2) = part.cuts
    if how == "counts":
        part.cuts = [(n0, b0), (n1, b1), (n2 - 1, b2)]
    elif how == "bytes":
        part.cuts = [(n0, b0), (n1, b1), (n2, b2 + 1)]
    elif how == "mid-key":  # the same totals, one cut a byte into a key
        part.cuts = [(n0, b0 + 1), (n1, b1 - 1), (n2, b2)]
    elif how == "negative":
        part.cuts = [(n0 + n1 + n2 + 1, b0 + b1 + b2), (-1, 0)]
    elif how == "layout":
        part.layout[-1] = 99
    elif how == "layout below zero":  # (would name the last layout: read from the end)
        part.layout[-1] = -1
    elif how == "none":  # (a file written before cuts)
        part.cuts = []


def test_a_shard_reads_the_index_keys_a_slice_at_a_time_and_checks_the_cuts(tmp_path, monkeypatch):
    """The index writes where its keys array may be cut (``cuts``), and a shard decodes it a slice per
    call (a million keys in one call held the shard's request loop for 60-120 ms); sizes the file
    declares are checked: a cut that lies is a ``CheckpointError`` naming the file, never wrong keys."""
    monkeypatch.setattr(index_checkpoint, "SLICE", 4)
    core = IndexCore()
    keys = [f"key-{i}" for i in range(10)]
    call(core, "commit", {"partition": "p", "keys": keys, "fields": ["a"], "specs": {"a": F32}})
    call(core, "commit", {"partition": "p", "keys": ["tag-only"], "tags": [{"x": 1}]})
    token = new_token()
    (tmp_path / token).touch()
    call(core, "checkpoint_save", {"path": str(tmp_path), "token": token})
    path = str(tmp_path / INDEX_FILE)
    data = (tmp_path / INDEX_FILE).read_bytes()

    def read(how: str = "") -> list[tuple[list[str], list[list[str]]]]:
        (part,) = msgspec.msgpack.decode(data, type=RawIndexKeys).partitions
        _cut(part, how)
        return list(keys_in_slices(part, path))

    got = read()
    assert [len(k) for k, _ in got] == [4, 4, 3]
    assert [k for ks, _ in got for k in ks] == [*keys, "tag-only"]
    assert [f for _, fs in got for f in fs] == [["a"]] * 10 + [[]]
    assert [len(k) for k, _ in read("none")] == [11]  # (one slice)
    for how in ("counts", "bytes", "mid-key", "negative", "layout", "layout below zero"):
        with pytest.raises(CheckpointError, match=f"{path}.*malformed"):
            read(how)


@pytest.mark.parametrize("n", [0, 15, 16, 65535, 65536])
def test_msgpack_written_in_pieces_is_msgpack(n):
    """Headers of every size, and a document laid out around a big array, match msgspec's own."""
    assert b"".join(pieces.pieces([None] * n)) == msgspec.msgpack.encode([None] * n)
    assert b"".join(pieces.pieces({str(i): i for i in range(n)})) == msgspec.msgpack.encode(
        {str(i): i for i in range(n)}
    )
    values = [f"k{i}" for i in range(n)]
    big = run_job(pieces.encode_list(values, 7000))
    doc = {"a": [{"keys": big, "x": [1, 2]}], "b": {}}
    assert b"".join(pieces.pieces(doc)) == msgspec.msgpack.encode(
        {"a": [{"keys": values, "x": [1, 2]}], "b": {}}
    )
