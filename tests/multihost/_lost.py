"""A driver run on host h1 of the test bed for the loss scenarios (``python tests/multihost/_lost.py
MODE CKPT_DIR``), printing one JSON line per step; it reads a line from stdin before each step that
needs the test to act first.

``shard``: the shard on h2 is SIGKILLed (by the test, on h2): a get of its rows fails with a typed
error naming it (dead, found through Ray: its process is in another pid namespace), rows on h1 stay.
``host``: the whole of h2 is lost; then the store is started again on what is left and loaded from
a checkpoint saved before the loss.
"""

from __future__ import annotations

import json
import sys
import time

import ray
import torch

import dataplane as dp
from dataplane.client.sharding import HashPlacement


def say(**facts: object) -> None:
    print(json.dumps(facts), flush=True)


def keys_by_host(partition: str, shards: list[dict], n: int) -> dict[str, list[str]]:
    """``n`` keys per host's shard (by the shard's address)."""
    placement, out = HashPlacement(len(shards)), {}
    i = 0
    while any(len(out.get(s["tcp"], [])) < n for s in shards):
        key = f"k{i}"
        shard = shards[placement.shard_of(partition, key)]
        if len(out.setdefault(shard["tcp"], [])) < n:
            out[shard["tcp"]].append(key)
        i += 1
    return out


def main(mode: str, ckpt: str) -> None:
    ray.init(address="auto", log_to_driver=False)  # (stdout carries this script's JSON lines only)
    name = f"lost-{mode}"
    dp.init(name=name, num_shards=2, rpc_timeout_s=120)  # a loss must be found long before this deadline
    shards = dp.current_client().registry["shards"]
    here = ray.util.get_node_ip_address()
    mine = next(s for s in shards if f"//{here}:" in s["tcp"])
    theirs = next(s for s in shards if s is not mine)
    by_host = keys_by_host("p", shards, 8)
    keys = by_host[mine["tcp"]] + by_host[theirs["tcp"]]
    values = torch.arange(len(keys), dtype=torch.float32)
    dp.kv_batch_put(keys, "p", {"x": values})
    if mode == "host":
        dp.save_checkpoint(ckpt)
    say(
        step="ready",
        victim_pid=theirs["pid"],
        victim=dp.current_client().config.shard_name(shards.index(theirs)),
    )
    sys.stdin.readline()  # the test kills the shard (or the host)
    try:
        dp.kv_batch_get(by_host[theirs["tcp"]], "p")
        lost = None
    except dp.DataplaneError as exc:
        lost = {"type": type(exc).__name__, "message": str(exc)}
    kept = dp.kv_batch_get(by_host[mine["tcp"]], "p")["x"].tolist()
    say(step="lost", error=lost, kept=kept == values[: len(by_host[mine["tcp"]])].tolist())
    if mode == "host":
        dp.close()  # what is left of the store
        # Ray marks the lost node dead after its missed health checks; until then it would still
        # place actors there. The store starts again once the cluster knows.
        deadline = time.monotonic() + 180
        while sum(n["Alive"] for n in ray.nodes()) > 1:
            if time.monotonic() > deadline:
                raise TimeoutError("Ray did not mark the lost host's node dead within 180 s")
            time.sleep(0.5)  # polling Ray's node table, bounded by the deadline above
        dp.init(name=name, num_shards=2, rpc_timeout_s=120)  # on the surviving host
        dp.load_checkpoint(ckpt)
        back = dp.kv_batch_get(keys, "p")["x"]
        say(
            step="loaded",
            nodes=len({s["node_id"] for s in dp.current_client().registry["shards"]}),
            exact=bool(torch.equal(back, values)),
        )
    dp.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
