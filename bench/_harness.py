"""The benchmark harness: configuration, payload, reader actors, checks and single-key latency.

Used by ``bench._paths`` and ``bench.store_throughput``; runs in the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bench import _common
from bench._reader import Reader, Summary

if TYPE_CHECKING:
    import torch
    from ray.actor import ActorHandle
    from tensordict import TensorDict

PARTITION = "bench"
LATENCY_PARTITION = "bench-latency"
LATENCY_COLS = 64


@dataclass
class Config:
    """What one run measures; every field has a CLI flag of the same name."""

    rows: int = 1024
    cols: int = 8192
    fields: int = 2
    repeats: int = 10
    warmup: int = 1
    latency_iters: int = 200
    latency_warmup: int = 20
    paths: str = "memcpy,ray,tq,store"
    skip_tq: bool = False
    skip_store: bool = False
    ray_address: str | None = None
    ray_num_cpus: int = 8
    reader_cpus: float = 0.1
    call_timeout_s: float = 300.0
    release_wait_s: float = 10.0
    store_transport: str = "auto"
    encrypt: bool = False
    json: str | None = None
    plot: str | None = None
    markdown: str | None = None

    @property
    def payload_bytes(self) -> int:
        return self.rows * self.cols * self.fields * 4


def make_payload(cfg: Config) -> TensorDict:
    """The benchmark batch: ``fields`` float32 columns of shape ``[rows, cols]``, fixed seed."""
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(0)
    columns = {f"f{i}": torch.randn(cfg.rows, cfg.cols, generator=gen) for i in range(cfg.fields)}
    return TensorDict(columns, batch_size=[cfg.rows])


def make_small_row() -> dict[str, torch.Tensor]:
    """One sample for the latency test: 2 fields of 64 float32 (the bare Ray call ships it too)."""
    import torch

    return {"a": torch.randn(LATENCY_COLS), "b": torch.randn(LATENCY_COLS)}


def check_summary(path: str, got: Summary, expected: Summary) -> None:
    """Raise if a reader's summary (bytes, sampled values) differs from the payload's."""
    if got["nbytes"] != expected["nbytes"] or got["samples"] != expected["samples"]:
        raise RuntimeError(
            f"{path}: the reader saw different data: {got['nbytes']} bytes {got['samples']}, "
            f"expected {expected['nbytes']} bytes {expected['samples']}"
        )


def new_reader(cfg: Config) -> ActorHandle:
    """A fresh reader actor, waited for (up to ``call_timeout_s``) so its start-up is never timed."""
    import ray

    reader = ray.remote(Reader).options(num_cpus=cfg.reader_cpus).remote()
    ray.get(reader.pid.remote(), timeout=cfg.call_timeout_s)
    return reader


def call(cfg: Config, ref: Any) -> Any:
    """``ray.get`` with the run's deadline."""
    import ray

    return ray.get(ref, timeout=cfg.call_timeout_s)


def bare_latency(cfg: Config, reader: ActorHandle, arg: dict[str, torch.Tensor] | None) -> _common.Latency:
    """p50/p90 of ``ray.get(reader.noop.remote(arg))`` (or ``noop.remote()`` when ``arg`` is None)."""
    remote = (lambda: reader.noop.remote()) if arg is None else (lambda: reader.noop.remote(arg))
    return _common.measure_latency(lambda: call(cfg, remote()), cfg.latency_iters, cfg.latency_warmup)


def kv_latency(cfg: Config, api: ModuleType, small: dict[str, torch.Tensor]) -> dict[str, _common.Latency]:
    """p50/p90 of single-key ``api.kv_put`` (fresh keys) then ``api.kv_batch_get`` of those keys."""
    n = cfg.latency_warmup + cfg.latency_iters
    keys = [f"lat{i}" for i in range(n)]
    put_keys, get_keys = iter(keys), iter(keys)
    iters, warmup = cfg.latency_iters, cfg.latency_warmup
    put = _common.measure_latency(
        lambda: api.kv_put(next(put_keys), LATENCY_PARTITION, dict(small)), iters, warmup
    )
    get = _common.measure_latency(
        lambda: api.kv_batch_get([next(get_keys)], LATENCY_PARTITION), iters, warmup
    )
    api.kv_clear(keys, LATENCY_PARTITION)
    return {"put": put, "get": get}
