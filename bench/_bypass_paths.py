"""The paths the controller-bypass benchmark compares, one class each, run in the driver.

Each path has one lifecycle::

    path.step(step, check)    # one whole step (producer stage, consumer stage, clean-up); timed by
                              # the caller, except when ``check`` (then the output is verified too)
    path.driver_bytes()       # (sent, received) by the driver in the last step, untimed
    path.close()              # drop what is left (idempotent)

What crosses the driver is counted as the pickled size (protocol 5, out-of-band buffers
included: what Ray ships) of every per-rank argument the controller dispatches and every per-rank
result it collects, plus the driver's own store calls (the clear: its keys and partition).
``bench.bypass`` interleaves the paths' steps (every round visits every path), so a burst of other
work on the host slows them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench._bypass_data import OUT, check_output
from bench._driver_cost import pickled_bytes

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from controlplane import RayWorkerGroup


@dataclass
class Point:
    """One measured point: the batch a step moves and the groups that move it."""

    payload_bytes: int  # as asked (--payload); the batch's real size is ``rows * row_nbytes(seq)``
    rows: int
    seq: int
    producers: RayWorkerGroup  # of BypassProducer
    consumers: RayWorkerGroup  # of BypassConsumer
    partition: str  # prefix; each path adds its name

    def prompts(self) -> TensorDict:
        """The producers' input: the row ids (what a rollout's prompts batch would be)."""
        import torch
        from tensordict import TensorDict

        return TensorDict({"row": torch.arange(self.rows, dtype=torch.int64)}, batch_size=[self.rows])


def dispatched_bytes(n: int, *args: object) -> int:
    """Pickled bytes of ``args`` as a PROTO dispatch sends them to ``n`` ranks (batches chunked)."""
    from controlplane import batch

    per_arg = [batch.chunk(a, n) if batch.is_batch(a) else [a] * n for a in args]
    return sum(pickled_bytes(tuple(pieces[i] for pieces in per_arg)) for i in range(n))


def collected_bytes(result: object, n: int) -> int:
    """Pickled bytes of the per-rank results behind ``result`` (a list per rank, or a concatenated batch)."""
    if isinstance(result, list):
        return sum(pickled_bytes(r) for r in result)
    return dispatched_bytes(n, result)


class BypassPath:
    """Base class: holds the point and the last step's objects (for the byte count)."""

    name = "?"

    def __init__(self, point: Point) -> None:
        self.point = point
        self.prompts = point.prompts()
        self.last: dict[str, Any] = {}

    @property
    def partition(self) -> str:
        return f"{self.point.partition}-{self.name}"

    def step(self, step: int, check: bool) -> None:
        raise NotImplementedError

    def driver_bytes(self) -> tuple[int, int]:
        raise NotImplementedError

    def close(self) -> None:
        self.last = {}

    def _check(self, out: torch.Tensor, step: int) -> None:
        check_output(self.name, out, self.point.rows, self.point.seq, step)

    @property
    def _np(self) -> int:
        return self.point.producers.world_size

    @property
    def _nc(self) -> int:
        return self.point.consumers.world_size


class FloorPath(BypassPath):
    """Producers make the rows and drop them; each consumer makes its own rows and computes."""

    name = "floor"

    def step(self, step: int, check: bool) -> None:
        made = self.point.producers.produce_floor(self.prompts, step)
        outs = self.point.consumers.step_floor(self.prompts, step, check)
        if check:
            import torch

            self._check(torch.cat([o[OUT] for o in outs]), step)
        self.last = {"step": step, "made": made, "outs": outs}

    def driver_bytes(self) -> tuple[int, int]:
        step = self.last["step"]
        sent = dispatched_bytes(self._np, self.prompts, step) + dispatched_bytes(
            self._nc, self.prompts, step, False
        )
        return sent, collected_bytes(self.last["made"], self._np) + collected_bytes(
            self.last["outs"], self._nc
        )


class ClassicPath(BypassPath):
    """verl without a data plane: the batch comes to the driver, goes out in chunks, results come back."""

    name = "classic"

    def step(self, step: int, check: bool) -> None:
        batch = self.point.producers.produce_classic(self.prompts, step)
        out = self.point.consumers.step(batch, step, self.name)
        if check:
            self._check(out[OUT], step)
        self.last = {"step": step, "batch": batch, "out": out}

    def driver_bytes(self) -> tuple[int, int]:
        step, batch, out = self.last["step"], self.last["batch"], self.last["out"]
        sent = dispatched_bytes(self._np, self.prompts, step) + dispatched_bytes(
            self._nc, batch, step, self.name
        )
        return sent, collected_bytes(batch, self._np) + collected_bytes(out, self._nc)


class StorePath(BypassPath):
    """The store: producers put, the driver dispatches ``KVBatchMeta`` only, workers fetch and write back."""

    name = "store"

    def step(self, step: int, check: bool) -> None:
        import dataplane as dp

        pid = self.partition
        meta = self.point.producers.produce_store(self.prompts, step, pid)
        done = self.point.consumers.step(meta, step, self.name)
        if check:
            if done.fields is None or OUT not in done.fields or list(done.keys) != list(meta.keys):
                raise RuntimeError(f"store path: the consumers' meta lacks {OUT!r} or keys: {done!r}")
            self._check(dp.kv_batch_get(done.keys, pid, select_fields=[OUT])[OUT], step)
        dp.kv_clear(meta.keys, pid)
        self.last = {"step": step, "meta": meta, "done": done}

    def driver_bytes(self) -> tuple[int, int]:
        step, meta, done = self.last["step"], self.last["meta"], self.last["done"]
        sent = dispatched_bytes(self._np, self.prompts, step, self.partition)
        sent += dispatched_bytes(self._nc, meta, step, self.name)
        sent += pickled_bytes((list(meta.keys), self.partition))  # the driver's kv_clear
        return sent, collected_bytes(meta, self._np) + collected_bytes(done, self._nc)

    def close(self) -> None:
        import dataplane as dp

        if self.last and dp.is_initialized():
            dp.clear_partition(self.partition)
        super().close()


class TQPath(BypassPath):
    """The same as ``store`` through TransferQueue 0.1.11's KV API (its ``KVBatchMeta`` is dispatched)."""

    name = "tq"

    def step(self, step: int, check: bool) -> None:
        import transfer_queue as tq

        from bench._bypass_data import densify

        pid = self.partition
        meta = self.point.producers.produce_tq(self.prompts, step, pid)
        done = self.point.consumers.step_tq(meta, step)
        if check:
            got = densify(tq.kv_batch_get(meta.keys, pid, select_fields=[OUT]), self.point.seq)
            self._check(got[OUT], step)
        tq.kv_clear(meta.keys, pid)
        self.last = {"step": step, "meta": meta, "done": done}

    def driver_bytes(self) -> tuple[int, int]:
        step, meta, done = self.last["step"], self.last["meta"], self.last["done"]
        sent = dispatched_bytes(self._np, self.prompts, step, self.partition)
        sent += dispatched_bytes(self._nc, meta, step)
        sent += pickled_bytes((list(meta.keys), self.partition))
        return sent, collected_bytes(meta, self._np) + collected_bytes(done, self._nc)


PATH_CLASSES: dict[str, type[BypassPath]] = {p.name: p for p in (FloorPath, ClassicPath, StorePath, TQPath)}
