"""Measure the controller bypass on your own Ray cluster: the driver passing metadata (the store
path) against the driver carrying the batch (the classic path), both over the compute floor.

A thin script over ``bench.bypass.run`` (``rlplane bench bypass`` has every option, plots and JSON);
this one prints one line per path. On a cluster, run it on the head node (``auto``) or give the
head's ``HOST:PORT``::

    .venv/bin/ray start --head        # on a laptop: a cluster of as many CPUs as it has cores
    .venv/bin/python examples/bypass_on_my_cluster.py --address auto --payload-mib 64 --workers 2

``--workers N`` needs N CPUs in the cluster (the producer shares the workers' bundles); more fails at
once, naming the fix. ``--address local`` (the default) starts a local Ray of its own for the run.
"""

from __future__ import annotations

import argparse
import sys

from bench import bypass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address",
        default="local",
        help="auto (RAY_ADDRESS, else the cluster `ray start` started), HOST:PORT, or local "
        "(a new local Ray; the default)",
    )
    parser.add_argument("--payload-mib", type=int, default=64, help="MiB per step (default: 64)")
    parser.add_argument("--workers", type=int, default=2, help="consumer workers (default: 2)")
    parser.add_argument("--rows", type=int, default=256, help="rows per step (default: 256)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path (default: 3)")
    args = parser.parse_args(argv)
    records = bypass.run(
        address=args.address,
        payloads=(args.payload_mib * 2**20,),
        workers=(args.workers,),
        producers=1,
        rows=args.rows,
        steps=args.steps,
        paths=("floor", "classic", "store"),
        progress=False,
    )
    print(f"{'path':<8} {'step s':>8} {'over floor s':>13} {'driver MiB':>11}")
    for r in records:
        mib = r["driver_bytes"] / 2**20
        print(f"{r['path']:<8} {r['step_s']:>8.3f} {r['overhead_s']:>13.3f} {mib:>11.2f}")
    by_path = {r["path"]: r for r in records}
    store, classic = by_path["store"], by_path["classic"]
    print(
        f"the driver carried {classic['driver_bytes'] / max(store['driver_bytes'], 1):.0f}x fewer bytes "
        f"through the store path than the classic one"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
