"""Transport benchmark: the store's put and get across two hosts against raw TCP and raw pyzmq, one link.

One run, every path in the same rounds, per payload size (``--sizes``: 64 MiB, 256 MiB, 1 GiB; one
untimed warm-up round, then best of ``--repeat`` 3 rounds) between a driver on one host and the other:

1. **raw TCP**, 1 connection and C connections (``--connections`` 2,4; the payload split into C
   parts): ``sendmsg`` of memoryview chunks, ``recv_into`` a preallocated buffer, connections kept
   open (``bench._rawtcp``); ``put`` = driver -> other host, ``get`` = back;
2. **raw pyzmq**: one PUSH/PULL stream of the same bytes in one zero-copy frame (``bench._rawzmq``),
   each direction;
3. **the store** (``--engine``: ``native``, large buffers over plain TCP split across
   ``engine_connections`` (4) connections per shard pair; ``zmq``, every byte in one zmq stream;
   ``mooncake``, where it can run): a store of two shards, one per host; a ``[16, size / 16]``
   uint8 column whose keys all land on the other host's shard, ``kv_batch_put`` from the driver and
   ``kv_batch_get`` back into it (``--transport``: the client's transport, ``auto`` by default).

Targets, per size: store put and get >= 0.8x raw TCP with as many connections as the store opens per
shard pair (native: 4, zmq: 1), and >= 0.8x raw TCP's best over the connection counts.

Where: with no ``--address`` (as root) the run builds a test bed of two hosts on this machine
(``bench.testbed``: network namespaces on a bridge, a Ray node each) and runs its driver on h1; with
``--address auto`` (or ``HOST:PORT``) it joins a running cluster of two nodes or more and measures
between the driver's node and another. On a 2-core machine the test bed's link is bound by the CPU:
compare engines on a real cluster.

Usage::

    rlplane bench transport --quick                 # 64 MiB and 256 MiB, best of 2, on the test bed (root)
    rlplane bench transport                         # 64 MiB, 256 MiB, 1 GiB, best of 3
    rlplane bench transport --address auto          # on this Ray cluster: this node and another
    python -m bench.transport --sizes 1MiB --repeat 1 --json /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import _common, testbed
from bench._transport_run import ENGINES, size_label

_MARK = "@@bench-transport-results@@ "  # the driver's last line: its results as JSON
_PATHS = (  # (row label, result key prefix)
    ("raw pyzmq, 1 stream", "zmq"),
    ("store", "store"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from dataplane._units import parse_size

    def sizes(text: str) -> list[int]:
        return [parse_size(part.strip()) for part in text.split(",") if part.strip()]

    def counts(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part.strip()]

    p = argparse.ArgumentParser(prog="rlplane bench transport", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=sizes, default=None, help="payload sizes (default 64M,256M,1G)")
    p.add_argument("--repeat", type=int, default=None, help="rounds per size, best of (default 3)")
    p.add_argument("--quick", action="store_true", help="64M,256M, best of 2: under 4 minutes")
    p.add_argument("--connections", type=counts, default=[2, 4], help="raw TCP connection counts (2,4)")
    p.add_argument("--rows", type=int, default=16, help="rows of the store's column (16)")
    p.add_argument("--engine", choices=sorted(ENGINES), default="native", help="the store's engine")
    p.add_argument(
        "--transport", choices=("auto", "zmq", "tcp"), default="auto", help="the client's transport"
    )
    p.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster of 2+ nodes (auto, HOST:PORT); default: the test bed",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one transfer or call (300)")
    p.add_argument(
        "--deadline-s", type=float, default=1500.0, help="deadline of the test bed's driver (1500)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the measuring process
    cfg = p.parse_args(argv)
    cfg.sizes = cfg.sizes or ([64 << 20, 256 << 20] if cfg.quick else [64 << 20, 256 << 20, 1 << 30])
    cfg.repeat = cfg.repeat or (2 if cfg.quick else 3)
    if cfg.repeat < 1 or cfg.rows < 1 or any(c < 1 for c in cfg.connections):
        p.error("--repeat, --rows and --connections must be >= 1")
    if any(s % cfg.rows or s < cfg.rows * 4096 for s in cfg.sizes):
        p.error(f"each size must be a multiple of --rows ({cfg.rows}) of at least 4096 bytes per row")
    return cfg


def _flags(cfg: argparse.Namespace) -> list[str]:
    """The measuring flags of ``cfg``, as the driver on the test bed takes them."""
    return [
        "--sizes", ",".join(map(str, cfg.sizes)), "--repeat", str(cfg.repeat),
        "--connections", ",".join(map(str, cfg.connections)), "--rows", str(cfg.rows),
        "--engine", cfg.engine, "--transport", cfg.transport, "--timeout-s", str(cfg.timeout_s),
    ]  # fmt: skip


# ---- where it runs ------------------------------------------------------------------------------------
def run_on_bed(bed: testbed.Testbed, argv: Sequence[str] | None = None) -> int:
    """The benchmark with ``argv``'s flags on a test bed that is up: its driver on ``bed.hosts[0]``,
    the far ends on ``bed.hosts[1]``; prints the report, writes the JSON; the exit status."""
    cfg = parse_args(argv)
    h1, h2 = bed.hosts[0], bed.hosts[1]
    print(f"test bed: driver on {h1.name} ({h1.ip}), the other host {h2.name} ({h2.ip})", flush=True)
    found: dict[str, Any] | None = None

    def on_line(line: str) -> None:
        nonlocal found
        if line.startswith(_MARK):
            found = json.loads(line[len(_MARK) :])
        else:
            print(f"  {h1.name}| {line}", end="", flush=True)

    argv = ["-m", "bench.transport", "--driver", "--address", "auto", *_flags(cfg)]
    rc = h1.drive(argv, cfg.deadline_s, on_line)
    if found is None:
        killed = " (stopped at --deadline-s)" if rc == -signal.SIGKILL else ""
        print(f"!! the driver on {h1.name} exited {rc}{killed} without results", file=sys.stderr)
        return rc or 1
    found["where"] = {"mode": "testbed", "hosts": {h.name: h.ip for h in bed.hosts[:2]}}
    return report(cfg, found)


def _driver(cfg: argparse.Namespace) -> int:
    """The measuring process: joins the cluster, runs every path, prints the results as one line."""
    import ray

    from bench import _transport_run

    with _common.ray_for_run(
        lambda: ray.init(address=cfg.address, log_to_driver=False, logging_level="ERROR")
    ):
        results = _transport_run.run(cfg)
    print(_MARK + json.dumps(results), flush=True)
    return 0


def _on_cluster(cfg: argparse.Namespace) -> int:
    import ray

    from bench import _transport_run

    with _common.ray_for_run(
        lambda: ray.init(address=cfg.address, log_to_driver=False, logging_level="ERROR")
    ):
        results = _transport_run.run(cfg)
    results["where"] = {"mode": "cluster", "address": cfg.address}
    return report(cfg, results)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    engine = ENGINES[cfg.engine]
    if not engine.available:
        print(f"rlplane bench transport: --engine {cfg.engine}: {engine.why_not}", file=sys.stderr)
        return 2
    if cfg.driver:
        return _driver(cfg)
    if cfg.address:
        return _on_cluster(cfg)
    why = testbed.missing()
    if why:
        print(
            f"rlplane bench transport: without --address it builds a test bed of two hosts on this machine, "
            f"and cannot here: {why}. Run it as root, or on a Ray cluster of two nodes: --address auto",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    with testbed.Testbed(hosts=2) as bed:
        print(f"test bed of 2 hosts up in {time.perf_counter() - t0:.1f} s", flush=True)
        return run_on_bed(bed, argv)


# ---- the report ---------------------------------------------------------------------------------------
def _best(res: dict[str, Any], key: str) -> float | None:
    return res[key]["best_gbps"] if key in res else None


def checks_of(results: dict[str, Any]) -> list[_common.Check]:
    """The targets, per size: store put and get against raw TCP with the store's connections, and
    against raw TCP's best connection count."""
    same = results["store_connections"]
    checks = []
    for size, res in results["sizes"].items():
        label = size_label(int(size)).replace(" ", "")
        for op in ("put", "get"):
            best_c = max(results["connections"], key=lambda c: _best(res, f"tcp{c}_{op}") or 0.0)
            checks += [
                _common.Check(
                    f"{op}_vs_tcp{same}_{label}",
                    _common.ratio(_best(res, f"store_{op}"), _best(res, f"tcp{same}_{op}")),
                    0.8,
                    ">=",
                    f"store {op} / raw tcp {op}, {same} connection{'s' * (same > 1)} (the store's)",
                ),
                _common.Check(
                    f"{op}_vs_tcp_best_{label}",
                    _common.ratio(_best(res, f"store_{op}"), _best(res, f"tcp{best_c}_{op}")),
                    0.8,
                    ">=",
                    f"store {op} / raw tcp {op}, best: {best_c} connection{'s' * (best_c > 1)}",
                ),
            ]
    return checks


def report(cfg: argparse.Namespace, results: dict[str, Any]) -> int:
    """Print the figures and the check table, write the JSON; 1 on a MISS, else 0."""
    near, far = results["near"]["ip"], results["far"]["ip"]
    print(
        f"\ntransport bench: {', '.join(size_label(int(s)) for s in results['sizes'])} between {near} "
        f"(driver) and {far}; engine {results['engine']}, transport {results['transport']}, best of "
        f"{cfg.repeat}; GB/s (1e9 bytes/s), put = driver -> {far}, get = back"
    )
    print(f"{'size':<9} {'path':<26} {'put GB/s':>9} {'get GB/s':>9}")
    same = results["store_connections"]
    for size, res in results["sizes"].items():
        rows: list[tuple[str, float | None, float | None]] = []
        for c in results["connections"]:
            rows.append(
                (f"raw tcp, {c} conn{'s' * (c > 1)}", _best(res, f"tcp{c}_put"), _best(res, f"tcp{c}_get"))
            )
        for label, key in _PATHS:
            rows.append((label, _best(res, f"{key}_put"), _best(res, f"{key}_get")))
        cold = res.get("cold", {})
        rows.append(("store, warm-up round", cold.get("store_put"), cold.get("store_get")))
        best = {
            op: max(_best(res, f"tcp{c}_{op}") or 0.0 for c in results["connections"])
            for op in ("put", "get")
        }
        for label, den in (
            (f"store / raw tcp {same} conn", {op: _best(res, f"tcp{same}_{op}") for op in ("put", "get")}),
            ("store / raw tcp best", best),
            ("store / raw pyzmq", {op: _best(res, f"zmq_{op}") for op in ("put", "get")}),
        ):
            rows.append(
                (
                    label,
                    _common.ratio(_best(res, "store_put"), den["put"]),
                    _common.ratio(_best(res, "store_get"), den["get"]),
                )
            )
        for i, (label, put, get) in enumerate(rows):
            first = size_label(int(size)) if i == 0 else ""
            print(f"{first:<9} {label:<26} {_common.fmt(put):>9} {_common.fmt(get):>9}")
    return _common.report_checks(checks_of(results), results, cfg, cfg.json)


if __name__ == "__main__":
    raise SystemExit(main())
