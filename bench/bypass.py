"""Controller-bypass benchmark: how close metadata-only dispatch through the store gets to the compute floor.

A step is a rollout-like producer stage (``--producers`` workers make the step's rows) followed by a
consumer stage (``--workers`` workers compute one new float32 field from them). The paths differ
only in how the rows travel from one stage to the next (``bench._bypass_worker`` has the workers,
``bench._bypass_paths`` the driver's side):

* ``floor``: no data movement at all; each consumer makes its rows itself. The compute alone.
* ``classic``: producers return the batch to the driver, which dispatches ``DP_COMPUTE_PROTO``
  chunks by value and concatenates the results (verl without a data plane).
* ``store``: producers write to the store; the driver dispatches ``KVBatchMeta`` only, through
  ``@register``; workers fetch their rows and write the field back; the driver clears the keys.
* ``tq``: the same through TransferQueue 0.1.11's KV API (skipped, with a note, without the
  ``bench`` extra).
* ``pyzmq`` (with ``--transport zmq``, or when the workers span nodes): the store path's wire
  bytes sent over one bare pyzmq tcp stream, the limit of the store's zmq transport.

Every round visits every path (order rotated per round), so load bursts hit all alike. The first
round is a warm-up whose output is checked exactly against the expected values (and every consumer
spot-checks the rows it receives on every step). Per point (payload x workers) and path: median and
best step seconds, the overhead over the floor (``step_s - floor step_s``), the bytes through the
driver (sent and received: pickled size of what the controller dispatches and collects, plus the
driver's own clear), the driver's peak RSS growth during a step and, for the store, the bytes
through the store per step.

Usage::

    rlplane bench bypass --quick                                  # 64 MiB, 2 workers, < 1 minute
    rlplane bench bypass --payload 64MiB,256MiB,1GiB --workers 2,4,8,16
    rlplane bench bypass --address auto --strategy spread         # on your Ray cluster
    rlplane bench bypass --quick --testbed 3                      # across 3 hosts built here (root)
    rlplane bench bypass --transport zmq                          # the cross-node path, on one host

From Python (``examples/``)::

    from bench import bypass
    records = bypass.run(payloads=[256 * 2**20], workers=[4], progress=False)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import _bypass_report as report
from bench import _common
from bench._bypass_data import BypassCheckError

__all__ = [
    "PATHS",
    "QUICK",
    "BypassCheckError",
    "BypassConfig",
    "format_size",
    "main",
    "parse_args",
    "parse_size",
    "run",
    "run_report",
]

log = logging.getLogger(__name__)

MiB, GiB = 2**20, 2**30
PATHS = ("floor", "classic", "store", "tq")
TRANSPORTS = ("auto", "shm", "zmq")
STRATEGIES = ("spread", "pack")
DEFAULT_JSON = "build/bench/bypass.json"
# --quick: one small point, few steps; about half a minute on a 2-core machine, Ray start included.
QUICK = {"payloads": (64 * MiB,), "workers": (2,), "producers": 1, "steps": 3}


@dataclass
class BypassConfig:
    """What one run measures; every field has a CLI flag (``payloads`` is ``--payload``).

    Attributes:
        payloads: bytes per step (every field of every row); one point per payload and group size.
        workers: consumer group sizes.
        rows: rows per step; the row size follows from the payload (unless ``row_bytes`` is set).
        row_bytes: bytes per row; then ``rows = payload // row_bytes``.
        producers: producer workers (each makes ``rows / producers`` rows per step).
        steps: timed rounds per point (each round runs one step of every path).
        warmup: untimed rounds first (>= 1; the first one's output is checked exactly).
        paths: which of ``PATHS`` to run (``tq`` is skipped with a note without transferqueue).
        transport: the store's data path: ``auto`` (shared memory on one host), ``shm``, or ``zmq``
            (tcp frames, what a worker on another node gets; adds the raw ``pyzmq`` reference).
        address: an existing Ray cluster (``auto`` or ``HOST:PORT``); None or ``local`` starts a
            local Ray. Ignored when this process has initialised Ray already.
        strategy: ``spread`` workers over the cluster's nodes, or ``pack`` them.
        raw_zmq: measure the raw pyzmq reference; None: when ``transport`` is ``zmq`` or the Ray
            cluster has more than one node.
        warm_idle_s: how long the store this run starts keeps freed segments mapped for reuse
            (``StoreConfig.warm_idle_s``). 60 s: longer than a round, so that the slower paths
            run in between do not make the store's segments go cold, as running its steps back to
            back would not. None: the store's default (2 s), with which, at 256 MiB and more, each
            put maps fresh pages (bench/RESULTS.md, 2026-12-02, has both figures). A store the run attaches to
            keeps its own setting.
    """

    payloads: tuple[int, ...] = (64 * MiB, 256 * MiB, 1 * GiB)
    workers: tuple[int, ...] = (2, 4)
    rows: int = 1024
    row_bytes: int | None = None
    producers: int = 2
    steps: int = 5
    warmup: int = 1
    paths: tuple[str, ...] = PATHS
    transport: str = "auto"
    address: str | None = None
    strategy: str = "spread"
    raw_zmq: bool | None = None
    shards: int | None = None
    warm_idle_s: float | None = 60.0
    store_name: str = "bench-bypass"
    ray_num_cpus: int | None = None
    call_timeout_s: float = 600.0
    progress: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and its valid range."""
        if not self.payloads or min(self.payloads) < 1:
            raise ValueError(f"payloads must be positive byte counts, got {self.payloads}")
        if not self.workers or min(self.workers) < 1 or self.producers < 1:
            raise ValueError(f"workers and producers must be >= 1, got {self.workers} and {self.producers}")
        if self.warm_idle_s is not None and self.warm_idle_s < 0:
            raise ValueError(f"warm_idle_s must be >= 0 seconds, got {self.warm_idle_s}")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError(f"steps and warmup must be >= 1, got {self.steps} and {self.warmup}")
        if unknown := sorted(set(self.paths) - set(PATHS)):
            raise ValueError(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: choose from {', '.join(TRANSPORTS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        if self.address is not None:
            from dataplane.service.connect import parse_address

            parse_address(self.address)  # raises ValueError naming the forms that work
        for payload in self.payloads:
            rows = self.rows_for(payload)
            for n in (*self.workers, self.producers):
                if rows < n or rows % n:
                    raise ValueError(
                        f"{format_size(payload)} makes {rows} rows, which do not split evenly over {n} "
                        "workers; change --rows / --row-bytes or the worker counts"
                    )

    def rows_for(self, payload: int) -> int:
        return payload // self.row_bytes if self.row_bytes else self.rows

    def row_bytes_for(self, payload: int) -> int:
        return self.row_bytes or payload // self.rows


def run_report(config: BypassConfig | None = None, **options: Any) -> report.Report:
    """Run the benchmark; return its records with the run's facts (config, machine, notes, checks).

    Args:
        config: the settings (default ``BypassConfig()``); ``options`` override its fields.

    Raises:
        ValueError: a bad setting (``BypassConfig.validate``).
        BypassCheckError: a path delivered wrong data.
    """
    from bench._bypass_session import Session, measure_point  # Ray, torch: not needed for `--help`

    cfg = dataclasses.replace(config or BypassConfig(), **options)
    cfg.validate()
    started = time.perf_counter()
    machine = _common.machine_facts()  # the load average before the run is the one that matters
    records: list[dict[str, Any]] = []
    with Session(cfg) as session, report.Progress(cfg, session.paths) as progress:
        for n in cfg.workers:
            with session.consumers(n) as consumers:
                for payload in cfg.payloads:
                    point = measure_point(session, consumers, payload, progress)
                    records.extend(point)
                    progress.point_done(point)
    elapsed = time.perf_counter() - started
    return report.Report(records, cfg, session.notes, elapsed, machine, setup_s=session.setup_s)


def run(config: BypassConfig | None = None, **options: Any) -> list[dict[str, Any]]:
    """Run the benchmark and return its records (one per path and point), as written to the JSON.

    Each record has ``path``, ``payload_bytes``, ``workers``, ``step_s``, ``best_s``, ``overhead_s``,
    ``driver_bytes`` (``driver_sent_bytes`` + ``driver_recv_bytes``), ``driver_peak_rss`` and more
    (``bench/README.md`` lists them). Starts a local Ray unless Ray is initialised or ``address``
    is given; stops only what it started.

    Example:
        >>> records = run(payloads=[64 * 2**20], workers=[2], steps=3, progress=False)
        >>> sorted({r["path"] for r in records})
        ['classic', 'floor', 'store', 'tq']
    """
    return run_report(config, **options).records


# ---------------------------------------------------------------------------- command line

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB}  # fmt: skip


def parse_size(text: str) -> int:
    """``"64MiB"``, ``"1GiB"``, ``"512k"``, ``"1000000"`` -> bytes (binary units unless ``kB``/``MB``/``GB``).

    Example:
        >>> parse_size("256MiB"), parse_size("1.5k")
        (268435456, 1536)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 64MiB, 1GiB, 512KiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """Bytes as the shortest exact binary unit: ``format_size(2**30) == "1GiB"``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _list(text: str, flag: str, parse: Any) -> tuple:
    try:
        values = tuple(parse(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{flag}: {exc}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{flag} takes positive values, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> tuple[BypassConfig, argparse.Namespace]:
    """The command line as a ``BypassConfig`` plus the output options (``json``, ``plot``)."""
    parser = argparse.ArgumentParser(prog="rlplane bench bypass", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="64MiB, 2 workers, 1 producer, 3 steps (< 1 minute)")
    add("--payload", default=None, help="bytes per step, comma-separated (default 64MiB,256MiB,1GiB)")
    add("--workers", default=None, help="consumer group sizes, comma-separated (default 2,4)")
    add("--rows", type=int, default=None, help="rows per step (default 1024; row size = payload / rows)")
    add("--row-bytes", default=None, help="bytes per row instead (rows = payload / row size)")
    add("--producers", type=int, default=None, help="producer workers (default 2)")
    add("--steps", type=int, default=None, help="timed steps per path and point (default 5)")
    add("--warmup", type=int, default=None, help="untimed steps first (>= 1; the first is checked)")
    add("--paths", default=None, help=f"paths to run (default {','.join(PATHS)})")
    add("--transport", choices=TRANSPORTS, default=None, help="the store's data path (zmq: tcp frames)")
    add("--address", default=None, help="Ray: auto (the running cluster), HOST:PORT or local (default)")
    add("--strategy", choices=STRATEGIES, default=None, help="spread workers over nodes, or pack them")
    add("--raw-zmq", choices=("auto", "on", "off"), default="auto", help="the raw pyzmq reference")
    add("--shards", type=int, default=None, help="store shards (default: one per Ray node)")
    add("--warm-idle-s", default=None,
        help="seconds the store keeps freed segments mapped (default 60; 'store': its own, 2 s)")  # fmt: skip
    add("--store-name", default=None, help="name of the store the run starts or attaches to")
    add("--ray-num-cpus", type=int, default=None, help="logical CPUs of a local Ray (default: enough)")
    add("--call-timeout-s", type=float, default=None, help="deadline of every group call (default 600)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--testbed", type=int, default=None, help="build a bed of N hosts here (root), run across them")
    add("--json", default=DEFAULT_JSON, help=f"records file (default {DEFAULT_JSON}; '' for none)")
    add("--plot", default=None, help="PNG chart (default: next to --json; '' for none)")
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    try:
        if args.payload is not None:
            values["payloads"] = _list(args.payload, "--payload", parse_size)
        if args.workers is not None:
            values["workers"] = _list(args.workers, "--workers", int)
        if args.row_bytes is not None:
            values["row_bytes"] = parse_size(args.row_bytes)
        if args.paths is not None:
            values["paths"] = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    for name in ("rows", "producers", "steps", "warmup", "transport", "address", "strategy", "shards",
                 "store_name", "ray_num_cpus", "call_timeout_s"):  # fmt: skip
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.warm_idle_s is not None:
        try:
            values["warm_idle_s"] = None if args.warm_idle_s == "store" else float(args.warm_idle_s)
        except ValueError:
            parser.error(f"--warm-idle-s takes seconds or 'store', got {args.warm_idle_s!r}")
    values["raw_zmq"] = {"auto": None, "on": True, "off": False}[args.raw_zmq]
    values["progress"] = not args.no_progress and sys.stderr.isatty()
    cfg = BypassConfig(**values)
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    if args.plot is None:
        args.plot = str(pathlib.Path(args.json).with_suffix(".png")) if args.json else ""
    return cfg, args


def main(argv: Sequence[str] | None = None) -> int:
    """Run from the command line: print the table, write the JSON and the PNG; return 0."""
    cfg, args = parse_args(argv)
    if args.testbed:
        from bench import _bypass_bed

        rest = list(sys.argv[1:] if argv is None else argv)
        at = next(i for i, a in enumerate(rest) if a.startswith("--testbed"))
        del rest[at : at + (1 if "=" in rest[at] else 2)]
        return _bypass_bed.run(args.testbed, rest, args.json, args.plot)
    result = run_report(cfg)
    print(report.render(result), flush=True)
    if args.json:
        for path in report.write_json(result, args.json):
            print(f"wrote {path}", flush=True)
    if args.plot:
        written = report.plot(result.records, args.plot)
        print(f"wrote {written}" if written else f"no chart: {report.plot_unavailable()}", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    raise SystemExit(main())
