"""Samplers and the index's streaming bookkeeping: pure tests, no Ray, no sockets.

The built-in samplers are driven on hand-made ``ReadyRows``; ``balanced_partition`` is checked
against brute force on small inputs; and ``IndexCore``'s streaming operations (``next``, ``ready``,
``claim``, ``finish``, ``reset``, ``consumption``) are driven the way the index serves them: a
msgpack-encoded body through ``core.handle``, answered with the op's reply struct (``Pending()`` is the
answer of a ``next`` / ``ready`` that would wait).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import pytest

from dataplane.errors import BatchSizeError, BatchTimeoutError, PartitionNotFoundError, WireError
from dataplane.samplers import (
    GroupSampler,
    ReadyRows,
    Sampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    balanced_partition,
    complete_groups,
    from_spec,
)
from dataplane.server.index.core import IndexCore
from dataplane.wire import protocol as _protocol

PENDING = _protocol.Pending()


def rows(keys: list[str], tags: dict[str, dict] | None = None) -> ReadyRows:
    tags = tags or {}
    return ReadyRows(list(keys), lambda k: tags.get(k, {}))


def call(core: IndexCore, op: str, body: dict) -> Any:
    """One request as the index serves it: the body msgpack-encoded, then decoded for its op."""
    return core.handle(op, msgspec.msgpack.encode(body), [])[0]


def put(core: IndexCore, pid: str, keys: list[str], fields: list[str], tags: list[dict] | None = None):
    body = {"partition": pid, "keys": keys, "fields": fields}
    if tags is not None:
        body["tags"] = tags
    return call(core, "commit", body)


def nxt(core: IndexCore, pid: str, task: str, n: int, fields: list[str], **kw) -> list[str] | None:
    """The keys a ``next`` call gets, or None while it would wait."""
    res = call(core, "next", {"partition": pid, "task": task, "batch_size": n, "fields": fields, **kw})
    return None if res == PENDING else res.keys


def consumed(core: IndexCore, pid: str, task: str) -> list[str]:
    return call(core, "consumed", {"partition": pid, "task": task, "limit": 1 << 20}).keys


# ---- samplers on ReadyRows ---------------------------------------------------------------------------


def test_sequential_sampler_waits_for_a_full_batch_until_finished():
    s = SequentialSampler()
    assert s.sample(rows(["a", "b"]), 3) is None
    assert s.sample(rows(["a", "b", "c", "d"]), 3) == ["a", "b", "c"]
    assert s.sample(rows(["a", "b"]), 3, finished=True) == ["a", "b"]
    assert s.sample(rows([]), 3, finished=True) == []
    assert Sampler().sample(rows(["x", "y"]), 1) == ["x"]  # the base class is the sequential choice


def test_group_sampler_hands_out_whole_groups_in_completion_order():
    tags = {"a0": {"uid": "A"}, "b0": {"uid": "B"}, "a1": {"uid": "A"}, "c0": {"uid": "C"}}
    tags |= {"b1": {"uid": "B"}, "c1": {"uid": "C"}}
    s = GroupSampler("uid", 2)
    # A completes at a1, B at b1, C at c1
    ready = rows(["a0", "b0", "a1", "c0", "b1", "c1"], tags)
    assert s.sample(ready, 4) == ["a0", "a1", "b0", "b1"]
    assert s.sample(rows(["a0", "b0", "c0", "a1"], tags), 4) is None  # one complete group of two
    assert s.sample(rows(["a0", "b0", "c0", "a1"], tags), 4, finished=True) == ["a0", "a1"]  # B, C never
    assert s.sample(rows(["b0", "c0"], tags), 2, finished=True) == []  # incomplete groups: never
    # a row without the tag is a group of its own key; list-valued ids are compared by value
    g = complete_groups(rows(["x", "y", "z"], {"y": {"uid": [1]}, "z": {"uid": [1]}}), "uid", 2, 5)
    assert g == [["y", "z"]]


def test_group_sampler_refuses_a_batch_size_that_would_split_a_group():
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        GroupSampler("uid", 0)
    with pytest.raises(ValueError, match=r"batch_size 6 is not a multiple of group_size 4"):
        GroupSampler("uid", 4).check(6, None, None, None)
    GroupSampler("uid", 4).check(8, None, None, None)


def test_seqlen_balanced_sampler_balances_tokens_and_keeps_groups_whole():
    rng = random.Random(3)
    keys, tags = [], {}
    for g in range(8):  # 8 groups of 2 rows; one long group
        for j in range(2):
            k = f"g{g}r{j}"
            keys.append(k)
            tags[k] = {"uid": f"g{g}", "length": 100 if g == 0 else rng.randint(1, 20)}
    s = SeqlenBalancedSampler("length", dp_size=2, group_tag="uid", group_size=2)
    assert s.sample(rows(keys[:6], tags), 4, dp_rank=0) is None  # needs 4 * 2 rows
    choice = s.sample(rows(keys, tags), 4, dp_rank=0)
    assert isinstance(choice, dict) and sorted(choice) == [0, 1]
    assert all(len(v) == 4 for v in choice.values())
    got = choice[0] + choice[1]
    assert len(set(got)) == 8 and set(got) <= set(keys)
    for part in choice.values():  # groups whole: both rows of each group on one rank
        uids = [tags[k]["uid"] for k in part]
        assert all(uids.count(u) == 2 for u in uids)
    # the chosen units (first 4 complete groups) split optimally (two of two groups each)
    units = sorted({tags[k]["uid"] for k in got})
    weight = {u: sum(tags[k]["length"] for k in keys if tags[k]["uid"] == u) for u in units}
    best = min(
        abs(sum(weight[u] for u in c) - sum(weight[u] for u in units if u not in c))
        for c in itertools.combinations(units, 2)
    )
    sums = [sum(tags[k]["length"] for k in part) for part in choice.values()]
    assert abs(sums[0] - sums[1]) == best
    # every call passes dp_rank and batch_index; group size must divide batch_size; numeric lengths
    with pytest.raises(ValueError, match="dp_rank and batch_index"):
        s.check(4, None, 2, 0)
    with pytest.raises(ValueError, match="dp_rank 2"):
        s.check(4, 2, 2, 0)
    with pytest.raises(ValueError, match="not a multiple of group_size 2"):
        s.check(3, 0, 2, 0)
    with pytest.raises(ValueError, match="numeric tag 'length'"):
        SeqlenBalancedSampler("length", dp_size=2).sample(rows(["a", "b"], {"a": {"length": "x"}}), 1)


def test_sampler_specs_name_builtins_only():
    assert GroupSampler("uid", 4).spec() == {"name": "group", "group_tag": "uid", "group_size": 4}
    assert SequentialSampler().spec() == {"name": "sequential"}
    spec = SeqlenBalancedSampler("n", 2, "g", 2).spec()
    again = from_spec(spec)
    assert type(again) is SeqlenBalancedSampler and again.spec() == spec

    class Mine(Sampler):
        def sample(self, ready, batch_size, **kw):
            return list(ready)[:batch_size]

    class MyGroups(GroupSampler):  # overrides sample: runs client-side too
        def sample(self, ready, batch_size, **kw):
            return []

    assert Mine().spec() is None and MyGroups("uid", 2).spec() is None
    with pytest.raises(ValueError, match="unknown sampler 'evil'"):
        from_spec({"name": "evil"})
    with pytest.raises(ValueError, match="sampler 'group'"):
        from_spec({"name": "group", "code": "import os"})
    assert isinstance(from_spec(None), SequentialSampler)


# ---- balanced_partition ---------------------------------------------------------------------------------


def _spread(parts: list[list[int]], w: list[float]) -> float:
    sums = [sum(w[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def _brute_force(w: list[float], k: int) -> float:
    """The smallest max-min spread over every assignment whose part sizes differ by at most one."""
    best = float("inf")
    for assign in itertools.product(range(k), repeat=len(w)):
        counts = [assign.count(r) for r in range(k)]
        if max(counts) - min(counts) > 1:
            continue
        sums = [0.0] * k
        for i, r in enumerate(assign):
            sums[r] += w[i]
        best = min(best, max(sums) - min(sums))
    return best


def test_balanced_partition_is_near_optimal_against_brute_force():
    rng = random.Random(20250117)
    worst = 0.0
    for _ in range(150):
        k = rng.choice([2, 3, 4])
        n = rng.randint(0, {2: 9, 3: 7, 4: 6}[k])
        w = [float(rng.randint(1, 100)) for _ in range(n)]
        parts = balanced_partition(w, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(n)), (w, k, parts)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1, (w, k, parts)
        if n:
            gap = _spread(parts, w) - _brute_force(w, k)
            assert gap <= max(w) / 2, f"KK spread {gap} above optimal for {w} in {k} parts: {parts}"
            worst = max(worst, gap / max(w))
    print(f"worst KK gap above optimal: {worst:.2f} of the largest weight")


def test_balanced_partition_edge_cases():
    assert balanced_partition([8, 7, 6, 5, 4, 3, 2, 1], 2) == [[0, 3, 5, 6], [1, 2, 4, 7]]
    assert balanced_partition([], 3) == [[], [], []]
    assert balanced_partition([5.0, 1.0], 1) == [[0, 1]]
    assert sorted(balanced_partition([5.0, 1.0], 3), key=len) == [[], [0], [1]]
    parts = balanced_partition([0.0] * 7, 3)
    assert sorted(len(p) for p in parts) == [2, 2, 3]
    big = [float(i % 17 + 1) for i in range(1000)]
    parts = balanced_partition(big, 8)
    assert {len(p) for p in parts} == {125} and _spread(parts, big) <= 17


# ---- IndexCore: readiness, consumption, tasks -------------------------------------------------------------


def test_next_returns_only_rows_holding_every_field_in_ready_order():
    core = IndexCore()
    assert nxt(core, "p", "t", 1, ["a"]) is None  # no partition yet: wait
    put(core, "p", ["k0", "k1", "k2"], ["a"])
    assert nxt(core, "p", "t", 1, ["a", "b"]) is None  # one of two fields: not ready
    put(core, "p", ["k2"], ["b"])
    put(core, "p", ["k0"], ["b"])
    assert nxt(core, "p", "t", 2, ["a", "b"]) == ["k2", "k0"]  # the order the puts made them ready
    assert nxt(core, "p", "t", 1, ["a", "b"]) is None
    put(core, "p", ["k1"], ["b", "c"])
    assert nxt(core, "p", "t", 1, ["a", "b"]) == ["k1"]
    # a rewrite of a consumed row does not make it ready again
    put(core, "p", ["k0"], ["a", "b"])
    assert nxt(core, "p", "t", 1, ["a", "b"]) is None


def test_tasks_are_independent_and_each_takes_every_row_once():
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(6)], ["x"])
    got = {t: [] for t in ("reward", "train")}
    for _ in range(3):
        for t in got:
            got[t] += nxt(core, "p", t, 2, ["x"])
    assert got["reward"] == got["train"] == [f"k{i}" for i in range(6)]
    assert nxt(core, "p", "reward", 1, ["x"]) is None
    # a task reading other fields shares the task's consumption: nothing is read twice
    put(core, "p", ["k0", "k6"], ["y"])
    assert nxt(core, "p", "reward", 2, ["y"]) is None  # k0 was taken; only k6 is new
    assert nxt(core, "p", "reward", 1, ["y"]) == ["k6"]


def test_finish_gives_a_short_batch_then_empty_batches():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert nxt(core, "p", "t", 2, ["x"]) == ["a", "b"]
    assert nxt(core, "p", "t", 2, ["x"]) is None
    call(core, "finish", {"partition": "p"})
    res = call(core, "next", {"partition": "p", "task": "t", "batch_size": 2, "fields": ["x"]})
    assert res.keys == ["c"] and res.finished is True
    assert nxt(core, "p", "t", 2, ["x"]) == []
    assert nxt(core, "p", "other", 5, ["never"]) == []  # finished: never waits
    with pytest.raises(PartitionNotFoundError, match="nothing to finish"):
        call(core, "finish", {"partition": "new"})  # a typo must not create an empty, finished partition
    assert call(core, "list", {}).list.keys() == {"p"}


def test_reset_per_task_and_for_all_tasks():
    core = IndexCore()
    put(core, "p", ["a", "b"], ["x"])
    for t in ("r", "s"):
        assert nxt(core, "p", t, 2, ["x"]) == ["a", "b"]
    call(core, "reset", {"partition": "p", "task": "r"})
    assert nxt(core, "p", "s", 1, ["x"]) is None
    assert nxt(core, "p", "r", 2, ["x"]) == ["a", "b"]
    call(core, "reset", {"partition": "p"})
    assert nxt(core, "p", "r", 2, ["x"]) == ["a", "b"]
    assert nxt(core, "p", "s", 2, ["x"]) == ["a", "b"]
    call(core, "reset", {"partition": "unknown", "task": "r"})  # nothing to reset: fine


def test_consumption_counts():
    core = IndexCore()
    with pytest.raises(PartitionNotFoundError, match="'p'"):
        call(core, "consumption", {"partition": "p", "task": "t"})
    put(core, "p", ["a", "b", "c", "d"], ["x"])
    put(core, "p", ["a", "b"], ["y"])
    c = call(core, "consumption", {"partition": "p", "task": "t"})
    assert c == _protocol.ConsumptionReply(
        total=4, produced=4, consumed=0, ready=4, leased=0, finished=False, fields=[]
    )
    assert nxt(core, "p", "t", 1, ["x", "y"]) == ["a"]
    c = call(core, "consumption", {"partition": "p", "task": "t"})  # default: the fields last asked for
    assert (c.produced, c.consumed, c.ready, c.fields) == (2, 1, 1, ["x", "y"])
    c = call(core, "consumption", {"partition": "p", "task": "t", "fields": ["x"]})
    assert (c.produced, c.consumed, c.ready) == (4, 1, 3)
    assert nxt(core, "p", "t", 3, ["x"]) == ["b", "c", "d"]
    c = call(core, "consumption", {"partition": "p", "task": "t", "fields": ["x"]})
    assert (c.produced, c.consumed, c.ready) == (4, 4, 0)
    assert call(core, "consumption", {"partition": "p", "task": "other"}).ready == 4
    call(core, "clear", {"partition": "p", "keys": ["a"]})
    c = call(core, "consumption", {"partition": "p", "task": "t", "fields": ["x"]})
    assert (c.total, c.produced, c.consumed, c.ready) == (3, 3, 3, 0)
    call(core, "finish", {"partition": "p"})
    assert call(core, "consumption", {"partition": "p", "task": "t"}).finished is True


# ---- IndexCore: samplers and data-parallel ranks ----------------------------------------------------------


def test_rank_aware_calls_repeat_per_slot_and_are_disjoint_across_ranks():
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(8)], ["x"])
    r0 = nxt(core, "p", "t", 2, ["x"], dp_rank=0, dp_size=2, batch_index=0)
    r0_peer = nxt(core, "p", "t", 2, ["x"], dp_rank=0, dp_size=2, batch_index=0)  # a TP peer of rank 0
    r1 = nxt(core, "p", "t", 2, ["x"], dp_rank=1, dp_size=2, batch_index=0)
    assert r0 == r0_peer == ["k0", "k1"] and r1 == ["k2", "k3"]
    assert nxt(core, "p", "t", 2, ["x"], dp_rank=0, dp_size=2, batch_index=1) == ["k4", "k5"]
    assert nxt(core, "p", "other", 2, ["x"], dp_rank=0, dp_size=2, batch_index=0) == ["k0", "k1"]
    assert len(consumed(core, "p", "t")) == 6


def test_group_sampler_in_the_index_never_splits_a_group_across_batches_or_ranks():
    core = IndexCore()
    spec = GroupSampler("uid", 3).spec()
    # 4 groups of 3 rows, put interleaved one row at a time
    order = [(g, j) for j in range(3) for g in range(4)]
    for g, j in order[:-1]:
        put(core, "p", [f"g{g}r{j}"], ["x"], tags=[{"uid": g}])
    got = {}
    for rank in (0, 1):
        got[rank] = nxt(core, "p", "t", 3, ["x"], sampler=spec, dp_rank=rank, dp_size=2, batch_index=0)
    assert got[0] == ["g0r0", "g0r1", "g0r2"] and got[1] == ["g1r0", "g1r1", "g1r2"]
    assert nxt(core, "p", "t", 6, ["x"], sampler=spec) is None  # g2 complete, g3 not: wait
    call(core, "finish", {"partition": "p"})
    assert nxt(core, "p", "t", 6, ["x"], sampler=spec) == ["g2r0", "g2r1", "g2r2"]  # g3 never completed
    assert nxt(core, "p", "t", 6, ["x"], sampler=spec) == []


def test_seqlen_balanced_sampler_in_the_index_serves_each_rank_its_part():
    core = IndexCore()
    lengths = [90, 10, 40, 60, 30, 70, 20, 80]
    keys = [f"k{i}" for i in range(8)]
    put(core, "p", keys, ["x"], tags=[{"length": n} for n in lengths])
    spec = SeqlenBalancedSampler("length", dp_size=2).spec()
    parts = [nxt(core, "p", "t", 4, ["x"], sampler=spec, dp_rank=r, dp_size=2, batch_index=0) for r in (0, 1)]
    assert sorted(parts[0] + parts[1]) == keys and not set(parts[0]) & set(parts[1])
    sums = [sum(lengths[keys.index(k)] for k in p) for p in parts]
    assert sums == [200, 200], sums
    assert nxt(core, "p", "t", 4, ["x"], sampler=spec, dp_rank=0, dp_size=2, batch_index=1) is None
    # the same slot again (a TP peer): the same keys
    again = nxt(core, "p", "t", 4, ["x"], sampler=spec, dp_rank=1, dp_size=2, batch_index=0)
    assert again == parts[1]


def test_seqlen_balanced_sampler_after_finish_ends_every_rank_at_the_same_batch_index():
    """Once the partition is finished, a last global batch too small to give every rank a row is not
    split: an empty batch tells a rank the partition is drained, so handing one rank rows and another
    nothing for the same batch index would make the ranks run different numbers of steps (a data-
    parallel job then hangs in its next collective). The rows stay ready, not consumed."""
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(7)], ["x"], tags=[{"length": 10 + i} for i in range(7)])
    spec = SeqlenBalancedSampler("length", dp_size=4).spec()
    kw = {"sampler": spec, "dp_size": 4}
    first = [nxt(core, "p", "t", 1, ["x"], dp_rank=r, batch_index=0, **kw) for r in range(4)]
    assert [len(p) for p in first] == [1, 1, 1, 1]
    call(core, "finish", {"partition": "p"})
    # 3 rows left for 4 ranks: every rank of batch index 1 gets an empty batch, whichever asks first
    for order in ([3, 0, 1, 2], [0, 1, 2, 3]):
        got = {r: nxt(core, "p", "t", 1, ["x"], dp_rank=r, batch_index=1, **kw) for r in order}
        assert got == {0: [], 1: [], 2: [], 3: []}, got
    counts = call(core, "consumption", {"partition": "p", "task": "t"})
    assert counts.consumed == 4 and counts.ready == 3  # left for reset_consumption, not lost
    # enough left for every rank: the short last batch is split, every rank gets some
    put(core, "q", [f"k{i}" for i in range(6)], ["x"], tags=[{"length": 10 + i} for i in range(6)])
    call(core, "finish", {"partition": "q"})
    parts = [nxt(core, "q", "t", 2, ["x"], dp_rank=r, batch_index=0, **kw) for r in range(4)]
    assert sorted(len(p) for p in parts) == [1, 1, 2, 2] and len({k for p in parts for k in p}) == 6
    assert [nxt(core, "q", "t", 2, ["x"], dp_rank=r, batch_index=1, **kw) for r in range(4)] == [[]] * 4
    # the sampler on its own: the same rule
    s = SeqlenBalancedSampler("length", dp_size=2)
    tags = {"a": {"length": 3}}
    assert s.sample(rows(["a"], tags), 2, dp_rank=0, finished=True) == {0: [], 1: []}
    assert s.sample(rows([], tags), 2, dp_rank=0, finished=True) == {0: [], 1: []}


# ---- IndexCore: bad input is refused and consumes nothing --------------------------------------------------


def test_bad_calls_are_refused_and_consume_nothing():
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(4)], ["x"], tags=[{"uid": i // 2} for i in range(4)])
    with pytest.raises(WireError, match="not a multiple of group_size 2"):
        nxt(core, "p", "t", 3, ["x"], sampler=GroupSampler("uid", 2).spec())
    with pytest.raises(WireError, match="unknown sampler 'nope'"):
        nxt(core, "p", "t", 2, ["x"], sampler={"name": "nope"})
    with pytest.raises(WireError, match="malformed 'next'"):
        nxt(core, "p", "t", 0, ["x"])
    with pytest.raises(WireError, match="at least one field"):
        nxt(core, "p", "t", 1, [])
    with pytest.raises(WireError, match="dp_rank and batch_index"):
        nxt(core, "p", "t", 1, ["x"], sampler=SeqlenBalancedSampler("uid", 2).spec())
    with pytest.raises(WireError, match="'claim' request names key 'k0' twice"):
        call(core, "claim", {"partition": "p", "task": "t", "fields": ["x"], "keys": ["k0", "k0"]})
    with pytest.raises(WireError, match=r"not ready for this task.*\['zz'\]"):
        call(core, "claim", {"partition": "p", "task": "t", "fields": ["x"], "keys": ["k0", "zz"]})
    with pytest.raises(PartitionNotFoundError, match="'q'"):
        call(core, "claim", {"partition": "q", "task": "t", "fields": ["x"], "keys": ["k0"]})
    with pytest.raises(ValueError, match="numeric tag 'length'"):  # a row without the length tag
        nxt(
            core,
            "p",
            "t",
            2,
            ["x"],
            sampler=SeqlenBalancedSampler("length", 2).spec(),
            dp_rank=0,
            batch_index=0,
        )
    assert consumed(core, "p", "t") == []
    assert nxt(core, "p", "t", 4, ["x"]) == [f"k{i}" for i in range(4)]


def test_a_sampler_that_chooses_rows_not_ready_is_refused_and_consumes_nothing():
    core = IndexCore()
    put(core, "p", ["a", "b"], ["x"])
    put(core, "p", ["c"], ["y"])  # c exists but does not hold x
    streams = core.partitions["p"].streams

    class Liar(Sampler):
        def __init__(self, keys):
            self.keys = keys

        def sample(self, ready, batch_size, **kw):
            return self.keys

    for bad, match in (
        (["a", "c"], r"Liar chose 1 key\(s\) that are not ready.*\['c'\]"),
        (["a", "zz"], r"not ready.*\['zz'\]"),
        (["a", "a"], "chose a key twice"),
        (["a", "b"], "returned 2 keys for a batch of 1"),
    ):
        with pytest.raises(WireError, match=match):
            streams.take("t", frozenset(["x"]), Liar(bad), 1, None, None, None)
        assert consumed(core, "p", "t") == [], bad
    assert nxt(core, "p", "t", 1, ["x"]) == ["a"]
    with pytest.raises(WireError, match=r"not ready.*\['a'\]"):  # already taken by this task
        streams.take("t", frozenset(["x"]), Liar(["a"]), 1, None, None, None)


def test_timeouts_name_the_partition_and_the_fields_nobody_wrote():
    core = IndexCore()

    def timeout(body: dict) -> Exception:
        full = {"task": "t", "batch_size": 4, **body}
        return core.timeout_error("next", msgspec.convert(full, _protocol.Next), 2.0)

    err = timeout({"partition": "p", "fields": ["x"]})
    assert isinstance(err, PartitionNotFoundError) and err.partition_id == "p"
    assert "'p'" in str(err) and "2.0s" in str(err)
    put(core, "p", ["a"], ["x"])
    err = timeout({"partition": "p", "fields": ["x", "ghost"]})
    assert isinstance(err, BatchTimeoutError) and err.partition_id == "p"
    assert "only 0 row(s)" in str(err) and "no row holds ['ghost']" in str(err)
    assert "nothing was consumed" in str(err)
    err = timeout({"partition": "p", "fields": ["x"]})
    assert "only 1 row(s)" in str(err) and "fewer than the 4" in str(err) and "no row holds" not in str(err)


# ---- IndexCore: client-side samplers, undelivered batches --------------------------------------------------


def test_ready_and_claim_serve_a_client_side_sampler():
    core = IndexCore()
    assert call(core, "ready", {"partition": "p", "task": "t", "fields": ["x"]}) == PENDING
    put(core, "p", ["a", "b", "c"], ["x"], tags=[{"n": 1}, {"n": 2}, {"n": 3}])
    body = {"partition": "p", "task": "t", "fields": ["x"], "min_rows": 4}
    assert call(core, "ready", body) == PENDING
    body["min_rows"] = 2
    res = call(core, "ready", body)
    assert res == _protocol.ReadyReply(rows=[("a", {"n": 1}), ("b", {"n": 2}), ("c", {"n": 3})])
    assert consumed(core, "p", "t") == []  # looking takes nothing
    claim = {
        "partition": "p",
        "task": "t",
        "fields": ["x"],
        "keys": ["c", "a"],
        "dp_rank": 0,
        "batch_index": 5,
    }
    assert call(core, "claim", claim).keys == ["c", "a"]
    with pytest.raises(WireError, match="not ready"):
        call(core, "claim", claim)  # taken
    res = call(core, "ready", {**body, "min_rows": 1, "dp_rank": 0, "batch_index": 5})
    assert res.cached is True and res.keys == ["c", "a"]  # the slot's keys, for a peer
    assert call(core, "ready", {**body, "min_rows": 1}).rows == [("b", {"n": 2})]


def test_an_undelivered_batch_is_first_in_line_again():
    core = IndexCore()
    put(core, "p", ["a", "b", "c", "d"], ["x"])
    assert nxt(core, "p", "t", 2, ["x"]) == ["a", "b"]
    core.changed.clear()
    core.give_back("p", "t", None, ["a", "b"])
    assert core.changed == {"p"}  # waiting consumers are woken
    assert consumed(core, "p", "t") == []
    assert nxt(core, "p", "t", 3, ["x"]) == ["a", "b", "c"]
    core.give_back("p", "nobody", None, ["a"])  # unknown task or partition: nothing to do
    core.give_back("q", "t", None, ["a"])


def test_deleted_and_dropped_rows_leave_the_streams():
    core = IndexCore()
    put(core, "p", ["a", "b", "c"], ["x"])
    assert nxt(core, "p", "t", 1, ["x"]) == ["a"]
    call(core, "clear", {"partition": "p", "keys": ["a", "b"]})
    assert nxt(core, "p", "t", 2, ["x"]) is None
    assert nxt(core, "p", "t", 1, ["x"]) == ["c"]
    put(core, "p", ["a"], ["x"])  # a new row under a deleted key's name is a new row
    assert nxt(core, "p", "t", 1, ["x"]) == ["a"]
    call(core, "clear_partition", {"partition": "p"})
    assert nxt(core, "p", "t", 1, ["x"]) is None  # the partition is gone: wait for it again


def test_refused_batch_size_is_a_batch_size_error():
    """A group size that does not divide batch_size is bad input of the batch size (typed)."""
    for sampler in (GroupSampler("uid", 4), SeqlenBalancedSampler("n", 2, group_size=4)):
        with pytest.raises(BatchSizeError, match="not a multiple of group_size 4"):
            sampler.check(6, 0, 2, 0)


def test_an_undelivered_rank_aware_batch_stays_with_its_slot():
    """TP peers share a (dp_rank, batch_index) slot: the first is served the batch, the second gets the
    slot's remembered keys but has gone away (its reply cannot be delivered). The keys must not be
    given back: the first peer holds them, so another rank taking them would read them twice."""
    core = IndexCore()
    put(core, "p", [f"k{i}" for i in range(6)], ["x"])
    slot = {"dp_rank": 0, "dp_size": 2, "batch_index": 0}
    first = nxt(core, "p", "t", 2, ["x"], **slot)  # delivered
    second = nxt(core, "p", "t", 2, ["x"], **slot)  # the slot's keys again; its consumer went away
    assert first == second == ["k0", "k1"]
    core.give_back("p", "t", None, second)
    assert consumed(core, "p", "t") == ["k0", "k1"]
    other = nxt(core, "p", "t", 2, ["x"], dp_rank=1, dp_size=2, batch_index=0)
    assert other == ["k2", "k3"], "a batch a TP peer received was handed to another rank"
    assert nxt(core, "p", "t", 2, ["x"], **slot) == first  # a replacement peer gets the slot's keys again
