"""Store throughput benchmark: this store against memcpy, Ray's object store and TransferQueue 0.1.11.

One process run, one fresh Ray (logical ``num_cpus=8``), the same payload for every path (default
1024 rows x 8192 float32 x 2 fields = 64 MiB). For each path the driver writes the whole batch and a
reader actor (``bench._reader.Reader``, one per path) fetches all of it; the get is timed from the
driver around ``ray.get(reader.read_*.remote(...))``, so it includes one actor call.

Paths (``bench._paths``):

1. ``memcpy``: ``dst.copy_(src)`` per field into preallocated tensors (the physical limit).
2. ``ray``: driver ``ray.put(td)``; the actor does ``ray.get(ref)`` (torch tensors arrive unpickled in
   the actor's private memory).
3. ``tq``: TransferQueue 0.1.11, default SimpleStorage (2 units): driver ``tq.kv_batch_put``; the actor
   ``tq.kv_batch_get`` (dense fields come back as jagged nested tensors); ``tq.kv_clear`` after each.
4. ``store``: ``dataplane`` embedded (``dp.init()``): driver ``dp.kv_batch_put``; the actor
   ``dp.kv_batch_get`` (copy-out default); ``dp.kv_clear`` after each. Then, in rounds of their own,
   ``copy=False`` view reads when the API has them.

All paths are started first; then one warm-up round and N timed rounds, each round visiting every
path in turn (interleaved, so load from other work on the host hits all paths alike). Throughput is
best of N and median; ratios use best of N on both sides. Single-key latency (one key, 2 fields of
64 float32): p50/p90 of ``kv_put`` and ``kv_batch_get`` from the driver, against bare
``ray.get(actor.noop.remote(x))`` and ``ray.get(actor.noop.remote())`` calls measured right before
with the same path's reader (the checks divide by the faster ``noop()``). Memory (store
only, before any round): the shards' ``dp.stats()`` accounting and what the OS shows for the shard
processes (``bench._memory``), empty, holding the payload, and after clear.

Usage::

    python -m bench.store_throughput                      # the full 64 MiB run, prints the table
    python -m bench.store_throughput --rows 8 --cols 16 --repeats 1 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from bench import _common, _report
from bench._harness import Config, make_payload, make_small_row
from bench._paths import PATHS, BenchPath
from bench._reader import summarize_fields

__all__ = ["Config", "main", "parse_args", "run"]

log = logging.getLogger(__name__)


def _interleaved_rounds(cfg: Config, live: list[BenchPath], results: dict[str, Any]) -> None:
    """``warmup + repeats`` rounds over every live path; a path that fails leaves the rotation."""
    timings: dict[str, dict[str, list[float]]] = {p.name: {} for p in live}
    for i in range(cfg.warmup + cfg.repeats):
        for path in list(live):
            try:
                seconds = path.round()
            except Exception as exc:  # one broken path must not hide the others' figures
                log.exception("path %s failed in round %d", path.name, i)
                results["paths"][path.name]["error"] = f"round {i}: {type(exc).__name__}: {exc}"
                live.remove(path)
                continue
            if i >= cfg.warmup:
                for op, s in seconds.items():
                    timings[path.name].setdefault(op, []).append(s)
    for path in live:
        for op, secs in timings[path.name].items():
            results["paths"][path.name][op] = _common.throughput(cfg.payload_bytes, secs)


def _guarded(results: dict[str, Any], path: BenchPath, step: str, live: list[BenchPath]) -> None:
    """Run ``path.start`` or ``path.finish``, merging its facts; on failure record it and drop the path."""
    start = time.perf_counter()
    try:
        results["paths"][path.name].update(getattr(path, step)())
    except Exception as exc:
        log.exception("path %s failed in %s", path.name, step)
        results["paths"][path.name]["error"] = f"{step}: {type(exc).__name__}: {exc}"
        if path in live:
            live.remove(path)
    results["paths"][path.name][f"{step}_wall_s"] = round(time.perf_counter() - start, 2)


def _run_paths(cfg: Config, paths: list[BenchPath], results: dict[str, Any]) -> None:
    """start all -> interleaved rounds -> finish all; every path is closed at the end."""
    live: list[BenchPath] = []
    try:
        for path in paths:
            results["paths"][path.name] = {}
            live.append(path)
            _guarded(results, path, "start", live)
        _interleaved_rounds(cfg, live, results)
        for path in list(live):
            _guarded(results, path, "finish", live)
    finally:
        for path in reversed(paths):
            try:
                path.close()
            except Exception:  # teardown trouble must not hide the figures
                log.exception("closing path %s failed", path.name)


def _store_available() -> str | None:
    """None when ``dataplane`` offers what the benchmark calls, else why not."""
    try:
        import dataplane as dp
    except Exception as exc:  # an import error in a half-built package is a "not available"
        return f"import dataplane failed: {exc}"
    missing = [
        n
        for n in ("init", "close", "kv_put", "kv_batch_put", "kv_batch_get", "kv_clear", "stats")
        if not hasattr(dp, n)
    ]
    return f"store not available yet: dataplane lacks {', '.join(missing)}" if missing else None


def _tq_available() -> str | None:
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        return "transferqueue is not installed (pip install -e '.[bench]')"
    return None


def _join_ray(cfg: Config, temp_dir: str) -> None:
    """Connect to ``cfg.ray_address``, or start a fresh local Ray in ``temp_dir``.

    A fresh Ray gets its own temp dir, so other Ray sessions on the host (sharing /tmp/ray) cannot
    disturb it, and it is removed afterwards.
    """
    import ray

    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=False)
        return
    ray.init(
        address="local",
        num_cpus=cfg.ray_num_cpus,
        include_dashboard=False,
        object_store_memory=max(512 * 2**20, 4 * cfg.payload_bytes),
        log_to_driver=False,
        _temp_dir=temp_dir,
    )


def run(cfg: Config) -> dict[str, Any]:
    """Run every path and return the results dict (also what ``--json`` writes). The Ray is a fresh
    local one, or ``--ray-address``, or the one this process has joined already (kept joined)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    results: dict[str, Any] = {
        "benchmark": "store_throughput",
        "config": {
            **asdict(cfg),
            "payload_bytes": cfg.payload_bytes,
            "dtype": "float32",
            "statistic": f"best of {cfg.repeats} after {cfg.warmup} warm-up (median also given)",
        },
        "machine": _common.machine_facts(),
        "paths": {},
        "skipped": {},
    }
    td = make_payload(cfg)
    expected = summarize_fields(td)
    small = make_small_row()
    wanted = set(cfg.paths.split(","))
    reasons = {
        "tq": "--skip-tq given" if cfg.skip_tq else _tq_available(),
        "store": "--skip-store given" if cfg.skip_store else _store_available(),
    }
    paths = []
    for name, cls in PATHS.items():
        reason = "not in --paths" if name not in wanted else reasons.get(name)
        if reason:
            results["skipped"][name] = reason
        else:
            paths.append(cls(cfg, td, expected, small))
    temp_dir = tempfile.mkdtemp(prefix="rlb-", dir="/tmp")  # short: Ray puts unix sockets under it
    try:
        with _common.ray_for_run(lambda: _join_ray(cfg, temp_dir)):
            _run_paths(cfg, paths, results)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    results["checks"], results["info"] = _report.evaluate(results)
    return results


def parse_args(argv: list[str] | None) -> Config:
    """CLI flags -> :class:`Config`."""
    d = Config()
    p = argparse.ArgumentParser(prog="python -m bench.store_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=d.rows, help="rows (keys) in the batch")
    p.add_argument("--cols", type=int, default=d.cols, help="float32 values per row per field")
    p.add_argument("--fields", type=int, default=d.fields, help="number of fields (columns)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed repeats per path (after warm-up)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed warm-up repeats")
    p.add_argument("--latency-iters", type=int, default=d.latency_iters, help="timed single-key calls")
    p.add_argument("--latency-warmup", type=int, default=d.latency_warmup)
    p.add_argument("--paths", default=d.paths, help="comma-separated subset of memcpy,ray,tq,store")
    p.add_argument("--skip-tq", action="store_true", help="do not run the TransferQueue path")
    p.add_argument("--skip-store", action="store_true", help="do not run this store's path")
    p.add_argument("--ray-address", default=None, help="use this Ray cluster instead of a fresh local one")
    p.add_argument("--call-timeout-s", type=float, default=d.call_timeout_s, help="deadline per actor call")
    p.add_argument(
        "--release-wait-s",
        type=float,
        default=d.release_wait_s,
        help="how long to wait for the store to give memory back after clear",
    )
    p.add_argument(
        "--store-transport",
        default=d.store_transport,
        choices=["auto", "shm", "zmq", "tcp"],
        help="this store's data path for the driver and the reader (tcp: frames over tcp, as across nodes)",
    )
    p.add_argument(
        "--encrypt", action="store_true", help="start the store with encrypt=True (CURVE on its tcp sockets)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a GB/s bar chart (PNG) here")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the tables as Markdown here")
    ns = p.parse_args(argv)
    unknown = set(ns.paths.split(",")) - set(Config.paths.split(","))
    if unknown:
        p.error(f"--paths: unknown path(s) {sorted(unknown)}; choose from {Config.paths}")
    for name in ("rows", "cols", "fields", "repeats", "latency_iters"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    return Config(**vars(ns))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON/plot if asked. Exit 0 unless a path errored."""
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # TransferQueue warns on every put that 8 torch threads exceed 2 cores; that is noise here.
    # Its loggers read this variable (its actors inherit it through the Ray we start).
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
    results = run(cfg)
    print(_report.render(results))
    if cfg.json:
        print(f"\nJSON: {_common.write_json(cfg.json, results)}")
    if cfg.plot:
        print(f"plot: {_report.plot(results, cfg.plot)}")
    if cfg.markdown:
        pathlib.Path(cfg.markdown).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(cfg.markdown).write_text(_report.markdown(results))
        print(f"markdown: {cfg.markdown}")
    errors = [name for name, res in results["paths"].items() if "error" in res]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
