"""The GRPO roles as controlplane workers: thin wrappers over :mod:`workers.engine`.

Two worker classes, each method bridged (``KVBatchMeta`` in, ``KVBatchMeta`` or metrics out):

- :class:`ActorRolloutRefWorker`, one per data-parallel rank (a ``torch.distributed`` gloo
  group on CPU, NCCL on GPU): ``generate_sequences`` (rollout), ``compute_log_prob`` (old
  log-probs), ``compute_ref_log_prob`` (a frozen copy of the initial weights, colocated as in
  verl's ActorRolloutRef worker) and ``update_actor`` (clipped policy gradient, gradients
  averaged over the group). Registered on mesh ``"actor"``: every rank is its own dp replica.
- :class:`RewardWorker`: ``make_prompts`` (the task's data source: writes prompts into the
  store), ``compute_reward`` (the rule) and ``compute_advantage`` (GRPO group normalisation,
  on one rank so that every prompt group is whole).

Field names are those of :mod:`workers.engine`. Settings that change per step travel in
``KVBatchMeta.extra_info``: ``step`` (sampling seeds), ``n`` (responses per prompt, for
``make_prompts``).

Stream mode (``GRPOTrainer`` with ``mode="stream"``): every bridged method also takes a
``dp.StreamRequest`` and pulls its own ready rows (see :mod:`workers.bridge`);
``make_stream_prompts`` names the keys itself and tags each row with its group (``uid``) for
``dp.GroupSampler``, and ``generate_sequences`` takes the step as a keyword.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

import dataplane as dp
from controlplane import Dispatch, Worker, make_nd_compute_dispatch_fn, register
from dataplane.bridge import Span
from dataplane.meta import check_partition
from workers.bridge import StreamReport, count, nbytes_of, tqbridge, traffic
from workers.engine import (
    Actor,
    ActorConfig,
    CountingTask,
    ModelConfig,
    PatternReward,
    Reference,
    Rollout,
    TinyCausalLM,
    compute_advantage,
)

logger = logging.getLogger(__name__)

__all__ = ["ActorRolloutRefWorker", "RewardWorker", "RoleWorker"]

ACTOR_MESH = "actor"
_ON_ACTOR_MESH = make_nd_compute_dispatch_fn(ACTOR_MESH)
_DIST_TIMEOUT = datetime.timedelta(seconds=120)


def _sampling_seed(seed: int, step: int, dp_rank: int) -> int:
    # Distinct, reproducible streams per (run, step, replica).
    return (seed * 1_000_003 + step * 1_009 + dp_rank) % (2**63)


class RoleWorker(Worker):
    """Base of the role workers: single-threaded torch, and the bridge's byte counters."""

    def __init__(self) -> None:
        super().__init__()
        # Several workers share a few cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def store_traffic(self) -> dict[str, int]:
        """This process's bridge counters (``read_bytes``, ``written_bytes``, ``calls``) and its pid."""
        return {**traffic(), "pid": os.getpid()}


class ActorRolloutRefWorker(RoleWorker):
    """Policy, sampler and frozen reference of one data-parallel rank.

    Args:
        task: the task's shapes (``CountingTask`` fields as a dict).
        model: ``ModelConfig`` fields as a dict (vocab and length come from the task).
        actor: ``ActorConfig`` fields as a dict.
        seed: initial weights (identical on every rank) and sampling streams.
        device: where the model lives (``"cpu"``, or ``"cuda"`` in a GPU pool: NCCL then).
    """

    def __init__(
        self,
        task: dict[str, Any],
        model: dict[str, Any] | None = None,
        actor: dict[str, Any] | None = None,
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.task = CountingTask(**task)
        self.model_cfg = ModelConfig(
            vocab_size=self.task.vocab_size, max_len=self.task.max_len, **(model or {})
        )
        self.actor_cfg = ActorConfig(**(actor or {}))
        self.seed = seed
        self.device = torch.device(device)
        self._register_dispatch_collect_info(ACTOR_MESH, dp_rank=self.rank, is_collect=True)
        self.actor: Actor | None = None
        self._stream_calls: dict[int, int] = {}  # rollout calls per step (stream mode: several)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, seed: int | None = None) -> None:
        """Join the data-parallel process group (once) and build the model on every rank.

        Called again, it starts a new run on the same processes: fresh weights (from ``seed``, by
        default the constructor's; it also seeds the sampling streams), reference and optimizer.
        """
        if seed is not None:
            self.seed = seed
        self._stream_calls = {}  # a new run's steps start again from 0
        if self.world_size > 1 and not dist.is_initialized():
            addr, port = self.get_master_addr_port()
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{addr}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=_DIST_TIMEOUT,
            )
        torch.manual_seed(self.seed)
        model = TinyCausalLM(self.model_cfg).to(self.device)
        self.actor = Actor(model, self.actor_cfg)  # broadcasts rank 0's weights
        self.rollout = Rollout(model, self.task.response_len, self.actor_cfg.temperature)
        self.reference = Reference(model, self.actor_cfg.temperature)

    def _model_ready(self) -> Actor:
        if self.actor is None:
            raise RuntimeError("ActorRolloutRefWorker: call init_model() on the group first")
        return self.actor

    @register(dispatch_mode=_ON_ACTOR_MESH)
    def generate_sequences(self, batch: TensorDict, step: int | None = None) -> TensorDict:
        """Sample one response per row (the rows already hold each prompt ``n`` times).

        ``step`` (stream mode, where a step's rows arrive in several calls): each call of a step
        gets its own sampling stream. Without it the step comes from ``extra_info``.
        """
        self._model_ready()
        stream = self.rank
        if step is None:
            step = int(batch.get_non_tensor("step")) if "step" in batch.keys() else 0
        else:
            call = self._stream_calls.get(step, 0)
            self._stream_calls = {s: c for s, c in self._stream_calls.items() if s > step - 8}
            self._stream_calls[step] = call + 1
            stream += 4099 * call
        gen = torch.Generator().manual_seed(_sampling_seed(self.seed, step, stream))
        out = self.rollout.generate(batch.select("prompts"), n=1, generator=gen)
        picked: TensorDict = out.select("responses", "response_mask", "rollout_log_probs")
        return picked

    @register(dispatch_mode=_ON_ACTOR_MESH)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        """``old_log_probs`` under the current weights."""
        out: TensorDict = self._model_ready().compute_log_prob(batch)
        return out

    @register(dispatch_mode=_ON_ACTOR_MESH)
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """``ref_log_probs`` of the frozen initial policy."""
        self._model_ready()
        out: TensorDict = self.reference.compute_ref_log_prob(batch)
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_state(self, path: str) -> bool:
        """Write the policy's weights and optimizer state to ``path`` (rank 0: every rank holds the
        same after each update); atomic (a temporary file, then a rename)."""
        actor = self._model_ready()
        if self.rank == 0:
            tmp = f"{path}.tmp"
            torch.save({"model": actor.model.state_dict(), "optimizer": actor.optimizer.state_dict()}, tmp)
            os.replace(tmp, path)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_state(self, path: str) -> bool:
        """Load what ``save_state`` wrote, on every rank (tensors only: ``weights_only``)."""
        actor = self._model_ready()
        state = torch.load(path, map_location=self.device, weights_only=True)
        actor.model.load_state_dict(state["model"])
        actor.optimizer.load_state_dict(state["optimizer"])
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @tqbridge(call_on_empty=True)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """One GRPO update on this rank's shard; metrics are averaged over the group.

        Called on every rank even when its stream batch is empty: the update's all-reduces need
        every rank (an empty shard joins with zero gradients).
        """
        return self._model_ready().update(batch)


class RewardWorker(RoleWorker):
    """The task's side: prompts in, rewards and advantages out.

    Args:
        task: the task's shapes (``CountingTask`` fields as a dict).
        seed: the prompt stream.
    """

    def __init__(self, task: dict[str, Any], seed: int = 0) -> None:
        super().__init__()
        self.task = CountingTask(**task)
        self.reward = PatternReward(self.task)
        self.seed = seed

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reseed(self, seed: int) -> None:
        """Start the prompt stream of a new run from ``seed`` (a trainer reusing this worker)."""
        self.seed = seed

    @register(dispatch_mode=Dispatch.RANK_ZERO, bridge=False)
    def make_prompts(self, meta: dp.KVBatchMeta) -> dp.KVBatchMeta:
        """Write ``prompts`` and ``uid`` for the keys of ``meta`` (``extra_info``: ``n``, ``step``).

        The keys hold ``len(meta) // n`` prompts, each repeated on ``n`` adjacent keys. Not bridged
        (``bridge=False``): the keys hold nothing yet, so there is nothing to fetch; it writes directly.
        """
        extra = meta.extra_info or {}
        n = int(extra.get("n", 1))
        step = int(extra.get("step", 0))
        if n < 1 or meta.size % n:
            raise ValueError(f"make_prompts: {meta.size} keys is not a multiple of n={n}")
        pid = check_partition(meta.partition_id, "make_prompts")
        data = self._prompts(step, meta.size // n, n)
        stored = dp.kv_batch_put(meta.keys, pid, fields=data, tags=meta.tags)
        count("written_bytes", nbytes_of(data))
        return dp.KVBatchMeta(meta.keys, meta.tags, pid, stored.fields, meta.extra_info)

    def _prompts(self, step: int, num: int, n: int) -> TensorDict:
        if not dp.is_initialized():
            dp.init(attach_only=True)
        gen = torch.Generator().manual_seed(_sampling_seed(self.seed, step, 7919))
        prompts = self.task.sample_prompts(num, gen).repeat_interleave(n, dim=0)
        uid = (torch.arange(num) + step * num).repeat_interleave(n)
        return TensorDict({"prompts": prompts, "uid": uid}, batch_size=[num * n])

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def make_stream_prompts(self, partition_id: str, step: int, num_prompts: int, n: int) -> StreamReport:
        """Stream mode's data source: write ``num_prompts`` prompts, each on ``n`` keys it names
        itself (``"<step>.<prompt>.<sample>"``), tagged ``{"uid": group}`` for ``dp.GroupSampler``.

        Returns a report (counts and the time span), not the keys: consumers find the rows with
        ``next_batch``. The same prompts as ``make_prompts`` for the same step.
        """
        called = time.time()
        if n < 1 or num_prompts < 1:
            raise ValueError(f"make_stream_prompts: num_prompts={num_prompts} and n={n} must be >= 1")
        data = self._prompts(step, num_prompts, n)
        keys = [f"{step}.{i}.{j}" for i in range(num_prompts) for j in range(n)]
        tags = [{"uid": int(u)} for u in data["uid"].tolist()]
        dp.kv_batch_put(keys, partition_id, fields=data, tags=tags)
        count("written_bytes", nbytes_of(data))
        span: Span = {
            "task": "prompts",
            "method": "make_stream_prompts",
            "partition": partition_id,
            "rank": self.rank,
            "rows": len(keys),
            "called": called,
            "start": called,
            "end": time.time(),
        }
        return StreamReport(partition_id, "prompts", len(keys), 1, spans=[span])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_reward(self, batch: TensorDict) -> TensorDict:
        """``rewards`` from the task's rule."""
        return self.reward.compute_reward(batch)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def compute_advantage(self, batch: TensorDict) -> TensorDict:
        """GRPO ``advantages`` over the whole batch (rank 0 only, so every group is whole)."""
        return compute_advantage(batch)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def reward_metrics(self, batch: TensorDict) -> dict[str, Any]:
        """Summary of a scored batch: mean/min/max reward and mean response length."""
        rewards = batch["rewards"].float()
        return {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()),
            "response/length": float(batch["response_mask"].sum(-1).float().mean()),
        }
