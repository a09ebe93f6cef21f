"""The streaming operations, sans-IO like ``ops`` (a generator over request batches): take the next
ready batch for a consumer task (``next_batch``: with a built-in sampler the index chooses; with a
sampler of the caller's own, the client chooses among the ready rows and claims them), and the small
bookkeeping calls (finish, reset, consumption). Waiting calls have a deadline of their own plus a
round trip, or none (``timeout_s=None``: only the index's death ends the wait), and a socket of
their own (``Call.exclusive``).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from dataplane.client.ops import Op, Route, _reply
from dataplane.config import INT64_MAX, MAX_TIMEOUT_S, check_number
from dataplane.errors import (
    ArgumentTypeError,
    BatchSizeError,
    DataplaneError,
    InvalidArgumentError,
    ShardUnavailableError,
    WireError,
)
from dataplane.meta import KVBatchMeta, check_partition
from dataplane.wire import protocol as _protocol
from dataplane.wire.protocol import MAX_COUNT, MAX_LEASE_S
from dataplane.wire.requests import INDEX, Call

if TYPE_CHECKING:
    from dataplane.samplers import Sampler

CLAIM_ATTEMPTS = 8  # a client-side sampler whose choice keeps losing to other consumers gives up
CONSUMED_PAGE = 65536  # keys of the partition ``consumed`` asks the index about per request


@dataclass
class Take:
    """One ``next_batch`` call as its rows' owner: the id the index files what it hands out under,
    and whether the index may have handed this call rows (a request went out and no refusal came
    back). A call that ends any other way than by returning its batch gives such rows back by id."""

    id: str
    sent: bool = False
    refused: bool = False

    @classmethod
    def new(cls) -> Take:
        return cls(uuid.uuid4().hex)

    @property
    def may_hold_rows(self) -> bool:
        return self.sent and not self.refused

    def answered(self, res: object) -> None:
        """A reply came: a refusal (not a lost connection) means the index took nothing for us."""
        self.refused = isinstance(res, BaseException) and not isinstance(res, ShardUnavailableError)


def _check_stream_args(partition_id: Any, task_name: Any, batch_size: Any, fields: Any) -> list[str]:
    check_partition(partition_id, "next_batch")
    _check_task(task_name, "next_batch")
    if type(batch_size) is not int or not 1 <= batch_size <= MAX_COUNT:
        raise BatchSizeError(f"batch_size must be an int in [1, 2**31 - 1], got {batch_size!r}")
    if isinstance(fields, str):
        fields = [fields]
    try:
        names: list[str] = list(fields) if fields is not None else []
    except TypeError:  # not iterable: named below, as any other bad value
        names = [fields]
    if not names or any(type(f) is not str for f in names):
        raise ArgumentTypeError(
            "fields", f"fields must name at least one field (a list of str), got {names!r}"
        )
    return names


def _check_task(task_name: object, caller: str) -> str:
    """``task_name`` as sent: a non-empty str, else named before anything is sent (msgpack would
    refuse another type on the way, or the index on arrival, with neither's names)."""
    if type(task_name) is str and task_name:
        return task_name
    raise ArgumentTypeError("task_name", f"{caller}: task_name must be a non-empty str, not {task_name!r}")


def _check_fields(fields: object, caller: str) -> list[str] | None:
    """``fields`` as sent: None, or a list of str (one str is a list of one)."""
    if fields is None:
        return None
    if isinstance(fields, str):
        return [fields]
    if isinstance(fields, (list, tuple)) and all(type(f) is str for f in fields):
        return list(fields)
    raise ArgumentTypeError("fields", f"{caller}: fields must be None or a list of str, got {fields!r}")


def _check_ranks(dp_rank: Any, dp_size: Any, batch_index: Any) -> None:
    for name, value, low, high in (
        ("dp_rank", dp_rank, 0, MAX_COUNT),
        ("dp_size", dp_size, 1, MAX_COUNT),
        ("batch_index", batch_index, 0, INT64_MAX),  # (the bridge derives 62-bit ones from a hash)
    ):
        if value is not None:
            check_number(name, value, low, high, integer=True)
    if dp_rank is not None and dp_size is not None and dp_rank >= dp_size:
        raise InvalidArgumentError(
            "dp_rank", f"dp_rank must be below dp_size: got dp_rank={dp_rank}, dp_size={dp_size}"
        )


def _check_timeout(timeout_s: Any) -> float | None:
    """``timeout_s`` as sent: None (or ``math.inf``) waits as long as it takes; else finite, >= 0."""
    if timeout_s is None or timeout_s == math.inf:
        return None
    check_number("timeout_s", timeout_s, 0, MAX_TIMEOUT_S)
    return float(timeout_s)


def _wait_timeout(route: Route, timeout_s: float | None) -> float:
    """The transport deadline of a waiting call: its own timeout plus a round trip (none: no limit)."""
    return math.inf if timeout_s is None else timeout_s + route.rpc_timeout_s


def next_batch(
    route: Route,
    partition_id: str,
    task_name: str,
    batch_size: int,
    fields: Any,
    sampler: object,
    timeout_s: float | None,
    dp_rank: int | None,
    dp_size: int | None,
    batch_index: int | None,
    take: Take,
    lease_s: float | None = None,
) -> Op[KVBatchMeta]:
    """The next batch of rows ready for ``task_name`` (see ``dataplane.stream.next_batch``), taken
    under ``take`` (leased for ``lease_s`` seconds when given)."""
    from dataplane.samplers import Sampler

    fields = _check_stream_args(partition_id, task_name, batch_size, fields)
    timeout_s = _check_timeout(timeout_s)
    _check_ranks(dp_rank, dp_size, batch_index)
    if lease_s is not None:
        check_number("lease_s", lease_s, 0, MAX_LEASE_S, above=True)
    if sampler is not None and not isinstance(sampler, Sampler):
        raise ArgumentTypeError(
            "sampler", f"sampler must be a dataplane Sampler, not {type(sampler).__name__}"
        )
    if sampler is not None:
        sampler.check(batch_size, dp_rank, dp_size, batch_index)
    spec = None if sampler is None else sampler.spec()
    if sampler is not None and spec is None:  # a sampler of the caller's own: it runs here
        ask = _Asked(partition_id, task_name, fields, dp_rank, dp_size, batch_index)
        return (yield from _next_client_side(route, ask, sampler, batch_size, timeout_s, take, lease_s))
    body = _protocol.Next(
        partition_id,
        task_name,
        batch_size,
        fields,
        spec,
        dp_rank,
        dp_size,
        batch_index,
        timeout_s,
        take.id,
        lease_s,
    )
    take.sent = True
    (res,) = yield [Call(INDEX, "next", body, timeout=_wait_timeout(route, timeout_s), exclusive=True)]
    take.answered(res)
    return _stream_meta(partition_id, _reply(res, _protocol.BatchReply), task_name)


@dataclass
class _Asked:
    """What a ``next_batch`` with a sampler of the caller's own asks for (checked)."""

    partition: str
    task: str
    fields: list[str]
    dp_rank: int | None
    dp_size: int | None
    batch_index: int | None


def _next_client_side(
    route: Route,
    ask: _Asked,
    sampler: Sampler,
    batch_size: int,
    timeout_s: float | None,
    take: Take,
    lease_s: float | None,
) -> Op[KVBatchMeta]:
    from dataplane.samplers import ReadyRows

    start = time.monotonic()
    min_rows = batch_size
    name = type(sampler).__name__
    lost = 0  # claims that lost a race with another consumer of the task (waits do not count)
    while True:
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
        body = _protocol.Ready(
            ask.partition,
            ask.task,
            ask.fields,
            min_rows,
            dp_rank=ask.dp_rank,
            batch_index=ask.batch_index,
            timeout_s=left,
        )
        (res,) = yield [Call(INDEX, "ready", body, timeout=_wait_timeout(route, left), exclusive=True)]
        got = _reply(res, _protocol.ReadyReply)
        if got.cached:
            return _stream_meta(ask.partition, got, ask.task)
        tags = dict(got.rows)
        ready = ReadyRows([k for k, _ in got.rows], tags.__getitem__)
        choice = sampler.sample(
            ready, batch_size, dp_rank=ask.dp_rank, dp_size=ask.dp_size, finished=got.finished
        )
        if choice is None or (not choice and not got.finished):
            if got.finished:  # no more rows will come: what it waits for never will
                return KVBatchMeta._trusted([], [], ask.partition, ask.fields)
            min_rows = len(ready) + 1  # wait until more rows are ready, then ask it again
            continue
        if isinstance(choice, dict):
            raise InvalidArgumentError(
                "sampler",
                f"{name}.sample returned a split by rank; a sampler of your own returns the caller's keys "
                "(a list)",
            )
        keys = list(choice)
        if len(keys) > batch_size:
            raise WireError(f"sampler {name} returned {len(keys)} keys for a batch of {batch_size}")
        bad = [k for k in keys if k not in tags]
        if bad:  # not a race: keys it was never shown as ready (nothing was claimed)
            raise WireError(
                f"{name} chose {len(bad)} key(s) that are not ready for task {ask.task!r} (not among "
                f"the ready rows it was given: not all of {sorted(ask.fields)} written, already "
                f"consumed, or unknown): {bad[:5]}"
            )
        claim = _protocol.Claim(
            ask.partition, ask.task, ask.fields, keys, ask.dp_rank, ask.batch_index, take.id, lease_s
        )
        take.sent = True
        (res,) = yield [Call(INDEX, "claim", claim)]
        take.answered(res)
        if isinstance(res, WireError) and "not ready" in str(res):
            lost += 1  # another consumer of this task took some of them first: choose again
            if lost < CLAIM_ATTEMPTS:
                continue
            raise DataplaneError(
                f"{name}: {CLAIM_ATTEMPTS} choices in a row were taken by other consumers of task "
                f"{ask.task!r} first; retry"
            )
        return _stream_meta(ask.partition, _reply(res, _protocol.BatchReply), ask.task)


def _stream_meta(
    partition_id: str, body: _protocol.BatchReply | _protocol.ReadyReply, task: str
) -> KVBatchMeta:
    meta = KVBatchMeta._trusted(body.keys, body.tags, partition_id, body.fields)
    if body.lease is not None:  # what ``ack`` / ``release`` need to name the lease
        meta._extra["lease"] = {"task": task, "take": body.lease}
    return meta


def release(partition_id: str, task_name: str, take: str) -> Op[int]:
    """Give back what take ``take`` got (a call its consumer gave up on, or a lease let go); returns
    how many rows went back."""
    (res,) = yield [Call(INDEX, "release", _protocol.Release(partition_id, task_name, take))]
    return _reply(res, _protocol.ReleaseReply).released


def ack(partition_id: str, task_name: str, take: str, keys: list[str]) -> Op[list[str]]:
    """Acknowledge leased ``keys``; returns those whose lease had run out first."""
    (res,) = yield [Call(INDEX, "ack", _protocol.Ack(partition_id, task_name, take, keys))]
    return _reply(res, _protocol.AckReply).late


def finish(partition_id: str) -> Op[None]:
    """Producers of ``partition_id`` are done (``dp.finish_partition``)."""
    yield from index_call("finish", _protocol.OnePartition(check_partition(partition_id, "finish_partition")))


def reset(partition_id: str, task_name: str | None) -> Op[None]:
    """``task_name`` (None: every task) reads ``partition_id`` again (``dp.reset_consumption``)."""
    partition = check_partition(partition_id, "reset_consumption")
    task = None if task_name is None else _check_task(task_name, "reset_consumption")  # None: every task
    yield from index_call("reset", _protocol.Reset(partition, task))


def consumption(
    partition_id: str, task_name: str, fields: list[str] | None = None
) -> Op[_protocol.ConsumptionReply]:
    """``task_name``'s progress on ``partition_id``: a ``ConsumptionReply``."""
    body = _protocol.Consumption(
        check_partition(partition_id, "consumption"),
        _check_task(task_name, "consumption"),
        _check_fields(fields, "consumption"),
    )
    got: _protocol.ConsumptionReply = yield from index_call("consumption", body)
    return got


def consumed(partition_id: str, task_name: str) -> Op[list[str]]:
    """The keys ``task_name`` has taken from ``partition_id``, in key order, asked for a page of
    ``CONSUMED_PAGE`` keys at a time (no reply, nor step of the index, grows with the partition).
    A partition cleared meanwhile raises ``PartitionNotFoundError``."""
    keys: list[str] = []
    cursor: str | None = None
    while True:
        ask = _protocol.Consumed(partition_id, task_name, CONSUMED_PAGE, cursor)
        got: _protocol.ConsumedReply = yield from index_call("consumed", ask)
        keys.extend(got.keys)
        if got.cursor is None:
            return keys
        cursor = got.cursor


def resolve(partition_id: str, keys: list[str]) -> Op[dict[str, list[str]]]:
    """Which of ``keys`` the index knows, and the fields each holds: ``{key: [field, ...]}``."""
    got: _protocol.ResolveReply = yield from index_call("resolve", _protocol.Resolve(partition_id, keys))
    return got.known


def index_call(op: str, body: msgspec.Struct) -> Op[Any]:
    """One call to the index; returns its reply as ``op``'s reply struct (``INDEX_REPLIES``)."""
    (res,) = yield [Call(INDEX, op, body)]
    return _reply(res, _protocol.INDEX_REPLIES[op])


__all__ = [
    "Take",
    "ack",
    "consumed",
    "consumption",
    "finish",
    "index_call",
    "next_batch",
    "release",
    "reset",
    "resolve",
]
