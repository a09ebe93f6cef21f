"""The shard's process side: a Ray actor holding a ``ShardCore`` served by a ``ShardServer`` thread.

The actor's Ray methods are used only to start, describe, link and stop the shard, and to save and load
its rows in a checkpoint (long file I/O, run beside the request loop); every KV operation reaches it
over zmq, on sockets that admit only the store's own peers (``transport.auth``). Runs on the shard's node.

``ShardServer`` also makes small puts ready in the index itself (``put_ready``), so a writer's small
put costs it one round trip instead of two (one to the shard, one to the index):

1. the shard stores the rows (they are readable from now on) and queues the index commit, built
   from what it stored (partition, keys, fields, specs; the client adds only the tags);
2. after each pass over its sockets it sends every queued commit in one ``commits`` request to the
   index (one message however many writers' puts it stored in that pass);
3. when the index answers, the shard answers each writer: the index's reply (fields and tags) on
   success; on a refusal (the index recorded nothing) it takes the rows back first and passes the
   error on, so nothing of the put stays; when the index does not answer within half of
   ``rpc_timeout_s``, or its process is found dead, the writer learns that the rows are stored but
   not ready (``index_error``), as when a put's index commit fails on the client's path.

So a row is still ready (handed out by ``next_batch``, listed) only once its shard can serve it, and
a writer's put returns only after both have recorded it (read-after-write for every reader).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from dataplane.config import env_unix_lane
from dataplane.errors import WireError
from dataplane.server.dispatch import OpReply
from dataplane.server.router import POLL_MS, Peer, RequestServer
from dataplane.server.shard.checkpoint import ShardCheckpoints
from dataplane.server.shard.core import PutUndo, ShardCore
from dataplane.server.shard.host_memory import HostMemory
from dataplane.telemetry import bounds as _bounds
from dataplane.telemetry import export
from dataplane.telemetry.recorder import ClientMetrics, Key, ServerMetrics
from dataplane.transport import unix as _unix
from dataplane.transport.auth import Credentials
from dataplane.transport.engine import start_server
from dataplane.transport.liveness import Liveness, Target, process_start
from dataplane.transport.locality import Locality
from dataplane.transport.sockets import (
    EVENTS,
    NOBLOCK,
    POLLIN,
    Endpoint,
    Endpoints,
    close_socket,
    recv_frames,
    send_frames,
)
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.policy import Probe, RequestPolicy
from dataplane.wire.requests import INDEX, next_rid, reply

logger = logging.getLogger(__name__)

_Files = dict[str, Any]  # a checkpoint manifest's files: name -> entry (``server.checkpoint_files``)
INDEX_WAIT = 0.5  # of rpc_timeout_s: a shard answers its writer well before the writer gives up
MAX_BATCH = 256  # queued index commits sent at once even in the middle of a busy pass


@dataclass(eq=False)
class _Forward:
    """One stored ``put_ready`` whose writer waits for the index."""

    sock: Peer
    ident: Any
    rid: int
    commit: _protocol.IndexCommit
    undo: PutUndo
    answered: bool = False


class ShardServer(RequestServer):
    """The shard's request loop: ``ShardCore`` operations, and ``put_ready`` passed on to the index."""

    core: ShardCore

    def __init__(
        self,
        core: ShardCore,
        host_ip: str,
        name: str,
        creds: Credentials,
        *,
        rpc_timeout_s: float,
        lock: threading.Lock,
        max_message_bytes: int = -1,
    ) -> None:
        super().__init__(
            core, host_ip, name, creds, tick=core.tick, lock=lock, max_message_bytes=max_message_bytes
        )
        self._index_wait_s = INDEX_WAIT * rpc_timeout_s
        self._link: Endpoints | None = None  # set by ``link`` before any client learns of this shard
        # When each ``commits`` request in flight ends (``wire.policy``), also set by ``link``.
        self._policy: RequestPolicy | None = None
        # The link's connection to the index, opened on the server thread: a Unix-lane connection
        # when the index is on this host (and the lane is on), else a DEALER.
        self._index_conn: Any = None
        self._outbox: list[_Forward] = []
        self._sent: dict[int, list[_Forward]] = {}  # rid -> the puts its ``commits`` request carries
        self._next_check = 0.0  # no request in flight is due for a probe or its deadline before this
        self.partition_series = -1  # partitions with series of their own (StoreConfig.metrics_partitions)
        self._peer_metrics: ClientMetrics | None = None  # the index found dead, when metrics are on

    def link(self, index: dict[str, Any], remote_dead: Callable[[str, str], bool] | None = None) -> None:
        """Where the index listens (its registry entry), so this shard can commit puts there."""
        here, there = Locality.here(), Locality.from_dict(index.get("locality"))
        creds = self._creds.for_clients()
        ipc = here.shares_files(there)  # each shortcut only where the namespace it needs is shared
        address = index["ipc"] if ipc else index["tcp"]
        unix = index.get("unix") if here.shares_network(there) and env_unix_lane() else None
        limit = index.get("max_message_bytes", -1)
        endpoint = Endpoint(address, index["name"], creds.encrypt and not ipc, unix, max_frame=limit)
        pid, start, actor_id = index.get("pid", -1), index.get("pid_start", ""), index.get("actor_id", "")
        target = Target(index["name"], pid, start, here.shares_pids(there), actor_id)
        on_dead = None if self._peer_metrics is None else self._peer_metrics.peer_dead
        liveness = Liveness({INDEX: target}, on_dead=on_dead, remote_dead=remote_dead)
        self._link = Endpoints({INDEX: endpoint}, creds, self._index_wait_s, liveness, lane=True)
        self._policy = RequestPolicy(liveness.known)

    # ---- requests --------------------------------------------------------------------------------
    def serve(
        self, sock: Peer, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]
    ) -> OpReply | None:
        if op != "put_ready":
            reply = super().serve(sock, ident, rid, op, body, bufs)
            if reply is not None and type(reply[0]) is _protocol.ShardStatsReply:
                reply[0].clients = self.connections  # what only the loop knows: its open connections
            return reply
        if self._link is None:
            raise WireError(f"{self.name} is not linked to the store's index yet; nothing was written")
        # Stored in steps (other requests answered between them), then passed on to the index.
        self._jobs.start(
            self.core.job_put_ready(body, bufs), functools.partial(self._forward, sock, ident, rid)
        )
        return None

    def _forward(
        self,
        sock: Peer,
        ident: Any,
        rid: int,
        stored: tuple[_protocol.IndexCommit, PutUndo] | None,
        exc: BaseException | None,
    ) -> None:
        """A put stored (``ShardCore.job_put_ready``): its commit queued for the index, and its writer
        answered once the index has; or, refused, the writer told why (nothing was stored)."""
        if exc is not None or stored is None:
            self.deliver(sock, ident, _wire.encode_error(rid, exc or WireError("the put stored nothing")))
            return
        self._outbox.append(_Forward(sock, ident, rid, *stored))
        if len(self._outbox) >= MAX_BATCH:
            self._send_outbox()

    def poll_timeout_ms(self) -> int:
        return 0 if self.core.dropped else POLL_MS  # rows of a dropped partition left: a slice per pass

    def after_poll(self) -> None:
        # Each step guarded on its own: a failure in one answers the writers it concerns, and the
        # others still run (``RequestServer._guarded`` logs it).
        if self.core.dropped:  # one slice of a dropped partition's rows, then requests again
            with self._lock:
                self._guarded("freeing a dropped partition's rows", self.core.free_some)
        if self._outbox:
            self._send_outbox()
        if type(self._index_conn) is _unix.Conn and self._index_conn.pending:  # the index's socket was full
            self._guarded("flushing the commits to the index", self._index_conn.flush)
        if self._sent and time.monotonic() >= self._next_check:
            try:
                self._check_sent()
            except Exception as exc:  # noqa: BLE001 - its writers are answered, the link starts afresh
                logger.exception("%s: checking the commits in flight to the index failed", self.name)
                link = self._link
                assert link is not None
                why = f" (checking its commits in flight failed: {exc!r})"
                self._lose_index(link.unavailable(INDEX, 0.0, why))

    # ---- to the index and back -------------------------------------------------------------------
    def _send_outbox(self) -> None:
        """Send the queued commits to the index in one request. Until the request is on its way
        anything that fails refuses them (the index never saw them: their rows are taken back)."""
        items, self._outbox = self._outbox, []
        link, policy = self._link, self._policy
        assert link is not None and policy is not None  # _put_ready queues nothing before the link
        try:
            if policy.refuses(INDEX):  # found dead before: these commits are not even sent
                self._refuse(items, link.died(INDEX))
                return
            sock = self._index_socket(link)
            rid = next_rid()
            frames = _wire.encode_request(rid, "commits", _protocol.Commits([f.commit for f in items]))
            refused = link.too_large(INDEX, "commits", frames)
            if refused is not None:  # (256 small puts' commits: never in practice)
                self._refuse(items, refused)
                return
            if type(sock) is _unix.Conn:
                # Queued whole or not at all: what the socket does not take now is sent by after_poll.
                if not sock.write(frames):
                    self._drop_index_socket()
                    self._refuse(items, link.gone(INDEX, 0.0, " (its connection closed)"))
                    return
            else:
                self.touch(sock)
                send_frames(sock, frames, NOBLOCK)
        except zmq.Again:  # not queued: the index never sees these commits
            self._refuse(items, link.unavailable(INDEX, 0.0, " (its send queue is full)"))
            return
        except ConnectionError as exc:  # the Unix lane refused: the index is gone (or not this store's)
            self._refuse(items, link.gone(INDEX, 0.0, f" (connecting failed: {exc})"))
            return
        except Exception as exc:  # noqa: BLE001 - e.g. out of file descriptors: not sent either
            logger.warning("%s: sending %d commits to the index failed: %r", self.name, len(items), exc)
            self._refuse(items, exc)
            return
        now = time.monotonic()
        policy.start(rid, INDEX, now, now + self._index_wait_s)  # (not refused: checked above)
        self._sent[rid] = items
        self._next_check = min(self._next_check, policy.wake_at())
        self.core.ready_puts += len(items)  # counted for stats(): how many puts one request carries
        self.core.ready_batches += 1

    def _index_socket(self, link: Endpoints) -> Any:
        if self._index_conn is None:
            self._index_conn = link.connect(self._ctx, INDEX)  # (a Unix-lane connect does not wait)
            self.watch(self._index_conn, self._on_index_reply)
        return self._index_conn

    def _drop_index_socket(self) -> None:
        if self._index_conn is not None:
            self.unwatch(self._index_conn)
            close_socket(self._index_conn)
            self._index_conn = None

    def _on_index_reply(self) -> None:
        link = self._link
        assert link is not None
        sock = self._index_conn
        messages: list[list[Any]]
        try:
            if type(sock) is _unix.Conn:
                try:
                    messages = sock.read()
                except _unix.ConnectionClosed as exc:
                    self._lose_index(link.gone(INDEX, 0.0, f" ({exc})"))
                    return
            else:
                messages = []
                while sock is not None and sock.getsockopt(EVENTS) & POLLIN:
                    messages.append(recv_frames(sock, NOBLOCK))
        except Exception as exc:  # noqa: BLE001 - a link that cannot be read is lost: its writers are told
            logger.exception("%s: reading the index's replies failed", self.name)
            self._lose_index(link.unavailable(INDEX, 0.0, f" (reading its reply failed: {exc!r})"))
            return
        for frames in messages:
            self._index_reply(frames)

    def _index_reply(self, frames: list[Any]) -> None:
        try:
            rep, _ = _wire.decode_raw_reply(frames)
        except Exception:  # noqa: BLE001 - its writers are answered at its deadline
            logger.warning("%s: an undecodable reply from the index was dropped", self.name, exc_info=True)
            return
        policy = self._policy
        assert policy is not None
        items = self._sent.pop(rep.rid, None)
        if not policy.reply(rep.rid) or items is None:  # the answer to a request that already gave up
            return
        try:
            self._settle(items, rep)
        except Exception as exc:  # noqa: BLE001 - the writers not answered yet are told, the loop goes on
            logger.exception("%s: answering %d puts from the index failed", self.name, len(items))
            why = WireError(f"the shard failed to read the index's answer to this put ({exc!r})")
            self._not_ready([f for f in items if not f.answered], why)

    def _settle(self, items: list[_Forward], rep: _wire.RawReply) -> None:
        """Answer the writers of one ``commits`` request from the index's reply."""
        if rep.error is not None:  # the whole request was refused: the index recorded none of it
            self._refuse(items, _rebuild(rep.error))
            return
        try:
            results = reply(rep.body, _protocol.CommitsReply).results
        except WireError:
            results = []
        if len(results) != len(items):
            self._not_ready(items, WireError(f"the index answered {len(items)} commits malformed"))
            return
        for fwd, res in zip(items, results, strict=True):
            if res.ok is not None:  # the index's commit reply, passed on as the put's
                ready = _protocol.PutReadyReply(res.ok.fields, res.ok.tags)
                self._answer(fwd, _wire.encode_reply(fwd.rid, ready))
            elif res.err is not None:
                self._refuse([fwd], _rebuild(res.err))
            else:
                self._not_ready([fwd], WireError("the index answered a commit malformed"))

    def _refuse(self, items: list[_Forward], exc: BaseException) -> None:
        """The index recorded nothing of these puts: take their rows back, then pass ``exc`` on."""
        with self._lock:
            for fwd in items:
                self.core.undo_put(fwd.undo)
        for fwd in items:
            self._answer(fwd, _wire.encode_error(fwd.rid, exc))

    def _answer(self, fwd: _Forward, reply: list[Any]) -> None:
        fwd.answered = True
        self.deliver(fwd.sock, fwd.ident, reply)

    def _not_ready(self, items: list[_Forward], exc: BaseException) -> None:
        """Whether the index recorded these puts is unknown: their rows stay, and the writers are told
        (taking the rows back could leave the index listing rows no shard holds)."""
        for fwd in items:
            self._answer(
                fwd, _wire.encode_reply(fwd.rid, _protocol.PutReadyReply(index_error=_wire.error_fields(exc)))
            )

    def _lose_index(self, exc: BaseException) -> None:
        """The index is gone: what it did with the commits in flight is unknown (``_not_ready``), and
        the next commit opens a new socket."""
        sent, self._sent = list(self._sent.values()), {}
        if self._policy is not None:
            self._policy.lost(INDEX)  # (a late answer to any of them is dropped)
        for items in sent:
            self._not_ready(items, exc)
        self._drop_index_socket()

    def _check_sent(self) -> None:
        """Carry out what the policy says is due for the commits in flight: a request past its
        deadline tells its writers; a silent index is probed, and found dead, the link is lost."""
        link, policy = self._link, self._policy
        assert link is not None and policy is not None
        now = time.monotonic()
        for decision in policy.due(now):
            if isinstance(decision, Probe):
                # Only a /proc read here: asking Ray about a remote index could stall this loop.
                dead = link.liveness.targets[INDEX].local and link.liveness.dead(INDEX)
                if policy.probed(INDEX, dead, now):
                    self._lose_index(link.died(INDEX))
                    return
            else:
                self._not_ready(self._sent.pop(decision.rid), link.give_up(decision))
        self._next_check = policy.wake_at()

    # ---- metrics ---------------------------------------------------------------------------------
    def metrics_snapshot(self, labels: tuple[str, ...]) -> tuple[dict[Key, float], dict[Key, float]]:
        counters, gauges = super().metrics_snapshot(labels)
        core = self.core
        for op, count in (("put", core.rows_put), ("get", core.rows_got), ("clear", core.rows_cleared)):
            counters[("dataplane_shard_rows", *labels, op)] = count
        counters[("dataplane_shard_bytes", *labels, "put")] = core.bytes_put
        counters[("dataplane_shard_bytes", *labels, "clear")] = core.bytes_cleared
        counters[("dataplane_shard_reservations_expired", *labels)] = core.expired
        capacity = core.capacity if core.capacity is not None else core.host_memory
        for state, nbytes in (
            ("used", core.used),
            ("reserved", core.pending),
            ("free", max(0, capacity - core.used - core.pending)),
        ):
            gauges[("dataplane_shard_capacity_bytes", *labels, state)] = nbytes
        gauges[("dataplane_shard_resident_bytes", *labels)] = core.pool.bytes_resident + core.heap_bytes
        sizes = {partition: part.nbytes for partition, part in core.partitions.items()}
        rows = {partition: len(part.rows) for partition, part in core.partitions.items()}
        gauges[("dataplane_shard_rows_held", *labels)] = sum(rows.values())
        keep = _bounds.chosen(sizes, self.partition_series)
        for name, series in (
            ("dataplane_shard_partition_rows", rows),
            ("dataplane_shard_partition_bytes", sizes),
        ):
            for partition, n in _bounds.fold(series, keep, _bounds.OTHER).items():
                gauges[(name, *labels, partition)] = n
        return counters, gauges


def _rebuild(error: Any) -> BaseException:
    try:
        return _wire.rebuild_error(error)
    except WireError as exc:
        return WireError(f"the index answered with a malformed error: {exc}")


class ShardActor:
    """A storage shard (wrapped with ``ray.remote`` by ``service.launch``; never built by user code)."""

    def __init__(
        self, shard_id: int, capacity_bytes: int | None, cfg: dict[str, Any], creds: dict[str, str]
    ) -> None:
        import ray

        # An unbounded store's shards on one host share its memory (``server.shard.host_memory``).
        host = None if capacity_bytes is not None else HostMemory.for_shard(cfg["name"], shard_id)
        self.core = ShardCore(
            shard_id,
            capacity_bytes,
            warm_idle_s=cfg["warm_idle_s"],
            warm_retain_bytes=cfg["warm_retain_bytes"],
            reservation_timeout_s=cfg["reservation_timeout_s"],
            name=cfg["name"],
            host=host,
        )
        self._lock = threading.Lock()
        ip = ray.util.get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        self._actor_id = ray.get_runtime_context().get_actor_id() or ""
        limit = cfg["max_message_bytes"]
        if capacity_bytes is not None:  # no frame can be larger than what the shard may hold
            limit = min(limit, capacity_bytes + (1 << 20))
        self._max_message_bytes = limit  # published (``info``): clients refuse a bigger frame themselves
        # What this process holds before it serves (modules, Ray's worker) lives as long as it does:
        # out of the garbage collector's sight (and the server goes on freezing: ``router.freeze_heap``).
        gc.freeze()
        credentials = Credentials.from_dict(creds)
        self.server = ShardServer(
            self.core,
            ip,
            f"{cfg['name']}-shard{shard_id}",
            credentials,
            rpc_timeout_s=cfg["rpc_timeout_s"],
            lock=self._lock,
            max_message_bytes=limit,
        )
        self._engine_kind = cfg.get("engine", "native")
        if not credentials.encrypt:  # (an encrypting store keeps every byte in its CURVE stream)
            self.server.engine = start_server(
                self._engine_kind,
                ip,
                credentials.secret,
                max_bytes=limit,
                ttl_s=cfg["rpc_timeout_s"],
                who=self.server.name,
            )
            self.server.engine_min_bytes = cfg.get("engine_min_bytes", 4 << 20)
            if self.server.engine is not None:  # (an engine that registered a segment lets go of it first)
                self.core.pool.on_free = self.server.engine.forget
        if cfg.get("metrics", True) and export.start():  # before the loop starts: it reads these
            self.server.partition_series = cfg.get("metrics_partitions", -1)
            self.server._peer_metrics = ClientMetrics(cfg["name"])
            self.server.metrics = ServerMetrics(
                "dataplane_shard", (cfg["name"], str(shard_id)), ShardCore.OPS
            )
        self.server.start()
        node = f"{ip} (Ray node {self._node_id[:12]})"
        self.checkpoints = ShardCheckpoints(self.core, self._lock, node, cfg["shm_min_bytes"])

    def info(self) -> dict[str, Any]:
        return {
            "shard": self.core.shard_id,
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "node_id": self._node_id,
            "actor_id": self._actor_id,
            "locality": Locality.here().to_dict(),
            "tcp": self.server.tcp,
            "ipc": self.server.ipc,
            "unix": self.server.unix,
            "engine": None if self.server.engine is None else self.server.engine.address,
            "engine_kind": self._engine_kind,
            "max_message_bytes": self._max_message_bytes,
            "host_ledger": self.core.host.ref(),  # (an unbounded shard's: see ``link_index``)
            "generations": self.core.pool.table.ref(),  # also the probe: can a client map our files?
        }

    def link_index(
        self,
        index: dict[str, Any],
        peers: list[dict[str, Any]] | None = None,
        remote_dead: Callable[[str, str], bool] | None = None,
    ) -> bool:
        """Learn the index's endpoints (``ShardServer.link``) and the store's shards (``peers``, their
        ``info``: an unbounded shard shares its host's memory with those on its host,
        ``HostMemory.share``); called once by the store's starter, before any client knows the shard.
        ``remote_dead``: how to tell the index is dead when it runs in another pid namespace (the
        starter passes Ray's check, ``service.liveness``)."""
        self.server.link(index, remote_dead)
        if peers:
            with self._lock:
                self.core.host.share(peers, Locality.here())
        return True

    def ping(self) -> bool:
        return True

    def clients(self) -> int:
        """Open connections to this shard: one per client socket (``rlplane store status``)."""
        return self.server.connections

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = msgspec.to_builtins(self.core.stats())  # (a Ray call: plain values)
            return out

    def engine_stats(self) -> dict[str, int]:
        """Its transfer engine's counts, where it keeps any (the mooncake engine's holds, registered
        segments, lends and copies); empty otherwise."""
        stats = getattr(self.server.engine, "stats", None)
        return dict(stats()) if stats is not None else {}

    # ---- checkpoints (``server.shard.checkpoint``): Ray calls, so that the request loop keeps serving
    # while the files are written or read; the actor runs one at a time.
    def checkpoint_save(
        self, path: str, token: str, num_shards: int, index_file: dict[str, int]
    ) -> _protocol.ShardSaveReply:
        return self.checkpoints.save(path, token, num_shards, index_file)

    def checkpoint_stage(
        self, path: str, load: int, num_shards: int, files: _Files, saved_shards: int, timeout_s: float
    ) -> _protocol.ShardStageReply:
        return self.checkpoints.stage(path, load, num_shards, files, saved_shards, timeout_s)

    def checkpoint_commit(self, load: int) -> bool:
        self.checkpoints.commit(load)
        return True

    def checkpoint_finish(self, load: int, keep: bool) -> bool:
        self.checkpoints.finish(load, keep)
        return True

    def shutdown(self) -> bool:
        self.server.stop()
        if self.server.engine is not None:
            self.server.engine.close()
        with self._lock:
            self.core.close()
        return True


__all__ = ["ShardActor", "ShardServer"]
