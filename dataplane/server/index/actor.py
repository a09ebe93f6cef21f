"""The index's process side: ``IndexServer``, the request loop serving an ``IndexCore``, and
``IndexActor``, the Ray actor around it (it starts the server, takes the shard registry and hands
out the client credentials).

``IndexServer`` serves the core on zmq ROUTER sockets from one thread (no locks needed) and parks
requests that wait for rows; ``IndexActor`` answers a few Ray calls used only at attach time
(``info``). Runs on the index's node.

Design rule, enforced in ``IndexServer``: the index receives metadata only. A request that
carries any buffer frame is refused with an error, so tensor bytes can never reach it.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from dataplane.errors import DataplaneError, PartitionNotFoundError
from dataplane.server.dispatch import OpReply
from dataplane.server.index.core import IndexCore
from dataplane.server.router import POLL_MS, Peer, RequestServer
from dataplane.telemetry import bounds as _bounds
from dataplane.telemetry import export
from dataplane.telemetry.recorder import Key, ServerMetrics
from dataplane.transport import auth as _auth
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol

logger = logging.getLogger(__name__)

# Requests that may wait for rows, or that take rows (a reply that cannot be delivered gives them back).
_TAKING_OPS = _protocol.WAITING_OPS | {"claim"}


@dataclass(eq=False)
class _Waiter:
    """A ``next`` / ``ready`` request parked until rows are ready for it (or its deadline passes)."""

    sock: Peer
    ident: Any
    rid: int
    op: str
    body: Any
    start: float
    deadline: float
    done: bool = False
    incarnation: int | None = None  # of the partition it waits on, if that existed when it came


class IndexServer(RequestServer):
    """The index's request loop: one thread, so ``IndexCore`` needs no lock.

    Requests that may wait (``next``, ``ready``) are answered at once when rows are ready; otherwise
    they are parked per partition and re-tried, in arrival order, after every request that changed
    that partition (a commit, a delete, a finish, ...): woken by the change, never by polling. A
    parked request past its ``timeout_s`` is answered with ``BatchTimeoutError``. Replies use
    mandatory routing, so a batch whose consumer has gone away cannot be delivered and is given back
    to the task (``IndexCore.give_back``).
    """

    core: IndexCore

    def __init__(self, core: IndexCore, host_ip: str, name: str, creds: _auth.Credentials, **kw: Any) -> None:
        self._waiters: dict[str, list[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._by_take: dict[str, _Waiter] = {}  # parked takes, to unpark one its consumer gives up on
        self._seq = itertools.count()
        self.rows_taken = 0  # rows handed out to consumers (metrics)
        self.partition_series = -1  # partitions with series of their own (StoreConfig.metrics_partitions)
        kw.update(max_frames=0, mandatory=True)  # metadata only: no buffer frames
        super().__init__(core, host_ip, name, creds, **kw)

    def _serve_one(self, sock: Peer, msg: list[Any]) -> None:
        super()._serve_one(sock, msg)
        self._recheck()  # the request may have changed partitions that parked requests wait on

    def serve(
        self, sock: Peer, ident: Any, rid: int, op: str, body: Any, bufs: list[memoryview]
    ) -> OpReply | None:
        if op not in _TAKING_OPS:
            if op == "release":  # a parked take its consumer gave up on waits no more
                self._unpark(self._by_take.get(body.take))
            return super().serve(sock, ident, rid, op, body, bufs)
        # Answered now if it can be, else parked until its partition changes.
        now = time.monotonic()
        waiter = _Waiter(sock, ident, rid, op, body, now, math.inf)
        if self._try(waiter):
            return None
        if body.timeout_s is not None:
            waiter.deadline = now + body.timeout_s
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))
        part = self.core.partitions.get(body.partition)
        waiter.incarnation = None if part is None else part.incarnation
        self._waiters.setdefault(body.partition, []).append(waiter)
        take = getattr(body, "take", None)
        if take is not None:
            self._by_take[take] = waiter
        return None

    def _unpark(self, w: _Waiter | None) -> None:
        """Answer a parked request whose consumer gave it up, taking nothing; its socket may be gone."""
        if w is None or w.done:
            return
        self._done(w)
        waiting = self._waiters.get(w.body.partition, [])
        if w in waiting:
            waiting.remove(w)
        err = DataplaneError(f"the consumer gave up on this {w.op!r} call; nothing was taken")
        self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, err))

    def _done(self, w: _Waiter) -> None:
        w.done = True
        take = getattr(w.body, "take", None)
        if take is not None and self._by_take.get(take) is w:
            del self._by_take[take]

    def _try(self, w: _Waiter) -> bool:
        """Answer ``w`` if it can be answered now (its rows are ready, or it failed)."""
        try:
            if w.incarnation is not None:
                part = self.core.partitions.get(w.body.partition)
                if part is None or part.incarnation != w.incarnation:
                    raise PartitionNotFoundError(
                        w.body.partition,
                        f"partition {w.body.partition!r} was cleared while this {w.op!r} call waited on it "
                        "(clear_partition); nothing was taken",
                    )
            result = self.core.operation(w.op)(w.body)
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the loop goes on
            self._done(w)
            self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, exc))
            return True
        if result is None:
            return False
        self._done(w)
        if self.metrics is not None:
            self.metrics.waited(w.op, time.monotonic() - w.start)
        taken = result.keys if type(result) is _protocol.BatchReply else []  # (a ready takes nothing)
        if not self.deliver(w.sock, w.ident, _wire.encode_reply(w.rid, result)):
            if taken:  # its consumer went away: ready again
                self.core.give_back(w.body.partition, w.body.task, w.body.take, taken)
        else:
            self.rows_taken += len(taken)
        return True

    def _recheck(self) -> None:
        """Re-try the parked requests of every partition that changed, oldest first."""
        while self.core.changed:
            partition = self.core.changed.pop()
            waiting = self._waiters.get(partition)
            if not waiting:
                continue
            self._waiters[partition] = [w for w in waiting if not w.done and not self._try(w)]
            if not self._waiters[partition]:
                del self._waiters[partition]

    def poll_timeout_ms(self) -> int:
        if self.core.dropped or self.core.building:  # a slice after every poll, polls that do not wait
            return 0
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        due = min(self._deadlines[0][0] if self._deadlines else math.inf, self.core.next_lease_due())
        if due == math.inf:
            return POLL_MS
        left = due - time.monotonic()
        if left <= 0:
            return 0
        if not left < POLL_MS / 1000:  # (a deadline the protocol's bounds let through is finite; and
            return POLL_MS  # should one not be, inf or nan ends here, never in an integer conversion)
        return math.ceil(left * 1000)

    def after_poll(self) -> None:
        """Answer the parked requests whose deadline passed; a request whose expiry fails is answered
        with that failure (``_fail``), and the others are still served."""
        # Each slice guarded on its own: one failing on every pass must not stop leases and deadlines.
        self._guarded("freeing a dropped partition's keys", self.core.free_some)  # one slice, then requests
        self._guarded("building a consumer's stream", self.core.build_some)  # one slice of a big partition
        now = time.monotonic()
        self.core.expire_leases(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                continue
            try:
                self._expire(w, now)
            except Exception as exc:  # noqa: BLE001 - this request gets the error, the loop goes on
                logger.exception("%s: timing out a %r request failed", self.name, w.op)
                why = f"{type(exc).__name__}: {exc}"
                self._fail(w, DataplaneError(f"the index failed at this {w.op!r} request's deadline ({why})"))
        self._recheck()

    def _expire(self, w: _Waiter, now: float) -> None:
        """``w``'s deadline passed: its rows if they are ready now, else ``BatchTimeoutError``."""
        if self._try(w):
            return
        err = self.core.timeout_error(w.op, w.body, now - w.start)
        self._fail(w, err)

    def _fail(self, w: _Waiter, exc: BaseException) -> None:
        """Answer a parked request with ``exc`` (unless it was answered already) and forget it."""
        waiting = self._waiters.get(w.body.partition, [])
        if w in waiting:
            waiting.remove(w)
        if w.done:
            return
        self._done(w)
        self.deliver(w.sock, w.ident, _wire.encode_error(w.rid, exc))

    def metrics_snapshot(self, labels: tuple[str, ...]) -> tuple[dict[Key, float], dict[Key, float]]:
        counters, gauges = super().metrics_snapshot(labels)
        core = self.core
        counters[("dataplane_index_rows_taken", *labels)] = self.rows_taken
        counters[("dataplane_index_leases_expired", *labels)] = core.leases_expired
        # One pass over the partitions and their tasks (this runs on the loop: it must stay cheap).
        rows: dict[str, int] = {}
        lag: dict[tuple[str, str], int] = {}
        counts: dict[tuple[str, str], tuple[int, int]] = {}  # (taken, leased)
        finished = 0
        for partition, part in core.partitions.items():
            rows[partition] = len(part.keys)
            finished += part.streams.finished
            for task, taken, ready, leased, _ in part.streams.progress():
                lag[(partition, task)] = ready
                counts[(partition, task)] = (taken, leased)
        gauges[("dataplane_index_partitions", *labels, "open")] = len(rows) - finished
        gauges[("dataplane_index_partitions", *labels, "finished")] = finished
        gauges[("dataplane_index_waiting", *labels)] = sum(
            1 for waiting in self._waiters.values() for w in waiting if not w.done
        )
        for partition, n in _bounds.fold(
            rows, _bounds.chosen(rows, self.partition_series), _bounds.OTHER
        ).items():
            gauges[("dataplane_index_partition_rows", *labels, partition)] = n
        # Consumer tasks: the (partition, task) pairs furthest behind get series of their own.
        keep = _bounds.chosen(lag, self.partition_series)
        other = (_bounds.OTHER, _bounds.OTHER)
        for (partition, task), n in _bounds.fold(lag, keep, other).items():
            gauges[("dataplane_consumer_ready_rows", *labels, partition, task)] = n
        for i, name in ((0, "dataplane_consumer_taken_rows"), (1, "dataplane_consumer_leased_rows")):
            values = {pair: c[i] for pair, c in counts.items()}
            for (partition, task), n in _bounds.fold(values, keep, other).items():
                gauges[(name, *labels, partition, task)] = n
        return counters, gauges


class IndexActor:
    """The index as a Ray actor (wrapped with ``ray.remote`` by ``service.launch``): its Ray methods only
    start and describe it; every KV and streaming request reaches ``IndexServer`` over zmq, on
    sockets that admit only the store's own peers (``transport.auth``)."""

    def __init__(
        self,
        name: str,
        creds: dict[str, str] | None = None,
        max_message_bytes: int = -1,
        reservation_timeout_s: float = 120.0,
        metrics: bool = False,
        metrics_partitions: int = -1,
    ) -> None:
        self.core = IndexCore(prepare_ttl_s=reservation_timeout_s)
        self._name = name
        self._metrics = metrics
        self._metrics_partitions = metrics_partitions
        self._creds = _auth.Credentials.from_dict(creds or {})
        self._max_message_bytes = max_message_bytes
        self.server: IndexServer | None = None

    def start(self) -> dict[str, Any]:
        import os

        import ray

        from dataplane.transport.liveness import process_start
        from dataplane.transport.locality import Locality

        if not self._creds.secret:
            raise ValueError("the index needs the store's credentials")
        host_ip = ray.util.get_node_ip_address()
        self.core.node = f"{host_ip} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"
        gc.freeze()  # as the shards do (``ShardActor``); the server goes on freezing (``router.freeze_heap``)
        self.server = IndexServer(
            self.core, host_ip, f"{self._name}-index", self._creds, max_message_bytes=self._max_message_bytes
        )
        if self._metrics and export.start():  # before the loop starts: it reads these
            self.server.partition_series = self._metrics_partitions
            # ("commits" relays puts the shards time as put_ready: timing it too would double the cost)
            self.server.metrics = ServerMetrics(
                "dataplane_index", (self._name,), IndexCore.OPS, untimed={"commits"}
            )
        self.server.start()
        pid = os.getpid()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "actor_id": ray.get_runtime_context().get_actor_id() or "",
            "tcp": self.server.tcp,
            "ipc": self.server.ipc,
            "unix": self.server.unix,
            "max_message_bytes": self._max_message_bytes,  # clients refuse a bigger frame themselves
            "locality": Locality.here().to_dict(),
            "pid": pid,
            "pid_start": process_start(pid),
        }

    def register(self, registry: dict[str, Any]) -> None:
        self.core.registry = registry

    def info(self) -> dict[str, Any]:
        """The registry and the client credentials: the one way a process obtains them (a Ray call)."""
        return {**self.core.registry, "credentials": self._creds.for_clients().to_dict()}

    def ping(self) -> bool:
        return True


__all__ = ["IndexActor", "IndexServer"]
