"""The placement groups behind a ``RayResourcePool``: one per node entry, one bundle per process.

Creating them (with a deadline, and a ``ResourceShortageError`` that says what is missing),
ordering them by node IP, checking that a set of pools fits the cluster, and removing them.
``controlplane.resource_pool`` hands out their bundles as slots; this module never sees a pool.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from controlplane.errors import ControlPlaneError, ResourceShortageError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

_EPS = 1e-9
_QUIET_WAIT_S = 2.0  # a placement that takes longer waits for resources in use: say what holds them


def require_ray(what: str) -> None:
    """Refuse to go on without Ray, naming the fix (Ray's own error speaks of its "state API").

    Raises:
        ControlPlaneError: Ray is not initialised in this process.
    """
    import ray

    if not ray.is_initialized():
        raise ControlPlaneError(
            f"{what} needs Ray, which is not initialised in this process: call ray.init() first (it "
            "starts a local Ray, or joins your cluster when RAY_ADDRESS is set or address='auto' is given)"
        )


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    require_ray("a RayResourcePool (and the RayWorkerGroup on it)")
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
        ResourceShortageError: naming the first demand that does not fit, what is missing and, against
            totals (a cluster that can never place it), how to make it fit.
    """
    totals = {n["NodeID"]: dict(n.get("Resources", {})) for n in _alive_nodes()}
    per_node = _available_per_node() if use_available else totals
    free = {node_id: dict(res) for node_id, res in per_node.items()}
    order = sorted(demands, key=lambda d: -d[1] * sum(d[2].values()))
    for label, count, spec in order:
        need = {k: v * count for k, v in spec.items()}
        target = next((nid for nid, have in free.items() if _fits(need, have)), None)
        if target is None:
            best_id = max(free, key=lambda nid: free[nid].get("CPU", 0.0), default=None)
            best = free.get(best_id, {}) if best_id is not None else {}
            short = {
                k: round(v - best.get(k, 0.0), 3) for k, v in need.items() if best.get(k, 0.0) + _EPS < v
            }
            kind = "available" if use_available else "total"
            text = (
                f"cannot place {label}: {count} bundles of {_fmt(spec)} need {_fmt(need)} on one node; "
                f"the best node has {_fmt(best)} {kind}, short by {short}; "
                f"nodes: {[_fmt(r) for r in per_node.values()]}"
            )
            if not use_available:  # it can never fit: say how to make it
                node_total = totals.get(best_id, {}) if best_id is not None else {}
                held = node_total.get("CPU", 0.0) - best.get("CPU", 0.0)  # by other demands of this check
                fit = _bundles_fitting(spec, best)
                text += "; " + never_fits_fix(held + need.get("CPU", 0.0), short, spec, fit, node_total)
            raise ResourceShortageError(text)
        for k, v in need.items():
            free[target][k] = free[target].get(k, 0.0) - v


def _bundles_fitting(spec: dict[str, float], have: dict[str, float]) -> int:
    """How many bundles of ``spec`` fit in ``have``."""
    counts = [have.get(k, 0.0) / v for k, v in spec.items() if v > 0]
    return max(0, int(min(counts) + _EPS)) if counts else 0


def never_fits_fix(
    cpus: float, short: dict[str, float], spec: dict[str, float], fit: int, node_total: dict[str, float]
) -> str:
    """How to make a request fit a cluster too small for it: more logical CPUs, the accelerator it
    lacks, or a smaller group.

    Args:
        cpus: the logical CPUs one node would need for the request.
        short: what is missing, per resource.
        spec: one bundle.
        fit: how many such bundles the cluster could hold.
        node_total: the largest node's resources.

    Example:
        >>> fix = never_fits_fix(4.0, {"CPU": 2.0}, {"CPU": 1.0}, 2, {"CPU": 2.0})
        >>> "ray.init(num_cpus=4)" in fix and "--num-cpus 4" in fix and "RayResourcePool([2], ...)" in fix
        True
    """
    fixes = []
    if "CPU" in short:
        n = math.ceil(cpus - _EPS)
        fixes.append(
            "give Ray more logical CPUs (they may exceed the machine's cores): "
            f"ray.init(num_cpus={n}), or `ray start --head --num-cpus {n}`"
        )
    others = {k: v for k, v in short.items() if k != "CPU"}
    if others:
        fixes.append(f"run on a cluster with the missing {_fmt(others)}, or ask for none (use_gpu=False)")
    if fit >= 1:
        fixes.append(
            f"ask for a smaller group: {fit} bundles of {_fmt(spec)} fit (RayResourcePool([{fit}], ...))"
        )
    return (
        f"this cluster can never place it (Ray counts {node_total.get('CPU', 0.0):g} CPUs on its largest "
        f"node). Fix: {'; or '.join(fixes)}"
    )


def check_feasible(store: Sequence[int], spec: dict[str, float], strategy: str, name_prefix: str) -> None:
    """Fail at once when the cluster's totals can never hold the placement groups (Ray would wait
    for ever): ``STRICT_PACK`` needs each group on one node; the other strategies need every bundle
    somewhere (``STRICT_SPREAD``: each on its own node).

    Raises:
        ResourceShortageError: what was asked, what the cluster has, and the fix.
    """
    if strategy == "STRICT_PACK":
        check_fits(
            [(f"placement group {name_prefix}{i}", n, spec) for i, n in enumerate(store)], use_available=False
        )
        return
    totals = [dict(n.get("Resources", {})) for n in _alive_nodes()]
    per_node = [_bundles_fitting(spec, have) for have in totals]
    room = sum(min(n, 1) for n in per_node) if strategy == "STRICT_SPREAD" else sum(per_node)
    wanted = sum(store)
    if wanted <= room:
        return
    largest = max(totals, key=lambda r: r.get("CPU", 0.0), default={})
    need = {k: v * wanted for k, v in spec.items()}
    short = {k: round(v - largest.get(k, 0.0), 3) for k, v in need.items() if largest.get(k, 0.0) + _EPS < v}
    raise ResourceShortageError(
        f"cannot place {wanted} bundles of {_fmt(spec)} ({strategy}, {_fmt(need)} in all): the cluster can "
        f"hold {room} of them; nodes: {[_fmt(r) for r in totals]}; "
        + never_fits_fix(need.get("CPU", 0.0), short or {"CPU": 0.0}, spec, room, largest)
    )


def holders(exclude: Sequence[PlacementGroup] = ()) -> list[str]:
    """What holds CPUs and GPUs now: placed placement groups (not those in ``exclude``) and actors
    outside any placement group, each as ``kind 'name' (resources)``; best effort (empty if Ray does
    not tell)."""
    import ray.util

    skip = {pg.id.hex() for pg in exclude}
    out = []
    try:
        for pg_id, info in ray.util.placement_group_table().items():
            if pg_id in skip or info.get("state") != "CREATED":
                continue
            held: dict[str, float] = {}
            for bundle in (info.get("bundles") or {}).values():
                for k, v in bundle.items():
                    held[k] = held.get(k, 0.0) + v
            name = info.get("name") or pg_id[:12]
            out.append(f"placement group {name!r} ({len(info.get('bundles') or {})} bundles, {_fmt(held)})")
    except Exception as exc:  # noqa: BLE001 - a diagnosis, never the reason a call fails
        logger.debug("placement groups unknown: %s", exc)
    try:  # actors that ask for CPUs or GPUs outside placement groups (Ray's GCS table, stable in 2.x)
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        for raw in state._connect_and_get_accessor().get_actor_table(None, "ALIVE"):
            actor = gcs_pb2.ActorTableData.FromString(raw)
            if actor.HasField("placement_group_id") and actor.placement_group_id.strip(b"\x00"):
                continue
            held = {k: v for k, v in actor.required_resources.items() if k in ("CPU", "GPU") and v > 0}
            if held:
                out.append(f"actor {actor.name or actor.class_name!r} ({_fmt(held)})")
    except Exception as exc:  # noqa: BLE001 - as above
        logger.debug("actors unknown: %s", exc)
    return out


def ip_sort_key(ip: str) -> tuple[int, int, int | str]:
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


def _node_ip_of(pg: PlacementGroup, ip_by_node: dict[str, str]) -> str:
    import ray.util

    table = ray.util.placement_group_table(pg)
    node_id: str | None = (table.get("bundles_to_node_id") or {}).get(0)
    return "" if node_id is None else ip_by_node.get(node_id, "")


def sort_by_node_ip(pgs: Sequence[PlacementGroup]) -> list[PlacementGroup]:
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
) -> list[PlacementGroup]:
    """One placement group per node entry; wait until all are placed or the deadline passes.

    Raises:
        ResourceShortageError: some group cannot be placed (checked against node totals first,
            then by waiting up to ``timeout_s``); created groups are removed before raising.
    """
    import ray
    import ray.util

    check_feasible(store, bundle_spec, strategy, name_prefix)  # fail fast when it can never fit
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
    refs = [pg.ready() for pg in pgs]
    # Placed at once on a cluster with room; otherwise say now what holds the resources it waits for.
    ready, _ = ray.wait(refs, num_returns=len(pgs), timeout=min(_QUIET_WAIT_S, timeout_s))
    if len(ready) < len(pgs):
        held = holders(exclude=pgs)
        logger.warning(
            "placement groups %s wait for %s (%.0fs at most); the cluster has %s available of %s; "
            "held by: %s",
            name_prefix,
            _fmt({k: v * sum(store) for k, v in bundle_spec.items()}),
            timeout_s,
            _fmt(ray.available_resources()),
            _fmt(ray.cluster_resources()),
            "; ".join(held) or "nothing Ray lists",
        )
        ready, _ = ray.wait(refs, num_returns=len(pgs), timeout=max(0.0, timeout_s - _QUIET_WAIT_S))
    if len(ready) < len(pgs):
        pending = [i for i, pg in enumerate(pgs) if not pg.wait(0)]
        held = holders(exclude=pgs)
        remove_placement_groups(pgs)
        needed = {k: v * sum(store[i] for i in pending) for k, v in bundle_spec.items()}
        raise ResourceShortageError(
            f"placement groups {[f'{name_prefix}{i}' for i in pending]} ({strategy}, "
            f"{[store[i] for i in pending]} bundles of {_fmt(bundle_spec)}; {_fmt(needed)} in all) were "
            f"not placed within {timeout_s}s; cluster has {_fmt(ray.available_resources())} available "
            f"of {_fmt(ray.cluster_resources())}, held by: {'; '.join(held) or 'nothing Ray lists'}. "
            "Free them (remove those pools, kill those groups or actors) or raise placement_timeout_s"
        )
    return sort_by_node_ip(pgs)


def remove_placement_groups(pgs: Sequence[PlacementGroup], timeout_s: float = 30.0) -> None:
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
