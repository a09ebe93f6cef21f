"""A driver run on host h1 of the test bed (``python tests/multihost/_across.py MODE``): a store with
a shard on each host, a peer process on h2, and what each saw, printed as one JSON line.

MODE: ``auto`` (the default transport: each same-host shortcut where its namespace is shared; the
tensor column's buffers through the transfer engine between hosts, its threshold lowered to 64 KiB)
or ``tcp-encrypted`` (every byte over tcp, CURVE-encrypted between hosts: no engine) or ``mooncake``
(as ``auto``, the buffers through Mooncake's Transfer Engine over its TCP transport). Rows of every
column kind cross both ways, and a checkpoint of the two live hosts is saved, the partition cleared
and the checkpoint loaded back, every row read again from both hosts.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import dataplane as dp


def facts() -> dict:
    """Per shard (in shard order): its host's address, and whether this process maps its memory and
    reaches it over the Unix lane or an ipc:// socket."""
    client = dp.current_client()
    out = []
    for i, shard in enumerate(client.registry["shards"]):
        endpoint = client.sync.endpoints[i]
        out.append(
            {
                "host": shard["tcp"].split("//")[1].rsplit(":", 1)[0],
                "shm": client.shm[i],
                "lane": endpoint.unix is not None,
                "ipc": endpoint.address.startswith("ipc://"),
                "engine": endpoint.engine is not None,
            }
        )
    return {"shards": out, "transport": client.transport}


def rows(start: int, n: int) -> dict:
    """Rows ``start .. start+n-1`` of every column kind: dense, jagged and ragged tensors, strings
    (arrow), JSON-like values and pickled objects."""
    span = range(start, start + n)
    return {
        "x": torch.arange(start, start + n, dtype=torch.float32).reshape(n, 1) * torch.ones(n, 4096),
        "ids": [torch.arange(i % 7 + 1) for i in span],
        "img": [torch.full((i % 3 + 1, 2 + i % 2), float(i)) for i in span],
        "text": [f"row {i}" for i in span],
        "chat": [{"role": "user", "turn": i, "tags": ["a", str(i)]} for i in span],
        "obj": [complex(i, 1) for i in span],
    }


def check_rows(partition: str, keys: list[str], start: int) -> bool:
    """The rows of ``keys`` read back here are exactly ``rows(start, len(keys))``."""
    got, want = dp.kv_batch_get(keys, partition), rows(start, len(keys))
    assert torch.equal(got["x"], want["x"]), "tensor column differs"
    for name in ("ids", "img"):
        assert [t.tolist() for t in got[name]] == [t.tolist() for t in want[name]], f"{name} differs"
    for name in ("text", "chat", "obj"):
        assert list(got[name]) == want[name], f"{name} column differs"
    return True


@ray.remote(num_cpus=0.1)
class Peer:
    def __init__(self, transport: str | None) -> None:
        dp.init(transport=transport, allow_pickle=True) if transport else dp.init(allow_pickle=True)

    def facts(self) -> dict:
        return facts()

    def put(self, keys: list[str], partition: str, start: int) -> None:
        dp.kv_batch_put(keys, partition, rows(start, len(keys)))

    def check(self, keys: list[str], partition: str, start: int) -> bool:
        return check_rows(partition, keys, start)

    def take(self, partition: str, n: int) -> list[str]:
        return list(dp.next_batch(partition, "train", n, ["x"], timeout_s=60).keys)


def main(mode: str) -> None:
    ray.init(address="auto")
    transport, encrypt = ("tcp", True) if mode == "tcp-encrypted" else (None, False)
    kw = {"transport": transport} if transport else {}
    if mode == "mooncake":
        kw["engine"] = "mooncake"
    dp.init(num_shards=2, encrypt=encrypt, allow_pickle=True, engine_min_bytes=1 << 16, **kw)
    other = next(
        n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] != ray.util.get_node_ip_address()
    )
    peer = Peer.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(other["NodeID"], soft=False)
    ).remote(transport)
    report = {"driver": facts(), "peer": ray.get(peer.facts.remote(), timeout=120)}
    # Written on h2, read on h1; written on h1, read on h2 (rows land on both shards, so on both hosts).
    far = [f"far-{i}" for i in range(64)]
    ray.get(peer.put.remote(far, "p", 0), timeout=120)
    check_rows("p", far, 0)
    near = [f"near-{i}" for i in range(64)]
    dp.kv_batch_put(near, "p", rows(64, len(near)))
    assert ray.get(peer.check.remote(near, "p", 64), timeout=120)
    # A checkpoint of both live hosts (the repository's build/ is one directory on every host),
    # loaded back over a cleared partition: every row again, read here and on h2.
    ckpt = pathlib.Path(__file__).resolve().parents[2] / "build" / f"multihost-across-{mode}"
    dp.save_checkpoint(str(ckpt))
    dp.clear_partition("p")
    dp.load_checkpoint(str(ckpt))
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(f"{ckpt}.old", ignore_errors=True)
    report["checkpoint"] = check_rows("p", far, 0) and ray.get(peer.check.remote(near, "p", 64), timeout=120)
    dp.finish_partition("p")
    taken = []
    while keys := ray.get(peer.take.remote("p", 48), timeout=120):
        taken.extend(keys)
    report["streamed"] = sorted(taken) == sorted(far + near)
    # The hosts whose engines this process moved buffers with (connections it keeps open to them).
    engine = dp.current_client().sync.engine
    pool = engine._pool if engine is not None and engine.name == "native" else {}
    report["engine_hosts"] = sorted({address.rsplit(":", 1)[0] for address, open_ in pool.items() if open_})
    if engine is not None and engine.name == "mooncake":  # where its engine listens, what it still lends
        report["mooncake"] = {"origin": engine.origin.rsplit(":", 1)[0], "lent": len(engine._lent.regions)}
    report["consumption"] = dp.consumption("p", "train")
    print(json.dumps(report))
    dp.close()


if __name__ == "__main__":
    main(sys.argv[1])
