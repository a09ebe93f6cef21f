"""The workers the controller-bypass benchmark (``bench.bypass``) runs: producers and consumers.

Imported by the driver and, through the pickled classes, by every Ray worker process. A step is
a producer stage (a rollout: make the step's rows) followed by a consumer stage (compute one new
field from them); the paths differ only in how the rows get from one stage to the next:

* ``floor``: producers make their rows and drop them; each consumer makes its own rows locally
  (``step_floor``). No data moves: the compute alone.
* ``classic``: producers return their rows to the driver (``produce_classic``, concatenated by
  ``DP_COMPUTE_PROTO``); the driver dispatches them by value to ``step``, which returns the field.
* ``store``: producers write to the store and return a ``KVBatchMeta`` (``produce_store``); the
  driver dispatches meta chunks to the same ``step``, which ``@register`` bridges: the worker
  fetches its rows, and the field is written back under the same keys.
* ``tq``: the same through TransferQueue 0.1.11's KV API (``produce_tq``, ``step_tq``).

Every consumer spot-checks the rows it received (``check_rows``) on every step.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypedDict

from bench._bypass_data import FIELDS, RowBuffers, check_rows, compute, densify
from controlplane import Dispatch, Worker, register

if TYPE_CHECKING:
    from tensordict import TensorDict

    from dataplane import KVBatchMeta


class WorkerPlace(TypedDict):
    """Where a worker runs, as its ``attach`` reports it."""

    rank: int
    pid: int
    node_id: str
    node_ip: str
    store_transport: str  # shm, zmq or mixed: this worker's path to the shards


def _nbytes(td: Any) -> int:  # (a TensorDict of tensors only)
    return sum(v.numel() * v.element_size() for v in td.values())


class _BypassWorker(Worker):
    """Common setup: attach to the store (and TransferQueue), report where this worker runs."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.stored_bytes = 0  # bytes this process wrote to the store itself (not through the bridge)
        self.tq: Any = None
        self.rows = RowBuffers()

    # Not blocking: the driver starts every group's attach at once and waits for them together, so
    # the workers' imports (torch, the store's client) overlap instead of running group by group.
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def attach(self, store_name: str, transport: str) -> WorkerPlace:
        """Attach to the driver's store (never start one); return where this worker runs. Untimed."""
        import ray

        import dataplane as dp

        info = dp.init(attach_only=True, name=store_name, transport=transport)
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "node_ip": _node_ip(),
            "store_transport": info.transport,  # shm, zmq or mixed: this worker's path to the shards
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def attach_tq(self) -> None:
        """Make this process's TransferQueue client (the driver's controller must run). Untimed."""
        import transfer_queue as tq

        tq.init()  # finds the driver's controller and only makes this process's client
        self.tq = tq

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_seq(self, seq: int) -> None:
        """Tokens per row for the next point (the row size changes with the payload)."""
        self.seq = seq

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def store_traffic(self, reset: bool = False) -> dict[str, int]:
        """Bytes this process moved through the store: its own puts and the bridge's reads and writes."""
        from workers.bridge import reset_traffic, traffic

        out = {**traffic(), "stored_bytes": self.stored_bytes}
        if reset:
            reset_traffic()
            self.stored_bytes = 0
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def teardown(self) -> None:
        """Drop this process's clients; never stop the shared store or TransferQueue's controller."""
        import dataplane as dp

        if self.tq is not None:
            import transfer_queue.interface as tqi

            # tq.close() would kill the controller, which the driver owns: close only our client.
            client = getattr(tqi, "_TQ_CLIENT", None)
            if client is not None:
                client.close()
                tqi._TQ_CLIENT = None
            self.tq = None
        dp.close()


class BypassProducer(_BypassWorker):
    """The producer stage: makes the step's rows for its chunk of ``prompts`` (a TensorDict of row ids).

    Example:
        >>> producers = RayWorkerGroup(pool, RayClassWithInitArgs(BypassProducer, seq=4096))
        >>> ray.get(producers.attach("bench-bypass", "auto"))
        >>> batch = producers.produce_classic(prompts, 0)   # the rows, concatenated in the driver
    """

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def produce_floor(self, prompts: TensorDict, step: int) -> int:
        """Floor: make the rows and drop them; return the row count only."""
        return len(self.rows.make(prompts["row"], self.seq, step))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def produce_classic(self, prompts: TensorDict, step: int) -> TensorDict:
        """Classic: return the rows for the driver to concatenate."""
        return self.rows.make(prompts["row"], self.seq, step)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def produce_store(self, prompts: TensorDict, step: int, partition: str) -> KVBatchMeta:
        """Store: write the rows under keys ``r<row id>``; return their ``KVBatchMeta``."""
        import dataplane as dp

        td = self.rows.make(prompts["row"], self.seq, step)
        self.stored_bytes += _nbytes(td)
        return dp.kv_batch_put([f"r{i}" for i in prompts["row"].tolist()], partition, td)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def produce_tq(self, prompts: TensorDict, step: int, partition: str) -> Any:
        """TransferQueue: the same through ``transfer_queue.kv_batch_put``; returns its ``KVBatchMeta``."""
        td = self.rows.make(prompts["row"], self.seq, step)
        return self.tq.kv_batch_put([f"r{i}" for i in prompts["row"].tolist()], partition, td)


class BypassConsumer(_BypassWorker):
    """The consumer stage: computes ``new_log_probs`` from rows it makes, receives or fetches.

    Example:
        >>> consumers = RayWorkerGroup(pool, RayClassWithInitArgs(BypassConsumer, seq=4096))
        >>> ray.get(consumers.attach("bench-bypass", "auto"))
        >>> meta = consumers.step(meta, 0)   # bridged: fetch, compute, write back, return the meta
    """

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def step_floor(self, prompts: TensorDict, step: int, check: bool = False) -> TensorDict | int:
        """Floor: make this chunk's rows here, compute; return the output only when ``check``."""
        td = self.rows.make(prompts["row"], self.seq, step)
        check_rows("floor", td, step)
        out = compute(td)
        return out if check else len(out)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def step(self, data: TensorDict, step: int, path: str = "classic") -> TensorDict:
        """Classic (``data`` is the rows) and store (``data`` is a ``KVBatchMeta``, bridged) alike."""
        check_rows(path, data, step)
        return compute(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def step_tq(self, meta: Any, step: int) -> Any:
        """TransferQueue: fetch by keys, compute, write the field back; return TransferQueue's meta."""
        if len(meta) == 0:
            return meta
        got = self.tq.kv_batch_get(meta.keys, meta.partition_id, select_fields=list(FIELDS))
        td = densify(got, self.seq)  # TransferQueue returns dense fields as jagged nested tensors
        check_rows("tq", td, step)
        return self.tq.kv_batch_put(meta.keys, meta.partition_id, compute(td))


def _node_ip() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only a label for the records
        return "?"
