"""The ``rlplane`` command line: ``store start|status|stop``, ``demo`` and ``bench``.

Each subcommand imports its package lazily, so ``rlplane --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _add_store(sub: argparse._SubParsersAction) -> None:
    store = sub.add_parser("store", help="run the batch store as a service on a Ray cluster")
    actions = store.add_subparsers(dest="store_action", required=True, metavar="{start,status,stop}")
    start = actions.add_parser("start", help="start the index service and shards as detached actors")
    start.add_argument("--shards", type=int, default=None, help="number of storage shards")
    start.add_argument(
        "--address", default="auto", help="Ray address: 'auto', HOST:PORT, or 'local' to start a local head"
    )
    start.add_argument("--capacity", type=int, default=None, help="byte capacity of the whole store")
    start.add_argument(
        "--encrypt", action="store_true", help="encrypt traffic between hosts (CURVE: ~3x slower over tcp)"
    )
    for name in ("status", "stop"):
        p = actions.add_parser(name, help=f"{name} the store service")
        p.add_argument("--address", default="auto", help="Ray address of the cluster")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run the GRPO demo trainer on an embedded store and a local Ray")
    demo.add_argument("--steps", type=int, default=None, help="training steps")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--summary", default="build/demo-summary.json", help="where to write the JSON summary")
    demo.add_argument(
        "--mode",
        choices=["sync", "stream", "both"],
        default="sync",
        help="sync: one blocking call per stage; stream: stages pull ready rows and overlap; "
        "both: sync then stream on the same seed, compared",
    )
    demo.add_argument(
        "--max-staleness", type=int, default=None, help="stream mode: steps the rollout may run ahead (1)"
    )
    demo.add_argument(
        "--stream-chunks", type=int, default=None, help="stream mode: reward/advantage batches per step (2)"
    )
    demo.add_argument(
        "--rollout-chunks", type=int, default=None, help="stream mode: rollout calls per rank and step (1)"
    )
    demo.add_argument(
        "--driver-actor",
        action="store_true",
        help="run the trainer in a Ray actor (verl's TaskRunner): this process only waits",
    )
    demo.add_argument(
        "--colocate",
        action="store_true",
        default=None,
        help="run the reward role in the actor's processes (one pool, create_colocated_worker_cls)",
    )
    demo.add_argument(
        "--timeline", default=None, help="timeline JSON path (default: next to the summary; a PNG beside it)"
    )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run a benchmark from bench/")
    bench.add_argument("which", nargs="?", default="all", help="store | dispatch | bypass | stream | all")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON results")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlplane", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{store,demo,bench}")
    _add_store(sub)
    _add_demo(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.command == "store":
        from dataplane import _service

        return _service.cli(args)
    if args.command == "demo":
        from workers import trainer

        return trainer.cli(args)
    if args.command == "bench":
        from bench import runner

        return runner.cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
