"""The measuring driver of ``bench.transport``: runs on one node of a Ray cluster of two or more (host h1
of the test bed, or a cluster node joined with ``--address``) and moves each payload between this
process and the other node through every path, in the same rounds.

Per payload size, one untimed warm-up round and then ``repeat`` rounds (best of), each path right after
the others in every round:

- **raw TCP** with 1 and with C connections (``bench._rawtcp``): this process and a ``TcpPeer`` actor
  on the other node; ``put`` = here -> there, ``get`` = there -> here;
- **raw pyzmq** (``bench._rawzmq``, one PUSH/PULL stream, zero-copy frames): a sender on one node and
  a receiver on the other, for each direction;
- **the store**, through ``Engine`` (``native``: ``dataplane``): a store of two shards, one per node
  (``dp.init`` places shards round-robin over the nodes); every key of the column is chosen so that
  it lands on the shard of the other node (``wire.placement.shard_of``), so ``kv_batch_put`` sends the
  whole column over the link and ``kv_batch_get`` brings it back.

The far end of every path is on the node of the store's remote shard: one link for all.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import _common

PARTITION = "xport"


@dataclass(frozen=True)
class Engine:
    """A store engine the benchmark can drive: its name, whether it exists in this build, the
    ``dp.init`` options it needs, and how many connections its client opens per shard pair (the raw
    TCP figure with that many connections is its same-connections reference)."""

    name: str
    available: bool
    why_not: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    connections: int = 1


def _engines() -> dict[str, Engine]:
    from dataplane.config import StoreConfig
    from dataplane.transport.engine import engine_missing

    conns = StoreConfig().engine_connections
    return {
        # The native engine: columns of 4 MiB or more split over ``engine_connections`` connections
        # per shard pair (plain TCP), the rest in the zmq message.
        "native": Engine("native", available=True, options={"engine": "native"}, connections=conns),
        # Every byte in the zmq message: one stream per shard pair.
        "zmq": Engine("zmq", available=True, options={"engine": "zmq"}, connections=1),
        "mooncake": Engine(
            "mooncake",
            available=not engine_missing("mooncake"),
            why_not=engine_missing("mooncake"),
            options={"engine": "mooncake"},
            connections=conns,
        ),
    }


ENGINES = _engines()


def far_node(here: str, shard_nodes: list[str]) -> tuple[int, str]:
    """The first shard on another node than ``here``: (its index, its node id).

    Example:
        >>> far_node("a", ["a", "b"])
        (1, 'b')
    """
    for i, node in enumerate(shard_nodes):
        if node != here:
            return i, node
    raise RuntimeError(
        "every shard of the store is on this node: the transport benchmark needs a Ray cluster of two "
        "nodes or more (the test bed builds one as root; on a cluster, run it with --address auto)"
    )


def keys_on(shard: int, num_shards: int, partition: str, rows: int) -> list[str]:
    """``rows`` keys of ``partition`` that all land on ``shard`` (the store's placement rule).

    Example:
        >>> from dataplane.wire.placement import shard_of
        >>> all(shard_of("p", k, 2) == 1 for k in keys_on(1, 2, "p", 4))
        True
    """
    from dataplane.wire.placement import shard_of

    keys: list[str] = []
    i = 0
    while len(keys) < rows:
        key = f"row-{i}"
        if shard_of(partition, key, num_shards) == shard:
            keys.append(key)
        i += 1
    return keys


class Store:
    """The store's side of a run: a store of two shards started by this process, and the remote one."""

    def __init__(self, cfg: argparse.Namespace, here: str) -> None:
        import dataplane as dp

        engine = ENGINES[cfg.engine]
        # A freed segment stays warm for the whole run (the default 2 s is shorter than one round of
        # 1 GiB, and the default 1 GiB of warm segments does not hold a 1 GiB column's), so each put
        # lands in warm pages as the raw far end's preallocated buffer does: what a training loop that
        # moves batches of one size every step sets.
        dp.init(
            name="bench-transport",
            num_shards=2,
            transport=cfg.transport,
            warm_idle_s=600.0,
            warm_retain_bytes=max(1 << 30, 2 * max(cfg.sizes)),  # (a 1 GiB column's segment is a bit more)
            rpc_timeout_s=cfg.timeout_s,
            **engine.options,
        )
        shards = dp.current_client().registry["shards"]
        self.shard, self.node = far_node(here, [s["node_id"] for s in shards])
        self.num_shards = len(shards)
        self.address = shards[self.shard]["tcp"]
        self.dp = dp

    def put_get(self, x: Any, tag: str) -> tuple[float, float]:
        """One put of ``x`` (a ``[rows, row_bytes]`` uint8 tensor) into the remote shard, then one get
        of it back; checks the bytes; returns (put seconds, get seconds)."""
        import torch

        dp, part = self.dp, f"{PARTITION}-{tag}"
        keys = keys_on(self.shard, self.num_shards, part, x.shape[0])
        t0 = time.perf_counter()
        dp.kv_batch_put(keys, part, {"x": x})
        t1 = time.perf_counter()
        got = dp.kv_batch_get(keys, part)
        t2 = time.perf_counter()
        y = got["x"]
        if not (torch.equal(y[0, :4096], x[0, :4096]) and torch.equal(y[-1, -4096:], x[-1, -4096:])):
            raise RuntimeError("the store gave back other bytes than were put")
        del got, y
        dp.clear_partition(part)
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.dp.close()


def _say(line: str) -> None:
    print(line, flush=True)  # progress, as each round ends


def _payload(nbytes: int, rows: int) -> Any:
    """``nbytes`` of warm, non-constant bytes as a ``[rows, nbytes // rows]`` uint8 tensor."""
    import torch

    x = torch.empty(rows, nbytes // rows, dtype=torch.uint8)
    x.view(-1).copy_(torch.arange(x.numel(), dtype=torch.int32).remainder_(251).to(torch.uint8))
    return x


def run(cfg: argparse.Namespace, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Every path at every size (``cfg.sizes``), ``cfg.repeat`` rounds; returns the results' dict."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from bench._rawtcp import RawTcp, TcpPeer
    from bench._rawzmq import RawZmq

    here = ray.get_runtime_context().get_node_id()
    t0 = time.perf_counter()
    store = Store(cfg, here)
    say(
        f"store: shard {store.shard} of {store.num_shards} at {store.address} (the other node); engine "
        f"{cfg.engine}, transport {cfg.transport}; started in {time.perf_counter() - t0:.1f} s"
    )
    on_far = NodeAffinitySchedulingStrategy(node_id=store.node, soft=False)
    peer = ray.remote(TcpPeer).options(num_cpus=0.01, scheduling_strategy=on_far).remote()
    conns = sorted({1, ENGINES[cfg.engine].connections, *cfg.connections})
    zmqs: list[RawZmq] = []
    try:
        endpoint = ray.get(peer.listen.remote(None, cfg.timeout_s), timeout=cfg.timeout_s)
        zmqs.append(RawZmq(here, store.node, cfg.timeout_s))  # put: sender here, receiver there
        zmqs.append(RawZmq(store.node, here, cfg.timeout_s))  # get: the other way
        paths = Paths(
            peer=peer,
            tcp=RawTcp(tuple(endpoint), max(conns), cfg.timeout_s),
            conns=conns,
            zmq_put=zmqs[0],
            zmq_get=zmqs[1],
            store=store,
            timeout_s=cfg.timeout_s,
        )
        say(
            f"raw tcp to {endpoint[0]}:{endpoint[1]} ({', '.join(map(str, conns))} connections); raw zmq "
            f"{paths.zmq_put.endpoint} (put) and {paths.zmq_get.endpoint} (get)"
        )
        sizes = {str(n): paths.measure(n, cfg.rows, cfg.repeat, say) for n in cfg.sizes}
        errors = ray.get(peer.errors_seen.remote(), timeout=cfg.timeout_s)
        if errors:
            raise RuntimeError(f"the raw tcp far end failed: {errors}")
        paths.tcp.close()
        return {
            "sizes": sizes,
            "connections": conns,
            "store_connections": ENGINES[cfg.engine].connections,
            "engine": cfg.engine,
            "transport": cfg.transport,
            "near": {"node_id": here, "ip": ray.util.get_node_ip_address()},
            "far": {"node_id": store.node, "ip": endpoint[0], "shard": store.address},
        }
    finally:
        for z in zmqs:
            z.close()
        try:
            ray.get(peer.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - tearing down; the actor is killed next either way
            pass
        ray.kill(peer)
        store.close()


@dataclass
class Paths:
    """Every path of a run, set up: the raw TCP far end and near end, the two raw zmq streams, the store."""

    peer: Any
    tcp: Any
    conns: list[int]
    zmq_put: Any
    zmq_get: Any
    store: Store
    timeout_s: float

    def measure(self, nbytes: int, rows: int, repeat: int, say: Callable[[str], None]) -> dict[str, Any]:
        """One warm-up round, then ``repeat`` rounds of every path with ``nbytes``: their throughput by
        path and direction, and the warm-up round's GB/s (``cold``)."""
        import numpy as np
        import ray

        x = _payload(nbytes, rows)
        src = memoryview(x.numpy()).cast("B")
        dst = np.ones(nbytes, dtype=np.uint8).data.cast("B")  # warm, as the far end's buffer
        ray.get(self.peer.prepare.remote(nbytes), timeout=self.timeout_s)
        for z in (self.zmq_put, self.zmq_get):
            z.prepare([nbytes])
        times: dict[str, list[float]] = {}
        cold: dict[str, float] = {}
        # Round 0 is not timed: the first transfer of a size pays once for what a loop moving batches
        # of that size every step pays only at its first (the store's first put and get of a segment
        # that size, the codec's import at the very first, a connection's slow start).
        for r in range(repeat + 1):
            got: dict[str, float] = {}
            for c in self.conns:
                got[f"tcp{c}_put"] = self.tcp.write(src, c)
                got[f"tcp{c}_get"] = self.tcp.read(dst, c)
            if bytes(dst[-4096:]) != bytes(src[-4096:]):  # (the far end holds what was put)
                raise RuntimeError("raw tcp gave back other bytes than were sent")
            got["zmq_put"] = self.zmq_put.transfer()
            got["zmq_get"] = self.zmq_get.transfer()
            got["store_put"], got["store_get"] = self.store.put_get(x, f"{nbytes}-{r}")
            rates = {k: nbytes / v / _common.GB for k, v in got.items()}
            if r == 0:
                cold = rates
            else:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
            which = "warm-up" if r == 0 else f"round {r}/{repeat}"
            say(
                f"  {size_label(nbytes)} {which} (GB/s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
            )
        return {**{k: _common.throughput(nbytes, v) for k, v in times.items()}, "cold": cold}


def size_label(nbytes: int) -> str:
    """``1 GiB``, ``64 MiB``, ``512 KiB``: the largest binary unit that divides ``nbytes``.

    Example:
        >>> size_label(1 << 30), size_label(3 << 20), size_label(1536)
        ('1 GiB', '3 MiB', '1536 B')
    """
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
