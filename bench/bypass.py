"""Controller-bypass benchmark: the classic driver-held batch against metadata-only dispatch via the store.

One process run, one Ray (logical ``num_cpus=8``), one embedded store. For each group size (default 2
and 4 CPU workers, ``use_gpu=False``, ``max_colocate_count=1``) and each batch size (default 256, 1024
and 4096 rows of a 512-token int64 prompt, a 512-token int64 response and 512 float32 log-probs, i.e.
10 KiB a row), the same worker step (``log_probs_x2 = old_log_probs * 2``) runs on two paths
(workers in ``bench._bypass_worker``):

* ``classic``: the driver holds the ``TensorDict``; a ``DP_COMPUTE_PROTO`` method receives its chunk
  (every field) and returns the new field; the controller concatenates the chunks in the driver.
  The controller sends each chunk as a compact copy, so every sample crosses once (a pickled view
  would carry the whole batch's storage to every rank).
* ``store``: the batch is written into the store once, untimed (a rollout would have produced it
  there); the method receives only a ``KVBatchMeta`` chunk, fetches that shard's rows (every field),
  computes the field, writes it back under the same keys and returns the updated meta; the
  controller concatenates metas.

Per call it records the driver's wall time (median and best of N after a warm-up; the paths are
interleaved so load from other work on the host hits them alike), the driver's bytes (pickled
size, protocol 5 with out-of-band buffers, of the per-rank arguments it sends plus the per-rank
results it receives; ``bench._driver_cost``) and its peak RSS growth during the call. Each path's
result is checked once per size (``out == 2 * old_log_probs``), untimed.

Usage::

    python -m bench.bypass                                   # default run (~2 min on 2 cores)
    python -m bench.bypass --sizes 64,256 --workers 2 --repeats 3 --json /tmp/bypass.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench._bypass_worker import IN_FIELDS, OUT, SOURCE, BypassWorker
from bench._driver_cost import peak_rss_growth, per_rank_bytes
from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

__all__ = ["PATHS", "format_table", "main", "make_batch", "measure_group", "parse_args"]

log = logging.getLogger(__name__)

PATHS = ("classic", "store")
PARTITION_PREFIX = "bench-bypass"


def make_batch(rows: int, seq: int, seed: int = 0) -> Any:
    """A rollout-like batch: int64 prompts and responses, float32 log-probs, each ``[rows, seq]``.

    Example:
        >>> make_batch(4, 8)["old_log_probs"].shape
        torch.Size([4, 8])
    """
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "prompts": torch.randint(0, 32000, (rows, seq), generator=gen),
            "responses": torch.randint(0, 32000, (rows, seq), generator=gen),
            "old_log_probs": -torch.rand(rows, seq, generator=gen),
        },
        batch_size=[rows],
    )


def _nbytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def _check(name: str, out: Any, batch: Any) -> None:
    """Raise unless ``out`` (a TensorDict, or a meta whose keys now hold ``OUT``) is 2 * the source."""
    import torch

    import dataplane as dp

    if name == "store":
        if out.fields is None or OUT not in out.fields or len(out) != len(batch):
            raise RuntimeError(f"store path: the returned meta lacks {OUT} or rows: {out!r}")
        out = dp.kv_batch_get(out.keys, out.partition_id, select_fields=[OUT])
    if not torch.equal(out[OUT], batch[SOURCE] * 2):
        raise RuntimeError(f"{name} path: {OUT} differs from 2 * {SOURCE}")


def _timed_rounds(calls: dict[str, Any], args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """``repeats`` rounds over every path (order rotated each round): times, RSS growths, last outputs."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    rss: dict[str, list[int]] = {name: [] for name in calls}
    outs: dict[str, Any] = {}
    names = list(calls)
    for i in range(args.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            grew, outs[name] = peak_rss_growth(calls[name])
            times[name].append(time.perf_counter() - start)
            if grew is not None:
                rss[name].append(grew)
    return times, rss, outs


def _measure_size(wg: Any, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every path on one batch size with one group; returns one row of the results."""
    import dataplane as dp

    batch = make_batch(rows, args.seq)
    partition = f"{PARTITION_PREFIX}-{wg.world_size}-{rows}"
    # Untimed: a rollout would have written it. Select the inputs so that repeats after the
    # write-back fetch the same fields.
    meta = dp.kv_batch_put([f"r{i}" for i in range(rows)], partition, batch).select_fields(IN_FIELDS)
    calls = {
        "classic": lambda: wg.classic_step(batch),
        "store": lambda: wg.store_step(meta),
    }
    try:
        for name, call in calls.items():
            _check(name, call(), batch)  # the first warm-up call
            for _ in range(args.warmup - 1):
                call()
        times, rss, outs = _timed_rounds(calls, args)
    finally:
        dp.clear_partition(partition)
    n = wg.world_size
    sent = {"classic": per_rank_bytes(batch, n), "store": per_rank_bytes(meta, n)}
    row: dict[str, Any] = {"workers": n, "rows": rows, "payload_bytes": _nbytes(batch)}
    for name in calls:
        recv = per_rank_bytes(outs[name], n)
        row[name] = {
            "median_s": statistics.median(times[name]),
            "best_s": min(times[name]),
            "seconds": [round(s, 6) for s in times[name]],
            "driver_sent_bytes": sent[name],
            "driver_recv_bytes": recv,
            "driver_bytes": sent[name] + recv,
            "driver_peak_rss_growth_bytes": max(rss[name]) if rss[name] else None,
        }
    classic, store = row["classic"], row["store"]
    row["classic_time_ratio"] = classic["median_s"] / store["median_s"]
    row["classic_best_time_ratio"] = classic["best_s"] / store["best_s"]
    row["classic_bytes_ratio"] = classic["driver_bytes"] / store["driver_bytes"]
    return row


def measure_group(n_workers: int, sizes: Sequence[int], store_name: str, args: argparse.Namespace) -> list:
    """Start one group of ``n_workers`` CPU workers, measure every batch size on it, tear it down."""
    pool = RayResourcePool([n_workers], use_gpu=False, max_colocate_count=1)
    wg = None
    try:
        wg = RayWorkerGroup(
            pool, RayClassWithInitArgs(BypassWorker, store_name), call_timeout_s=args.call_timeout_s
        )
        wg.attach_store()
        return [_measure_size(wg, rows, args) for rows in sizes]
    finally:
        if wg is not None:
            wg.kill()
        pool.remove()


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The results as a fixed-width text table: median ms, driver KiB and peak RSS growth per call."""
    head = (
        f"{'wk':>2} {'rows':>5} {'MiB':>5} | {'ms classic':>10} {'store':>6} {'cl/st':>5} | "
        f"{'KiB classic':>11} {'store':>6} {'cl/st':>5} | {'RSS+ MiB cl':>11} {'st':>4}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        c, s = r["classic"], r["store"]
        lines.append(
            f"{r['workers']:>2} {r['rows']:>5} {r['payload_bytes'] / 2**20:>5.1f} | "
            f"{c['median_s'] * 1e3:>10.1f} {s['median_s'] * 1e3:>6.1f} {r['classic_time_ratio']:>5.2f} | "
            f"{c['driver_bytes'] / 1024:>11.0f} {s['driver_bytes'] / 1024:>6.1f} "
            f"{r['classic_bytes_ratio']:>5.0f} | "
            f"{_mib(c['driver_peak_rss_growth_bytes']):>11} {_mib(s['driver_peak_rss_growth_bytes']):>4}"
        )
    return "\n".join(lines)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{flag} takes positive integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; the defaults are the documented default run."""
    parser = argparse.ArgumentParser(prog="rlplane bench bypass", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--sizes", default="256,1024,4096", help="batch sizes in rows (default 256,1024,4096)")
    add("--workers", default="2,4", help="group sizes (default 2,4)")
    add("--seq", type=int, default=512, help="tokens per prompt / response / log-probs row (default 512)")
    add("--repeats", type=int, default=5, help="timed calls per path and size (default 5)")
    add("--warmup", type=int, default=1, help="untimed calls per path first (>= 1; the first is checked)")
    add("--shards", type=int, default=None, help="store shards (default: one per Ray node)")
    add("--store-name", default="bench-bypass", help="name of the embedded store")
    add("--address", default=None, help="an existing Ray cluster (default: start a fresh local one)")
    add("--ray-num-cpus", type=int, default=8, help="logical CPUs of the Ray it starts (default 8)")
    add("--call-timeout-s", type=float, default=300.0, help="deadline of every group call")
    add("--json", dest="json_path", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        args.sizes = _int_list(args.sizes, "--sizes")
        args.workers = _int_list(args.workers, "--workers")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.warmup < 1 or args.seq < 1:
        parser.error(
            f"--repeats, --warmup and --seq must be >= 1, got {args.repeats}, {args.warmup}, {args.seq}"
        )
    return args


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start (or reuse) Ray and the store, measure every group size, stop what this run started."""
    import ray

    import dataplane as dp

    started_ray = not ray.is_initialized()
    if started_ray:
        # address="local": a fresh cluster, never one another process left running on this host
        address = args.address or "local"
        cpus = None if args.address else args.ray_num_cpus
        ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    had_store = dp.is_initialized()
    try:
        options: dict[str, Any] = {"name": args.store_name}
        if args.shards is not None:
            options["num_shards"] = args.shards
        info = dp.init(**options)
        store_name = info.extra.get("name", args.store_name)
        rows: list[dict[str, Any]] = []
        for n in args.workers:
            log.info("group of %d workers", n)
            rows.extend(measure_group(n, args.sizes, store_name, args))
        return rows
    finally:
        if not had_store:
            dp.close()
        if started_ray:
            ray.shutdown()


_METHOD = {
    "time": "driver wall time per group call; median and best of repeats; paths interleaved",
    "driver_bytes": "pickled size (protocol 5, out-of-band buffers incl.) of per-rank args + results",
    "driver_peak_rss_growth": "VmHWM in the call (reset by /proc/self/clear_refs) minus VmRSS before",
    "classic": "DP_COMPUTE_PROTO on the driver's TensorDict (the controller sends compact chunks)",
    "store": "DP_COMPUTE_PROTO on a KVBatchMeta; workers fetch by meta and write the field back",
    "ratios": "<path>_time_ratio = path median / store median; <path>_bytes_ratio = path / store bytes",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``); return 0."""
    from bench import _common

    args = parse_args(argv)
    started = time.perf_counter()
    rows = _run(args)
    print(format_table(rows), flush=True)
    payload = {
        "benchmark": "bypass",
        "config": {
            "sizes": args.sizes,
            "workers": args.workers,
            "seq": args.seq,
            "fields": {"prompts": "int64", "responses": "int64", "old_log_probs": "float32"},
            "repeats": args.repeats,
            "warmup": args.warmup,
            "shards": args.shards,
        },
        "method": _METHOD,
        "results": rows,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "machine": _common.machine_facts(),
    }
    if args.json_path:
        _common.write_json(args.json_path, payload)
        print(f"wrote {args.json_path}", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raise SystemExit(main())
