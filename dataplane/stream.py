"""Streaming: consumers pull the rows that are ready for them, while producers keep writing.

The index knows, per row, which fields have been written, and per consumer task which rows it has
taken. ``next_batch`` returns rows whose fields are all written and that the task has not taken
yet, and marks them taken; when too few are ready it waits, woken by the put that makes them ready
(no polling). Tasks are independent: "reward" and "train" each take every row once::

    import dataplane as dp

    # producers (rollout workers) put rows whenever they finish them, then say they are done
    dp.kv_batch_put(keys, "step3", {"prompts": p, "responses": r}, tags=[{"uid": u} for u in uids])
    dp.finish_partition("step3")

    # a consumer (the reward worker) takes batches as they become ready
    while (meta := dp.next_batch("step3", "reward", 64, ["responses"], timeout_s=60)).size:
        rewards = score(dp.kv_batch_get_by_meta(meta))
        dp.kv_batch_put(meta.keys, "step3", {"rewards": rewards})

A call that fails (bad arguments, a timeout) marks nothing consumed; a batch whose reply cannot
reach its consumer (it went away while waiting) is given back, except a rank-aware one, which stays
with its ``(dp_rank, batch_index)``: asking that again returns it. Taking is at most once: a consumer
that dies after its batch arrived loses that batch for its task; ``reset_consumption`` reads again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import msgspec

from dataplane.api import current_client
from dataplane.client import stream_ops as _stream_ops
from dataplane.errors import ArgumentTypeError, InvalidArgumentError, LeaseExpiredError
from dataplane.meta import KVBatchMeta
from dataplane.samplers import Sampler

if TYPE_CHECKING:
    from dataplane.client.handle import StoreClient
    from dataplane.client.ops import Op

_log = logging.getLogger(__name__)


def _give_back(client: StoreClient, partition_id: str, task_name: str, take: _stream_ops.Take) -> None:
    """The call ``take`` belongs to ended without handing its batch to its caller (cancelled,
    interrupted, failed after the index answered): give back whatever the index handed it. Blocking,
    even from an event loop: a cancelled coroutine cannot count on being resumed to send it."""
    if not take.may_hold_rows:
        return
    try:
        client.run(_stream_ops.release(partition_id, task_name, take.id))
    except Exception as exc:  # noqa: BLE001 - the original exception is what the caller must see
        _log.warning(
            "could not give back the rows of an abandoned next_batch call (task %r, partition %r): %s; "
            "they stay taken for this task (dp.reset_consumption reads them again)",
            task_name,
            partition_id,
            exc,
        )


def _taking(
    partition_id: str,
    task_name: str,
    batch_size: int,
    fields: list[str] | str,
    sampler: Sampler | None,
    timeout_s: float | None,
    dp_rank: int | None,
    dp_size: int | None,
    batch_index: int | None,
    lease_s: float | None,
) -> tuple[StoreClient, _stream_ops.Take, Op[KVBatchMeta]]:
    client = current_client()
    take = _stream_ops.Take.new()
    args = (partition_id, task_name, batch_size, fields, sampler, timeout_s, dp_rank, dp_size, batch_index)
    return client, take, _stream_ops.next_batch(client.route, *args, take, lease_s)


def next_batch(
    partition_id: str,
    task_name: str,
    batch_size: int,
    fields: list[str] | str,
    *,
    sampler: Sampler | None = None,
    timeout_s: float | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    batch_index: int | None = None,
    lease_s: float | None = None,
) -> KVBatchMeta:
    """Up to ``batch_size`` rows of ``partition_id`` whose ``fields`` are all written and that
    ``task_name`` has not taken yet; marks them taken and returns their meta (listing ``fields``).

    Rows come in the order the puts made them ready, unless ``sampler`` chooses otherwise
    (``dp.GroupSampler``, ``dp.SeqlenBalancedSampler`` or your own ``dp.Sampler`` subclass). With
    ``dp_rank`` and ``batch_index``, every caller with the same ``(task_name, dp_rank, batch_index)``
    gets the same keys (the TP/PP peers of one data-parallel rank); different ``dp_rank`` s get
    different keys. After ``finish_partition``, a call gets what is left (a short batch) and then an
    empty meta (``size == 0``) at once. While rows of the partition are leased by other calls of the
    task (``lease_s``) no more rows may still come (a lease that runs out gives its rows back), so the
    short last batch and the empty meta wait for those leases to be acknowledged or to run out (up to
    ``timeout_s``), and the rows of a lease that ran out are handed out first. A loop that stops at
    ``size == 0`` has seen every row at least once.

    Delivery: rows are taken only by a call that returns them. A call that ends any other way
    (cancelled, interrupted by a signal, failed after the index answered) gives back what the index
    handed it, first in line for the task. By default a batch that was returned is taken for good
    (at most once: if this process dies while working on it, the task never sees those rows again).
    With ``lease_s``, the batch is leased instead: acknowledge it with ``dp.ack(meta)`` when done;
    rows not acknowledged within ``lease_s`` seconds (the consumer died or stalled) go back to the task
    and are delivered again (at least once; ``dp.release(meta)`` gives them back at once).

    Raises:
        BatchTimeoutError: fewer rows became ready within ``timeout_s`` (None: wait as long as it
            takes); says how many were ready, and names fields no put has written.
        PartitionNotFoundError: ``timeout_s`` passed and no put created the partition.
        BatchSizeError / InvalidArgumentError / ArgumentTypeError: bad arguments (``batch_size < 1``,
            a group size that does not divide ``batch_size``, ``timeout_s=-1``, ``fields=[1]``, ...),
            before anything is sent. Each is a ``DataplaneError`` and the built-in a caller would
            catch (``ValueError``, ``TypeError``), and names the argument.

    Example:
        >>> meta = dp.next_batch("step0", "reward", 64, ["responses"], timeout_s=30)
        >>> leased = dp.next_batch("step0", "train", 64, ["advantages"], lease_s=600)
        >>> dp.ack(leased)  # after the update that used it
    """
    args = (partition_id, task_name, batch_size, fields, sampler, timeout_s, dp_rank, dp_size, batch_index)
    client, take, op = _taking(*args, lease_s)
    # The return is inside the try: a signal handler that raises runs at the next call, and the last
    # call before the batch reaches the caller's frame is ``moved``; a raise there gives it back too.
    try:
        meta = client.run(op, "next_batch")
        client.moved("next_batch", meta.size)
        return meta
    except BaseException:
        _give_back(client, partition_id, task_name, take)
        raise


async def async_next_batch(
    partition_id: str,
    task_name: str,
    batch_size: int,
    fields: list[str] | str,
    *,
    sampler: Sampler | None = None,
    timeout_s: float | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    batch_index: int | None = None,
    lease_s: float | None = None,
) -> KVBatchMeta:
    """Async ``next_batch``: the wait does not block the event loop. Cancelling it at any point gives
    back what the index handed it."""
    args = (partition_id, task_name, batch_size, fields, sampler, timeout_s, dp_rank, dp_size, batch_index)
    client, take, op = _taking(*args, lease_s)
    # The return is inside the try: a signal handler that raises runs at the next call, and the last
    # call before the batch reaches the caller's frame is ``moved``; a raise there gives it back too.
    try:
        meta = await client.arun(op, "next_batch")
        client.moved("next_batch", meta.size)
        return meta
    except BaseException:
        _give_back(client, partition_id, task_name, take)
        raise


def _lease_of(meta: KVBatchMeta, caller: str) -> tuple[str, str]:
    if not isinstance(meta, KVBatchMeta):
        raise ArgumentTypeError("meta", f"{caller}: meta must be a KVBatchMeta, not {type(meta).__name__}")
    lease = meta._extra.get("lease")
    if not isinstance(lease, dict) or not isinstance(lease.get("task"), str):
        raise InvalidArgumentError(
            "meta",
            f"{caller}: this meta (partition {meta._pid!r}, {meta.size} row(s)) holds no lease: pass a meta "
            "that next_batch(..., lease_s=...) returned (or a chunk of one)",
        )
    return lease["task"], lease["take"]


def ack(meta: KVBatchMeta) -> None:
    """The consumer is done with the rows of ``meta``, a batch leased by ``next_batch(..., lease_s=)``
    (or a chunk of one): they stay taken for good.

    Raises:
        LeaseExpiredError: some rows' lease had run out first; they went back to the task and may
            have been delivered again (it names them). The other rows are acknowledged.
        InvalidArgumentError: ``meta`` holds no lease (also a ``ValueError``); nothing was sent.

    Example:
        >>> meta = dp.next_batch("step0", "train", 64, ["advantages"], lease_s=600)
        >>> dp.ack(meta)
    """
    task, take = _lease_of(meta, "dp.ack")
    late = current_client().run(_stream_ops.ack(meta._pid, task, take, list(meta.keys)))
    _raise_late(meta, task, late)


async def async_ack(meta: KVBatchMeta) -> None:
    task, take = _lease_of(meta, "dp.async_ack")
    late = await current_client().arun(_stream_ops.ack(meta._pid, task, take, list(meta.keys)))
    _raise_late(meta, task, late)


def _raise_late(meta: KVBatchMeta, task: str, late: list[str]) -> None:
    if late:
        raise LeaseExpiredError(
            meta._pid,
            f"the lease of {len(late)} of {meta.size} row(s) of partition {meta._pid!r} (task "
            f"{task!r}) ran out before this ack: they went back to the task and may have been delivered "
            f"again: {late[:5]}; acknowledge sooner or ask for a longer lease_s",
            keys=late,
        )


def release(meta: KVBatchMeta) -> int:
    """Give the rows of leased ``meta`` back to its task now (they are delivered again, first in line).
    Only rows still leased under this take go back: rows already acknowledged stay taken, and rows
    whose lease ran out went back already (and may be another consumer's now), so ``ack`` then
    ``release`` in a ``finally`` gives back nothing. Returns how many went back.

    Example:
        >>> meta = dp.next_batch("step0", "train", 64, ["advantages"], lease_s=600)
        >>> dp.release(meta)  # this consumer cannot use them after all
        64
    """
    task, take = _lease_of(meta, "dp.release")
    return current_client().run(_stream_ops.release(meta._pid, task, take))


async def async_release(meta: KVBatchMeta) -> int:
    task, take = _lease_of(meta, "dp.async_release")
    return await current_client().arun(_stream_ops.release(meta._pid, task, take))


def finish_partition(partition_id: str) -> None:
    """Producers are done with ``partition_id``: consumers drain it, then get empty metas at once
    (a task drains once none of its rows is ready or leased)."""
    current_client().run(_stream_ops.finish(partition_id))


async def async_finish_partition(partition_id: str) -> None:
    await current_client().arun(_stream_ops.finish(partition_id))


def reset_consumption(partition_id: str, task_name: str | None = None) -> None:
    """Make every row of ``partition_id`` readable again for ``task_name`` (every task when None)."""
    current_client().run(_stream_ops.reset(partition_id, task_name))


async def async_reset_consumption(partition_id: str, task_name: str | None = None) -> None:
    await current_client().arun(_stream_ops.reset(partition_id, task_name))


def consumption(partition_id: str, task_name: str, fields: list[str] | None = None) -> dict[str, Any]:
    """Progress of ``task_name`` over ``partition_id``: ``{"total", "produced", "ready", "consumed",
    "leased", "finished", "fields", "drained"}``. ``produced`` counts rows holding every field in
    ``fields`` (default: the fields the task last asked for); ``ready`` = produced and not yet taken;
    ``leased`` = taken under a lease and not acknowledged (they come back if it runs out);
    ``drained`` = finished with nothing ready and nothing leased (``next_batch`` answers empty).

    Example:
        >>> dp.consumption("step0", "reward")["ready"]
        12
    """
    progress = current_client().run(_stream_ops.consumption(partition_id, task_name, fields))
    return msgspec.structs.asdict(progress)


async def async_consumption(
    partition_id: str, task_name: str, fields: list[str] | None = None
) -> dict[str, Any]:
    progress = await current_client().arun(_stream_ops.consumption(partition_id, task_name, fields))
    return msgspec.structs.asdict(progress)


@dataclass
class StreamRequest:
    """Ask a bridged worker method to pull its own ready batch (``next_batch``) instead of receiving a
    meta: the driver sends this, each data-parallel rank takes the rows ready for it, and the driver
    never sees the keys. ``chunk(n)`` gives rank ``i`` of ``n`` its ``dp_rank`` / ``dp_size``::

        wg.compute_reward(dp.StreamRequest("step3", "reward", 64, ["responses"], timeout_s=60))

    ``batch_size`` is *per rank*: a split dispatch (``DP_COMPUTE_PROTO``) hands every rank the same
    ``batch_size`` and each takes up to that many rows, so one call of a group of ``n`` ranks takes up
    to ``n * batch_size`` rows (``len()`` of the request says so). For a global batch of ``G`` rows,
    ask for ``G // n``. (A request every rank receives whole, under ``ONE_TO_ALL``, is one batch of
    ``batch_size`` rows for the whole group.)

    Example:
        >>> req = StreamRequest("step3", "reward", 8, ["responses"])
        >>> [(r.dp_rank, r.dp_size, r.batch_size) for r in req.chunk(2)]  # what 2 ranks receive
        [(0, 2, 8), (1, 2, 8)]
        >>> len(StreamRequest("step3", "reward", 8, ["responses"], dp_size=2))  # rows, at most
        16
    """

    partition_id: str
    task_name: str
    batch_size: int
    fields: list[str]
    sampler: Sampler | None = None
    timeout_s: float | None = None
    dp_rank: int | None = None
    dp_size: int | None = None
    batch_index: int | None = None
    lease_s: float | None = None  # lease each batch; the bridge acknowledges it once its outputs are written

    allows_uneven_chunks = True
    # Makes ``@register`` methods pull their batch for it (see ``controlplane.bridge``).
    __worker_bridge__: ClassVar[Any] = None  # set by dataplane._bridge_hook (see KVBatchMeta)

    def __len__(self) -> int:
        return self.batch_size * (self.dp_size or 1)

    def chunk(self, n: int) -> list[StreamRequest]:
        """One request per data-parallel rank: rank ``i`` of ``n``."""
        return [
            StreamRequest(
                self.partition_id,
                self.task_name,
                self.batch_size,
                list(self.fields),
                self.sampler,
                self.timeout_s,
                i,
                n,
                self.batch_index,
                self.lease_s,
            )
            for i in range(n)
        ]

    @classmethod
    def concat(cls, parts: list[StreamRequest]) -> StreamRequest:
        """The request the parts came from (they share partition, task, batch size and fields)."""
        first = parts[0]
        return StreamRequest(
            first.partition_id,
            first.task_name,
            first.batch_size,
            list(first.fields),
            first.sampler,
            first.timeout_s,
            lease_s=first.lease_s,
        )

    def _kwargs(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler,
            "timeout_s": self.timeout_s,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "batch_index": self.batch_index,
            "lease_s": self.lease_s,
        }

    def next_batch(self) -> KVBatchMeta:
        """``next_batch`` with this request's arguments."""
        return next_batch(self.partition_id, self.task_name, self.batch_size, self.fields, **self._kwargs())

    async def async_next_batch(self) -> KVBatchMeta:
        """``async_next_batch`` with this request's arguments."""
        return await async_next_batch(
            self.partition_id, self.task_name, self.batch_size, self.fields, **self._kwargs()
        )


@dataclass
class StreamResult:
    """What a stage that pulled its own batches (``StreamRequest``) returns to the driver: counts,
    no keys. Concatenating the ranks' results adds them up.

    Attributes: ``partition_id``, ``task_name``, ``rows`` (taken and processed), ``batches``, and
    ``finished`` (the partition is finished and this task has drained it).
    """

    partition_id: str
    task_name: str
    rows: int = 0
    batches: int = 0
    finished: bool = False

    allows_uneven_chunks = True

    def __len__(self) -> int:
        return self.rows

    def chunk(self, n: int) -> list[Self]:
        """``self`` and ``n - 1`` empty results of the same type (the counts stay with one chunk)."""
        return [self] + [type(self)(self.partition_id, self.task_name) for _ in range(n - 1)]

    @classmethod
    def concat(cls, parts: Sequence[StreamResult]) -> StreamResult:
        first = parts[0]
        return StreamResult(
            first.partition_id,
            first.task_name,
            sum(p.rows for p in parts),
            sum(p.batches for p in parts),
            all(p.finished for p in parts),
        )


__all__ = [
    "StreamRequest",
    "StreamResult",
    "ack",
    "async_ack",
    "async_consumption",
    "async_finish_partition",
    "async_next_batch",
    "async_release",
    "async_reset_consumption",
    "consumption",
    "finish_partition",
    "next_batch",
    "release",
    "reset_consumption",
]
