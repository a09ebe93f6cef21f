"""Shared helpers for the benchmarks: timing statistics, GB/s, verdicts, machine facts, JSON.

Conventions used by every benchmark in ``bench/``:

- A *GB* is 10**9 bytes, so GB/s figures compare directly with ``dd``/``iperf`` style numbers.
- Throughput is summarised as *best of N* (the fastest repeat, the least disturbed by other work on
  a shared 2-core machine) and the *median* is recorded next to it; ratios use best-of on both sides.
- Latency is summarised as p50 and p90 of N single calls, after a warm-up.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import pathlib
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, TypedDict, TypeVar

GB = 10**9
T = TypeVar("T")


class Throughput(TypedDict):
    """Repeated transfers of one size, as ``throughput`` summarises them."""

    best_gbps: float
    median_gbps: float
    best_s: float
    median_s: float
    n: int
    seconds: list[float]


class Latency(TypedDict):
    """Single-call latencies, as ``latency`` summarises them (microseconds)."""

    p50_us: float
    p90_us: float
    min_us: float
    n: int


_REPORTED_DISTRIBUTIONS = ("torch", "ray", "tensordict", "numpy", "pyzmq", "transferqueue", "rlplane")


@contextlib.contextmanager
def ray_for_run(join: Callable[[], object]) -> Iterator[bool]:
    """Ray for one benchmark run; yields whether the run joined it (and so shuts it down at the end).

    A process that has joined Ray already (a notebook, the test suite) runs the benchmark on that Ray
    and keeps it joined; only otherwise is ``join()`` called (joining ``--address``, or starting a
    local Ray), and Ray shut down when the run ends.

    Example::

        with ray_for_run(lambda: ray.init(address=cfg.address, log_to_driver=False)):
            results = run_paths(cfg)
    """
    import ray

    if ray.is_initialized():
        yield False
        return
    join()
    try:
        yield True
    finally:
        ray.shutdown()


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn()`` once and return ``(seconds, result)`` measured with ``time.perf_counter``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def throughput(nbytes: int, seconds: Sequence[float]) -> Throughput:
    """Summarise repeated transfers of ``nbytes`` as GB/s: best of N and median, plus the raw times.

    Example:
        >>> throughput(2 * 10**9, [1.0, 2.0, 4.0])["best_gbps"]
        2.0
    """
    if not seconds:
        raise ValueError("throughput() needs at least one timing")
    best = max(min(seconds), 1e-9)  # a sub-nanosecond timing is a clock artefact, not a speed
    median = max(statistics.median(seconds), 1e-9)
    return {
        "best_gbps": nbytes / best / GB,
        "median_gbps": nbytes / median / GB,
        "best_s": best,
        "median_s": median,
        "n": len(seconds),
        "seconds": [round(s, 9) for s in seconds],
    }


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``samples`` with linear interpolation."""
    if not samples:
        raise ValueError("percentile() needs at least one sample")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency(samples: Sequence[float]) -> Latency:
    """Summarise single-call latencies (seconds) as p50 / p90 / min in microseconds."""
    return {
        "p50_us": percentile(samples, 50) * 1e6,
        "p90_us": percentile(samples, 90) * 1e6,
        "min_us": min(samples) * 1e6,
        "n": len(samples),
    }


def measure_latency(fn: Callable[[], object], n: int, warmup: int) -> Latency:
    """Call ``fn`` ``warmup`` times untimed, then ``n`` times timed; return :func:`latency` of those."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return latency(samples)


@dataclass
class Check:
    """One target of the spec: ``value`` compared against ``target`` with ``op`` (">=" or "<=")."""

    name: str
    value: float | None
    target: float
    op: str
    what: str

    @property
    def verdict(self) -> str:
        """``PASS``, ``MISS``, or ``n/a`` when the value could not be measured."""
        if self.value is None:
            return "n/a"
        ok = self.value >= self.target if self.op == ">=" else self.value <= self.target
        return "PASS" if ok else "MISS"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either side is missing or the denominator is zero."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict[str, Any]:
    """Where and when a benchmark ran: host, cores, memory, Python and the versions that matter."""
    import psutil

    return {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        # Other work on the host skews every figure; the load at the start says how much.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in _REPORTED_DISTRIBUTIONS},
    }


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> pathlib.Path:
    """Write ``payload`` as indented JSON, creating parent folders; return the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return out


def why_not_tq(skip: bool) -> str | None:
    """Why TransferQueue is not run beside the store (``--skip-tq``, or not installed); None to run it."""
    if skip:
        return "--skip-tq"
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        return "transferqueue is not installed (pip install -e '.[bench]')"
    return None


def report_checks(checks: list[Check], results: dict[str, Any], config: Any, json_path: str | None) -> int:
    """Print the checks' table, add them, ``config`` and the machine's facts to ``results``, write it as
    JSON to ``json_path`` (if any); the exit status: 1 if a check missed its target, else 0."""
    print(f"\n{'check':<22} {'value':>10} {'target':>9}  verdict  what")
    for c in checks:
        print(f"{c.name:<22} {fmt(c.value):>10} {c.op} {c.target:<6}  {c.verdict:<7}  {c.what}")
    results["checks"] = [c.as_dict() for c in checks]
    results["config"] = vars(config)
    results["machine"] = machine_facts()
    if json_path:
        print(f"JSON: {write_json(json_path, results)}")
    return 0 if all(c.verdict != "MISS" for c in checks) else 1


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    """Format a possibly-missing number for a table cell."""
    return "-" if value is None else f"{value:{spec}}{unit}"
