"""A Ray cluster of its own with its metrics agent, traffic through the store, and a scrape.

Run by ``test_metrics_ray.py`` in a subprocess (its own Ray, so the session's cluster is untouched):
``python -m tests.dataplane._metrics_cluster EXPECTED.json``. It starts Ray with a metrics export
port and a 0.5 s report interval, makes a known amount of traffic (``traffic``: puts, gets,
streams, a clear, failed calls, refused connections and requests, a shard found dead), then scrapes
the metrics agent's Prometheus endpoint until every expected series (``[name, labels, value]``,
summed over matching series) has its value or 90 s pass, and prints one JSON line: what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from tests._fresh_ray import free_port

os.environ["RAY_metrics_report_interval_ms"] = "500"  # read by every process of the cluster
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("REPORTER_UPDATE_INTERVAL_MS", None)  # set by tests/conftest.py: Ray's default here

STORE = "m"
DEADLINE_S = 90.0


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value


def refused_traffic(registry: dict) -> None:
    """Two connections that fail authentication (zmq, Unix lane), a request of another protocol
    version, and three malformed requests (a header that does not decode, an unknown op, a body its
    op cannot read): all to the index."""
    import msgspec
    import zmq

    from dataplane.transport import unix
    from dataplane.transport.auth import Credentials, secure_client
    from dataplane.wire import frames

    index = registry["index"]
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.setsockopt(zmq.RECONNECT_IVL, -1)  # one attempt: one refusal
    bad.plain_username, bad.plain_password = b"dataplane", b"not-the-secret"
    monitor = bad.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    bad.connect(index["ipc"])
    assert monitor.poll(30_000), "the index never refused the connection with a wrong secret"
    bad.disable_monitor()
    monitor.close()
    bad.close()

    lane = unix.connect(index["unix"], "not-the-secret", max_frames=4, max_bytes=1 << 20)

    def lane_closed() -> bool:
        try:
            lane.wait(100)
            lane.read()
        except unix.ConnectionClosed:
            return True
        return lane.closed

    _wait(lane_closed, "the index to close a Unix-lane connection with a wrong secret")
    lane.close()

    good = ctx.socket(zmq.DEALER)
    good.setsockopt(zmq.LINGER, 0)
    secure_client(good, Credentials.from_dict(registry["credentials"]), curve=False)
    good.connect(index["ipc"])
    requests = [
        [msgspec.msgpack.encode([1, "stats", {}, frames.PROTOCOL_VERSION + 1])],  # another version
        [b"\xc1 is no msgpack"],
        frames.encode_request(2, "no-such-op", {}),
        frames.encode_request(3, "list", {"partition": 5}),  # a partition id must be a str
    ]
    for req in requests:
        good.send_multipart(req)
        assert good.poll(30_000), "the index did not answer a refused request"
        reply, _ = frames.decode_raw_reply(good.recv_multipart())
        assert reply.error is not None, reply
    good.close()


def traffic() -> None:
    """The store's calls whose counts ``test_metrics_ray.py`` expects."""
    import torch

    import dataplane as dp

    x = torch.arange(32, dtype=torch.float32).reshape(8, 4)  # 16 bytes a row
    dp.kv_batch_put([f"a{i}" for i in range(8)], "p1", {"x": x})
    dp.kv_put("a8", "p1", {"x": x[0]})  # a known schema now: one round trip (put_ready)
    dp.kv_batch_put(["b0", "b1", "b2"], "p2", {"x": x[:3]})
    dp.kv_batch_put(["c0", "c1"], "p3", {"x": x[:2]})
    dp.kv_batch_put(["d0"], "p4", {"x": x[:1]})
    got = dp.kv_batch_get([f"a{i}" for i in range(9)], "p1")
    assert got["x"].shape == (9, 4)
    try:
        dp.kv_batch_get(["nope"], "p1")
    except dp.KeyNotFoundError:
        pass
    for _ in range(2):
        assert dp.next_batch("p1", "reward", 4, ["x"], timeout_s=30).size == 4
    try:
        dp.next_batch("p1", "reward", 5, ["x"], timeout_s=0)
    except dp.BatchTimeoutError:
        pass
    assert dp.next_batch("p2", "train", 1, ["x"], timeout_s=30).size == 1
    assert dp.next_batch("p3", "acked", 2, ["x"], timeout_s=30, lease_s=600).size == 2
    dp.finish_partition("p2")
    dp.kv_clear(["d0"], "p4")


def dead_shard() -> None:
    """A store of one shard whose shard dies: a client of it finds it dead (once) and its get fails."""
    import ray

    from dataplane.client import ops
    from dataplane.client.handle import StoreClient
    from dataplane.config import StoreConfig
    from dataplane.errors import ShardUnavailableError
    from dataplane.service.launch import start_service
    from dataplane.transport.liveness import process_start

    registry, handle = start_service(StoreConfig.from_options(name="victim", num_shards=1))
    client = StoreClient(registry)
    try:
        shard = registry["shards"][0]
        ray.kill(handle.shards[0], no_restart=True)
        _wait(lambda: process_start(shard["pid"]) != shard["pid_start"], "the killed shard's process to end")
        try:
            client.run(ops.get(client.route, ["k"], "vp", None, True), "get")
        except ShardUnavailableError:
            pass
        else:
            raise AssertionError("a get from a dead shard succeeded")
    finally:
        client.close()
        handle.stop()


def main(expected_path: str) -> None:
    import ray

    import dataplane as dp
    import dataplane.tq as tq
    from dataplane import metrics
    from tests.dataplane import _prometheus

    with open(expected_path) as f:
        expected = json.load(f)
    tmp = tempfile.mkdtemp(prefix="rm", dir="/tmp")  # short: Ray's socket paths live under it
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _metrics_export_port=free_port(),
        _temp_dir=tmp,
        object_store_memory=256 << 20,
    )
    dp.init(name=STORE, num_shards=2, metrics_partitions=2)
    endpoint = metrics.endpoint()
    assert endpoint is not None and endpoint == next(iter(metrics.endpoints().values())), endpoint
    assert tq.get_metrics_endpoint() == endpoint  # TransferQueue's name for it
    traffic()
    refused_traffic(dp.api._state.client.registry)
    dead_shard()
    dp.api.export.flush()  # (the exporter would within half a second anyway)

    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            series = _prometheus.scrape(endpoint)
        except OSError:  # the agent is still starting
            series = []
        seen = [[name, labels, _prometheus.total(series, name, **labels)] for name, labels, _ in expected]
        if seen == expected or time.monotonic() > deadline:
            break
        time.sleep(0.25)  # a scrape costs the agent CPU: not in a tight loop
    names = {n for n, _, _ in series if n.startswith("ray_dataplane")}
    partition_series = {
        name: sorted(ls["partition"] for n, ls, _ in series if n == name and ls.get("store") == STORE)
        for name in ("ray_dataplane_index_partition_rows", "ray_dataplane_consumer_ready_rows")
    }
    shard_partitions = [
        sorted(
            ls["partition"]
            for n, ls, _ in series
            if n == "ray_dataplane_shard_partition_rows" and ls["shard"] == s
        )
        for s in ("0", "1")
    ]
    print(
        json.dumps(
            {
                "seen": seen,
                "names": sorted(names),
                "partitions": partition_series,
                "shard_partitions": shard_partitions,
            }
        )
    )
    dp.close()
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
