"""The paths the store benchmark compares: memcpy, Ray's object store, TransferQueue 0.1.11, this store.

Each path is a small class with one lifecycle, run in the driver on an initialised Ray::

    path.start()    # bring the system up, untimed; returns facts to record (init time, memory)
    path.round()    # one timed put and one timed actor read (and an untimed clear): {"put": s, "get": s}
    path.finish()   # untimed extras: single-key latency, where the read bytes live, view rounds
    path.close()    # tear down (always called, idempotent)

The benchmark interleaves the rounds of all paths (memcpy, ray, tq, store, memcpy, ray, ...), so a
burst of other work on the shared host slows every path alike and the ratios stay meaningful.
Readers are ``bench._reader.Reader`` actors, one per path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bench import _common, _memory
from bench._harness import PARTITION, Config, bare_latency, call, check_summary, kv_latency, new_reader
from bench._reader import Summary

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef
    from tensordict import TensorDict


class BenchPath:
    """Base class: holds the run's config, payload, expected read summary and latency row."""

    name = "?"

    def __init__(
        self, cfg: Config, td: TensorDict, expected: Summary, small: dict[str, torch.Tensor]
    ) -> None:
        self.cfg, self.td, self.expected, self.small = cfg, td, expected, small
        self.keys = [f"k{i}" for i in range(cfg.rows)]
        self.reader: Any = None

    def start(self) -> dict[str, Any]:
        return {}

    def round(self) -> dict[str, float]:
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.reader is not None:
            import ray

            ray.kill(self.reader)
            self.reader = None

    def _latency(self, api: ModuleType | None = None) -> dict[str, _common.Latency]:
        """Bare Ray actor-call latency with this path's reader, then ``api``'s single-key latency.

        ``bare_ray`` ships the same two tensors as the single-key put; ``bare_ray_no_arg`` is the
        same call with no argument (the faster one, which the latency checks divide by).
        """
        out = {
            "bare_ray": bare_latency(self.cfg, self.reader, self.small),
            "bare_ray_no_arg": bare_latency(self.cfg, self.reader, None),
        }
        return {**out, **kv_latency(self.cfg, api, self.small)} if api is not None else out

    def _kv_round(
        self, put: Callable[[], object], read: Callable[[], ObjectRef], clear: Callable[[], object]
    ) -> dict[str, float]:
        put_s, _ = _common.timed(put)
        get_s, got = _common.timed(lambda: call(self.cfg, read()))
        check_summary(self.name, got, self.expected)
        clear()
        return {"put": put_s, "get": get_s}


class MemcpyPath(BenchPath):
    """``dst.copy_(src)`` per field into preallocated tensors; a round is the best of 3 copies."""

    name = "memcpy"

    def start(self) -> dict[str, Any]:
        import torch

        self.dst = {name: torch.empty_like(self.td[name]) for name in self.td.keys()}
        self.round()  # fault the destination pages in
        return {"torch_threads": torch.get_num_threads()}

    def round(self) -> dict[str, float]:
        copy = lambda: [self.dst[name].copy_(self.td[name]) for name in self.dst]  # noqa: E731
        return {"copy": min(_common.timed(copy)[0] for _ in range(3))}


class RayPath(BenchPath):
    """Driver ``ray.put(td)``; the actor does ``ray.get(ref)``. Also the bare actor-call latency."""

    name = "ray"

    def start(self) -> dict[str, Any]:
        self.reader = new_reader(self.cfg)
        return {}

    def round(self) -> dict[str, float]:
        import ray

        put_s, ref = _common.timed(lambda: ray.put(self.td))
        get_s, got = _common.timed(lambda: call(self.cfg, self.reader.read_ray.remote([ref])))
        check_summary(self.name, got, self.expected)
        return {"put": put_s, "get": get_s}  # the object is freed when ``ref`` goes

    def finish(self) -> dict[str, Any]:
        import ray

        ref = ray.put(self.td)
        backing = call(self.cfg, self.reader.read_ray.remote([ref], probe=True))["backing"]
        return {"get_backing": backing, "latency": self._latency()}


class TQPath(BenchPath):
    """TransferQueue 0.1.11, default SimpleStorage (2 units): ``kv_batch_put`` / actor ``kv_batch_get``."""

    name = "tq"

    def start(self) -> dict[str, Any]:
        import transfer_queue as tq

        self.tq = tq
        init_s, _ = _common.timed(tq.init)
        self.reader = new_reader(self.cfg)
        call(self.cfg, self.reader.attach_tq.remote())
        return {"init_s": init_s, "notes": ["kv_batch_get returns dense fields as jagged nested tensors"]}

    def round(self) -> dict[str, float]:
        tq, keys = self.tq, self.keys
        return self._kv_round(
            lambda: tq.kv_batch_put(keys, PARTITION, self.td),
            lambda: self.reader.read_tq.remote(keys, PARTITION),
            lambda: tq.kv_clear(keys, PARTITION),
        )

    def finish(self) -> dict[str, Any]:
        self.tq.kv_batch_put(self.keys, PARTITION, self.td)
        backing = call(self.cfg, self.reader.read_tq.remote(self.keys, PARTITION, probe=True))["backing"]
        self.tq.kv_clear(self.keys, PARTITION)
        return {"get_backing": backing, "latency": self._latency(self.tq)}

    def close(self) -> None:
        super().close()
        if getattr(self, "tq", None) is not None:
            self.tq.close()
            self.tq = None


class StorePath(BenchPath):
    """This store, embedded (``dp.init()``): ``kv_batch_put`` / actor ``kv_batch_get`` (copy-out).

    ``start`` measures the shards' memory on a store that has never held data. The zero-copy view
    reads run in ``finish``, in rounds of their own: a segment handed out as a view is not recycled,
    so view reads mixed into the copy-out rounds would slow those rounds' puts.
    """

    name = "store"

    def start(self) -> dict[str, Any]:
        import dataplane as dp

        self.dp = dp
        cfg = self.cfg
        init_s, _ = _common.timed(lambda: dp.init(transport=cfg.store_transport, encrypt=cfg.encrypt))
        memory = _memory.store_memory(
            dp, self.keys, PARTITION, self.td, cfg.payload_bytes, cfg.release_wait_s
        )
        self.reader = new_reader(cfg)
        call(cfg, self.reader.attach_store.remote(cfg.store_transport))
        return {"init_s": init_s, "memory": memory}

    def round(self, copy: bool | None = None) -> dict[str, float]:
        dp, keys = self.dp, self.keys
        return self._kv_round(
            lambda: dp.kv_batch_put(keys, PARTITION, self.td),
            lambda: self.reader.read_store.remote(keys, PARTITION, copy),
            lambda: dp.kv_clear(keys, PARTITION),
        )

    def _backing(self, copy: bool | None) -> dict[str, str]:
        self.dp.kv_batch_put(self.keys, PARTITION, self.td)
        got = call(self.cfg, self.reader.read_store.remote(self.keys, PARTITION, copy, True))
        self.dp.kv_clear(self.keys, PARTITION)
        return got["backing"]

    def finish(self) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {
            "get_backing": {"copy": self._backing(None)},
            "latency": self._latency(self.dp),
        }
        if "copy" in inspect.signature(self.dp.kv_batch_get).parameters:
            rounds = [self.round(copy=False) for _ in range(cfg.warmup + cfg.repeats)][cfg.warmup :]
            out["get_view"] = _common.throughput(cfg.payload_bytes, [r["get"] for r in rounds])
            out["put_in_view_rounds"] = _common.throughput(cfg.payload_bytes, [r["put"] for r in rounds])
            out["get_backing"]["view"] = self._backing(False)
        return out

    def close(self) -> None:
        super().close()
        if getattr(self, "dp", None) is not None:
            self.dp.close()
            del self.dp


PATHS: dict[str, type[BenchPath]] = {p.name: p for p in (MemcpyPath, RayPath, TQPath, StorePath)}
