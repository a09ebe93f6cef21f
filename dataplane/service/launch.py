"""Start, find and stop the store service (index + shards as named Ray actors); what the
``rlplane store`` command runs is ``dataplane.admin``.

The service's actors are named ``<name>-index`` and ``<name>-shard-<i>`` in the Ray namespace
``rlplane`` (``config.NAMESPACE``), so any process of the cluster finds them. ``rlplane store
start`` makes them detached (they outlive the CLI); ``dp.init()`` with no service running makes
an embedded one: named (workers attach to it) but owned by the process, which stops it on
``close()`` or at exit (and Ray kills owned actors when their owner dies anyway).

Scheduling is checked, not hoped for: ``start_service`` waits ``schedule_timeout_s`` for every
actor to come up and otherwise kills what it created and raises ``SchedulingError`` naming the
actors, what they asked for and what the cluster has free.

The starter makes the store's credentials (``transport.auth``) and hands them to its actors at creation;
clients get them from the index's ``info`` (a Ray call), never from anywhere else.

A store whose index died is *broken*: its shards may live on, holding their names. ``find_service``
reports it (``BrokenStoreError`` message), ``stop_named`` removes every actor named after the
store whatever state it is in, and ``dp.init()`` clears such remnants before starting afresh.
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataplane.config import NAMESPACE, StoreConfig
from dataplane.errors import SchedulingError, StoreNotInitializedError
from dataplane.service.connect import command
from dataplane.service.liveness import ray_says_dead
from dataplane.transport.auth import Credentials

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

_KILL_WAIT_S = 5.0
INDEX_MAX_MESSAGE_BYTES = 1 << 30  # metadata only: keys, fields and tags of one call


@dataclass
class ServiceHandle:
    """The actors of a service this process started (so it can stop them)."""

    index: ActorHandle | None  # None when the index is already gone
    shards: list[ActorHandle] = field(default_factory=list)
    stopped: bool = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        import ray

        refs = []
        for s in self.shards:
            try:
                refs.append(s.shutdown.remote())
            except Exception:  # noqa: BLE001 - already dead
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=_KILL_WAIT_S)
        for actor in [*self.shards, self.index]:
            if actor is None:
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass


_REMOTE_CLASSES: dict[str, Any] = {}


def _remote(cls: type) -> Any:
    """The ``ray.remote`` class of ``cls``, made once per process and kept alive (see start_service)."""
    import ray

    if cls.__name__ not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls.__name__] = ray.remote(cls)
    return _REMOTE_CLASSES[cls.__name__]


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(nodes, key=lambda n: n["NodeID"])


def _is_store_name(cfg: StoreConfig, name: str) -> bool:
    shard = f"{cfg.name}-shard-"
    return name == cfg.index_name() or (name.startswith(shard) and name[len(shard) :].isdigit())


def store_actor_names(cfg: StoreConfig) -> list[str]:
    """Names of the live actors of store ``cfg.name`` (index and shards) in the store's namespace."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE and _is_store_name(cfg, a["name"])
    )


def release_dead_names(cfg: StoreConfig) -> list[str]:
    """Free the names of store ``cfg.name`` that Ray still holds for dead actors; returns them.

    Why a dead actor can hold its name: an actor owned by a process (an embedded store's, owned by
    the driver that started it) whose own process died (an OS kill, a crash; ``max_restarts=0``) is
    DEAD to Ray but stays registered, name included, until its owner drops every handle to it or
    dies itself (Ray 2.60's GCS, ``GcsActorManager::RestartActor``). ``list_named_actors`` no longer
    lists it, but creating an actor of that name fails with ``ActorAlreadyExistsError``, from any
    process, for as long as the owner lives. ``ray.kill`` of such an actor, from any process,
    destroys its registration and frees the name; ``ray.get_actor`` still hands out a handle to it.
    (``ray.kill`` of a live store actor frees its name at once: only OS kills leave this behind.)

    The dead holders are found in the GCS's actor table (every dead actor Ray remembers, with its
    name); a handle is fetched by name only for those, and killed only if it is one of them (a new
    actor may have taken a freed name meanwhile).
    """
    import ray

    try:  # the GCS actor table with its DEAD actors: no public API has it without the dashboard
        from ray._private import state as ray_state

        dead = ray_state.actors(actor_state_name="DEAD")
    except Exception as exc:  # noqa: BLE001 - another Ray: nothing freed, so the start raises Ray's error
        logger.warning("store %r: cannot read Ray's table of dead actors (%s)", cfg.name, exc)
        return []
    dead_ids = {str(aid) for aid in dead}
    alive = set(store_actor_names(cfg))
    names = sorted({a["Name"] for a in dead.values() if _is_store_name(cfg, a["Name"])} - alive)
    freed = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # not held: the dead actor's registration is gone already
            continue
        if actor._actor_id.hex() not in dead_ids:  # a live actor took the name since
            continue
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - destroyed meanwhile by someone else: freed all the same
            pass
        freed.append(name)
    if freed:
        logger.warning("store %r: freed the names %s that Ray still held for dead actors", cfg.name, freed)
    return freed


def find_service(cfg: StoreConfig, timeout: float | None = None) -> tuple[dict[str, Any], Any] | None:
    """The registry of the running service named ``cfg.name``, or None when there is none.

    A store whose index is gone but whose shards still hold their names is not "none": that raises
    ``StoreNotInitializedError`` saying so (``stop_named`` clears it).
    """
    import ray

    # Look the name up in the list first: a failed ray.get_actor() of a name this process then
    # creates makes Ray 2.60 cancel that creation ("all references removed").
    names = store_actor_names(cfg)
    if cfg.index_name() not in names:
        if not names:
            return None
        if not _being_created(cfg.index_name()):
            raise StoreNotInitializedError(_broken(cfg, names))
    try:
        index = ray.get_actor(cfg.index_name(), namespace=NAMESPACE)
    except ValueError:
        return None
    deadline = time.monotonic() + (timeout or cfg.schedule_timeout_s)
    while True:  # a service being started by another process has no registry yet
        left = deadline - time.monotonic()
        try:
            registry = ray.get(index.info.remote(), timeout=max(0.1, left))
        except ray.exceptions.GetTimeoutError:
            registry = {}
        except ray.exceptions.RayActorError:
            if _being_created(cfg.index_name()):  # alive, only unreachable for now (a busy node): again
                registry = {}
            else:
                rest = [n for n in store_actor_names(cfg) if n != cfg.index_name()]
                if rest:
                    raise StoreNotInitializedError(_broken(cfg, rest)) from None
                return None
        if registry.get("shards"):
            return registry, index
        if left <= 0:
            raise SchedulingError(
                f"the store {cfg.name!r} exists (actor {cfg.index_name()!r}) but did not finish starting "
                f"within "
                f"{cfg.schedule_timeout_s:.0f}s; stop it with `{store_command(cfg, 'stop')}` and start again"
            )
        time.sleep(0.05)


def store_command(cfg: StoreConfig, action: str) -> str:
    """The ``rlplane store ACTION`` line for the store ``cfg`` names, as a shell runs it (``--name``
    only for a store not named the default).

    Example:
        >>> store_command(StoreConfig(name="exp 1"), "stop").split(" store ")[1]
        "stop --name 'exp 1'"
    """
    named = "" if cfg.name == StoreConfig.name else f" --name {shlex.quote(cfg.name)}"
    return f"{command('rlplane')} store {action}{named}"


def no_store_message(cfg: StoreConfig) -> str:
    """Why an attach found nothing, and the two fixes: a store that outlives its starter
    (``rlplane store start``, naming the store when it is not the default one), or an embedded one.

    Example:
        >>> print(no_store_message(StoreConfig(name="exp1")))  # doctest: +ELLIPSIS
        no store 'exp1' runs in Ray namespace 'rlplane' of this Ray cluster; start one with ...
    """
    init_args = "" if cfg.name == StoreConfig.name else f"name={cfg.name!r}"
    return (
        f"no store {cfg.name!r} runs in Ray namespace {NAMESPACE!r} of this Ray cluster; start one with "
        f"`{store_command(cfg, 'start')}` (a service: it outlives the command), or call dp.init({init_args}) "
        "without attach_only=True to start an embedded one (it lives as long as the process that calls it)"
    )


def _being_created(name: str) -> bool:
    """Whether an actor named ``name`` is registered and not dead (starting, alive or restarting).

    A store is broken only when its index is dead: a call to an index that is alive but does not
    answer Ray for a while (``ActorUnavailableError``, a ``RayActorError``, on a busy node) must not
    get a live store stopped by the next ``dp.init``. Read from the GCS's actor table; unreadable
    (another Ray): False, the store is judged by its live names alone.
    """
    try:
        from ray._private import state as ray_state

        table = ray_state.actors()
    except Exception:  # noqa: BLE001 - no table: judged by live names alone
        return False
    return any(a.get("Name") == name and a.get("State") != "DEAD" for a in table.values())


def _broken(cfg: StoreConfig, names: list[str]) -> str:
    return (
        f"the store {cfg.name!r} is broken: its index is dead but {names} still run. Stop what is left "
        f"with `{store_command(cfg, 'stop')}` (or dataplane.service.launch.stop_named) and start a new store"
    )


def start_service(cfg: StoreConfig) -> tuple[dict[str, Any], ServiceHandle]:
    """Create the index and the shards, wait until all are up, and publish the registry.

    A name of the store that Ray still holds for a dead actor (``release_dead_names``) is freed and
    the start tried once more; a name a live actor holds raises ``ActorAlreadyExistsError`` (a
    ``ValueError``): another process started the same store first.
    """
    import ray

    from dataplane.transport.engine import require_engine

    require_engine(cfg.engine)  # (said here, where the store starts, not in each shard's actor)
    try:
        return _start_service(cfg)
    except ray.exceptions.ActorAlreadyExistsError:
        if not release_dead_names(cfg):
            raise
    return _start_service(cfg)


def _start_service(cfg: StoreConfig) -> tuple[dict[str, Any], ServiceHandle]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dataplane.server.index.actor import IndexActor
    from dataplane.server.shard.actor import ShardActor

    nodes = _alive_nodes()
    if not nodes:
        raise SchedulingError("the Ray cluster has no alive node with CPUs to place the store on")
    biggest = max(node.get("Resources", {}).get("CPU", 0) for node in nodes)
    if biggest < cfg.num_cpus:  # infeasible: say so now instead of waiting for the deadline
        raise SchedulingError(
            f"Ray cannot place the store's actors: each asks for num_cpus={cfg.num_cpus} but the largest "
            f"node has {biggest} CPUs. Lower num_cpus (default 0)."
        )
    n = cfg.num_shards or len(nodes)
    lifetime = "detached" if cfg.detached else None
    opts = {"namespace": NAMESPACE, "num_cpus": cfg.num_cpus, "lifetime": lifetime, "max_restarts": 0}
    creds = Credentials.new(encrypt=cfg.encrypt).to_dict()
    index_limit = min(cfg.max_message_bytes, INDEX_MAX_MESSAGE_BYTES)
    index = _remote(IndexActor).options(name=cfg.index_name(), **opts)
    index = index.remote(
        cfg.name, creds, index_limit, cfg.reservation_timeout_s, cfg.metrics, cfg.metrics_partitions
    )
    handle = ServiceHandle(index)
    try:
        for i in range(n):
            node = nodes[i % len(nodes)]["NodeID"]
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            actor = _remote(ShardActor).options(name=cfg.shard_name(i), scheduling_strategy=strategy, **opts)
            handle.shards.append(actor.remote(i, cfg.shard_capacity(n), cfg.to_dict(), creds))
        refs = [index.start.remote(), *(s.info.remote() for s in handle.shards)]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=cfg.schedule_timeout_s)
        if pending:
            names = [cfg.index_name() if r is refs[0] else cfg.shard_name(refs.index(r) - 1) for r in pending]
            raise SchedulingError(
                f"Ray could not start the store's actors {names} within {cfg.schedule_timeout_s:.0f}s: each "
                f"asks for num_cpus={cfg.num_cpus}; the cluster has {ray.available_resources()} free. "
                "Lower num_cpus, num_shards, or add resources."
            )
        infos = ray.get(refs)
        # Shards commit small puts in the index themselves (``server.shard.actor``): tell them where it is
        # before any client can learn of them, and (unbounded) who shares their host's memory.
        index_entry = {**infos[0], "name": cfg.index_name()}
        links = [s.link_index.remote(index_entry, infos[1:], ray_says_dead) for s in handle.shards]
        ray.get(links, timeout=cfg.schedule_timeout_s)
        registry = {"config": cfg.to_dict(), "index": infos[0], "shards": infos[1:], "started_by": _starter()}
        ray.get(index.register.remote(registry), timeout=cfg.schedule_timeout_s)
        registry["credentials"] = Credentials.from_dict(creds).for_clients().to_dict()
    except BaseException:
        handle.stop()
        raise
    logger.debug(  # dp.init and the CLI say it to the user
        "started store %r: %d shard(s) on %d node(s)", cfg.name, n, len({s["node_id"] for s in infos[1:]})
    )
    return registry, handle


def _starter() -> dict[str, Any]:
    """Who started the store (named in the error a client gets once it is stopped)."""
    import os
    import socket

    return {"pid": os.getpid(), "host": socket.gethostname()}


def stop_named(cfg: StoreConfig) -> bool:
    """Stop every actor of the store named ``cfg.name`` (any owner, even a broken store), and free the
    names Ray still holds for its dead ones (``release_dead_names``); False when there was nothing."""
    import ray

    names = store_actor_names(cfg)
    if not names:
        return bool(release_dead_names(cfg))
    index, shards = None, []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # gone meanwhile
            continue
        if name == cfg.index_name():
            index = actor
        else:
            shards.append(actor)
    ServiceHandle(index, shards).stop()
    release_dead_names(cfg)
    return True


__all__ = [
    "ServiceHandle",
    "find_service",
    "no_store_message",
    "store_command",
    "release_dead_names",
    "start_service",
    "stop_named",
    "store_actor_names",
]
