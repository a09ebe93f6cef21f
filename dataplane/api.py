"""The public KV interface of the store (TransferQueue's names), sync and ``async_`` forms.

Every function works on a per-process client created by ``init()``. Each operation is written
once as a sans-IO generator (``client.ops``); the sync form drives it with blocking sockets, the async
form on the running event loop, so both behave identically.

Example:
    >>> import dataplane as dp, torch
    >>> dp.init()  # attaches to the running store, or starts an embedded one
    >>> meta = dp.kv_batch_put(["a", "b"], "train", {"x": torch.zeros(2, 4)})
    >>> dp.kv_batch_get_by_meta(meta)["x"].shape
    torch.Size([2, 4])
    >>> dp.close()
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import msgspec

from dataplane._units import format_bytes
from dataplane.client import ops as _ops
from dataplane.client.handle import StoreClient
from dataplane.config import NAMESPACE, StoreConfig, client_transport_override
from dataplane.errors import InvalidArgumentError, StoreNotInitializedError
from dataplane.meta import KVBatchMeta, KVListPage, StoreInfo
from dataplane.service import connect as _connect
from dataplane.service.launch import ServiceHandle, find_service, no_store_message, start_service, stop_named
from dataplane.service.liveness import ray_says_dead
from dataplane.telemetry import export
from dataplane.wire.protocol import IndexStatsReply, ShardStatsReply

if TYPE_CHECKING:  # annotations only: the store's own processes import this package without torch
    import torch
    from tensordict import TensorDict

    Device: TypeAlias = torch.device | str | int  # where a get puts its tensors

logger = logging.getLogger(__name__)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.client: StoreClient | None = None
        self.handle: ServiceHandle | None = None
        self.info: StoreInfo | None = None
        self.atexit = False
        self.ray_ctx: Any = None
        # What init attached with, to attach again to a store restarted under the same name.
        self.cfg: StoreConfig | None = None
        self.transport: str | None = None


_state = _State()


def current_client() -> StoreClient:
    """This process's client of the store (what ``init`` made); ``StoreNotInitializedError`` before
    ``init`` or after ``close``. For the other public modules (``stream``, ``dataset``, ``tq``,
    ``checkpoint``) and tools that drive operations of their own (``client.ops``, ``client.stream_ops``)
    with it: ``current_client().run(op)``."""
    client = _state.client
    if client is None:
        raise StoreNotInitializedError("the store is not initialised in this process: call dp.init() first")
    if client.stopped and _state.handle is None:
        return _reattach(client)
    return client


def _reattach(stale: StoreClient) -> StoreClient:
    """The store this process attached to was stopped (a call found it so): if one runs again under
    its name (``rlplane store start`` after ``stop``), attach to it; else keep the stale client, whose
    calls keep saying the store was stopped and how to start it."""
    with _state.lock:
        if _state.client is not stale or _state.cfg is None:
            return _state.client or stale  # another thread re-attached (or closed) meanwhile
        try:
            found = find_service(_state.cfg)
        except StoreNotInitializedError:  # a broken store: nothing to attach to yet
            return stale
        if found is None or found[0] == stale.registry:
            return stale
        _attach(found[0], None, _state.cfg, _state.transport)
        stale.close()
        logger.info("the store %r was stopped and started again: attached to the new one", _state.cfg.name)
        return _state.client


# ---- lifecycle ------------------------------------------------------------------------------------


def init(*, address: str | None = None, attach_only: bool = False, **options: Any) -> StoreInfo:
    """Connect this process to the store, starting an embedded one if none runs.

    Joins Ray first if this process has not (``address``). Idempotent: later calls return the same
    info. When a service named ``name`` (default "dataplane") already runs, this process attaches to
    it and only ``transport`` among ``options`` applies; otherwise it starts an embedded service
    with ``options`` (see ``StoreConfig``), owned by this process and stopped by ``close()`` or at exit.
    Either way it logs one line through the ``dataplane`` logger ("attached to store ..." or
    "started an embedded store ..."); a driver whose program has not configured ``logging`` gets a
    stderr handler on that logger so the line shows (``logging.getLogger("dataplane").setLevel(
    logging.WARNING)`` silences it; in Ray workers the line is DEBUG).

    Args:
        address: the Ray cluster to join when Ray is not initialised in this process yet (the same
            meaning as ``rlplane ... --address``): ``None`` does what ``ray.init()`` does
            (``RAY_ADDRESS``, else the cluster ``ray start`` started on this machine, else a new local
            Ray); ``"local"`` a new Ray of this process's own; ``"auto"`` the running cluster (error
            if none); ``"HOST:PORT"`` the cluster whose head listens there. With Ray already
            initialised, ``HOST:PORT`` must name that cluster and the other forms are not used.
        attach_only: raise ``StoreNotInitializedError`` instead of starting a store.
        **options: ``StoreConfig`` fields (``num_shards``, ``capacity_bytes``, ``num_cpus``,
            ``transport``, ``rpc_timeout_s``, ...).

    Returns:
        ``StoreInfo`` describing the service and this client's data path.

    Raises:
        ArgumentTypeError: an option that is no ``StoreConfig`` field (the message names the one it
            may mean), or of the wrong type; raised before Ray is started or joined.
        InvalidArgumentError: an option out of range, or ``address`` of none of the forms above
            (before Ray is started or joined), or naming another cluster than the one this process
            has joined.
        StoreNotInitializedError: ``attach_only`` and no store of that name runs; the message says
            how to start one.
        SchedulingError: Ray could not place the store's actors within ``schedule_timeout_s``.
        ClusterConnectError: no Ray cluster answers at ``address``.
        ClusterAuthError: the cluster at ``address`` refused this process's authentication token.

    Example:
        >>> info = dp.init(num_shards=2)
        >>> info.num_shards
        2
    """
    # Arguments first: a typo must not wait for Ray to start (seconds) or leave one started behind.
    cfg = StoreConfig.from_options(**options)
    _connect.parse_address(address)
    with _state.lock:
        import ray

        if ray.is_initialized():
            _connect.check_joined(address)
        if _state.client is not None:
            return _state.info  # type: ignore[return-value]
        if not ray.is_initialized():
            # Keep the context: if it is garbage collected, actor creations in flight get cancelled.
            _state.ray_ctx = _connect.connect(address)
        # The codec (torch, tensordict: some 4.5 CPU-seconds) is imported by the first put or get, not
        # here: a process that handles metadata only (the TransferQueue controller, the CLI, a
        # metadata-only driver) never pays for it.
        try:
            found = find_service(cfg)
        except StoreNotInitializedError:  # a broken store (its index died): clear it, then start afresh
            if attach_only:
                raise
            logger.warning("store %r is broken (its index died); stopping what is left of it", cfg.name)
            stop_named(cfg)
            found = None
        handle = None
        if found is None and attach_only:
            raise StoreNotInitializedError(no_store_message(cfg))
        if found is None:
            try:
                registry, handle = start_service(cfg)
            except ValueError:  # another process created the same named actors first: attach to it
                found = find_service(cfg)
                if found is None:
                    raise
                registry = found[0]
        else:
            registry = found[0]
        info = _attach(registry, handle, cfg, options.get("transport") or client_transport_override())
        if not _state.atexit:
            atexit.register(close)
            _state.atexit = True
        _announce(info)
        return info


def _attach(
    registry: dict[str, Any], handle: ServiceHandle | None, cfg: StoreConfig, transport: str | None
) -> StoreInfo:
    """This process's client of the store ``registry`` describes (``handle``: the one it started)."""
    client = StoreClient(
        registry,
        transport=transport,
        allow_pickle=cfg.allow_pickle,  # this process's choice (option or env), never the service's
        remote_dead=ray_says_dead,
    )
    _state.client, _state.handle, _state.cfg, _state.transport = client, handle, cfg, transport
    shards = registry["shards"]
    svc = client.config
    info = _state.info = StoreInfo(
        namespace=NAMESPACE,
        num_shards=len(shards),
        shard_nodes=tuple(s["node_id"] for s in shards),
        owned=handle is not None,
        capacity_bytes=svc.capacity_bytes,
        transport=client.transport,
        extra={"name": svc.name},
    )
    return info


def _announce(info: StoreInfo) -> None:
    """The one line saying what ``init`` did: INFO in a driver, DEBUG in Ray workers (one per worker
    would flood the driver's terminal through Ray's log forwarding)."""
    import ray

    nodes = len(set(info.shard_nodes))
    capacity = "unlimited" if info.capacity_bytes is None else format_bytes(info.capacity_bytes)
    where = f"{info.num_shards} shard(s) on {nodes} node(s), capacity {capacity}, transport {info.transport}"
    name = info.extra.get("name", "dataplane")
    if info.owned:
        line = (
            f"started an embedded store {name!r} ({where}); it lives as long as this process (dp.close() "
            "stops it); `rlplane store start` runs one that outlives it"
        )
    else:
        line = f"attached to store {name!r} ({where}) in Ray namespace {info.namespace!r}"
    # (ray.get_runtime_context() would start a Ray if none were up: ask only when one is.)
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        logger.debug(line)
        return
    _ensure_visible()
    logger.info(line)


def _ensure_visible() -> None:
    """Let the package's INFO lines reach a program that never configured ``logging``.

    Without any handler Python prints WARNING and above only, so "started an embedded store" would
    vanish. When neither the root logger nor the ``dataplane`` logger has a handler, the ``dataplane``
    logger gets one (stderr, INFO). A program that configures logging, before or after, decides
    itself; ``logging.getLogger("dataplane").setLevel(logging.WARNING)`` silences the line.
    """
    package = logging.getLogger("dataplane")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("dataplane: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


def close() -> None:
    """Drop this process's client; the process that started an embedded store also stops it.

    A worker's ``close()`` never stops a shared service. Safe to call twice.
    """
    _close(None)


# How long async_close waits for its own event loop to close the client's asyncio sockets. The loop is
# free (the close is awaited in a thread), so it does so at once unless a task hogs it; past this,
# the sockets are closed from the thread, as a blocking close() does.
_LOOP_CLOSE_TIMEOUT_S = 30.0


def _close(loop: asyncio.AbstractEventLoop | None) -> None:
    """``close``; with ``loop`` (run in a thread by ``async_close``), the client's asyncio sockets,
    which belong to that loop, are closed on it."""
    with _state.lock:
        client, handle = _state.client, _state.handle
        _state.client = _state.handle = _state.info = None
        if client is not None:
            export.flush()  # what this process recorded, before it may leave Ray
            if loop is not None:
                closing = asyncio.run_coroutine_threadsafe(_on_loop(client.asyn.close), loop)
                try:
                    closing.result(timeout=_LOOP_CLOSE_TIMEOUT_S)
                except TimeoutError:
                    logger.warning(
                        "dp.async_close: the event loop did not run for %.0f s; closing its sockets "
                        "from another thread",
                        _LOOP_CLOSE_TIMEOUT_S,
                    )
            client.close()
        if handle is not None:
            handle.stop()


def is_initialized() -> bool:
    """True between ``init()`` and ``close()``."""
    return _state.client is not None


async def async_init(**options: Any) -> StoreInfo:
    """``init`` for asyncio code: the one-time attach runs in a thread, off the event loop."""
    return await asyncio.to_thread(init, **options)


async def async_close() -> None:
    """``close`` for asyncio code: it runs in a thread (flushing metrics and stopping an embedded
    store wait on Ray, for seconds), so the event loop goes on serving its other tasks meanwhile."""
    await asyncio.to_thread(_close, asyncio.get_running_loop())


async def _on_loop(step: Callable[[], None]) -> None:
    step()


# ---- operations (built once, driven sync or async) -------------------------------------------------


# The op builders check the caller's keys once (``ops.check_keys``: a str where a list of keys belongs
# is refused with TypeError, before anything is encoded), then run the operation on the client's route.
def _put_op(keys: Any, partition_id: str, fields: Any, tags: Any, row: bool) -> _ops.Op[KVBatchMeta]:
    from dataplane.codec.columns import encode_put, encode_row

    client = current_client()
    keys = _ops.check_keys(keys, partition_id)
    cols: dict[str, _ops.AnyColumn] | None = None
    if fields is not None:
        if row:
            cols = cast("dict[str, _ops.AnyColumn]", encode_row(fields, allow_pickle=client.allow_pickle))
        else:
            cols = encode_put(fields, len(keys), allow_pickle=client.allow_pickle)
    meta = yield from _ops.put(client.route, keys, partition_id, cols, tags)
    client.moved("put", meta.size, cols or {})
    return meta


def _get_op(
    keys: Any, partition_id: str, select_fields: Any, device: Any, copy: bool, non_blocking: bool = False
) -> _ops.Op[TensorDict]:
    from dataplane.codec.columns import decode_fields

    client = current_client()
    keys = _ops.check_keys([keys] if isinstance(keys, str) else keys, partition_id)
    cols = yield from _ops.get(client.route, keys, partition_id, select_fields, copy, device, non_blocking)
    td: TensorDict = decode_fields(cols, len(keys), device=device, allow_pickle=client.allow_pickle)
    client.moved("get", len(keys), cols)
    return td


def _meta_args(meta: KVBatchMeta, select_fields: Any) -> tuple[list[str], str, Any]:
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"meta must be a KVBatchMeta, not {type(meta).__name__}")
    if meta.partition_id is None:
        raise ValueError("meta.partition_id is None; a KVBatchMeta from kv_batch_put always has one")
    return meta.keys, meta.partition_id, select_fields if select_fields is not None else meta.fields


def _clear_op(keys: Any, partition_id: str) -> _ops.Op[None]:
    client = current_client()
    keys = _ops.check_keys([keys] if isinstance(keys, str) else keys, partition_id)
    yield from _ops.clear(client.route, keys, partition_id)
    client.moved("clear", len(keys))


def kv_put(
    key: str, partition_id: str, fields: Mapping[str, Any] | None = None, tag: dict[Any, Any] | None = None
) -> KVBatchMeta:
    """Write one sample (``fields``: tensors without the batch dim, or a TensorDict of batch size 1).

    Example:
        >>> dp.kv_put("k0", "train", {"x": torch.arange(4)}, tag={"score": 1.0}).fields
        ['x']
    """
    tags = [tag] if tag is not None else None
    return current_client().run(_put_op([key], partition_id, fields, tags, row=True), "put")


def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: Mapping[str, Any] | None = None,
    tags: Sequence[dict[Any, Any] | None] | None = None,
) -> KVBatchMeta:
    """Write a batch: ``fields`` has batch size ``len(keys)``; new fields add columns to existing keys.

    ``fields=None`` only updates tags. Tags are merged into the stored tag dict of each key. The
    returned meta's ``fields`` lists every field those keys now hold.

    All or nothing: everything (tags included) is checked before anything is sent, and a failure
    before the commit writes nothing anywhere. A new field's dtype and shape are decided by the
    first put that declares it; a concurrent put declaring another gets ``SchemaError``.

    Raises:
        TypeError: a tag holds something other than plain values (str, int, float, bool, None, lists,
            dicts); nothing is written.
        BatchSizeError: a field's (or tags') length differs from ``len(keys)``.
        SchemaError: a field exists with another dtype or shape (names the field).
        StoreFullError: the write would exceed the store's byte capacity (nothing is written).
        ReservationExpiredError: this process stalled between reserving space and committing for
            most of ``reservation_timeout_s``; nothing is written.

    Example:
        >>> meta = dp.kv_batch_put(["a", "b"], "train", TensorDict({"x": torch.ones(2, 3)}, [2]))
        >>> meta.size
        2
    """
    return current_client().run(_put_op(keys, partition_id, fields, tags, row=False), "put")


def kv_batch_get(
    keys: Sequence[str] | str,
    partition_id: str,
    select_fields: Sequence[str] | str | None = None,
    *,
    device: Device | None = None,
    copy: bool = True,
    non_blocking: bool = False,
) -> TensorDict:
    """Read rows of ``keys`` in that order as a TensorDict of batch size ``len(keys)``.

    Dense fields come back as ``[B, ...]`` tensors, variable-length ones as jagged nested tensors,
    strings, JSON-like values and objects as non-tensor stacks. By default the result is a private
    copy (one gather copy straight out of shared memory), checked after the copy against concurrent
    clears: it holds exactly what a completed put wrote. ``copy=False`` returns zero-copy views of
    the store's memory where the rows are one contiguous run of one segment (else it copies); such
    a view stays valid and unchanged while you hold it, even if the keys are cleared meanwhile.

    A view is *shared*: every reader of those rows maps the same memory. Never write into it: a
    write changes what every other reader sees, with no error. torch has no read-only tensors, and
    mapping the memory read-only would turn a stray write into a crash of your process, so the view
    stays writable; ``.clone()`` it first if you need to modify it. The price of views: a segment
    handed out as a view is never recycled, so later puts fault fresh memory.

    ``device`` puts the tensors there. Onto a GPU, dense and jagged fields are copied straight from
    the store's shared memory (one DMA per run of rows, from a mapping registered with CUDA:
    ``docs/gpu.md``), finished and checked before the call returns; the result is always a private
    copy. ``non_blocking=True`` runs those copies on a stream of their own, so they overlap with the
    work the caller queued before the get; the caller's current stream waits for them.

    Object (pickled) columns are unpickled only if this process opted in (``dp.init(allow_pickle=
    True)`` or ``DATAPLANE_ALLOW_PICKLE=1``); otherwise reading one raises ``SerializationError``.

    Raises:
        KeyNotFoundError: a key (or a field of a key) is not stored; names key and partition.
        PartitionNotFoundError: the partition does not exist.
        ShardUnavailableError: a shard is dead (noticed within seconds) or did not answer within
            ``rpc_timeout_s``.
        SerializationError: an object column, and this process did not opt in to unpickling.

    Example:
        >>> dp.kv_batch_get(["a", "b"], "train", select_fields=["x"])["x"].shape
        torch.Size([2, 3])
    """
    return current_client().run(_get_op(keys, partition_id, select_fields, device, copy, non_blocking), "get")


def kv_batch_get_by_meta(
    meta: KVBatchMeta,
    select_fields: Sequence[str] | str | None = None,
    *,
    device: Device | None = None,
    copy: bool = True,
    non_blocking: bool = False,
) -> TensorDict:
    """``kv_batch_get`` with keys, partition and fields taken from ``meta``.

    Example:
        >>> td = dp.kv_batch_get_by_meta(meta)
    """
    keys, pid, fields = _meta_args(meta, select_fields)
    return kv_batch_get(keys, pid, fields, device=device, copy=copy, non_blocking=non_blocking)


def kv_list(
    partition_id: str | None = None, *, limit: int | None = None, cursor: str | None = None
) -> dict[str, dict[str, dict[Any, Any]]]:
    """``{partition: {key: tag}}`` for one partition (``{}`` if it does not exist) or all.

    With ``limit``, one page of ``partition_id``: at most ``limit`` keys in the order they were put,
    from ``cursor`` on, as a ``KVListPage`` (the same dict, and ``.cursor``: pass it to the next call;
    None after the last page). A page costs the index what it returns, so listing a partition of
    millions of keys holds up no other caller; keys put meanwhile come in later pages, cleared ones
    are left out; a partition cleared since the first page raises ``PartitionNotFoundError``.
    ``kv_iter_keys`` walks the pages for you. The whole form is asked for in pages too.

    Example:
        >>> dp.kv_list("train")
        {'train': {'a': {}, 'b': {}}}
        >>> page = dp.kv_list("train", limit=1)
        >>> page
        {'train': {'a': {}}}
        >>> last = dp.kv_list("train", limit=1, cursor=page.cursor)
        >>> last, last.cursor
        ({'train': {'b': {}}}, None)
    """
    client = current_client()
    return client.run(_list_op(client.route, partition_id, limit, cursor), "list")


def _list_op(
    route: _ops.Route, partition_id: str | None, limit: int | None, cursor: str | None
) -> _ops.Op[dict[str, dict[str, dict[Any, Any]]]]:
    """``kv_list``'s operation: the whole listing, or one page of it (a ``KVListPage``)."""
    if limit is None:
        if cursor is not None:
            raise InvalidArgumentError("cursor", "kv_list: a cursor goes with a limit (the page size)")
        return (yield from _ops.list_keys(route, partition_id))
    listing, nxt = yield from _ops.list_page(route, _page_args(partition_id, limit), limit, cursor)
    return KVListPage(listing, nxt)


def _page_args(partition_id: str | None, limit: int) -> str:
    if partition_id is None:
        raise InvalidArgumentError("partition_id", "kv_list: a page lists one partition; name it")
    if type(limit) is not int or limit < 1:
        raise InvalidArgumentError("limit", f"kv_list: limit must be an int >= 1, got {limit!r}")
    return partition_id


def kv_iter_keys(partition_id: str, page_size: int = _ops.LIST_PAGE) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Every key of ``partition_id`` with its tag, in the order they were put, fetched ``page_size``
    at a time (``kv_list`` with ``limit`` and ``cursor``): memory and each request stay bounded
    however big the partition. A partition that does not exist yields nothing.

    Example:
        >>> for key, tag in dp.kv_iter_keys("train", page_size=10_000):
        ...     print(key, tag)
        a {}
        b {}
    """
    client = current_client()
    pid = _page_args(partition_id, page_size)
    cursor: str | None = None
    while True:
        listing, cursor = client.run(_ops.list_page(client.route, pid, page_size, cursor), "list")
        yield from listing.get(pid, {}).items()
        if cursor is None:
            return


def kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    """Free ``keys``; keys that are not stored are ignored; a cleared key written again starts empty.

    Example:
        >>> dp.kv_clear(["a"], "train")
    """
    current_client().run(_clear_op(keys, partition_id), "clear")


def clear_partition(partition_id: str) -> None:
    """Free every key of ``partition_id`` and forget the partition (its schema too).

    Example:
        >>> dp.clear_partition("train")
    """
    client = current_client()
    client.run(_ops.clear_partition(client.route, partition_id), "clear_partition")


def stats(trim: bool = False) -> dict[str, Any]:
    """Per-shard memory and placement, and keys per partition.

    Each entry of ``stats()["shards"]`` has ``bytes_used`` (live data), ``bytes_resident`` (memory
    the shard holds, including warm free segments kept for reuse), ``bytes_warm``, ``pid``,
    ``node_id``, ``host`` (its node's IP), ``capacity_bytes`` and ``transport`` (this client's path
    to it). ``trim=True`` first gives every warm segment back to the OS.

    Example:
        >>> dp.stats()["shards"][0]["bytes_used"]
        0
    """
    client = current_client()
    shards, index = client.run(_ops.stats(client.route, trim))
    return stats_dict(client, shards, index)


def stats_dict(client: StoreClient, replies: list[ShardStatsReply], index: IndexStatsReply) -> dict[str, Any]:
    """What ``stats()`` returns, from the shards' and the index's stats replies (``ops.stats``)."""
    shards = [msgspec.structs.asdict(st) for st in replies]
    out = []
    for i, (st, info) in enumerate(zip(shards, client.registry["shards"], strict=True)):
        if st["clients"] is None:  # (only a shard's server loop counts its connections)
            del st["clients"]
        out.append(
            {
                **st,
                "name": client.config.shard_name(i),
                "pid": info["pid"],
                "node_id": info["node_id"],
                "host": info["tcp"].rsplit("//", 1)[-1].rsplit(":", 1)[0],  # the node's IP
                "transport": "shm" if client.shm[i] else "zmq",
            }
        )
    return {
        "name": client.config.name,
        "shards": out,
        "partitions": index.partitions,
        "bytes_used": sum(s["bytes_used"] for s in shards),
        "bytes_resident": sum(s["bytes_resident"] for s in shards),
    }


# ---- async forms ----------------------------------------------------------------------------------


def _import_codec() -> None:
    import tensordict  # noqa: F401 - what decoding a get builds

    import dataplane.codec.columns  # noqa: F401


async def _codec_loaded() -> None:
    """Import the codec on a worker thread the first time an async put or get needs it: an import of
    seconds (torch, tensordict) must not stall the caller's event loop."""
    if "tensordict" not in sys.modules or "dataplane.codec.columns" not in sys.modules:
        await asyncio.to_thread(_import_codec)


async def async_kv_put(
    key: str, partition_id: str, fields: Mapping[str, Any] | None = None, tag: dict[Any, Any] | None = None
) -> KVBatchMeta:
    """Async ``kv_put``."""
    tags = [tag] if tag is not None else None
    await _codec_loaded()
    return await current_client().arun(_put_op([key], partition_id, fields, tags, row=True), "put")


async def async_kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: Mapping[str, Any] | None = None,
    tags: Sequence[dict[Any, Any] | None] | None = None,
) -> KVBatchMeta:
    """Async ``kv_batch_put``."""
    await _codec_loaded()
    return await current_client().arun(_put_op(keys, partition_id, fields, tags, row=False), "put")


async def async_kv_batch_get(
    keys: Sequence[str] | str,
    partition_id: str,
    select_fields: Sequence[str] | str | None = None,
    *,
    device: Device | None = None,
    copy: bool = True,
    non_blocking: bool = False,
) -> TensorDict:
    """Async ``kv_batch_get``."""
    await _codec_loaded()
    return await current_client().arun(
        _get_op(keys, partition_id, select_fields, device, copy, non_blocking), "get"
    )


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta,
    select_fields: Sequence[str] | str | None = None,
    *,
    device: Device | None = None,
    copy: bool = True,
    non_blocking: bool = False,
) -> TensorDict:
    """Async ``kv_batch_get_by_meta``."""
    keys, pid, fields = _meta_args(meta, select_fields)
    return await async_kv_batch_get(keys, pid, fields, device=device, copy=copy, non_blocking=non_blocking)


async def async_kv_list(
    partition_id: str | None = None, *, limit: int | None = None, cursor: str | None = None
) -> dict[str, dict[str, dict[Any, Any]]]:
    """Async ``kv_list`` (a page with ``limit``: a ``KVListPage``)."""
    client = current_client()
    return await client.arun(_list_op(client.route, partition_id, limit, cursor), "list")


async def async_kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    """Async ``kv_clear``."""
    await current_client().arun(_clear_op(keys, partition_id), "clear")


async def async_clear_partition(partition_id: str) -> None:
    """Async ``clear_partition``."""
    client = current_client()
    await client.arun(_ops.clear_partition(client.route, partition_id), "clear_partition")


async def async_stats(trim: bool = False) -> dict[str, Any]:
    """Async ``stats``."""
    client = current_client()
    shards, index = await client.arun(_ops.stats(client.route, trim))
    return stats_dict(client, shards, index)


__all__ = [
    "async_clear_partition",
    "async_close",
    "async_init",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "async_stats",
    "clear_partition",
    "close",
    "current_client",
    "init",
    "is_initialized",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_iter_keys",
    "kv_list",
    "kv_put",
    "stats",
]
