"""Where the store's metrics can be scraped, and what they are called.

The store's processes (its shards and index, and every process attached to it) record through
``ray.util.metrics``, so their metrics go wherever the cluster's go: each node's Ray metrics agent
serves the metrics of that node's processes in Prometheus' text format at
``http://<node ip>:<metrics export port>/metrics``, Ray's dashboard shows them, and a Prometheus
that reads Ray's service-discovery file scrapes every node (``docs/metrics.md``). The names, labels
and meanings are in ``dataplane.telemetry.catalog`` (Prometheus shows them with Ray's ``ray_``
prefix).

    >>> import dataplane as dp
    >>> from dataplane import metrics
    >>> dp.init()
    >>> metrics.endpoint()                 # the metrics agent of the index's node
    '10.0.1.42:51413'
    >>> sorted(metrics.endpoints().values())   # every node's, for a cluster of several nodes
    ['10.0.1.42:51413', '10.0.1.43:51413']

``dataplane.tq.get_metrics_endpoint`` is ``endpoint`` under TransferQueue's name (it, too, returns
``"host:port"``, or None when there is nothing to scrape).
"""

from __future__ import annotations

from typing import Any

from dataplane.config import StoreConfig
from dataplane.errors import StoreNotInitializedError

# The catalog's names, for a reader of this module (their home is dataplane.telemetry.catalog).
from dataplane.telemetry.catalog import METRICS as METRICS
from dataplane.telemetry.catalog import Metric as Metric
from dataplane.telemetry.catalog import exported_names as exported_names


def endpoints() -> dict[str, str]:
    """``{node id: "host:port"}``: the metrics agent of every alive node of the Ray cluster this
    process is connected to ({} when it is not, or when Ray runs without its metrics agent: install
    ``ray[default]``)."""
    import ray

    if not ray.is_initialized():
        return {}
    out = {}
    for node in ray.nodes():
        port = node.get("MetricsExportPort") or -1
        if node.get("Alive") and port > 0:
            out[node["NodeID"]] = f"{node['NodeManagerAddress']}:{port}"
    return out


def _registry(name: str | None) -> dict[str, Any] | None:
    """The registry of the store this process is attached to (or of store ``name``), else None."""
    from dataplane import api

    client = api._state.client
    if client is not None and (name is None or client.config.name == name):
        return client.registry
    from dataplane.service.launch import find_service

    cfg = StoreConfig.from_options(**({} if name is None else {"name": name}))
    try:
        found = find_service(cfg, timeout=5.0)
    except StoreNotInitializedError:  # a broken store: nothing of it to scrape
        return None
    return None if found is None else found[0]


def endpoint(name: str | None = None) -> str | None:
    """Where the store's metrics can be scraped: ``"host:port"`` of the Ray metrics agent on the node
    its index runs on (``http://host:port/metrics``); its shards' and clients' metrics are on their
    own nodes' agents (``endpoints``). None when this process is not connected to Ray, no store
    ``name`` (default: the one this process is attached to, else "dataplane") runs in Ray namespace
    ``rlplane``, the store's ``metrics`` option is off, or the node has no metrics agent.

    Example:
        >>> endpoint()
        '10.0.1.42:51413'
    """
    import ray

    if not ray.is_initialized():
        return None
    registry = _registry(name)
    if registry is None or not registry.get("config", {}).get("metrics", True):
        return None
    agents = endpoints()
    node = registry["index"].get("node_id")
    if node in agents:
        return agents[node]
    host = registry["index"]["tcp"].rsplit("//", 1)[-1].rsplit(":", 1)[0]  # an index of an older release
    return next((a for a in agents.values() if a.rsplit(":", 1)[0] == host), None)


__all__ = ["endpoint", "endpoints"]
