"""Grouped samplers are incremental: the index keeps complete groups indexed as rows come and go, so
a commit costs the same however many ready rows wait in incomplete groups (no Ray, no sockets)."""

from __future__ import annotations

import random

import pytest

from dataplane import samplers
from dataplane.samplers import GroupSampler, ReadyRows, complete_groups
from dataplane.server.index import ready as ready_mod
from dataplane.server.index.core import IndexCore
from dataplane.server.index.ready import ReadyKeys

from .test_samplers import PENDING, call, put


def _scan(keys: list[str], tags: dict[str, dict], size: int, want: int) -> list[list[str]]:
    return complete_groups(ReadyRows(keys, tags.__getitem__), "uid", size, want)


def test_the_index_gives_the_groups_a_scan_gives():
    """Random appends, takes, clears and tag changes: the index's complete groups equal a full scan's,
    and without re-tags they come in the same order."""
    for seed in range(30):
        rng = random.Random(seed)
        tags: dict[str, dict] = {}
        ready = ReadyKeys(tags.__getitem__)
        size = rng.choice([1, 2, 3, 4])
        index = ready.groups("uid", size)
        for step in range(300):
            roll = rng.random()
            if roll < 0.6:
                key = f"k{step}"
                tags[key] = {"uid": rng.randrange(12)}
                ready.add(key)
            elif roll < 0.9 and len(ready):
                ready.discard(rng.choice(list(ready)))
            elif len(ready):
                key = rng.choice(list(ready))  # re-tagged while ready: filed again
                tags[key] = {"uid": rng.randrange(12)}
                ready.retag(key)
            if all(len(m) <= size for m in index.members.values()):
                # (a group with more members than its size may be cut differently; so may the order of
                # groups completed by a re-tag: both only decide which rows come first)
                got = {frozenset(unit) for unit in index.units(10**6)}
                assert got == {frozenset(unit) for unit in _scan(list(ready), tags, size, 10**6)}, (
                    seed,
                    step,
                )


def test_given_back_rows_put_their_group_first_in_line():
    tags = {k: {"uid": k[0]} for k in ("a1", "a2", "b1", "b2")}
    ready = ReadyKeys(tags.__getitem__, ["a1", "a2", "b1"])
    index = ready.groups("uid", 2)
    assert index.units(5) == [["a1", "a2"]]
    ready.put_first(["b2"])
    assert list(ready) == ["b2", "a1", "a2", "b1"] and index.units(5) == [["b2", "b1"], ["a1", "a2"]]


def test_a_commit_costs_the_same_beside_many_rows_in_incomplete_groups(monkeypatch):
    """50,000 ready rows in pairs, 4 consumers waiting for groups of 4: a commit and the retries of
    the 4 waiting calls look at a handful of rows, not at 4 x 50,000 (the old code scanned them all)."""
    core = IndexCore()
    n = 50_000
    put(core, "p", [f"s{i}" for i in range(n)], ["x"], tags=[{"uid": f"g{i // 2}"} for i in range(n)])
    body = {"partition": "p", "batch_size": 4, "fields": ["x"], "sampler": GroupSampler("uid", 4).spec()}
    for _ in range(2):  # each stream gathered in slices, then its group index
        for t in range(4):
            assert call(core, "next", {**body, "task": f"t{t}"}) == PENDING
        while core.building:
            core.build_some()
    looked = [0]
    real = samplers.group_id

    def counting(tag, group_tag, key):
        looked[0] += 1
        return real(tag, group_tag, key)

    monkeypatch.setattr(ready_mod, "group_id", counting)
    monkeypatch.setattr(samplers, "group_id", counting)
    put(core, "p", ["lone"], ["x"], tags=[{"uid": "lone"}])
    for t in range(4):  # what the index server does after a commit: ask each parked call again
        assert call(core, "next", {**body, "task": f"t{t}"}) == PENDING
    assert looked[0] <= 8, f"a commit looked at {looked[0]} rows"
    put(core, "p", ["s-extra-1", "s-extra-2"], ["x"], tags=[{"uid": "g0"}, {"uid": "g0"}])  # g0 complete
    assert call(core, "next", {**body, "task": "t0"}).keys == ["s0", "s1", "s-extra-1", "s-extra-2"]


def test_without_retags_groups_come_in_the_order_a_scan_finds_them():
    """Groups that never hold more rows than their size (the GRPO case: n responses per prompt)."""
    for seed in range(30):
        rng = random.Random(seed)
        tags: dict[str, dict] = {}
        ready = ReadyKeys(tags.__getitem__)
        index = ready.groups("uid", 3)
        for step in range(200):
            if rng.random() < 0.7:
                uid = rng.randrange(15)
                if len(index.members.get(uid, ())) < 3:
                    key = f"k{step}"
                    tags[key] = {"uid": uid}
                    ready.add(key)
            elif len(ready):
                ready.discard(rng.choice(list(ready)))
            assert index.units(4) == _scan(list(ready), tags, 3, 4), (seed, step)


def _grouped_next(task: str, size: int) -> dict:
    """A ``next`` of one group of ``size`` rows by their ``uid`` tag."""
    return {
        "partition": "p",
        "task": task,
        "batch_size": size,
        "fields": ["x"],
        "sampler": GroupSampler("uid", size).spec(),
    }


def test_an_index_gathered_in_slices_is_the_one_built_at_once_and_kept_current(monkeypatch):
    """Over more than ``GROUP_SLICE`` ready keys a group index is gathered a slice at a time while
    keys come, go, come back first and change groups: once whole it equals an index built at once
    when it was asked for and kept current by the same changes."""
    monkeypatch.setattr(ready_mod, "GROUP_SLICE", 5)
    for seed in range(40):
        rng = random.Random(seed)
        tags = {f"k{i}": {"uid": rng.randrange(6)} for i in range(40)}
        start = [k for k in tags if rng.random() < 0.7]
        sliced = ReadyKeys(tags.__getitem__, start, lambda tags=tags: dict(tags).__getitem__)  # (replaced)
        with pytest.raises(ready_mod.StillGathering):
            sliced.groups("uid", 3)
        whole = ReadyKeys(tags.__getitem__, start)
        reference = ready_mod.GroupIndex("uid", 3, tags.__getitem__)
        for key in start:
            reference.add(key)
        whole.indexes[("uid", 3)] = reference
        while sliced.gathering():
            change = rng.randrange(4)
            key = rng.choice(list(tags))
            if change == 0:
                for ready in (sliced, whole):
                    ready.add(key)
            elif change == 1:
                for ready in (sliced, whole):
                    ready.discard(key)
            elif change == 2:
                for ready in (sliced, whole):
                    ready.put_first([key])
            else:
                tags[key] = {"uid": rng.randrange(6)}
                for ready in (sliced, whole):
                    ready.retag(key)
            sliced.gather_some()
        index = sliced.groups("uid", 3)
        assert list(sliced) == list(whole)
        assert index.members == reference.members and index.gid == reference.gid, seed
        assert list(index.complete) == list(reference.complete), seed
        assert index.units(100) == reference.units(100)


def test_a_grouped_take_over_many_ready_rows_waits_while_its_index_is_gathered_in_slices(monkeypatch):
    """The first grouped take over a stream of many ready rows is not answered in one step over
    them: it waits, the index is gathered a slice per pass, and the take then gets the first group."""
    monkeypatch.setattr(ready_mod, "GROUP_SLICE", 64)
    core = IndexCore()
    n = 1000
    put(core, "p", [f"s{i}" for i in range(n)], ["x"], tags=[{"uid": f"g{i // 4}"} for i in range(n)])
    body = _grouped_next("t", 4)
    assert call(core, "next", body) == PENDING and core.building
    core.build_some()
    assert core.building  # one slice, not all of them
    while core.building:
        core.build_some()
    assert call(core, "next", body).keys == ["s0", "s1", "s2", "s3"]


def test_a_commit_that_retags_a_ready_row_files_it_in_its_new_group():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"], tags=[{"uid": "g1"}, {"uid": "g2"}, {"uid": "g2"}])
    body = _grouped_next("t", 2)
    assert call(core, "next", body).keys == ["b", "c"]
    put(core, "p", ["d"], ["x"], tags=[{"uid": "g3"}])
    assert call(core, "next", body) == PENDING  # a and d, each alone in its group
    put(core, "p", ["d"], ["x"], tags=[{"uid": "g1"}])  # the same field again, a new tag
    assert call(core, "next", body).keys == ["a", "d"]
