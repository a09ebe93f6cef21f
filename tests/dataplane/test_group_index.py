"""Grouped samplers are incremental: the index keeps complete groups indexed as rows come and go, so
a commit costs the same however many ready rows wait in incomplete groups (no Ray, no sockets)."""

from __future__ import annotations

import random

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
    for t in range(4):
        assert call(core, "next", {**body, "task": f"t{t}"}) == PENDING  # each stream gathered in slices
    while core.building:
        core.build_some()
    for t in range(4):
        assert call(core, "next", {**body, "task": f"t{t}"}) == PENDING  # builds each stream's index
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
