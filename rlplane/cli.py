"""The rlplane command line: store start|status|stop, demo and bench (``rlplane --help``).

This module parses; each subcommand's work lives in the package it is about (``dataplane.admin``,
``workers.demo``, ``bench.runner``) and is imported only when that subcommand runs, so
``rlplane --version`` and every ``--help`` answer without loading torch or Ray. ``--address`` has one
meaning in every subcommand (``dataplane.service.connect``): ``local`` a new Ray of the command's own,
``auto`` the running cluster, ``HOST:PORT`` the cluster whose head listens there.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
from typing import Any

import rlplane

DESCRIPTION = (
    "rlplane: a data plane for RL post-training. Run the batch store as a service on a Ray cluster "
    "(store), train the GRPO demo on it (demo), or measure it (bench)."
)
# What --address means, in every subcommand's help (one meaning everywhere: dataplane.service.connect).
AUTO_FORM = "auto = the running cluster (RAY_ADDRESS, else the one `ray start` started on this machine)"
HOST_FORM = "HOST:PORT = the cluster whose head listens there"
LOCAL_FORM = "local = a new Ray of this command's own"
STORE_EPILOG = (
    "exit status: 0 done; 1 the cluster or the store refused (the printed line says why); 2 bad arguments; "
    "141 what reads the output went away (`| head -1`): the command's work was done all the same (a store "
    "it started keeps running), only the output was cut short"
)
DEMO_EPILOG = (
    "exit status: 0 the mean reward of the last 10% of steps is above that of the first 10% (with "
    "--steps 1 there is nothing to compare: 0, and a line says the rise was not judged); 1 it is not "
    "(a line says so); 2 bad arguments"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ "(default: X)" after each option whose default says something: not for flags, nor for
    ``None`` (the help says what happens then), nor where the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """Every parser and subparser of the CLI formats its help the same way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # argparse's own signature
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1.

    Example:
        >>> positive_int("3")
        3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def whole_number(text: str) -> int:
    """argparse type: a whole number >= 0.

    Example:
        >>> whole_number("0")
        0
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def size(text: str) -> int:
    """argparse type: a byte size such as ``1073741824``, ``512M``, ``1G`` or ``2GiB`` (``_units``)."""
    from dataplane._units import parse_size  # only when the option is given: `--help` stays instant

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_store(sub: argparse._SubParsersAction[_Parser]) -> None:
    store = sub.add_parser(
        "store",
        help="run the batch store as a service on a Ray cluster",
        description="Run the batch store (an index and N shards, detached Ray actors) as a service that "
        "outlives this command; any process of the cluster attaches with dp.init().",
        epilog=STORE_EPILOG,
    )
    actions = store.add_subparsers(dest="store_action", required=True, metavar="{start,status,stop}")
    start = actions.add_parser(
        "start",
        help="start the index service and shards as detached actors",
        description="Start the store on a Ray cluster; print what runs and the line that attaches to it. "
        "A store already running with other options is left as it is, and the options that differ "
        "are named (exit 1).",
        epilog=STORE_EPILOG,
    )
    start.add_argument(
        "--shards", type=positive_int, default=None, help="storage shards (default: one per alive Ray node)"
    )
    start.add_argument(
        "--address",
        default="auto",
        help=f"the Ray cluster to start the store on: {AUTO_FORM}; {HOST_FORM}; local = a new Ray head "
        "on this machine, started in the background (`ray start --head`) so that it outlives this command",
    )
    start.add_argument(
        "--capacity",
        type=size,
        default=None,
        metavar="SIZE",
        help="byte capacity of the whole store, split evenly over the shards: bytes, or a number with K, "
        "M, G or T, powers of 1024 (1G = 1 GiB; KB and KiB mean the same), e.g. 512M, 1.5G "
        "(default: unlimited)",
    )
    start.add_argument(
        "--encrypt",
        action="store_true",
        default=None,
        help="encrypt traffic between hosts (CURVE: ~3x slower over tcp)",
    )
    status = actions.add_parser(
        "status",
        help="show the running store: a row per shard (node, memory, capacity, partitions, clients)",
        description="Show the store running on a Ray cluster: a summary line, then a row per shard (its "
        "node, bytes used and held in memory, capacity, partitions, rows, open client connections) and "
        "the partitions with their number of keys. Exit 1, saying so, when no store runs there.",
        epilog=STORE_EPILOG,
    )
    status.add_argument("--json", action="store_true", help="print dp.stats() as JSON (bytes as integers)")
    status.add_argument(
        "--watch", action="store_true", help="refresh in place like top: shards, partitions, tasks"
    )
    status.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes")
    status.add_argument("--count", type=positive_int, metavar="N", help="stop after N refreshes (--watch)")
    stop = actions.add_parser(
        "stop",
        help="stop the store service (its data is gone)",
        description="Stop the store running on a Ray cluster: its index and every shard, whoever started "
        "them, a broken store (its index dead) included. Its data is gone; the Ray cluster keeps running "
        "(`ray stop` stops that).",
        epilog=STORE_EPILOG,
    )
    for p in (status, stop):
        p.add_argument(
            "--address",
            default="auto",
            help=f"the Ray cluster the store runs on: {AUTO_FORM}; {HOST_FORM} (local, a new Ray, holds no "
            "store)",
        )
    for p in (start, status, stop):
        p.add_argument(
            "--name",
            default="dataplane",
            help="the store's name: several stores of other names can run on one cluster; a process "
            "attaches to this one with dp.init(name=NAME)",
        )


def _add_demo(sub: argparse._SubParsersAction[_Parser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run the GRPO demo trainer on an embedded store and a local Ray",
        description="Train a small causal transformer with GRPO; the driver holds metadata only. Prints a "
        "progress bar and a summary table, and writes the summary and a timeline next to --summary.",
        epilog=DEMO_EPILOG,
    )
    demo.add_argument(
        "--address",
        default="local",
        help=f"the Ray to train on: {LOCAL_FORM}, stopped at the end; {AUTO_FORM}; {HOST_FORM}. The demo "
        "uses the store running there, or starts one of its own for the run",
    )
    demo.add_argument("--steps", type=positive_int, default=40, help="training steps")
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the model weights, the prompts and the sampling"
    )
    demo.add_argument("--summary", default="build/demo-summary.json", help="where to write the JSON summary")
    demo.add_argument(
        "--dp",
        type=positive_int,
        default=None,
        help="data-parallel actor workers, one process each (default: 2)",
    )
    demo.add_argument(
        "--mode",
        choices=["sync", "stream", "both"],
        default=None,  # sync, or stream with a checkpoint flag (workers.config.from_demo_args)
        help="sync: one blocking call per stage; stream: stages pull ready rows and overlap; "
        "both: sync then stream on the same seed, compared (default: sync; stream with --resume, "
        "--checkpoint-dir or --checkpoint-every, which only stream mode has)",
    )
    demo.add_argument(
        "--max-staleness",
        type=whole_number,
        default=None,
        help="stream mode: steps the rollout may run ahead of the update (default: 1)",
    )
    demo.add_argument(
        "--stream-chunks",
        type=positive_int,
        default=None,
        help="stream mode: reward/advantage batches per step (default: 2)",
    )
    demo.add_argument(
        "--rollout-chunks",
        type=positive_int,
        default=None,
        help="stream mode: rollout calls per rank and step (default: 1)",
    )
    demo.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the actor ranks train, roll out and compute log-probs: cuda (a GPU each, NCCL), "
        "cpu (gloo), or auto: cuda when the Ray cluster has a GPU per --dp rank, else cpu (default)",
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
    demo.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="stream mode: save checkpoints here (the policy, its optimizer and the store together)",
    )
    demo.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="stream mode: save a checkpoint before every N-th step (needs --checkpoint-dir)",
    )
    demo.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="stream mode: resume from the newest complete checkpoint in DIR (a --checkpoint-dir), with "
        "the settings it was saved with; checked before anything starts",
    )


def _add_bench(sub: argparse._SubParsersAction[_Parser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="run a benchmark from bench/",
        description="Run a benchmark of bench/ in a process of its own (a fresh Ray, unless its --address "
        "names a running one) and write its "
        "results (JSON, and charts where it draws some) to --out. `make bench-quick` runs `rlplane bench "
        "bypass --quick`: the controller bypass in under a minute.",
        epilog="flags after the benchmark's name go to it: `rlplane bench bypass --help` lists bypass's "
        "(--quick, --payload, --workers, --address, --transport, ...)",
    )
    bench.add_argument(
        "which",
        nargs="?",
        default="all",
        help="store | dispatch | bypass | stream | checkpoint | index | all",
    )
    bench.add_argument(
        "--out", default=None, help="folder for the results (default: bench/results; bypass: build/bench)"
    )
    # Everything after the name is the benchmark's own (its parser checks it); argparse.REMAINDER
    # also swallows a later --out, which bench.runner takes back out.
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The ``rlplane`` parser: every subcommand, with plain-text help that shows the defaults."""
    parser = _Parser(prog="rlplane", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {rlplane.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{store,demo,bench}", parser_class=_Parser
    )
    _add_store(sub)
    _add_demo(sub)
    _add_bench(sub)
    return parser


# The exit status of a command whose reader went away (`rlplane store status | head -1`): what a
# process killed by SIGPIPE reports in a shell (128 + 13), as `yes | head -1` does. Not 1 ("refused")
# nor 2 ("bad arguments"): the work was done (a store started keeps running), only output was cut.
EXIT_OUTPUT_CLOSED = 141


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); returns the exit status."""
    try:
        return _run(argv)
    except BrokenPipeError:
        if not _stdout_closed():  # a socket of the command's own: a real failure, with its traceback
            raise
        # Python ignores SIGPIPE, so the write raised instead; the interpreter's last flush of what
        # is still buffered would raise again ("Exception ignored ..."): give it nowhere to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED


def _stdout_closed() -> bool:
    """Whether nothing reads this process's stdout any more (a pipe whose reader exited): Linux
    reports the write end of such a pipe (or a socket whose peer is gone) as an error when polled."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # no file behind stdout (replaced, or closed)
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.command == "store":
        from dataplane import admin

        return admin.cli(args)
    if args.command == "demo":
        # The flags and --resume's checkpoint first, with no torch or Ray loaded (workers.config reads
        # files only): a mistake is answered at once, not after Ray and the workers have started.
        from workers.config import from_demo_args

        try:
            from_demo_args(args)
        except ValueError as exc:
            sys.stdout.write(f"rlplane demo: {exc}\n")
            return 2
        from workers import demo

        return demo.cli(args)
    if args.command == "bench":
        from bench import runner

        return runner.cli(args)
    return 2
