"""Every metric the store exports: its name, kind, labels and meaning, in one table.

The names are what the processes record through ``ray.util.metrics``; Prometheus (Ray's metrics
agent) shows them with Ray's ``ray_`` prefix, a counter with ``_total`` after it and a histogram as
its ``_bucket`` / ``_sum`` / ``_count`` series (``Metric.exported``). ``docs/metrics.md`` explains
each; ``docs/grafana/rlplane.json`` queries only names listed here (a test checks it).

Who records what:

* **client** (every process attached to a store, labels ``store`` and ``op``): rows and payload
  bytes of each call, its latency (``next_batch``'s includes the wait for rows), the calls that
  failed by error class, and store actors it found dead.
* **shard** (each shard actor, labels ``store`` and ``shard``): rows and bytes stored, served and
  freed, the time to serve each request, refused connections and requests, reservations that
  expired (fenced), and gauges of its memory, rows, partitions and clients.
* **index** (the index actor, label ``store``): the time to serve and to answer waiting calls, rows
  handed out to consumers, leases that ran out, refusals, and gauges of partitions (open, finished,
  rows) and of each consumer task (rows ready and not taken: the lag; taken; leased).

Labels whose values come from users (``partition``, ``task``) are bounded: the largest
``StoreConfig.metrics_partitions`` partitions (or (partition, task) pairs) get their own series,
the rest are summed under ``"other"`` (``bounds``).

    >>> METRICS["dataplane_client_rows"].exported()
    ('ray_dataplane_client_rows_total',)
"""

from __future__ import annotations

from dataclasses import dataclass

PROMETHEUS_PREFIX = "ray_"  # what Ray's metrics agent puts before every application metric
OTHER = "other"  # the label value that sums what has no series of its own

# Seconds. Server requests take tens of microseconds; a next_batch may wait minutes.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


@dataclass(frozen=True)
class Metric:
    """One exported metric: ``kind`` is "counter", "gauge" or "histogram"; ``tags`` its label keys
    in the order a recorded key lists their values."""

    name: str
    kind: str
    tags: tuple[str, ...]
    help: str
    side: str  # "client", "shard" or "index": which processes record it

    def exported(self) -> tuple[str, ...]:
        """The series names Prometheus shows for this metric."""
        base = PROMETHEUS_PREFIX + self.name
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


_C, _S, _I = "client", "shard", "index"
_SHARD = ("store", "shard")

_ALL = [
    # ---- clients ----
    Metric(
        "dataplane_client_rows",
        "counter",
        ("store", "op"),
        "rows of the calls that succeeded: written (put), read (get), asked to clear (clear), taken "
        "(next_batch)",
        _C,
    ),
    Metric(
        "dataplane_client_bytes",
        "counter",
        ("store", "op"),
        "payload bytes (the rows' data buffers) written (put) and read (get) by calls that succeeded",
        _C,
    ),
    Metric(
        "dataplane_client_op_seconds",
        "histogram",
        ("store", "op"),
        "latency of a call as its caller saw it (next_batch: waiting for rows included)",
        _C,
    ),
    Metric(
        "dataplane_client_errors",
        "counter",
        ("store", "op", "error"),
        "calls that raised, by error class",
        _C,
    ),
    Metric(
        "dataplane_peers_dead",
        "counter",
        ("store", "peer"),
        "store actors found dead by a client, or by a shard (its index): a late reply, then /proc or "
        "Ray said so",
        _C,
    ),
    # ---- shards ----
    Metric(
        "dataplane_shard_rows",
        "counter",
        (*_SHARD, "op"),
        "rows stored (put), served (get) and freed (clear)",
        _S,
    ),
    Metric(
        "dataplane_shard_bytes",
        "counter",
        (*_SHARD, "op"),
        "bytes stored (put: data, offsets and shapes) and freed (clear)",
        _S,
    ),
    Metric(
        "dataplane_shard_op_seconds",
        "histogram",
        (*_SHARD, "op"),
        "time a shard took to serve one request (decode, work, reply)",
        _S,
    ),
    Metric(
        "dataplane_shard_refused",
        "counter",
        (*_SHARD, "reason"),
        "connections and requests a shard refused: auth, uid, handshake_timeout, evicted, "
        "protocol_version, malformed",
        _S,
    ),
    Metric(
        "dataplane_shard_reservations_expired",
        "counter",
        _SHARD,
        "puts whose writer stalled between reserve and commit past reservation_timeout_s; their "
        "memory is fenced, never reused",
        _S,
    ),
    Metric(
        "dataplane_shard_capacity_bytes",
        "gauge",
        (*_SHARD, "state"),
        "a shard's capacity by state: used (live rows), reserved (puts in flight), free (the rest; an "
        "unbounded shard's capacity is its host's memory)",
        _S,
    ),
    Metric(
        "dataplane_shard_resident_bytes",
        "gauge",
        _SHARD,
        "memory a shard holds: live rows plus freed segments kept warm for reuse",
        _S,
    ),
    Metric("dataplane_shard_rows_held", "gauge", _SHARD, "rows a shard holds", _S),
    Metric(
        "dataplane_shard_partition_rows",
        "gauge",
        (*_SHARD, "partition"),
        "rows a shard holds per partition (bounded: see metrics_partitions)",
        _S,
    ),
    Metric(
        "dataplane_shard_partition_bytes",
        "gauge",
        (*_SHARD, "partition"),
        "bytes a shard holds per partition (bounded: see metrics_partitions)",
        _S,
    ),
    Metric("dataplane_shard_clients", "gauge", _SHARD, "open connections to a shard", _S),
    # ---- the index ----
    Metric(
        "dataplane_index_op_seconds",
        "histogram",
        ("store", "op"),
        "time the index took to serve one request (a waiting call: its first attempt)",
        _I,
    ),
    Metric(
        "dataplane_index_wait_seconds",
        "histogram",
        ("store", "op"),
        "from a next_batch (next, ready, claim) request's arrival to its answer: the wait for rows",
        _I,
    ),
    Metric(
        "dataplane_index_refused",
        "counter",
        ("store", "reason"),
        "connections and requests the index refused (reasons as for shards)",
        _I,
    ),
    Metric("dataplane_index_rows_taken", "counter", ("store",), "rows handed out to consumers", _I),
    Metric(
        "dataplane_index_leases_expired",
        "counter",
        ("store",),
        "leased rows given back to their task because the lease ran out unacknowledged",
        _I,
    ),
    Metric(
        "dataplane_index_partitions",
        "gauge",
        ("store", "state"),
        "partitions by state: open, finished (finish_partition was called)",
        _I,
    ),
    Metric(
        "dataplane_index_partition_rows",
        "gauge",
        ("store", "partition"),
        "rows (keys) the index lists per partition (bounded: see metrics_partitions)",
        _I,
    ),
    Metric("dataplane_index_waiting", "gauge", ("store",), "next_batch calls waiting for rows", _I),
    Metric("dataplane_index_clients", "gauge", ("store",), "open connections to the index", _I),
    Metric(
        "dataplane_consumer_ready_rows",
        "gauge",
        ("store", "partition", "task"),
        "rows ready for a consumer task and not taken yet: its lag (bounded: see metrics_partitions)",
        _I,
    ),
    Metric(
        "dataplane_consumer_taken_rows",
        "gauge",
        ("store", "partition", "task"),
        "rows a consumer task has taken (bounded like the lag)",
        _I,
    ),
    Metric(
        "dataplane_consumer_leased_rows",
        "gauge",
        ("store", "partition", "task"),
        "rows a consumer task holds under a lease, not acknowledged yet (bounded like the lag)",
        _I,
    ),
]

METRICS: dict[str, Metric] = {m.name: m for m in _ALL}


def exported_names() -> set[str]:
    """Every series name the store's metrics appear under in Prometheus.

    >>> "ray_dataplane_shard_op_seconds_bucket" in exported_names()
    True
    """
    return {name for m in _ALL for name in m.exported()}


__all__ = ["LATENCY_BOUNDS", "METRICS", "OTHER", "PROMETHEUS_PREFIX", "Metric", "exported_names"]
