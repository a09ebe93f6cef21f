"""The per-process client handle: transports, the shared-memory mapping cache, and op drivers.

``StoreClient`` is built from the service's registry (shard endpoints, pids, hosts) that the index
actor hands out at attach time; after that, no Ray call is made per KV operation. It picks, per
shard, the shared-memory path (same host and the inode probe passes) or the zmq path, and the ipc
endpoint on the same host or tcp otherwise. Its sockets are closed by ``close()`` or, if the
client is simply dropped, by a ``weakref.finalize``.

Metrics: when the store's ``metrics`` option is on and this process is connected to Ray, the client
starts the process's exporter (``telemetry.export``) and records, per named call (``run(op, name)``),
its latency and outcome, and (``moved``) the rows and bytes it moved; store actors it finds dead
are counted too. Otherwise it records nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from dataplane.client import ops as _ops
from dataplane.client.mappings import MappingCache, ShardMemory, probe
from dataplane.client.sharding import HashPlacement
from dataplane.config import StoreConfig, env_unix_lane
from dataplane.errors import ShardUnavailableError
from dataplane.telemetry import export
from dataplane.telemetry.recorder import ClientMetrics
from dataplane.transport.auth import Credentials
from dataplane.transport.clients import AsyncTransport, SyncTransport
from dataplane.transport.engine import start_client
from dataplane.transport.liveness import Liveness, Target
from dataplane.transport.locality import Locality
from dataplane.transport.sockets import Endpoint
from dataplane.wire.requests import INDEX

COMMIT_WITHIN = 0.8  # a put commits only within this fraction of reservation_timeout_s
STOPPED_WAIT_S = 2.0  # how long a failed call waits to learn whether the whole store was stopped
STOPPED_RECHECK_S = 10.0  # that verdict holds this long for the calls that found the same target gone

logger = logging.getLogger(__name__)

T = TypeVar("T")


def drive(transport: SyncTransport, op: _ops.Op[T]) -> T:
    """Run a sans-IO operation to completion with blocking sockets; returns the operation's result."""
    try:
        calls = next(op)
        while True:
            calls = op.send(transport.call_many(calls))
    except StopIteration as stop:
        result: T = stop.value  # (what the generator returned: its declared result)
        return result


async def adrive(transport: AsyncTransport, op: _ops.Op[T]) -> T:
    """Run a sans-IO operation to completion on the running event loop; returns its result."""
    try:
        calls = next(op)
        while True:
            calls = op.send(await transport.call_many(calls))
    except StopIteration as stop:
        result: T = stop.value
        return result


def _close_resources(sync: SyncTransport, asyn: AsyncTransport, maps: MappingCache) -> None:
    sync.close()
    asyn.close()
    maps.clear()


class StoreClient:
    """Routes KV operations of this process to the shards and the index."""

    def __init__(
        self,
        registry: dict[str, Any],
        transport: str | None = None,
        allow_pickle: bool = False,
        remote_dead: Callable[[str, str], bool] | None = None,
    ) -> None:
        """``remote_dead(actor_name)``: whether a store actor this process cannot see through
        ``/proc`` is dead (``dataplane.service.liveness.ray_says_dead``; without it such an actor's
        calls end at their deadline only)."""
        self.registry = registry
        self.config = StoreConfig.from_dict(registry["config"])
        # This process's own choice, never the service's: what a reader unpickles is up to the reader.
        self.allow_pickle = allow_pickle
        mode = transport or self.config.transport
        here = Locality.here()
        shards = registry["shards"]
        # Each same-host shortcut only where the namespace it needs is shared (``transport.locality``):
        # shared memory is mapped through /proc/<pid> (the pid namespace), then probed for real.
        self.shm = [
            mode not in ("zmq", "tcp")
            and here.shares_pids(Locality.from_dict(s.get("locality")))
            and probe(s["pid"], s["generations"])
            for s in shards
        ]
        if mode == "shm" and not all(self.shm):
            logger.warning(
                "transport='shm' requested but some shards are not mappable here; using zmq for them"
            )
        creds = Credentials.from_dict(registry.get("credentials", {}))
        unix_lane = env_unix_lane()
        curve = creds.encrypt
        endpoints: dict[int, Endpoint] = {}
        targets: dict[int, Target] = {}
        for i, actor in [*enumerate(shards), (INDEX, registry["index"])]:
            name = self.config.index_name() if i == INDEX else self.config.shard_name(i)
            there = Locality.from_dict(actor.get("locality"))
            ipc = mode != "tcp" and here.shares_files(there)
            lane = mode != "tcp" and unix_lane and here.shares_network(there)
            endpoints[i] = Endpoint(
                actor["ipc"] if ipc else actor["tcp"],
                name,
                curve and not ipc,
                actor.get("unix") if lane else None,
                max_frame=actor.get("max_message_bytes", -1),  # what the service takes (-1: unknown)
                # Large buffers through the shard's transfer engine wherever they would cross tcp.
                engine=None if ipc or lane or curve or i == INDEX else actor.get("engine"),
            )
            pid, start = actor.get("pid", -1), actor.get("pid_start", "")
            targets[i] = Target(name, pid, start, here.shares_pids(there), actor.get("actor_id", ""))
        timeout = self.config.rpc_timeout_s
        # Recording only where the store asks for it and the process can export (it is on Ray).
        self.metrics = ClientMetrics(self.config.name) if self.config.metrics and export.start() else None
        on_dead = None if self.metrics is None else self.metrics.peer_dead
        self.liveness = Liveness(targets, on_dead=on_dead, remote_dead=remote_dead)
        args = (endpoints, creds, timeout, self.liveness, self.config.max_message_bytes)
        engine = None
        kinds = {s.get("engine_kind", "native") for s in shards if s.get("engine")}
        if kinds:
            engine = start_client(
                kinds.pop(),  # (every shard of a store runs the engine its config names)
                creds.secret,
                connections=self.config.engine_connections,
                max_bytes=self.config.max_message_bytes,
            )
        self.sync = SyncTransport(*args, engine=engine, engine_min_bytes=self.config.engine_min_bytes)
        self.asyn = AsyncTransport(*args)
        self.maps = MappingCache()
        # The operations map nothing themselves: they read and write shard files through this.
        self.memory = ShardMemory([s["pid"] for s in shards], [s["generations"] for s in shards], self.maps)
        self.route = _ops.Route(
            placement=HashPlacement(len(shards)),
            shm=self.shm,
            memory=self.memory,
            shm_min_bytes=self.config.shm_min_bytes,
            commit_within_s=COMMIT_WITHIN * self.config.reservation_timeout_s,
            rpc_timeout_s=self.config.rpc_timeout_s,
        )
        self._finalizer = weakref.finalize(self, _close_resources, self.sync, self.asyn, self.maps)
        # A call found the whole store stopped: ``dp.current_client`` then attaches to one started
        # again under the same name, if any.
        self.stopped = False
        self._stopped_lock = threading.Lock()
        self._stopped_seen: dict[str, tuple[float, bool]] = {}  # failed target -> (when, stopped?)

    @property
    def transport(self) -> str:
        return "shm" if self.shm and all(self.shm) else ("zmq" if not any(self.shm) else "mixed")

    def run(self, op: _ops.Op[T], name: str | None = None) -> T:
        """Drive ``op`` with blocking sockets; ``name`` (e.g. "put") times it for the metrics."""
        started = time.perf_counter()
        try:
            out = drive(self.sync, op)
        except BaseException as exc:
            self._ended(name, started, exc)
            if isinstance(exc, ShardUnavailableError) and self._store_stopped(exc.shard):
                raise self._stopped_error(exc) from None
            raise
        self._ended(name, started)
        return out

    async def arun(self, op: _ops.Op[T], name: str | None = None) -> T:
        """``run`` on the running event loop."""
        started = time.perf_counter()
        try:
            out = await adrive(self.asyn, op)
        except BaseException as exc:
            self._ended(name, started, exc)
            if isinstance(exc, ShardUnavailableError):
                import asyncio

                if await asyncio.to_thread(self._store_stopped, exc.shard):
                    raise self._stopped_error(exc) from None
            raise
        self._ended(name, started)
        return out

    def _ended(self, name: str | None, started: float, exc: BaseException | None = None) -> None:
        if name is not None and self.metrics is not None:
            self.metrics.call(name, time.perf_counter() - started, exc)
        if isinstance(exc, ShardUnavailableError):
            self._forget(exc.shard)

    def moved(self, op: str, rows: int, columns: dict[str, Any] | None = None) -> None:
        """Count the rows a call that succeeded moved, and the payload bytes of its ``columns`` (the
        rows' data buffers); nothing at all without metrics."""
        metrics = self.metrics
        if metrics is not None and metrics.rec.on:
            nbytes = None if columns is None else sum(col.nbytes for col in columns.values())
            metrics.moved(op, rows, nbytes)

    def _store_stopped(self, failed: str) -> bool:
        """Whether the whole store was stopped (its index and shards are gone), not one actor lost.

        One check per failed target at a time, its verdict kept ``STOPPED_RECHECK_S``: a burst of
        calls that found the same shard gone (200 concurrent async gets) waits for one check, not
        one each.
        """
        with self._stopped_lock:
            seen = self._stopped_seen.get(failed)
            if seen is not None and time.monotonic() - seen[0] < STOPPED_RECHECK_S:
                return seen[1]
            verdict = self._check_stopped(failed)
            self._stopped_seen[failed] = (time.monotonic(), verdict)
            self.stopped = self.stopped or verdict
            return verdict

    def _check_stopped(self, failed: str) -> bool:
        """A store being stopped closes its shards' connections and kills its shards, then its index
        (``ServiceHandle.stop``), so the index may still run for a moment after the shard this call
        found gone: this waits up to ``STOPPED_WAIT_S`` for it to go (a shard lost alone costs its
        error that much more, once). An index found gone while shard 0 lives died alone (a broken
        store)."""
        if failed == self.config.index_name():
            return self.liveness.dead(0)
        target = next((i for i in range(len(self.shm)) if self.config.shard_name(i) == failed), 0)
        deadline = time.monotonic() + STOPPED_WAIT_S
        while True:
            if self.liveness.dead(INDEX) and self.liveness.dead(target):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # polling the actors' liveness, bounded by the deadline above

    def _where(self, name: str) -> str:
        """The address of the host a store actor ran on (from the registry)."""
        actors = {self.config.index_name(): self.registry["index"]}
        actors.update((self.config.shard_name(i), s) for i, s in enumerate(self.registry["shards"]))
        return str(actors.get(name, {}).get("tcp", "?")).split("//")[-1].rsplit(":", 1)[0]

    def _stopped_error(self, exc: ShardUnavailableError) -> ShardUnavailableError:
        """What happened (the store was stopped, or lost with its host), who did it as far as this
        process can know, the fix."""
        far = [t for t in self.liveness.targets.values() if t.name in (exc.shard, self.config.index_name())]
        if any(not t.local for t in far):  # (this process cannot tell a stop from a lost host there)
            hosts = sorted({self._where(t.name) for t in far})
            return ShardUnavailableError(
                exc.shard,
                f"the store {self.config.name!r} is gone: {exc.shard} (on {self._where(exc.shard)}) and "
                f"its index (on {self._where(self.config.index_name())}) are dead. It was stopped, or the "
                f"host(s) {', '.join(hosts)} were lost (Ray marks a lost host's node dead within about "
                "30 s: `ray status`); the rows held there are gone with them. Start the store again (on the "
                "remaining nodes) and load a checkpoint (dp.load_checkpoint) to get them back",
            )
        by = self.registry.get("started_by") or {}
        who = f"process {by['pid']} on {by['host']}" if by else "the process that started it"
        if self.config.detached:
            how = (
                f"it ran as a service (`rlplane store start`, from {who}) and was stopped (`rlplane store "
                "stop`) or its actors were killed; start it again with `rlplane store start`: this process "
                "attaches to the new store on its next call"
            )
        else:
            how = (
                f"it was an embedded store, started by dp.init() in {who}, and an embedded store stops "
                "when that process calls dp.close() or exits. Call dp.close() there after the last call "
                "that needs the store, or run the store as a service that outlives any one process "
                "(`rlplane store start`)"
            )
        return ShardUnavailableError(
            exc.shard,
            f"the store {self.config.name!r} was stopped while process {os.getpid()} still used it "
            f"({exc.shard} is gone): {how}",
        )

    def _forget(self, shard_name: str) -> None:
        """Drop our mappings of a dead shard's memory, so none of it outlives the shard here."""
        for i in range(len(self.shm)):
            if self.config.shard_name(i) == shard_name:
                self.maps.drop_shard(i)

    def close(self) -> None:
        self._finalizer()


__all__ = ["StoreClient", "adrive", "drive"]
