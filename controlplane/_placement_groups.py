"""The placement groups behind a ``RayResourcePool``: one per node entry, one bundle per process.

Creating them (with a deadline, and a ``ResourceShortageError`` that says what is missing),
ordering them by node IP, checking that a set of pools fits the cluster, and removing them.
``controlplane.resource_pool`` hands out their bundles as slots; this module never sees a pool.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import Any

from controlplane.errors import ResourceShortageError

logger = logging.getLogger(__name__)

_EPS = 1e-9


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def _available_per_node() -> dict[str, dict[str, float]]:
    """Available resources per node id; falls back to totals where Ray does not tell."""
    nodes = _alive_nodes()
    totals = {node["NodeID"]: dict(node.get("Resources", {})) for node in nodes}
    try:  # no public API gives per-node availability; this one is stable across Ray 2.x
        from ray._private import state

        available = state.available_resources_per_node()
        return {node_id: dict(available.get(node_id, {})) for node_id in totals}
    except Exception as exc:  # pragma: no cover - depends on the Ray build
        logger.debug("per-node availability unknown (%s); using totals", exc)
        return totals


def _fmt(resources: dict[str, float]) -> str:
    hidden = ("memory", "object_store_memory")
    keep = {
        k: round(v, 3)
        for k, v in sorted(resources.items())
        if not k.startswith("node:") and "_group_" not in k and k not in hidden
    }
    return str(keep)


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in need.items())


def check_fits(demands: Sequence[tuple[str, int, dict[str, float]]], *, use_available: bool = True) -> None:
    """Check that every demand (label, bundle count, bundle spec) fits on one node, together.

    First-fit decreasing over the nodes' available (or total) resources.

    Raises:
        ResourceShortageError: naming the first demand that does not fit and what is missing.
    """
    per_node = (
        _available_per_node()
        if use_available
        else {n["NodeID"]: dict(n.get("Resources", {})) for n in _alive_nodes()}
    )
    free = {node_id: dict(res) for node_id, res in per_node.items()}
    order = sorted(demands, key=lambda d: -d[1] * sum(d[2].values()))
    for label, count, spec in order:
        need = {k: v * count for k, v in spec.items()}
        target = next((nid for nid, have in free.items() if _fits(need, have)), None)
        if target is None:
            best = max(free.values(), key=lambda r: r.get("CPU", 0.0), default={})
            short = {
                k: round(v - best.get(k, 0.0), 3) for k, v in need.items() if best.get(k, 0.0) + _EPS < v
            }
            kind = "available" if use_available else "total"
            raise ResourceShortageError(
                f"cannot place {label}: {count} bundles of {_fmt(spec)} need {_fmt(need)} on one node; "
                f"the best node has {_fmt(best)} {kind}, short by {short}; "
                f"nodes: {[_fmt(r) for r in per_node.values()]}"
            )
        for k, v in need.items():
            free[target][k] = free[target].get(k, 0.0) - v


def ip_sort_key(ip: str) -> tuple:
    """Numeric order for IPv4/IPv6 addresses (``10.0.0.9`` before ``10.0.0.10``).

    Example:
        >>> sorted(["10.0.0.10", "10.0.0.9"], key=ip_sort_key)
        ['10.0.0.9', '10.0.0.10']
    """
    try:
        addr = ipaddress.ip_address(ip.strip("[]"))
        return (0, addr.version, int(addr))
    except ValueError:
        return (1, 0, ip)


def _node_ip_of(pg: Any, ip_by_node: dict[str, str]) -> str:
    import ray.util

    table = ray.util.placement_group_table(pg)
    node_id = (table.get("bundles_to_node_id") or {}).get(0)
    return ip_by_node.get(node_id, "")


def sort_by_node_ip(pgs: Sequence[Any]) -> list[Any]:
    """Placement groups ordered by the IP of their bundle-0 node, numerically; ties keep order."""
    ip_by_node = {node["NodeID"]: node["NodeManagerAddress"] for node in _alive_nodes()}
    keyed = [(ip_sort_key(_node_ip_of(pg, ip_by_node)), i, pg) for i, pg in enumerate(pgs)]
    return [pg for _, _, pg in sorted(keyed, key=lambda item: (item[0], item[1]))]


def create_placement_groups(
    store: Sequence[int],
    bundle_spec: dict[str, float],
    *,
    strategy: str,
    name_prefix: str,
    detached: bool,
    timeout_s: float,
) -> list[Any]:
    """One placement group per node entry; wait until all are placed or the deadline passes.

    Raises:
        ResourceShortageError: some group cannot be placed (checked against node totals first,
            then by waiting up to ``timeout_s``); created groups are removed before raising.
    """
    import ray
    import ray.util

    if strategy == "STRICT_PACK":  # fail fast when no node could ever hold a group
        for i, count in enumerate(store):
            check_fits([(f"placement group {name_prefix}{i}", count, bundle_spec)], use_available=False)
    lifetime = "detached" if detached else None
    pgs = [
        ray.util.placement_group(
            [dict(bundle_spec) for _ in range(count)],
            strategy=strategy,
            name=f"{name_prefix}{i}",
            lifetime=lifetime,
        )
        for i, count in enumerate(store)
    ]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        pending = [i for i, pg in enumerate(pgs) if not pg.wait(0)]
        remove_placement_groups(pgs)
        needed = {k: v * sum(store[i] for i in pending) for k, v in bundle_spec.items()}
        raise ResourceShortageError(
            f"placement groups {[f'{name_prefix}{i}' for i in pending]} ({strategy}, "
            f"{[store[i] for i in pending]} bundles of {_fmt(bundle_spec)}; {_fmt(needed)} in all) were "
            f"not placed within {timeout_s}s; cluster has {_fmt(ray.available_resources())} available "
            f"of {_fmt(ray.cluster_resources())}"
        )
    return sort_by_node_ip(pgs)


def remove_placement_groups(pgs: Sequence[Any], timeout_s: float = 30.0) -> None:
    """Remove placement groups and wait (up to ``timeout_s``) until Ray reports them removed."""
    import time

    import ray.util

    for pg in pgs:
        try:
            ray.util.remove_placement_group(pg)
        except Exception as exc:  # already removed, or the cluster is gone
            logger.debug("removing placement group failed: %s", exc)
    deadline = time.monotonic() + timeout_s
    pending = list(pgs)
    while pending and time.monotonic() < deadline:
        try:
            pending = [pg for pg in pending if ray.util.placement_group_table(pg).get("state") != "REMOVED"]
        except Exception as exc:  # the cluster is gone: nothing left to wait for
            logger.debug("placement group state unknown: %s", exc)
            return
        if pending:
            time.sleep(0.05)  # polling Ray's table; bounded by the deadline above
    if pending:
        logger.warning("%d placement groups not removed after %.0fs", len(pending), timeout_s)
