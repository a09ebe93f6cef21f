"""A ``DataProto``-shaped batch and its future, written for the tests (verl is not a dependency).

``ProtoBatch`` has what verl's ``DataProto`` has and controlplane relies on: a TensorDict
``batch``, a ``non_tensor_batch`` dict of numpy object arrays, ``meta_info``, ``chunk`` /
``concat`` / ``reorder`` / ``padding`` (in place, as in verl), ``is_padding_enabled()`` reading
verl's ``meta_info["_verl_auto_padding"]`` flag, and ``future_type = ProtoFuture`` (built like
verl's ``DataProtoFuture(collect_fn, futures, dispatch_fn)``). ``HookedBatch`` names its future
through the ``make_future`` hook instead. The workers live here too, so Ray can import them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import ray
import torch
from tensordict import TensorDict

from controlplane import Dispatch, Worker, make_nd_compute_dispatch_fn, register

PAD_KEY = "_verl_auto_padding"


@dataclass
class ProtoBatch:
    """Rows along dim 0 of ``batch`` and of every ``non_tensor_batch`` array."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    future_type: ClassVar[type]  # set below, once ProtoFuture exists

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor],
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> ProtoBatch:
        size = len(next(iter(tensors.values())))
        arrays = {k: _objects(v) for k, v in (non_tensors or {}).items()}
        meta = dict(meta_info or {})
        if auto_padding:
            meta[PAD_KEY] = True
        return cls(TensorDict(dict(tensors), batch_size=[size]), arrays, meta)

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()), ()))

    def __getitem__(self, index: slice | list[int] | np.ndarray) -> ProtoBatch:
        rows = np.arange(len(self))[index]
        picked = None if self.batch is None else self.batch[torch.as_tensor(rows)]
        arrays = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        return type(self)(picked, arrays, dict(self.meta_info))

    def is_padding_enabled(self) -> bool:
        return bool(self.meta_info.get(PAD_KEY, False))

    def padding(self, padding_size: int) -> None:
        """verl's semantics: in place, by rebinding the fields, repeating the last row."""
        if padding_size == 0:
            return
        padded = type(self).concat([self, self[[len(self) - 1] * padding_size]])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list[ProtoBatch]:
        if len(self) % chunks:
            raise AssertionError(f"only equal chunks: {len(self)} rows into {chunks}")
        step = len(self) // chunks
        return [self[i * step : (i + 1) * step] for i in range(chunks)]

    @staticmethod
    def concat(data: list[ProtoBatch]) -> ProtoBatch:
        tds = [d.batch for d in data]
        batch = None if tds[0] is None else torch.cat(tds, dim=0)
        arrays = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch}
        meta: dict[str, Any] = {}
        for d in data:
            for k, v in d.meta_info.items():
                if meta.setdefault(k, v) != v:
                    raise AssertionError(f"conflicting meta_info[{k!r}]")
        return type(data[0])(batch, arrays, meta)

    def reorder(self, indices: torch.Tensor) -> None:
        """In place, as verl's."""
        rows = indices.numpy()
        self.batch = self.batch[indices]
        self.non_tensor_batch = {k: v[rows] for k, v in self.non_tensor_batch.items()}


def _objects(values: Any) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _pick_chunk(data: ProtoBatch, i: int, chunks: int) -> ProtoBatch:
    return data.chunk(chunks)[i]


@dataclass
class ProtoFuture:
    """verl's ``DataProtoFuture`` shape: resolves ``futures`` with ``collect_fn``, then ``dispatch_fn``."""

    collect_fn: Callable[[list], Any]
    futures: list[ray.ObjectRef]
    dispatch_fn: Callable[[Any], Any] | None = None

    def chunk(self, chunks: int) -> list[ProtoFuture]:
        return [
            type(self)(self.collect_fn, self.futures, functools.partial(_pick_chunk, i=i, chunks=chunks))
            for i in range(chunks)
        ]

    @staticmethod
    def concat(data: list[ray.ObjectRef]) -> ProtoFuture:
        return ProtoFuture(ProtoBatch.concat, list(data))

    def get(self) -> ProtoBatch:
        out = self.collect_fn(ray.get(self.futures, timeout=120))
        return out if self.dispatch_fn is None else self.dispatch_fn(out)


ProtoBatch.future_type = ProtoFuture


class TaggedFuture(ProtoFuture):
    """Built by ``HookedBatch.make_future``."""


class HookedBatch(ProtoBatch):
    """Names its future with the ``make_future`` hook (wins over ``future_type``)."""

    @classmethod
    def make_future(cls, refs: list[ray.ObjectRef], collect_fn: Callable[[list], Any]) -> TaggedFuture:
        return TaggedFuture(collect_fn, refs)


def rows(n: int, *, auto_padding: bool = False, cls: type[ProtoBatch] = ProtoBatch) -> ProtoBatch:
    """``n`` rows: ``a`` = 0..n-1 (float), ``text`` = "s0".."s<n-1>", ``meta_info`` = {"step": 3}."""
    return cls.from_dict(
        {"a": torch.arange(n, dtype=torch.float32)},
        {"text": [f"s{i}" for i in range(n)]},
        {"step": 3},
        auto_padding=auto_padding,
    )


def tag_with_rank(worker: Worker, data: ProtoBatch) -> ProtoBatch:
    """For ``execute_with_func_generator``: every row learns which rank saw it."""
    data.non_tensor_batch["rank"] = _objects([worker.rank] * len(data))
    return data


class ProtoWorker(Worker):
    """Four ranks; mesh "mesh" is dp=2 x tp=2, the tp==0 rank of each replica collects."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("mesh", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    def _stamp(self, data: ProtoBatch) -> ProtoBatch:
        if not isinstance(data, ProtoBatch):
            raise TypeError(f"rank {self.rank} got a {type(data).__name__}, not a ProtoBatch")
        data.batch["a"] = data.batch["a"] + 100 * self.rank
        data.non_tensor_batch["rank"] = _objects([self.rank] * len(data))
        data.meta_info["seen_by"] = "proto"
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def stamp(self, data: ProtoBatch) -> ProtoBatch:
        return self._stamp(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stamp_later(self, data: ProtoBatch) -> ProtoBatch:
        return self._stamp(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def stamp_later_async(self, data: ProtoBatch) -> ProtoBatch:
        return self._stamp(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def arrived(self, data: Any) -> list:
        return [type(data).__name__]

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def per_rank(self, data: ProtoBatch) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, data: ProtoBatch) -> ProtoBatch:
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self, data: ProtoBatch) -> tuple:
        text = list(data.non_tensor_batch["text"])
        return (self.rank, type(data).__name__, len(data), text, data.meta_info)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def first_text(self, data: ProtoBatch) -> str:
        return data.non_tensor_batch["text"][0]

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def total(self, data: ProtoBatch) -> tuple:
        return (self.rank, float(data.batch["a"].sum()))

    @register(dispatch_mode=make_nd_compute_dispatch_fn("mesh"))
    def mesh_stamp(self, data: ProtoBatch) -> ProtoBatch:
        return self._stamp(data)

    @register(dispatch_mode=make_nd_compute_dispatch_fn("mesh"), blocking=False)
    def mesh_stamp_later(self, data: ProtoBatch) -> ProtoBatch:
        return self._stamp(data)
