"""Streaming benchmark: ``next_batch`` against TransferQueue 0.1.11's ``get_meta``, same run.

Four figures, the first three for both systems:

1. **next_batch of 256 keys** from a partition holding ``--rows`` ready rows (100,000), next to
   ``--others`` other partitions of as many rows (10): p50 / p90 of ``--calls`` calls from the
   driver (each call takes the next 256 rows for one consumer task). TransferQueue:
   ``get_client().get_meta(fields, 256, pid, mode="fetch", task_name=...)`` on the same layout.
2. **Wake-up latency**: a consumer in another process waits for a batch of 1 row that is not ready;
   the driver puts the row; latency = the consumer's return time minus the moment the put returned
   (one host: one clock). TransferQueue has no wake-up: its loader polls ``get_meta`` every
   ``--tq-poll-s`` (1 s, its ``StreamingDataset`` default), which is what its consumer does here.
3. **Readiness updates**: ``--writers`` (4) writer processes each put ``--updates`` 1-key rows
   (``kv_put``) into one partition at the same time; rows per second over the slowest writer.
4. **Stuck groups** (this store only): 1-row put latency into a partition where 4 consumers wait
   with ``GroupSampler("uid", 4)`` for groups that never complete, with ``--stuck-rows`` (50,000)
   rows in incomplete groups against none: the index keeps complete groups indexed, so a commit
   costs the same however many rows wait in incomplete groups.

Usage::

    rlplane bench stream                                   # the full run, table + JSON
    python -m bench.stream --rows 20000 --others 2 --calls 50 --skip-tq --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import _common

log = logging.getLogger(__name__)

BATCH = 256
FIELD = "x"


def _fill(put_batch, pid: str, rows: int, chunk: int = 20_000) -> None:
    """``rows`` ready rows of one small field in ``pid``, written ``chunk`` keys per put."""
    import torch
    from tensordict import TensorDict

    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        keys = [f"{pid}-{i}" for i in range(start, start + n)]
        put_batch(keys, pid, TensorDict({FIELD: torch.arange(start, start + n)}, [n]))


def _next_batch_latency(take: Callable[[], int], calls: int) -> _common.Latency:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        got = take()
        samples.append(time.perf_counter() - t0)
        if got != BATCH:
            raise RuntimeError(f"a call returned {got} rows, not {BATCH}")
    return _common.latency(samples)


def _consumer_class(system: str, poll_s: float):
    import ray

    @ray.remote(num_cpus=0.1)
    class Consumer:
        def __init__(self) -> None:
            if system == "store":
                import dataplane as dp

                dp.init()
                self.dp = dp
            else:
                import transfer_queue as tq

                tq.init()
                self.client = tq.get_client()

        def wait_one(self, pid: str, task: str) -> float:
            """Block until one row of ``pid`` is ready for ``task``; the wall time it came back."""
            if system == "store":
                meta = self.dp.next_batch(pid, task, 1, [FIELD], timeout_s=60)
                assert meta.size == 1
                return time.time()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                meta = self.client.get_meta(
                    data_fields=[FIELD], batch_size=1, partition_id=pid, task_name=task
                )
                if meta.size:
                    return time.time()
                time.sleep(poll_s)
            raise TimeoutError("no row became ready in 60 s")

        def ready(self) -> bool:
            return True

    return Consumer


def _wakeup(
    system: str, put_one: Callable[[str, str, str], object], rounds: int, poll_s: float
) -> _common.Latency:
    import ray

    consumer = _consumer_class(system, poll_s).remote()
    ray.get(consumer.ready.remote(), timeout=120)
    samples = []
    try:
        for i in range(rounds):
            pid = f"wake-{system}-{i}"
            put_one(f"seed-{i}", pid, "seed")  # the partition exists; no row holds FIELD yet
            waiting = consumer.wait_one.remote(pid, "w")
            time.sleep(0.1)  # let the consumer start waiting (a benchmark, not a test: not measured)
            put_one(f"row-{i}", pid, FIELD)
            put_done = time.time()
            done = ray.get(waiting, timeout=70)
            samples.append(max(0.0, done - put_done))
    finally:
        ray.kill(consumer)
    return _common.latency(samples)


def _writer_class(system: str):
    import ray

    @ray.remote(num_cpus=0.1)
    class Writer:
        def __init__(self) -> None:
            if system == "store":
                import dataplane as dp

                dp.init()
                self.put = lambda k, pid, f: dp.kv_put(k, pid, f)
            else:
                import transfer_queue as tq

                tq.init()
                self.put = lambda k, pid, f: tq.kv_put(key=k, partition_id=pid, fields=f)

        def write(self, prefix: str, pid: str, n: int, start_at: float) -> tuple[float, float]:
            """Seconds the ``n`` puts took, and the CPU seconds this process spent on them."""
            import torch

            while time.time() < start_at:  # all writers start together
                time.sleep(0.001)
            t0, c0 = time.perf_counter(), _process_cpu()
            for i in range(n):
                self.put(f"{prefix}-{i}", pid, {FIELD: torch.tensor(i)})
            return time.perf_counter() - t0, _process_cpu() - c0

        def ready(self) -> bool:
            return True

    return Writer


def _process_cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread: zmq's I/O threads too) of a process (default: this one)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _updates(
    system: str, writers: int, per_writer: int, servers: dict[str, int] | None = None
) -> dict[str, Any]:
    """Rows per second of ``writers`` processes putting 1-key rows, and the CPU each side spent per row
    (``servers``: name -> pid of the store's own processes, measured around the run)."""
    import ray

    cls = _writer_class(system)
    actors = [cls.remote() for _ in range(writers)]
    ray.get([a.ready.remote() for a in actors], timeout=120)
    servers = servers or {}
    try:
        start_at = time.time() + 1.0
        pid = f"updates-{system}"
        before = {name: _process_cpu(p) for name, p in servers.items()}
        load = os.getloadavg()[0]
        runs = ray.get(
            [a.write.remote(f"w{i}", pid, per_writer, start_at) for i, a in enumerate(actors)], timeout=600
        )
        after = {name: _process_cpu(p) for name, p in servers.items()}
    finally:
        for a in actors:
            ray.kill(a)
    total = writers * per_writer
    secs = max(r[0] for r in runs)
    cpu_us = {"writers": sum(r[1] for r in runs) / total * 1e6}
    cpu_us.update({name: (after[name] - before[name]) / total * 1e6 for name in servers})
    return {
        "rows": total,
        "seconds": secs,
        "rows_per_s": total / secs,
        "cpu_us_per_row": cpu_us,
        "load_avg_1m_at_start": load,
    }


def _group_waiter_class():
    import ray

    @ray.remote(num_cpus=0.1)
    class GroupWaiter:
        """A consumer waiting for whole groups of 4 that never complete (until the partition finishes)."""

        def __init__(self) -> None:
            import dataplane as dp

            dp.init()
            self.dp = dp

        def wait(self, pid: str, task: str) -> int:
            sampler = self.dp.GroupSampler("uid", 4)
            return self.dp.next_batch(pid, task, 4, [FIELD], sampler=sampler, timeout_s=600).size

        def ready(self) -> bool:
            return True

    return GroupWaiter


def _stuck_groups(stuck: int, puts: int) -> dict[str, Any]:
    """1-row put latency into a partition where 4 ``GroupSampler`` consumers wait for groups of 4 that
    never complete, with ``stuck`` ready rows in incomplete groups (pairs) and with none."""
    import ray
    import torch
    from tensordict import TensorDict

    import dataplane as dp

    waiters = [_group_waiter_class().remote() for _ in range(4)]
    ray.get([w.ready.remote() for w in waiters], timeout=120)
    out: dict[str, Any] = {"stuck_rows": stuck, "waiters": len(waiters)}
    try:
        for label, rows in (("empty", 0), ("stuck", stuck)):
            pid = f"groups-{label}"
            dp.kv_put("seed", pid, {FIELD: torch.tensor(0)}, tag={"uid": "seed"})
            for start in range(0, rows, 10_000):
                n = min(10_000, rows - start)
                keys = [f"s-{i}" for i in range(start, start + n)]
                tags = [{"uid": f"g{i // 2}"} for i in range(start, start + n)]  # pairs: never 4
                dp.kv_batch_put(keys, pid, TensorDict({FIELD: torch.zeros(n, dtype=torch.int64)}, [n]), tags)
            waiting = [w.wait.remote(pid, f"t{i}") for i, w in enumerate(waiters)]
            while any(dp.consumption(pid, f"t{i}")["fields"] != [FIELD] for i in range(len(waiters))):
                time.sleep(0.01)  # (a benchmark, not a test: the waiters park, then puts are timed)
            samples = []
            for i in range(puts):
                t0 = time.perf_counter()
                dp.kv_put(f"p-{i}", pid, {FIELD: torch.tensor(i)}, tag={"uid": f"lone-{i}"})
                samples.append(time.perf_counter() - t0)
            dp.finish_partition(pid)  # the waiters get an empty batch and return
            ray.get(waiting, timeout=120)
            out[label] = _common.latency(samples)
            dp.clear_partition(pid)
    finally:
        for w in waiters:
            ray.kill(w)
    out["ratio"] = out["stuck"]["p50_us"] / out["empty"]["p50_us"]
    return out


def _server_pids() -> dict[str, int]:
    """The embedded store's index and shard processes (same host), for CPU accounting."""
    from dataplane import api

    registry = api.current_client().registry
    pids = {"index": registry["index"]["pid"]}
    pids.update({f"shard{i}": s["pid"] for i, s in enumerate(registry["shards"])})
    return pids


def run_store(cfg: argparse.Namespace) -> dict[str, Any]:
    import torch

    import dataplane as dp

    dp.init()
    try:
        pids = [f"big-{i}" for i in range(cfg.others + 1)]
        t0 = time.perf_counter()
        for pid in pids:
            _fill(dp.kv_batch_put, pid, cfg.rows)
        fill_s = time.perf_counter() - t0
        target = pids[0]
        take = lambda: dp.next_batch(target, "bench", BATCH, [FIELD], timeout_s=10).size  # noqa: E731
        take()  # registers the task's stream (one scan of the partition), untimed
        out: dict[str, Any] = {"fill_s": fill_s, "next_batch": _next_batch_latency(take, cfg.calls)}
        for pid in pids:
            dp.clear_partition(pid)
        out["wakeup"] = _wakeup(
            "store", lambda k, pid, f: dp.kv_put(k, pid, {f: torch.tensor(0)}), cfg.wakeups, cfg.tq_poll_s
        )
        out["updates"] = _updates("store", cfg.writers, cfg.updates, _server_pids())
        out["groups"] = _stuck_groups(cfg.stuck_rows, cfg.group_puts)
        return out
    finally:
        dp.close()


def run_tq(cfg: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"controller": {"polling_mode": True}}))
    try:
        client = tq.get_client()
        pids = [f"big-{i}" for i in range(cfg.others + 1)]
        t0 = time.perf_counter()
        for pid in pids:
            _fill(lambda k, p, td: tq.kv_batch_put(keys=k, partition_id=p, fields=td), pid, cfg.rows)
        fill_s = time.perf_counter() - t0
        target = pids[0]

        def take() -> int:
            meta = client.get_meta(
                data_fields=[FIELD], batch_size=BATCH, partition_id=target, task_name="bench"
            )
            return meta.size

        take()
        out: dict[str, Any] = {"fill_s": fill_s, "next_batch": _next_batch_latency(take, cfg.calls)}
        for pid in pids:
            client.clear_partition(pid)
        out["wakeup"] = _wakeup(
            "tq",
            lambda k, pid, f: tq.kv_put(key=k, partition_id=pid, fields={f: torch.tensor(0)}),
            cfg.tq_wakeups,
            cfg.tq_poll_s,
        )
        out["updates"] = _updates("tq", cfg.writers, cfg.updates)
        return out
    finally:
        tq.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlplane bench stream", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000, help="ready rows in the partition read from")
    p.add_argument("--others", type=int, default=10, help="other partitions of as many rows")
    p.add_argument("--calls", type=int, default=200, help="timed next_batch / get_meta calls of 256 keys")
    p.add_argument("--wakeups", type=int, default=30, help="wake-up latency samples (this store)")
    p.add_argument("--tq-wakeups", type=int, default=5, help="wake-up samples for TransferQueue (1 s each)")
    p.add_argument("--tq-poll-s", type=float, default=1.0, help="TransferQueue consumer's poll interval")
    p.add_argument("--writers", type=int, default=4, help="concurrent writer processes")
    p.add_argument("--updates", type=int, default=1500, help="1-key puts per writer")
    p.add_argument("--stuck-rows", type=int, default=50_000, help="rows stuck in incomplete groups")
    p.add_argument(
        "--group-puts", type=int, default=300, help="timed 1-row puts beside waiting group samplers"
    )
    p.add_argument("--skip-tq", action="store_true", help="do not run TransferQueue")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    return p.parse_args(argv)


def _row(name: str, res: dict[str, Any] | None) -> str:
    if res is None:
        return f"{name:<22} skipped"
    nb, wk, up = res["next_batch"], res["wakeup"], res["updates"]
    return (
        f"{name:<22} {nb['p50_us'] / 1e3:>10.2f} {nb['p90_us'] / 1e3:>10.2f} "
        f"{wk['p50_us'] / 1e3:>12.2f} {wk['p90_us'] / 1e3:>12.2f} {up['rows_per_s']:>12.0f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)  # before importing Ray: `--help` answers at once
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    results: dict[str, Any] = {"store": None, "tq": None, "skipped": {}}
    try:
        results["store"] = run_store(cfg)
        skipped = _common.why_not_tq(cfg.skip_tq)
        if skipped:
            results["skipped"]["tq"] = skipped
        else:
            results["tq"] = run_tq(cfg)
    finally:
        ray.shutdown()
    store, tq = results["store"], results["tq"]
    checks = [
        _common.Check(
            "next_batch_p50_ms", store["next_batch"]["p50_us"] / 1e3, 2.0, "<=", "next_batch of 256, p50 ms"
        ),
        _common.Check(
            "next_batch_vs_tq",
            None if tq is None else _common.ratio(tq["next_batch"]["p50_us"], store["next_batch"]["p50_us"]),
            5.0,
            ">=",
            "TQ get_meta p50 / next_batch p50",
        ),
        _common.Check(
            "wakeup_p50_ms", store["wakeup"]["p50_us"] / 1e3, 5.0, "<=", "put returned -> consumer returned"
        ),
        _common.Check(
            "updates_per_s", store["updates"]["rows_per_s"], 5000.0, ">=", "1-key rows/s, 4 writers"
        ),
        _common.Check(
            "stuck_groups_ratio",
            store["groups"]["ratio"],
            2.0,
            "<=",
            f"1-row put p50, {cfg.stuck_rows} stuck rows / none (4 GroupSampler waiters)",
        ),
    ]
    print(
        f"stream bench: {cfg.rows} ready rows (+{cfg.others} partitions of as many), batches of {BATCH}, "
        f"{cfg.writers} writers x {cfg.updates} 1-key puts"
    )
    print(
        f"{'system':<22} {'next p50 ms':>10} {'next p90 ms':>10} {'wake p50 ms':>12} {'wake p90 ms':>12} "
        f"{'updates/s':>12}"
    )
    print(_row("dataplane", store))
    print(_row("TransferQueue 0.1.11", tq))
    updates = store["updates"]
    print(
        "dataplane readiness updates, CPU per row (us): "
        + ", ".join(f"{name} {us:.0f}" for name, us in updates["cpu_us_per_row"].items())
        + f" (writers: all {cfg.writers} together; load average {updates['load_avg_1m_at_start']:.2f})"
    )
    groups = store["groups"]
    print(
        f"1-row put beside 4 waiting GroupSampler consumers: p50 {groups['empty']['p50_us']:.0f} us with no "
        f"stuck rows, {groups['stuck']['p50_us']:.0f} us with {groups['stuck_rows']} rows stuck"
    )
    return _common.report_checks(checks, results, cfg, cfg.json)


if __name__ == "__main__":
    raise SystemExit(main())
