"""The index service's core: ``IndexCore``, the store's metadata bookkeeping (partitions, keys,
per-key field production status, tags, per-task consumption, the shard registry), and its reads
(``list``, ``resolve``, ``stats``).

``IndexCore`` joins the index's state (``index.records``) and its operations, one group per module:
puts and clears (``index.puts``), streaming (``index.streaming``), checkpoints
(``index.checkpoint``). It is a plain class, tested without Ray; ``index.actor`` serves it
(``IndexServer``, the zmq request loop) inside the Ray actor (``IndexActor``).

Placement of keys is a stable hash (``client.sharding``), so the index is not asked where a key lives;
it is on the path only where metadata changes (put, clear) or must be resolved (``kv_list``,
classifying a missing key).
"""

from __future__ import annotations

import time
from typing import Any

from dataplane.errors import WireError
from dataplane.server.dispatch import Operations, OpReply
from dataplane.server.index.checkpoint import IndexCheckpoints
from dataplane.server.index.puts import IndexPuts
from dataplane.server.index.records import CLEARED_KEYS_KEPT
from dataplane.server.index.streaming import IndexStreaming
from dataplane.server.jobs import Job
from dataplane.wire import protocol as _protocol


class IndexCore(IndexPuts, IndexStreaming, IndexCheckpoints, Operations):
    """Metadata bookkeeping of the store. Plain class, tested without Ray.

    Its operations take the body only (the index takes no buffer frames) and return the reply
    body; a waiting one (``next``, ``ready``) returns None while its rows are not ready. Its state is
    ``IndexRecords`` (``server.index.records``); the operations come one group per module: puts and
    clears (``server.index.puts``), streaming (``server.index.streaming``), checkpoints
    (``server.index.checkpoint``), and here the reads that resolve metadata (``list``, ``resolve``,
    ``stats``).

    A put's prepare (``op_prepare``) stays open for ``prepare_ttl_s`` (the store's
    ``reservation_timeout_s``, as long as the shards keep the put's reservations), then expires as
    if aborted; ``clock`` is the monotonic clock those deadlines are read on (a test moves its own).
    """

    OPS = _protocol.INDEX_OPS
    REPLIES = _protocol.INDEX_REPLIES
    SERVICE = "the index"
    JOBS = {  # (answered in steps by the server; ``op_<name>`` runs the job whole)
        "commit": "job_commit",
        "commits": "job_commits",
        "checkpoint_save": "job_checkpoint_save",
        "checkpoint_finish": "job_checkpoint_finish",
    }

    def job(self, op: str, body: Any, bufs: list[memoryview]) -> Job[OpReply]:
        reply = yield from getattr(self, self.JOBS[op])(body)  # (the index takes no buffers)
        return reply, []

    def run(self, op: str, body: Any, bufs: list[memoryview]) -> OpReply:
        result = self.operation(op)(body)  # no buffers: the index's server refuses any
        return (_protocol.Pending() if result is None else result), []  # a waiting op, run once

    def op_list(self, body: _protocol.ListKeys) -> _protocol.ListReply:
        """Keys with their tags (``ListKeys``): a page costs what it returns, so a listing of a big
        partition asked for in pages never holds up other requests; the whole form costs the
        partition."""
        pid = body.partition
        if body.limit is not None:
            return self._list_page(pid, body.limit, body.cursor)
        if body.cursor is not None:
            raise WireError("list: a cursor goes with a limit")
        pids = [pid] if pid is not None else list(self.partitions)
        return _protocol.ListReply(
            {p: part.keys.page(0, len(part.keys))[0] for p in pids if (part := self.partitions.get(p))}
        )

    def _list_page(self, pid: str | None, limit: int, cursor: str | None) -> _protocol.ListReply:
        if pid is None:
            if limit or cursor is not None:
                raise WireError("list: pages list one partition (name it); limit=0 alone names them all")
            return _protocol.ListReply({p: {} for p in self.partitions})
        if limit < 1:  # (an empty page whose cursor never moves: a caller paging on would loop for ever)
            raise WireError(f"list: a page of partition {pid!r} holds at least 1 key (limit={limit})")
        part, start = self.page_start(pid, cursor, "listing")
        if part is None:
            return _protocol.ListReply({})
        keys, nxt = part.keys.page(start, limit)
        return _protocol.ListReply({pid: keys}, None if nxt is None else f"{part.incarnation}.{nxt}")

    def op_resolve(self, body: _protocol.Resolve) -> _protocol.ResolveReply:
        """Which of ``keys`` the index knows, and which fields they hold (classifies a failed get)."""
        part = self.partitions.get(body.partition)
        if part is None:
            return _protocol.ResolveReply(partition=False, known={}, error=str(self.missing(body.partition)))
        return _protocol.ResolveReply(
            partition=True,
            known={k: sorted(part.keys[k]) for k in body.keys if k in part.keys},
            cleared=[k for k in body.keys if k not in part.keys and k in part.cleared],
            cleared_kept=CLEARED_KEYS_KEPT,
        )

    def op_stats(self, body: _protocol.Stats) -> _protocol.IndexStatsReply:
        """Keys per partition, and the prepared puts: open now, and how many were aborted, expired,
        or refused (their abort had come first); each partition's idle seconds, the finished ones and
        the drained ones. O(partitions + tasks)."""
        self.expire()
        now = time.monotonic()
        parts = self.partitions
        return _protocol.IndexStatsReply(
            partitions={p: len(m.keys) for p, m in parts.items()},
            puts={"open": len(self.txns), **self.put_counts},
            idle={p: max(0.0, now - m.active) for p, m in parts.items()},
            finished=[p for p, m in parts.items() if m.streams.finished],
            drained=[p for p, m in parts.items() if m.streams.drained_by_all()],
        )


__all__ = ["IndexCore"]
