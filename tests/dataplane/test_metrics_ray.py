"""The store's metrics reach Prometheus through Ray's own pipeline, by the exact amounts.

One Ray cluster of its own (in a subprocess, ``_metrics_cluster.py``: the session's cluster is
untouched) with its metrics export port; traffic of known size through a store; the metrics agent's
Prometheus endpoint scraped over HTTP and parsed. Every assertion about the exported values is here,
on that one cluster: starting one costs some 15 s on the 2-core machine.
"""

from __future__ import annotations

import json
import os

import pytest

from dataplane.client.sharding import HashPlacement
from dataplane.telemetry.catalog import exported_names
from tests.forkserver import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M = {"store": "m"}


def _expected() -> list[list]:
    get_requests = len(HashPlacement(2).group("p1", [f"a{i}" for i in range(9)])) + 1  # + the failed get
    rows = [
        # clients: 5 puts of 15 rows (16 bytes each), a get of 9 rows and one of a missing key, 4 takes
        # of 11 rows and one that timed out, a clear of 1 key
        ("client_rows_total", {**M, "op": "put"}, 15),
        ("client_bytes_total", {**M, "op": "put"}, 240),
        ("client_rows_total", {**M, "op": "get"}, 9),
        ("client_bytes_total", {**M, "op": "get"}, 144),
        ("client_rows_total", {**M, "op": "next_batch"}, 11),
        ("client_rows_total", {**M, "op": "clear"}, 1),
        ("client_op_seconds_count", {**M, "op": "put"}, 5),
        ("client_op_seconds_count", {**M, "op": "get"}, 2),
        ("client_op_seconds_count", {**M, "op": "next_batch"}, 5),
        ("client_op_seconds_count", {**M, "op": "clear"}, 1),
        ("client_errors_total", {**M, "op": "get", "error": "KeyNotFoundError"}, 1),
        ("client_errors_total", {**M, "op": "next_batch", "error": "BatchTimeoutError"}, 1),
        # a store whose shard died: found dead once, its get failed
        ("peers_dead_total", {"store": "victim", "peer": "victim-shard-0"}, 1),
        ("client_errors_total", {"store": "victim", "op": "get", "error": "ShardUnavailableError"}, 1),
        # shards (summed over both)
        ("shard_rows_total", {**M, "op": "put"}, 15),
        ("shard_bytes_total", {**M, "op": "put"}, 240),
        ("shard_rows_total", {**M, "op": "get"}, 9),
        ("shard_rows_total", {**M, "op": "clear"}, 1),
        ("shard_bytes_total", {**M, "op": "clear"}, 16),
        ("shard_reservations_expired_total", M, 0),
        ("shard_op_seconds_count", {**M, "op": "get"}, get_requests),
        ("shard_capacity_bytes", {**M, "state": "used"}, 224),
        ("shard_capacity_bytes", {**M, "state": "reserved"}, 0),
        ("shard_rows_held", M, 14),
        ("shard_partition_rows", M, 14),
        ("shard_partition_bytes", M, 224),
        # the index: metrics_partitions=2, so p1 and p2 by rows, p3 (2) and p4 (0, cleared) as other
        ("index_rows_taken_total", M, 11),
        ("index_op_seconds_count", {**M, "op": "next"}, 5),
        ("index_wait_seconds_count", {**M, "op": "next"}, 4),
        ("index_partitions", {**M, "state": "open"}, 3),
        ("index_partitions", {**M, "state": "finished"}, 1),
        ("index_partition_rows", {**M, "partition": "p1"}, 9),
        ("index_partition_rows", {**M, "partition": "p2"}, 3),
        ("index_partition_rows", {**M, "partition": "other"}, 2),
        ("index_refused_total", {**M, "reason": "auth"}, 2),
        ("index_refused_total", {**M, "reason": "protocol_version"}, 1),
        ("index_refused_total", {**M, "reason": "malformed"}, 3),
        # consumer tasks: the two furthest behind by name, the third (p3/acked, all leased) as other
        ("consumer_ready_rows", {**M, "partition": "p2", "task": "train"}, 2),
        ("consumer_ready_rows", {**M, "partition": "p1", "task": "reward"}, 1),
        ("consumer_taken_rows", {**M, "partition": "p1", "task": "reward"}, 8),
        ("consumer_taken_rows", {**M, "partition": "p2", "task": "train"}, 1),
        ("consumer_taken_rows", {**M, "partition": "other", "task": "other"}, 2),
        ("consumer_leased_rows", {**M, "partition": "other", "task": "other"}, 2),
    ]
    return [["ray_dataplane_" + name, labels, float(value)] for name, labels, value in rows]


@pytest.mark.slow
def test_metrics_reach_prometheus_by_the_exact_amounts(tmp_path, fork_server) -> None:
    expected = _expected()
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(expected))
    # The driver is forked by the session's server (it has imported what the driver imports); the Ray
    # it starts is its own, as it would be without the server.
    proc = run_python(["-m", "tests.dataplane._metrics_cluster", str(path)], timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = [(exp, seen) for exp, seen in zip(expected, report["seen"], strict=True) if exp != seen]
    assert not wrong, "\n".join(f"expected {e[0]}{e[1]} = {e[2]}, scraped {s[2]}" for e, s in wrong)
    # the label sets are bounded: 2 partitions of their own, the rest summed as "other"
    assert report["partitions"]["ray_dataplane_index_partition_rows"] == ["other", "p1", "p2"]
    assert report["partitions"]["ray_dataplane_consumer_ready_rows"] == ["other", "p1", "p2"]
    assert all(len(names) <= 3 for names in report["shard_partitions"]), report["shard_partitions"]
    # every name the scrape shows is one the catalog lists (the dashboard's test relies on the catalog)
    assert set(report["names"]) <= exported_names(), set(report["names"]) - exported_names()
