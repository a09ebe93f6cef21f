"""Runs the benchmarks in ``bench/`` by name: ``rlplane bench NAME`` (``all``: every one, in order).

Each benchmark is a module in ``bench`` exposing ``main(argv: list[str] | None) -> int``. The runner
starts each one in a child Python process (a fresh Ray per benchmark, and one benchmark's crash or
leftover global state cannot touch the next) and passes it ``--json <out>/<name>.json`` plus any
extra flags in its :class:`Benchmark` entry. ``all`` runs every registered benchmark in order and
skips, with a message, those whose module is not built yet or that cannot run here (``why_not``).

To add a benchmark: write ``bench/<module>.py`` with ``main(argv)`` accepting ``--json PATH``, and
add a :class:`Benchmark` to :data:`BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from bench import testbed

log = logging.getLogger(__name__)

# A generous ceiling so a hung benchmark still ends; the full store run takes a few minutes.
BENCH_TIMEOUT_S = 1800.0

# The child imports the module and calls main(argv) with the flags that follow.
_CHILD = "import importlib, sys; sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))"


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark: its module, the JSON file it writes, and extra flags."""

    name: str
    module: str
    description: str
    plot: bool = False
    out: str = "bench/results"  # where its results go unless --out says otherwise
    # Why it cannot run here with no flags (None: it can); `all` skips it with this reason, and named
    # on its own it runs and says so itself.
    why_not: Callable[[], str | None] | None = None

    def argv(self, out: pathlib.Path) -> list[str]:
        args = ["--json", str(out / f"{self.module.rsplit('.', 1)[-1]}.json")]
        if self.plot:
            stem = self.module.rsplit(".", 1)[-1]
            args += ["--plot", str(out / f"{stem}.png"), "--markdown", str(out / f"{stem}.md")]
        return args


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("store", "bench.store_throughput", "store GB/s vs memcpy, Ray, TransferQueue", plot=True),
        Benchmark("dispatch", "bench.dispatch_overhead", "controller overhead per call vs bare Ray"),
        Benchmark(
            "bypass",
            "bench.bypass",
            "controller bypass: floor, classic, store, TransferQueue",
            out="build/bench",
        ),  # also writes bypass.png and bypass.run.json there
        Benchmark("stream", "bench.stream", "next_batch, wake-up and readiness updates vs TransferQueue"),
        Benchmark("checkpoint", "bench.checkpoint", "checkpoint save/load vs the disk and TransferQueue"),
        Benchmark("index", "bench.index", "the index at a million keys: memory, rates, others' latency"),
        Benchmark(
            "transport",
            "bench.transport",
            "put/get across two hosts vs raw TCP and raw pyzmq on the same link",
            why_not=testbed.missing,  # with no --address it builds its two hosts: root only
        ),
    )
}


def is_built(bench: Benchmark) -> bool:
    """Whether the benchmark's module exists (``all`` skips those that do not)."""
    return importlib.util.find_spec(bench.module) is not None


def run_one(
    bench: Benchmark, out: pathlib.Path, timeout_s: float = BENCH_TIMEOUT_S, extra: list[str] | None = None
) -> int:
    """Run ``bench`` in a child process (``extra``: more flags for it), streaming its output; return
    its exit status."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _CHILD, bench.module, *bench.argv(out), *(extra or [])]
    if not {"-h", "--help"} & set(extra or []):  # a help text starts with its usage line
        print(f"== rlplane bench {bench.name}: {bench.description}", flush=True)
    try:
        return subprocess.run(cmd, timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"!! rlplane bench {bench.name}: no result after {timeout_s:.0f} s; stopped it", flush=True)
        return 124


def split_out(extra: list[str], out: str | None) -> tuple[str | None, list[str]]:
    """Take ``--out DIR`` / ``--out=DIR`` out of a benchmark's own flags; returns (out, the rest).

    Example:
        >>> split_out(["--quick", "--out", "build/bench"], "bench/results")
        ('build/bench', ['--quick'])
    """
    rest: list[str] = []
    it = iter(extra)
    for arg in it:
        if arg == "--out":
            out = next(it, out)
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return out, rest


def cli(args: argparse.Namespace) -> int:
    """Entry point for ``rlplane bench <which> [--out DIR] [flags of the benchmark]``.

    Reads ``args.which``, ``args.out`` (None: each benchmark's own ``out``) and ``args.bench_args``:
    the flags after the name, passed to that benchmark's ``main`` after the runner's own ``--json``,
    so the benchmark's parser checks them and a flag given there wins.
    """
    out_text, extra = split_out(list(getattr(args, "bench_args", None) or []), args.out)
    if args.which == "all":
        selected = list(BENCHMARKS.values())
    elif args.which in BENCHMARKS:
        selected = [BENCHMARKS[args.which]]
    else:
        names = ", ".join([*BENCHMARKS, "all"])
        print(f"rlplane bench: unknown benchmark {args.which!r}; choose one of {names}", file=sys.stderr)
        return 2
    if extra and len(selected) > 1:
        print(f"rlplane bench all: flags {extra} belong to one benchmark; name it", file=sys.stderr)
        return 2
    status = 0
    for bench in selected:
        if not is_built(bench):
            print(f"-- rlplane bench {bench.name}: {bench.module} is not built yet; skipped", flush=True)
            status = status if args.which == "all" else 2
            continue
        why = bench.why_not() if bench.why_not and args.which == "all" else None
        if why:
            print(f"-- rlplane bench {bench.name}: cannot run here ({why}); skipped", flush=True)
            continue
        rc = run_one(bench, pathlib.Path(out_text or bench.out), extra=extra)
        if rc:
            print(f"!! rlplane bench {bench.name} exited with status {rc}", flush=True)
        status = status or rc
    return status
