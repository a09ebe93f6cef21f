"""The store's metrics inside a process, without Ray: what is recorded, what the servers publish, the
bounds on label sets, and the Grafana dashboard's queries. ``test_metrics_ray.py`` checks the same
metrics end to end, scraped from a Ray metrics agent."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import threading
import uuid

import msgspec
import numpy as np
import pytest

from dataplane.errors import KeyNotFoundError, PartitionNotFoundError, WireError
from dataplane.server.index.actor import IndexServer
from dataplane.server.index.core import IndexCore
from dataplane.server.shard.actor import ShardServer
from dataplane.server.shard.core import ShardCore
from dataplane.telemetry import bounds
from dataplane.telemetry.catalog import LATENCY_BOUNDS, METRICS, OTHER, exported_names
from dataplane.telemetry.export import midpoints
from dataplane.telemetry.recorder import ClientMetrics, Recorder, Sample, ServerMetrics
from dataplane.transport.auth import Credentials
from dataplane.wire import protocol as _protocol
from tests.dataplane._metrics_cluster import refused_traffic

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def _on() -> Recorder:
    rec = Recorder()
    rec.on = True
    return rec


def test_a_process_not_connected_to_ray_records_nothing() -> None:
    code = """
import ray
from dataplane.telemetry import export
from dataplane.telemetry.recorder import RECORDER, ClientMetrics
assert not ray.is_initialized()
assert export.start() is False and RECORDER.on is False
ClientMetrics("s").moved("put", 5, 80)
ClientMetrics("s").call("put", 0.001)
sample = RECORDER.collect()
print(sample.counters, sample.histograms)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "{} {}", proc.stdout


def test_a_client_records_calls_rows_and_bytes_exactly() -> None:
    rec = _on()
    client = ClientMetrics("s", rec)
    client.moved("put", 4, 64)
    client.moved("put", 1, 16)
    client.moved("clear", 3)
    client.call("get", 0.0003)
    client.call("get", 0.02, KeyNotFoundError("k", "p"))
    client.peer_dead("s-shard-1")
    sample = rec.collect()
    assert sample.counters == {
        ("dataplane_client_rows", "s", "put"): 5,
        ("dataplane_client_bytes", "s", "put"): 80,
        ("dataplane_client_rows", "s", "clear"): 3,
        ("dataplane_client_errors", "s", "get", "KeyNotFoundError"): 1,
        ("dataplane_peers_dead", "s", "s-shard-1"): 1,
    }
    buckets = sample.histograms[("dataplane_client_op_seconds", "s", "get")]
    assert sum(buckets) == 2
    assert buckets[LATENCY_BOUNDS.index(0.0005)] == 1 and buckets[LATENCY_BOUNDS.index(0.025)] == 1


def test_nothing_is_recorded_while_the_recorder_is_off() -> None:
    rec = Recorder()
    ClientMetrics("s", rec).moved("put", 4, 64)
    ClientMetrics("s", rec).call("put", 0.001, ValueError())
    ServerMetrics("dataplane_shard", ("s", "0"), {"get"}, rec).served("get", 0.001)
    assert rec.collect() == Sample()


def test_error_labels_and_op_labels_are_bounded() -> None:
    rec = _on()
    client = ClientMetrics("s", rec)
    client.call("get", 0.001, type("Surprise", (Exception,), {})())
    client.call("get", 0.001, TypeError())
    server = ServerMetrics("dataplane_index", ("s",), _protocol.INDEX_OPS, rec, untimed={"commits"})
    server.served("commits", 0.001)  # not timed at all
    server.served("x" * 100, 0.001)  # a peer's op name is never a label value
    server.served(None, 0.001)  # the header did not even decode
    server.served("next", 0.001)
    errors = {k[-1] for k in rec.collect().counters}
    assert errors == {OTHER, "TypeError"}
    ops = {k[-1] for k in rec.collect().histograms if k[0] == "dataplane_index_op_seconds"}
    assert ops == {OTHER, "next"}


def test_a_value_on_a_bound_falls_in_that_bucket_and_midpoints_stay_inside() -> None:
    rec = _on()
    for value in (*LATENCY_BOUNDS, 1e9):
        rec.observe(("h",), value)
    assert rec.collect().histograms[("h",)] == [1] * (len(LATENCY_BOUNDS) + 1)
    edges = (0.0, *LATENCY_BOUNDS, float("inf"))
    for i, mid in enumerate(midpoints()):
        assert edges[i] < mid <= edges[i + 1], (i, mid)


def test_a_server_snapshot_replaces_the_last_one() -> None:
    rec = _on()
    rec.publish("shard0", {("c",): 5}, {("g", "p1"): 1.0, ("g", "p2"): 2.0})
    rec.publish("shard0", {("c",): 7}, {("g", "p2"): 3.0})  # p1 is gone: no longer exported
    rec.publish("shard1", {("c",): 1}, {})
    sample = rec.collect()
    assert sample.counters == {("c",): 8} and sample.gauges == {("g", "p2"): 3.0}
    rec.withdraw("shard1")
    assert rec.collect().counters == {("c",): 7}


def test_bounds_keep_the_largest_and_sum_the_rest() -> None:
    sizes = {f"p{i}": i for i in range(10_000)}
    keep = bounds.chosen(sizes, 20)
    folded = bounds.fold(sizes, keep, OTHER)
    assert len(folded) == 21 and folded[OTHER] == sum(range(10_000 - 20))
    assert {f"p{i}" for i in range(9_980, 10_000)} == set(folded) - {OTHER}
    assert bounds.fold(sizes, bounds.chosen(sizes, -1), OTHER) == sizes  # asked for: every partition
    assert bounds.fold(sizes, bounds.chosen(sizes, 0), OTHER) == {OTHER: sum(range(10_000))}
    assert bounds.fold({"a": 1}, bounds.chosen({"a": 1}, 20), OTHER) == {"a": 1}  # nothing to fold


def _serving(server):
    server.start()
    return server


def _stopped(server) -> None:
    server.stop()
    if not server._ctx.closed:
        server._ctx.destroy(linger=0)


@pytest.fixture
def creds() -> Credentials:
    return Credentials.new(encrypt=False)


def _commit(core: IndexCore, pid: str, keys: list[str]) -> None:
    core.op_commit(_protocol.IndexCommit(partition=pid, keys=keys, fields=["x"]))


def _next(core: IndexCore, pid: str, task: str, n: int, lease_s: float | None = None) -> list[str]:
    body = _protocol.Next(
        partition=pid, task=task, batch_size=n, fields=["x"], take=uuid.uuid4().hex, lease_s=lease_s
    )
    got = core.op_next(body)
    return [] if got is None else got.keys


def test_ten_thousand_partitions_make_at_most_k_plus_one_series(creds) -> None:
    core = IndexCore()
    for i in range(10_000):
        _commit(core, f"step{i}", [f"k{j}" for j in range(1 + i % 7)])
        _next(core, f"step{i}", "reward", 1)
    server = IndexServer(core, "127.0.0.1", f"t-{uuid.uuid4().hex[:6]}", creds)
    try:
        for k, per_metric in ((20, 21), (-1, 10_000)):
            server.partition_series = k
            counters, gauges = server.metrics_snapshot(("s",))
            for name in ("dataplane_index_partition_rows", "dataplane_consumer_ready_rows"):
                series = [key for key in gauges if key[0] == name]
                assert len(series) == per_metric, (k, name, len(series))
        server.partition_series = 20
        _, gauges = server.metrics_snapshot(("s",))
        assert sum(v for key, v in gauges.items() if key[0] == "dataplane_index_partition_rows") == sum(
            1 + i % 7 for i in range(10_000)
        )
        assert gauges[("dataplane_consumer_taken_rows", "s", OTHER, OTHER)] == 10_000 - 20
        assert gauges[("dataplane_index_partitions", "s", "open")] == 10_000
    finally:
        _stopped(_serving(server))


def test_the_index_lists_the_consumer_tasks_of_a_partition() -> None:
    core = IndexCore()
    _commit(core, "p", [f"k{i}" for i in range(10)])
    assert _next(core, "p", "reward", 4) == ["k0", "k1", "k2", "k3"]
    assert len(_next(core, "p", "train", 3, lease_s=60)) == 3
    core.op_finish(_protocol.OnePartition(partition="p"))
    raw = msgspec.msgpack.encode({"partition": "p"})
    got = core.operation("tasks")(core.decode("tasks", raw))
    idle = {name: t.idle_s for name, t in got.tasks.items()}
    assert idle["reward"] is not None and idle["train"] is not None and 0 <= idle["train"] < idle["reward"]
    got.tasks = {name: msgspec.structs.replace(t, idle_s=None) for name, t in got.tasks.items()}
    assert got == _protocol.TasksReply(
        rows=10,
        fields=[],  # commits without prepare or specs decide no schema
        finished=True,
        tasks={
            "reward": _protocol.TaskProgress(taken=4, ready=6, leased=0, fields=["x"]),
            "train": _protocol.TaskProgress(taken=3, ready=7, leased=3, fields=["x"]),
        },
    )
    with pytest.raises(PartitionNotFoundError):
        core.operation("tasks")(core.decode("tasks", msgspec.msgpack.encode({"partition": "nope"})))
    with pytest.raises(WireError, match="malformed 'tasks' request"):
        core.decode("tasks", msgspec.msgpack.encode({"partition": 3}))


def test_the_index_says_how_long_each_partition_and_task_has_been_idle() -> None:
    """A put, a take and an ack make a partition (and the task) the most recent; reads and an empty take
    do not. ``stats`` also names the finished partitions and those every task drained."""
    core = IndexCore()

    def idle() -> dict[str, float]:
        return core.op_stats(_protocol.Stats()).idle

    def recent() -> list[str]:
        got = idle()
        return sorted(got, key=got.__getitem__)

    _commit(core, "old", ["a", "b"])
    _commit(core, "new", ["a", "b"])
    assert recent() == ["new", "old"]
    assert _next(core, "old", "train", 2) == ["a", "b"]  # a take
    assert recent() == ["old", "new"]
    leased = _protocol.Next(partition="new", task="train", batch_size=2, fields=["x"], take="t1", lease_s=60)
    assert core.op_next(leased) is not None
    assert recent() == ["new", "old"]
    _commit(core, "old", ["c"])  # a put
    assert recent() == ["old", "new"]
    core.op_ack(_protocol.Ack(partition="new", task="train", take="t1", keys=["a", "b"]))  # an ack
    assert recent() == ["new", "old"]
    core.op_finish(_protocol.OnePartition(partition="old"))
    before = idle()
    assert _next(core, "new", "train", 1) == []  # nothing to take: no activity
    core.op_tasks(_protocol.Tasks(partition="old"))
    core.op_consumption(_protocol.Consumption(partition="old", task="train"))
    assert recent() == ["new", "old"] and all(idle()[p] >= before[p] for p in before)
    tasks = core.op_tasks(_protocol.Tasks(partition="new")).tasks
    assert tasks["train"].idle_s is not None and tasks["train"].idle_s <= idle()["new"] + 1e-3

    stats = core.op_stats(_protocol.Stats())
    assert stats.finished == ["old"] and stats.drained == []  # "old": row c not taken yet
    assert _next(core, "old", "train", 2) == ["c"]
    assert core.op_stats(_protocol.Stats()).drained == ["old"]
    core.op_finish(_protocol.OnePartition(partition="new"))
    stats = core.op_stats(_protocol.Stats())
    assert stats.finished == ["old", "new"] and stats.drained == ["old", "new"]
    _next(core, "new", "reward", 1)  # a second task, with a row left to take
    assert core.op_stats(_protocol.Stats()).drained == ["old"]


def _put(core: ShardCore, pid: str, keys: list[str], rows: np.ndarray) -> None:
    bufs: list = []
    col = {"spec": ["dense", "float32", [rows.shape[1]]], "rows": len(keys), "data": 0}
    bufs.append(memoryview(rows.tobytes()).cast("B"))
    body = {
        "partition": pid,
        "keys": keys,
        "fields": {"x": {"spec": col["spec"], "nbytes": rows.nbytes, "col": col}},
    }
    core.put_ready(core.decode("put_ready", msgspec.msgpack.encode(body)), bufs)  # (not sent on: no index)


def test_a_shard_snapshot_counts_rows_and_bytes_and_bounds_partitions(creds) -> None:
    core = ShardCore(0, capacity_bytes=1 << 20)
    server = ShardServer(
        core, "127.0.0.1", f"t-{uuid.uuid4().hex[:6]}", creds, rpc_timeout_s=10, lock=threading.Lock()
    )
    try:
        server.partition_series = 2
        for p, n in (("a", 5), ("b", 3), ("c", 2), ("d", 1)):
            _put(core, p, [f"{p}{i}" for i in range(n)], np.ones((n, 4), dtype=np.float32))
        _put(core, "a", ["a0"], np.zeros((1, 4), dtype=np.float32))  # replaces a0's row: its old one stays
        core.op_get(core.decode("get", msgspec.msgpack.encode({"partition": "a", "keys": ["a1", "a2"]})), [])
        core.op_clear(
            core.decode("clear", msgspec.msgpack.encode({"partition": "c", "keys": ["c0", "c1"]})), []
        )
        counters, gauges = server.metrics_snapshot(("s", "0"))
        assert counters[("dataplane_shard_rows", "s", "0", "put")] == 12
        assert counters[("dataplane_shard_bytes", "s", "0", "put")] == 12 * 16
        assert counters[("dataplane_shard_rows", "s", "0", "get")] == 2
        assert counters[("dataplane_shard_rows", "s", "0", "clear")] == 2
        assert counters[("dataplane_shard_bytes", "s", "0", "clear")] == 2 * 16
        used = 12 * 16 - 2 * 16  # a's first segment is still live: four of its rows point into it
        assert gauges[("dataplane_shard_capacity_bytes", "s", "0", "used")] == used == core.used
        assert gauges[("dataplane_shard_capacity_bytes", "s", "0", "free")] == (1 << 20) - used
        partitions = {k[-1]: v for k, v in gauges.items() if k[0] == "dataplane_shard_partition_bytes"}
        assert partitions == {"a": 6 * 16, "b": 3 * 16, OTHER: 1 * 16}  # c's bytes are freed, d is other
        rows = {k[-1]: v for k, v in gauges.items() if k[0] == "dataplane_shard_partition_rows"}
        assert rows == {"a": 5, "b": 3, OTHER: 1} and gauges[("dataplane_shard_rows_held", "s", "0")] == 9
    finally:
        _stopped(_serving(server))


def test_servers_count_what_they_refuse_by_cause(creds) -> None:
    server = _serving(IndexServer(IndexCore(), "127.0.0.1", f"t-{uuid.uuid4().hex[:6]}", creds))
    try:
        registry = {
            "index": {"ipc": server.ipc, "unix": server.unix},
            "credentials": creds.for_clients().to_dict(),
        }
        refused_traffic(registry)  # as the end-to-end test does, against this server alone
        assert server.refusals == {
            "auth": 2,
            "uid": 0,
            "handshake_timeout": 0,
            "evicted": 0,
            "protocol_version": 1,
            "malformed": 3,
        }
        counters, _ = server.metrics_snapshot(("s",))
        assert counters[("dataplane_server_refused", "s", "auth")] == 2  # (no prefix: metrics unset)
    finally:
        _stopped(server)


# ---- the Grafana dashboard ---------------------------------------------------------------------------

DASHBOARD = ROOT / "docs" / "grafana" / "rlplane.json"
_NAME = re.compile(r"\b(ray_dataplane_[a-z_]+)\b")


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its query variables."""

    def exprs(node) -> list[str]:
        if isinstance(node, dict):
            own = [node["expr"]] if isinstance(node.get("expr"), str) else []
            return own + [q for v in node.values() for q in exprs(v)]
        if isinstance(node, list):
            return [q for v in node for q in exprs(v)]
        return []

    variables = [v for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs(dashboard["panels"]) + [v["query"]["query"] for v in variables]


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 10, queries
    exported = exported_names()
    named = set()
    for query in queries:
        names = set(_NAME.findall(query))
        assert names or "label_values" in query, f"a query that names no store metric: {query}"
        assert names <= exported, f"{query} names {sorted(names - exported)}, which the store does not export"
        named |= names
    # the dashboard shows what an operator looks for: lag, capacity, refusals, dead peers, latency
    for metric in (
        "dataplane_consumer_ready_rows",
        "dataplane_shard_capacity_bytes",
        "dataplane_index_refused",
        "dataplane_shard_refused",
        "dataplane_peers_dead",
        "dataplane_client_op_seconds",
        "dataplane_shard_op_seconds",
        "dataplane_shard_reservations_expired",
        "dataplane_index_partitions",
    ):
        assert any(n.startswith("ray_" + metric) for n in named), f"no panel shows {metric}"
    assert set(METRICS) == {m.name for m in METRICS.values()}


def test_the_metrics_page_names_every_metric() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    missing = [m.name for m in METRICS.values() if f"ray_{m.name}" not in page]
    assert not missing, f"docs/metrics.md does not describe {missing}"
