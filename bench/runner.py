"""Runs the benchmarks in ``bench/`` by name: ``rlplane bench store|dispatch|bypass|all [--out DIR]``.

Each benchmark is a module in ``bench`` exposing ``main(argv: list[str] | None) -> int``. The runner
starts each one in a child Python process (a fresh Ray per benchmark, and one benchmark's crash or
leftover global state cannot touch the next) and passes it ``--json <out>/<name>.json`` plus any
extra flags in its :class:`Benchmark` entry. ``all`` runs every registered benchmark in order and
skips, with a message, those whose module is not built yet.

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
from dataclasses import dataclass

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
        Benchmark("bypass", "bench.bypass", "driver-held batches vs metadata-only dispatch via the store"),
        Benchmark("stream", "bench.stream", "next_batch, wake-up and readiness updates vs TransferQueue"),
    )
}


def is_built(bench: Benchmark) -> bool:
    """Whether the benchmark's module exists (``all`` skips those that do not)."""
    return importlib.util.find_spec(bench.module) is not None


def run_one(bench: Benchmark, out: pathlib.Path, timeout_s: float = BENCH_TIMEOUT_S) -> int:
    """Run ``bench`` in a child process, streaming its output; return its exit status."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _CHILD, bench.module, *bench.argv(out)]
    print(f"== rlplane bench {bench.name}: {bench.description}", flush=True)
    try:
        return subprocess.run(cmd, timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"!! rlplane bench {bench.name}: no result after {timeout_s:.0f} s; stopped it", flush=True)
        return 124


def cli(args: argparse.Namespace) -> int:
    """Entry point for ``rlplane bench <which> [--out DIR]`` (``args.which``, ``args.out``)."""
    out = pathlib.Path(args.out)
    if args.which == "all":
        selected = list(BENCHMARKS.values())
    elif args.which in BENCHMARKS:
        selected = [BENCHMARKS[args.which]]
    else:
        names = ", ".join([*BENCHMARKS, "all"])
        print(f"rlplane bench: unknown benchmark {args.which!r}; choose one of {names}", file=sys.stderr)
        return 2
    status = 0
    for bench in selected:
        if not is_built(bench):
            print(f"-- rlplane bench {bench.name}: {bench.module} is not built yet; skipped", flush=True)
            status = status if args.which == "all" else 2
            continue
        rc = run_one(bench, out)
        if rc:
            print(f"!! rlplane bench {bench.name} exited with status {rc}", flush=True)
        status = status or rc
    return status
