"""A stream's ready keys (``ReadyKeys``) against a plain list as the model: random adds, takes of
the first keys, discards anywhere, give-backs, resets and drains; order, membership and ``first``
agree after every step (no Ray, no sockets)."""

from __future__ import annotations

import random

from dataplane.server.index import ready as ready_mod
from dataplane.server.index.ready import ReadyKeys


def _step(rng: random.Random, ready: ReadyKeys, model: list[str], fresh: list[int]) -> None:
    roll = rng.random()
    if roll < 0.3:  # new keys, and some of those ready already (they keep their place)
        new = [f"k{fresh[0] + i}" for i in range(rng.randrange(1, 6))]
        fresh[0] += len(new)
        old = rng.sample(model, min(len(model), rng.randrange(3)))
        batch = new + old
        rng.shuffle(batch)
        if rng.random() < 0.5:
            ready.extend(batch)
        else:
            for key in batch:
                ready.add(key)
        model.extend(k for k in dict.fromkeys(batch) if k not in model)
    elif roll < 0.55:  # a take of the first keys
        got = ready.first(rng.randrange(1, 5))
        assert got == model[: len(got)]
        ready.discard_all(got)
        del model[: len(got)]
    elif roll < 0.7 and model:  # keys discarded anywhere (cleared, taken by a sampler of its own)
        gone = rng.sample(model, rng.randrange(1, min(4, len(model)) + 1))
        ready.discard_all(gone) if rng.random() < 0.5 else [ready.discard(k) for k in gone]
        model[:] = [k for k in model if k not in gone]
    elif roll < 0.8:  # keys given back first in line (some of them ready: those stay where they are)
        back = [f"k{rng.randrange(max(1, fresh[0]))}" for _ in range(rng.randrange(1, 4))]
        ready.put_first(back)
        model[:0] = [k for k in dict.fromkeys(back) if k not in model]
    elif roll < 0.85:  # a key that was ready before, ready again at the end
        key = f"k{rng.randrange(max(1, fresh[0]))}"
        ready.add(key)
        if key not in model:
            model.append(key)
    elif roll < 0.87:
        keys = [f"k{fresh[0] + i}" for i in range(rng.randrange(4))]
        fresh[0] += len(keys)
        ready.replace(keys)
        model[:] = keys


def test_ready_keys_keep_the_order_a_list_would(monkeypatch):
    monkeypatch.setattr(ready_mod, "TRIM_MIN", 3)  # (the order list is cut often)
    for seed in range(200):
        rng = random.Random(seed)
        ready, model, fresh = ReadyKeys(lambda key: {}), [], [0]
        for step in range(200):
            _step(rng, ready, model, fresh)
            assert list(ready) == model, (seed, step)
            assert len(ready) == len(model)
            n = rng.randrange(1, 8)
            assert ready.first(n) == model[:n], (seed, step)
            probe = f"k{rng.randrange(max(1, fresh[0]))}"
            assert (probe in ready) == (probe in model)
            assert ready.contains_all(model[:3]) and not ready.contains_all([*model[:2], "nope"])


def test_drained_ready_keys_go_in_slices_of_at_most_n():
    ready = ReadyKeys(lambda key: {}, [f"k{i}" for i in range(10)])
    ready.discard_all(ready.first(3))
    ready.put_first(["k0"])
    counts = []
    while n := ready.drain(4):
        assert n <= 4
        counts.append(n)
    assert len(ready) == 0 and sum(counts) >= 8 and list(ready) == [] and ready.first(5) == []
