"""Index benchmark: one partition of a million small rows, and what the index does to everyone else.

One run, one fresh local Ray, one store (``--shards`` 1). Figures:

1. **The big partition**: ``--rows`` (1,000,000; ``--quick`` 200,000) rows of one int64 column, no
   tags, put by the driver with ``kv_batch_put`` in batches of ``--put-batch`` (10,000): keys/s;
   then taken by one consumer with ``next_batch`` in batches of ``--take-batch`` (1,000): rows/s;
   then ``kv_list`` of the partition (seconds, and the listing's size as msgpack, about the reply's
   bytes); then ``dp.save_checkpoint`` of the store into a temporary directory (seconds; the
   checkpoint is removed after); then ``clear_partition`` (seconds). For each: the index's CPU
   seconds (its process, every thread, from ``/proc``, in ticks of 10 ms), per key where that means
   something. Index memory: the
   RSS of its process before and after the puts (and after the clear); bytes per key = growth / rows.
2. **The probe**: another process (a Ray actor) that every ``--probe-ms`` (20 ms) puts 1 row in a
   partition of its own, takes it with a 1-row ``next_batch`` and asks ``dp.consumption``; each call
   timed. p50 / p99 / max per call, per phase: idle (``--idle-s`` before the big partition: the
   reference), puts, streaming, listing, saving, clearing, and all five together ("busy"). Each sample
   belongs to the phase in which it started (phases are marked by the driver's wall clock; one host).
3. **Many clients**: ``--clients`` (16; ``--quick`` 8) processes, each with a consumer task of its
   own, loop for ``--client-s`` seconds (10; ``--quick`` 5) over a 1-key put, a 1-row ``next_batch``
   and a get of the row it took, all in one partition: calls/s per call over all clients, p50 / p99
   / max per call, and the index's CPU per loop.

Targets (for the work on the index): index bytes per key <= 200; the probe's calls during the big
partition's phases at p99 <= 10 ms and max <= 50 ms; index-side put commits >= 300k keys/s (keys per
CPU-second of the index during the puts; the wall rate is printed next to it); ``next_batch`` >= 500k
rows/s. Like every benchmark here, the exit status is 1 when a target is missed.

Usage::

    rlplane bench index                                    # the full run, table + JSON
    rlplane bench index --quick                            # 200k rows, 8 clients (< 3 minutes on 2 cores)
    python -m bench.index --rows 20000 --clients 2 --client-s 1 --json /tmp/i.json
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench import _common

log = logging.getLogger(__name__)

STORE = "bench-index"  # a store of its own: the run clears partitions and reads its index's process
BIG = "big"
PROBE = "probe"
MANY = "many"
FIELD = "x"
PHASES = ("puts", "streaming", "listing", "saving", "clearing")  # the big partition's; "busy": all
PROBE_OPS = ("put", "next_batch", "consumption")
CLIENT_OPS = ("put", "next_batch", "get")
CALL_TIMEOUT_S = 60.0  # every blocking call and every ray.get has a deadline
QUICK = {"rows": 200_000, "clients": 8, "client_s": 5.0, "idle_s": 3.0}
DEFAULTS = {"rows": 1_000_000, "clients": 16, "client_s": 10.0, "idle_s": 5.0}


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 / max of latencies (seconds) in milliseconds, and their count (None-filled if none).

    Example:
        >>> summary([0.001, 0.002, 0.003])["max_ms"]
        3.0
    """
    if not samples:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "n": 0}
    return {
        "p50_ms": _common.percentile(samples, 50) * 1e3,
        "p99_ms": _common.percentile(samples, 99) * 1e3,
        "max_ms": max(samples) * 1e3,
        "n": len(samples),
    }


def split_phases(
    samples: Sequence[tuple[float, dict[str, float]]], marks: dict[str, tuple[float, float]]
) -> dict[str, dict[str, Any]]:
    """Each probe sample ``(start wall time, {op: seconds})`` goes to the phase in which it started;
    returns ``{phase: {op: summary}}`` for every phase in ``marks`` and "busy" (the big partition's
    phases together).

    Example:
        >>> marks = {"idle": (0.0, 1.0), "puts": (1.0, 2.0)}
        >>> split_phases([(0.5, {"put": 0.001}), (1.5, {"put": 0.004})], marks)["busy"]["put"]["n"]
        1
    """
    out: dict[str, dict[str, Any]] = {}
    busy = [p for p in PHASES if p in marks]
    groups = {**{name: [name] for name in marks}, "busy": busy}
    for name, members in groups.items():
        spans = [marks[m] for m in members]
        chosen = [ops for t, ops in samples if any(a <= t < b for a, b in spans)]
        ops = sorted({op for s in chosen for op in s} | set(PROBE_OPS))
        out[name] = {op: summary([s[op] for s in chosen if op in s]) for op in ops}
    return out


class _Index:
    """The index's process (same host): CPU seconds over every thread, and RSS."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.pid = pid
        self.proc = psutil.Process(pid)

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)


# ---- the probe -------------------------------------------------------------------------------------


def _probe_class() -> Any:
    import ray

    # Two threads: run() loops in one, started() and stop() answer in the other.
    @ray.remote(num_cpus=0.1, max_concurrency=2)
    class Probe:
        def __init__(self) -> None:
            self.stopping = threading.Event()
            self.warm = threading.Event()

        def run(self, store: str, interval_s: float, warmup: int, max_s: float) -> dict[str, Any]:
            """Every ``interval_s``: 1-row put, 1-row next_batch of it, consumption; each timed.
            Returns the samples ``(wall time at the tick's start, {op: seconds})`` and the errors."""
            import torch

            import dataplane as dp

            dp.init(name=store, attach_only=True)  # in this thread: the only one that uses the client
            samples: list[tuple[float, dict[str, float]]] = []
            errors: list[str] = []
            deadline = time.monotonic() + max_s  # the loop ends even if stop() never comes
            tick = time.perf_counter()
            i = 0
            while not self.stopping.is_set() and time.monotonic() < deadline:
                start, times = time.time(), {}
                try:
                    t0 = time.perf_counter()
                    dp.kv_put(f"p{i}", PROBE, {FIELD: torch.tensor(i)})
                    t1 = time.perf_counter()
                    got = dp.next_batch(PROBE, PROBE, 1, [FIELD], timeout_s=CALL_TIMEOUT_S)
                    t2 = time.perf_counter()
                    dp.consumption(PROBE, PROBE)
                    t3 = time.perf_counter()
                    if got.size != 1:
                        raise RuntimeError(f"next_batch returned {got.size} rows, not 1")
                    times = {"put": t1 - t0, "next_batch": t2 - t1, "consumption": t3 - t2}
                except Exception as exc:  # counted and shown: a probe that fails says so, the run goes on
                    errors.append(f"{type(exc).__name__}: {exc}")
                i += 1
                if i == warmup:
                    self.warm.set()  # imports and connections done: from here on, samples count
                elif i > warmup and times:
                    samples.append((start, times))
                # Fixed rate: the next tick 20 ms after this one's, at once when late (no bursts).
                tick += interval_s
                delay = tick - time.perf_counter()
                if delay > 0:
                    self.stopping.wait(delay)
                else:
                    tick = time.perf_counter()
            dp.close()
            return {"samples": samples, "errors": errors, "ticks": i}

        def started(self, timeout_s: float) -> bool:
            return self.warm.wait(timeout_s)

        def stop(self) -> None:
            self.stopping.set()

    return Probe


# ---- the big partition -----------------------------------------------------------------------------


def _put_all(dp: Any, keys: list[str], batch: int) -> None:
    import torch
    from tensordict import TensorDict

    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        n = len(part)
        dp.kv_batch_put(part, BIG, TensorDict({FIELD: torch.arange(start, start + n)}, [n]))


def _warm(dp: Any) -> None:
    """Each call of the big partition's once, untimed: the first put imports the codec (seconds)."""
    import torch
    from tensordict import TensorDict

    dp.kv_batch_put(["w0"], "warm", TensorDict({FIELD: torch.arange(1)}, [1]))
    dp.next_batch("warm", "consumer", 1, [FIELD], timeout_s=CALL_TIMEOUT_S)
    dp.kv_list("warm")
    dp.clear_partition("warm")


def _take_all(dp: Any, rows: int, batch: int) -> dict[str, Any]:
    taken, calls, first_s = 0, 0, None
    while taken < rows:
        t0 = time.perf_counter()
        meta = dp.next_batch(BIG, "consumer", batch, [FIELD], timeout_s=CALL_TIMEOUT_S)
        if first_s is None:
            first_s = time.perf_counter() - t0  # this task's first call also registers its stream
        if meta.size == 0:
            raise RuntimeError(f"next_batch returned no rows after {taken} of {rows}")
        taken += meta.size
        calls += 1
    return {"calls": calls, "first_call_s": first_s}


def run_big(cfg: argparse.Namespace, dp: Any, index: _Index, marks: dict[str, tuple[float, float]]) -> dict:
    """The big partition's phases, each marked in ``marks`` (wall clock) for the probe."""
    import msgspec

    keys = [f"k{i}" for i in range(cfg.rows)]  # made before the clock starts
    out: dict[str, Any] = {"rows": cfg.rows}
    rss_before = index.rss()

    def phase(name: str, fn: Any) -> Any:
        cpu0, w0, t0 = index.cpu(), time.time(), time.perf_counter()
        res = fn()
        secs, w1, cpu = time.perf_counter() - t0, time.time(), index.cpu() - cpu0
        marks[name] = (w0, w1)
        out[name] = {"seconds": secs, "index_cpu_s": cpu}
        return res

    phase("puts", lambda: _put_all(dp, keys, cfg.put_batch))
    rss_after = index.rss()
    took = phase("streaming", lambda: _take_all(dp, cfg.rows, cfg.take_batch))
    listing = phase("listing", lambda: dp.kv_list(BIG))
    where = tempfile.mkdtemp(prefix="rlplane-bench-index-")
    try:
        saved = phase("saving", lambda: dp.save_checkpoint(os.path.join(where, "ckpt")))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out["saving"]["keys"] = saved.partitions.get(BIG, 0)  # (the probe's partitions are saved too)
    phase("clearing", lambda: dp.clear_partition(BIG))
    rss_cleared = index.rss()
    listed = len(listing.get(BIG, {}))
    if listed != cfg.rows:
        raise RuntimeError(f"kv_list listed {listed} keys of {cfg.rows}")
    puts, stream = out["puts"], out["streaming"]
    puts["keys_per_s"] = cfg.rows / puts["seconds"]
    puts["index_cpu_us_per_key"] = puts["index_cpu_s"] / cfg.rows * 1e6
    puts["index_keys_per_cpu_s"] = _common.ratio(cfg.rows, puts["index_cpu_s"])
    stream.update(took)
    stream["rows_per_s"] = cfg.rows / stream["seconds"]
    stream["index_cpu_us_per_row"] = stream["index_cpu_s"] / cfg.rows * 1e6
    out["listing"]["keys"] = listed
    out["listing"]["reply_bytes"] = len(msgspec.msgpack.encode(listing))  # after the clock: not timed
    out["index_rss"] = {
        "before": rss_before,
        "after_puts": rss_after,
        "after_clear": rss_cleared,
        "bytes_per_key": (rss_after - rss_before) / cfg.rows,
    }
    return out


# ---- many clients ----------------------------------------------------------------------------------


def _client_class() -> Any:
    import ray

    @ray.remote(num_cpus=0.1)
    class Client:
        def __init__(self, store: str) -> None:
            import dataplane as dp

            dp.init(name=store, attach_only=True)
            self.dp = dp

        def warm(self, name: str) -> bool:
            """One loop untimed in a partition of its own: imports and connections before the clock."""
            self._loop_once(f"warm-{name}", name, "warm")
            self.dp.clear_partition(f"warm-{name}")
            return True

        def _loop_once(self, pid: str, task: str, key: str) -> tuple[float, float, float]:
            import torch

            dp = self.dp
            t0 = time.perf_counter()
            dp.kv_put(key, pid, {FIELD: torch.tensor(1)})
            t1 = time.perf_counter()
            meta = dp.next_batch(pid, task, 1, [FIELD], timeout_s=CALL_TIMEOUT_S)
            t2 = time.perf_counter()
            if meta.size != 1:
                raise RuntimeError(f"next_batch returned {meta.size} rows, not 1")
            dp.kv_batch_get(meta.keys, pid)
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        def loop(self, name: str, start_at: float, seconds: float) -> dict[str, Any]:
            """From wall time ``start_at``, loops for ``seconds``: the latencies per call."""
            time.sleep(max(0.0, start_at - time.time()))  # every client starts at once
            lat: dict[str, list[float]] = {op: [] for op in CLIENT_OPS}
            t0 = time.perf_counter()
            i = 0
            while time.perf_counter() - t0 < seconds:
                for op, s in zip(CLIENT_OPS, self._loop_once(MANY, name, f"{name}-{i}"), strict=True):
                    lat[op].append(s)
                i += 1
            return {"latencies": lat, "seconds": time.perf_counter() - t0}

        def close(self) -> None:
            self.dp.close()

    return Client


def run_clients(cfg: argparse.Namespace, dp: Any, index: _Index) -> dict[str, Any]:
    import ray

    cls = _client_class()
    clients = [cls.remote(STORE) for _ in range(cfg.clients)]
    try:
        t0 = time.perf_counter()
        ray.get([c.warm.remote(f"c{i}") for i, c in enumerate(clients)], timeout=600)
        start_s = time.perf_counter() - t0
        start_at = time.time() + 1.0
        time.sleep(max(0.0, start_at - time.time()))  # index CPU from the clients' start (they wait too)
        cpu0, load = index.cpu(), os.getloadavg()[0]
        runs = ray.get(
            [c.loop.remote(f"c{i}", start_at, cfg.client_s) for i, c in enumerate(clients)],
            timeout=cfg.client_s + 300,
        )
        cpu = index.cpu() - cpu0
        ray.get([c.close.remote() for c in clients], timeout=CALL_TIMEOUT_S)
    finally:
        for c in clients:
            ray.kill(c)
    dp.clear_partition(MANY)
    window = max(r["seconds"] for r in runs)
    loops = sum(len(r["latencies"]["put"]) for r in runs)
    ops: dict[str, Any] = {}
    for op in CLIENT_OPS:
        samples = [s for r in runs for s in r["latencies"][op]]
        ops[op] = {**summary(samples), "calls_per_s": len(samples) / window}
    return {
        "clients": cfg.clients,
        "seconds": window,
        "loops": loops,
        "ops": ops,
        "index_cpu_s": cpu,
        "index_cpu_us_per_loop": _common.ratio(cpu * 1e6, loops),
        "start_s": start_s,
        "load_avg_1m_at_start": load,
    }


# ---- the run ---------------------------------------------------------------------------------------


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    import ray

    import dataplane as dp

    dp.init(name=STORE, num_shards=cfg.shards)
    probe = None
    try:
        index = _Index(int(dp.current_client().registry["index"]["pid"]))
        print(
            f"store {STORE!r}: index pid {index.pid} (py-spy record -p {index.pid} profiles it)", flush=True
        )
        _warm(dp)
        probe = _probe_class().remote()
        probing = probe.run.remote(STORE, cfg.probe_ms / 1e3, 5, 3600.0)
        # Warm within 300 s, or the run ended early (its error is raised here).
        started = probe.started.remote(300.0)
        done, _ = ray.wait([started, probing], num_returns=1, timeout=310)
        if probing in done or not done or not ray.get(started):
            ray.get(probing, timeout=1)
            raise RuntimeError("the probe did not start within 300 s")
        marks: dict[str, tuple[float, float]] = {}
        w0, cpu0 = time.time(), index.cpu()
        time.sleep(cfg.idle_s)  # the idle baseline: the probe alone
        marks["idle"] = (w0, time.time())
        idle_cpu = index.cpu() - cpu0
        try:
            big = run_big(cfg, dp, index, marks)
        finally:
            probe.stop.remote()
            probed = ray.get(probing, timeout=CALL_TIMEOUT_S + 30)
        ticks = len([s for s in probed["samples"] if marks["idle"][0] <= s[0] < marks["idle"][1]])
        big["idle"] = {
            "seconds": marks["idle"][1] - marks["idle"][0],
            "index_cpu_s": idle_cpu,
            "index_cpu_us_per_tick": _common.ratio(idle_cpu * 1e6, ticks),
        }
        out = {
            "index_pid": index.pid,
            "big": big,
            "probe": {
                "interval_ms": cfg.probe_ms,
                "phases": split_phases(probed["samples"], marks),
                "errors": len(probed["errors"]),
                "first_errors": probed["errors"][:5],
            },
        }
        out["clients"] = run_clients(cfg, dp, index) if cfg.clients else None
        return out
    finally:
        if probe is not None:
            ray.kill(probe)
        dp.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rlplane bench index",
        description=__doc__.splitlines()[0],
        epilog="Exit status 1 when a target is missed (as every benchmark in bench/ does), 0 when all pass.",
    )
    p.add_argument("--quick", action="store_true", help="200,000 rows, 8 clients for 5 s (< 3 minutes)")
    p.add_argument("--rows", type=int, default=None, help="rows of the big partition (default 1,000,000)")
    p.add_argument("--put-batch", type=int, default=10_000, help="keys per kv_batch_put")
    p.add_argument("--take-batch", type=int, default=1_000, help="rows per next_batch")
    p.add_argument("--probe-ms", type=float, default=20.0, help="the probe's period, ms")
    p.add_argument("--idle-s", type=float, default=None, help="the probe's idle baseline, s (default 5)")
    p.add_argument("--clients", type=int, default=None, help="many-clients processes (default 16; 0: skip)")
    p.add_argument("--client-s", type=float, default=None, help="seconds the clients loop (default 10)")
    p.add_argument("--shards", type=int, default=1, help="store shards")
    p.add_argument("--address", default="local", help="the Ray to run on (default: a new local one)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    cfg = p.parse_args(argv)
    for name, value in (QUICK if cfg.quick else DEFAULTS).items():
        if getattr(cfg, name) is None:  # a flag given wins over --quick
            setattr(cfg, name, value)
    if cfg.rows < 1 or cfg.put_batch < 1 or cfg.take_batch < 1 or cfg.shards < 1 or cfg.clients < 0:
        p.error("--rows, --put-batch, --take-batch and --shards must be >= 1, --clients >= 0")
    if cfg.probe_ms <= 0 or cfg.idle_s <= 0 or cfg.client_s <= 0:
        p.error("--probe-ms, --idle-s and --client-s must be > 0")
    return cfg


def _ms(v: float | None) -> str:
    return _common.fmt(v, ".2f")


def _print(cfg: argparse.Namespace, res: dict[str, Any]) -> None:
    big, probe = res["big"], res["probe"]
    mib = 2**20
    rss, stream = big["index_rss"], big["streaming"]
    print(
        f"index bench: {cfg.rows:,} rows of one int64 in one partition (puts of {cfg.put_batch:,}, "
        f"next_batch of {cfg.take_batch:,}), {cfg.shards} shard(s); probe every {cfg.probe_ms:g} ms"
    )
    print(f"{'phase':<10} {'seconds':>8} {'rate':>20} {'index CPU s':>12} {'index CPU us/key':>17}")
    rows = (
        ("puts", f"{big['puts']['keys_per_s']:,.0f} keys/s", big["puts"].get("index_cpu_us_per_key")),
        ("streaming", f"{stream['rows_per_s']:,.0f} rows/s", stream["index_cpu_us_per_row"]),
        ("listing", f"{big['listing']['reply_bytes'] / mib:,.1f} MiB reply", None),
        ("saving", f"{big['saving']['keys']:,} keys", None),
        ("clearing", "", None),
    )  # fmt: skip
    for name, rate, per in rows:
        ph = big[name]
        print(
            f"{name:<10} {ph['seconds']:>8.3f} {rate:>20} {ph['index_cpu_s']:>12.2f} {_common.fmt(per):>17}"
        )
    print(
        f"index RSS: {rss['before'] / mib:.0f} MiB before the puts, {rss['after_puts'] / mib:.0f} MiB after, "
        f"{rss['after_clear'] / mib:.0f} MiB after the clear: {rss['bytes_per_key']:.0f} bytes per key; "
        f"first next_batch {stream['first_call_s'] * 1e3:.1f} ms of {stream['calls']} calls"
    )
    print(
        f"index-side puts: {_common.fmt(big['puts']['index_keys_per_cpu_s'], ',.0f')} keys per index "
        f"CPU-second; idle, index CPU per probe tick (its own timers included): "
        f"{_common.fmt(big['idle']['index_cpu_us_per_tick'], '.0f')} us"
    )
    print(f"\nprobe, ms: p50 / p99 / max ({probe['errors']} errors)")
    print(f"{'phase':<10} {'n':>5} " + " ".join(f"{op:>24}" for op in PROBE_OPS))
    for phase, ops in probe["phases"].items():
        cells = [
            f"{_ms(ops[o]['p50_ms'])} / {_ms(ops[o]['p99_ms'])} / {_ms(ops[o]['max_ms'])}" for o in PROBE_OPS
        ]
        print(f"{phase:<10} {ops['put']['n']:>5} " + " ".join(f"{c:>24}" for c in cells))
    cl = res["clients"]
    if cl:
        print(
            f"\n{cl['clients']} clients x {cl['seconds']:.1f} s, each: 1-key put, 1-row next_batch "
            f"(own task), get; index CPU {_common.fmt(cl['index_cpu_us_per_loop'], '.0f')} us per loop "
            f"(load average {cl['load_avg_1m_at_start']:.2f}; clients started in {cl['start_s']:.1f} s)"
        )
        print(f"{'call':<12} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for op, s in cl["ops"].items():
            print(
                f"{op:<12} {s['calls_per_s']:>9.0f} "
                + " ".join(f"{_ms(s[k]):>8}" for k in ("p50_ms", "p99_ms", "max_ms"))
            )
    if probe["first_errors"]:
        print("probe errors: " + "; ".join(probe["first_errors"]))


def checks(res: dict[str, Any]) -> list[_common.Check]:
    """The targets of the index work, with this run's values."""
    big, busy = res["big"], res["probe"]["phases"]["busy"]
    out = [
        _common.Check(
            "index_bytes_per_key",
            big["index_rss"]["bytes_per_key"],
            200,
            "<=",
            "index RSS growth / keys, no tags",
        ),
    ]
    for op, short in zip(PROBE_OPS, ("put", "next", "cons"), strict=True):
        what = f"the probe's 1-row {op} beside the big partition's phases"
        out.append(_common.Check(f"probe_{short}_p99_ms", busy[op]["p99_ms"], 10, "<=", what + ", p99"))
        out.append(_common.Check(f"probe_{short}_max_ms", busy[op]["max_ms"], 50, "<=", what + ", max"))
    out += [
        _common.Check(
            "put_commits_per_s",
            big["puts"]["index_keys_per_cpu_s"],
            300_000,
            ">=",
            f"keys per index CPU-second, puts of 10k (wall: {big['puts']['keys_per_s']:,.0f} keys/s)",
        ),
        _common.Check(
            "next_batch_rows_per_s", big["streaming"]["rows_per_s"], 500_000, ">=",
            "one consumer, batches of 1k",
        ),
    ]  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)  # before importing Ray: `--help` answers at once
    import ray

    t0 = time.perf_counter()
    opts = {"num_cpus": max(8, cfg.clients + 2), "include_dashboard": False} if cfg.address == "local" else {}
    with _common.ray_for_run(
        lambda: ray.init(address=cfg.address, log_to_driver=False, logging_level="ERROR", **opts)
    ):
        results = run(cfg)
    results["wall_s"] = time.perf_counter() - t0
    _print(cfg, results)
    print(f"wall time {results['wall_s']:.1f} s, Ray start included")
    return _common.report_checks(checks(results), results, cfg, cfg.json)


if __name__ == "__main__":
    raise SystemExit(main())
