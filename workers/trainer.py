"""A GRPO trainer whose driver handles metadata only (``rlplane demo``, ``make demo``).

Each step the driver names the step's rows (keys in a fresh partition) and calls the worker
groups with ``KVBatchMeta`` only::

    make_prompts -> generate_sequences -> compute_reward -> compute_ref_log_prob
      -> compute_log_prob -> compute_advantage -> update_actor      (then clear the partition)

Prompts, responses, log-probs, rewards and advantages go worker -> store -> worker; the driver
gets back metadata and small metric dicts. Every group is wrapped in
:class:`~workers.driver_guard.MetadataOnlyGroup`, so a tensor reaching the driver raises
instead of passing silently, and the bytes through the driver are counted next to the bytes
the workers' bridges moved through the store.

Example:
    >>> trainer = GRPOTrainer(TrainerConfig(steps=3))
    >>> summary = trainer.fit()
    >>> trainer.close()
    >>> summary["reward_last"] > summary["reward_first"]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import sys
import time
from typing import Any

import dataplane as dp
from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from workers.driver_guard import MetadataOnlyGroup
from workers.roles import ActorRolloutRefWorker, RewardWorker

logger = logging.getLogger(__name__)

__all__ = ["TrainerConfig", "GRPOTrainer", "cli", "format_summary"]

# The fields each call reads; the driver asks for no more than that.
_GEN = ["prompts"]
_SCORE = ["prompts", "responses", "response_mask"]
_ADV = ["rewards", "uid", "response_mask"]
_UPDATE = ["prompts", "responses", "response_mask", "old_log_probs", "advantages", "ref_log_probs"]


@dataclasses.dataclass
class TrainerConfig:
    """What the trainer runs.

    Attributes:
        steps: training steps.
        prompts_per_step: distinct prompts per step; each is sampled ``n`` times.
        n: responses per prompt (the GRPO group size).
        dp: data-parallel actor workers.
        seed: weights, prompts and sampling streams.
        task: ``CountingTask`` fields.
        model: ``ModelConfig`` fields (besides vocabulary and length, which come from the task).
        actor: ``ActorConfig`` fields.
        num_shards: store shards when the trainer starts the store itself.
        use_gpu: one GPU per actor worker (model on CUDA, NCCL); default CPU with gloo.
    """

    steps: int = 40
    prompts_per_step: int = 16
    n: int = 8
    dp: int = 2
    seed: int = 0
    task: dict = dataclasses.field(
        default_factory=lambda: {"vocab_size": 16, "prompt_len": 4, "response_len": 8}
    )
    model: dict = dataclasses.field(default_factory=dict)
    actor: dict = dataclasses.field(default_factory=dict)
    num_shards: int = 2
    use_gpu: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "n", "dp", "num_shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainerConfig.{name} must be a positive int, got {value!r}")


class GRPOTrainer:
    """Builds the worker groups (and the store if none runs) and runs GRPO steps.

    Args:
        cfg: the run's settings.

    The store is attached to if this process already has one; otherwise an embedded one is
    started and :meth:`close` stops it. Ray must be initialised (``dp.init`` starts it if not).
    """

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self._owns_store = not dp.is_initialized()
        dp.init(num_shards=cfg.num_shards)
        self._pools = [
            RayResourcePool([cfg.dp], use_gpu=cfg.use_gpu, max_colocate_count=1),
            RayResourcePool([1], use_gpu=False, max_colocate_count=1),
        ]
        device = "cuda" if cfg.use_gpu else "cpu"
        actor_cls = RayClassWithInitArgs(
            ActorRolloutRefWorker, cfg.task, cfg.model, cfg.actor, cfg.seed, device
        )
        reward_cls = RayClassWithInitArgs(RewardWorker, cfg.task, cfg.seed)
        self._groups: list[RayWorkerGroup] = []
        self.history: list[dict[str, float]] = []
        try:
            self._groups.append(RayWorkerGroup(self._pools[0], actor_cls))
            self._groups.append(RayWorkerGroup(self._pools[1], reward_cls))
            self.actor = MetadataOnlyGroup(self._groups[0], "actor")
            self.reward = MetadataOnlyGroup(self._groups[1], "reward")
            self.actor.init_model()
        except BaseException:
            self.close()  # leave no actors, placement groups or owned store behind
            raise

    # ---- traffic ------------------------------------------------------------------------------
    @property
    def driver_bytes(self) -> int:
        """Bytes of arguments and results that went through the driver so far."""
        return self.actor.driver_bytes + self.reward.driver_bytes

    def store_bytes(self) -> int:
        """Bytes the workers read from and wrote to the store so far (each process counted once)."""
        per_pid: dict[int, int] = {}
        for stats in [*self.actor.group.store_traffic(), *self.reward.group.store_traffic()]:
            per_pid[stats["pid"]] = stats["read_bytes"] + stats["written_bytes"]
        return sum(per_pid.values())

    # ---- one step -----------------------------------------------------------------------------
    def step(self, index: int, prompts_per_step: int | None = None) -> dict[str, float]:
        """Run GRPO step ``index`` on ``prompts_per_step`` prompts (default: the config's); return metrics."""
        num = prompts_per_step or self.cfg.prompts_per_step
        n = self.cfg.n
        pid = f"grpo-{index}"
        keys = [f"{index}.{i}.{j}" for i in range(num) for j in range(n)]
        batch = dp.KVBatchMeta(keys, partition_id=pid, extra_info={"step": index, "n": n})
        try:
            self._expect(self.reward.make_prompts(batch), batch, "make_prompts")
            self._expect(
                self.actor.generate_sequences(batch.select_fields(_GEN)), batch, "generate_sequences"
            )
            self._expect(self.reward.compute_reward(batch.select_fields(_SCORE)), batch, "compute_reward")
            scores = self.reward.reward_metrics(batch.select_fields(["rewards", "response_mask"]))
            self._expect(self.actor.compute_ref_log_prob(batch.select_fields(_SCORE)), batch, "ref")
            self._expect(self.actor.compute_log_prob(batch.select_fields(_SCORE)), batch, "compute_log_prob")
            self._expect(self.reward.compute_advantage(batch.select_fields(_ADV)), batch, "compute_advantage")
            per_rank = self.actor.update_actor(batch.select_fields(_UPDATE))
        finally:
            dp.clear_partition(pid)
        metrics = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
        metrics.update(scores)
        self.history.append(metrics)
        return metrics

    @staticmethod
    def _expect(result: Any, batch: dp.KVBatchMeta, what: str) -> None:
        # Cheap sanity on the metadata that came back: the same rows, in order.
        if not isinstance(result, dp.KVBatchMeta) or result.keys != batch.keys:
            raise RuntimeError(
                f"{what} returned {result!r}, not the metadata of the {batch.size} rows it was given"
            )

    # ---- a run --------------------------------------------------------------------------------
    def fit(self, progress: bool = False) -> dict[str, Any]:
        """Run ``cfg.steps`` steps; return the summary (see :func:`format_summary`)."""
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=self.cfg.steps, desc="GRPO", unit="step", file=sys.stderr, dynamic_ncols=True)
        driver0, store0, t0 = self.driver_bytes, self.store_bytes(), time.perf_counter()
        try:
            for index in range(self.cfg.steps):
                m = self.step(index)
                logger.info("step %d: %s", index, m)
                if bar is not None:
                    bar.set_postfix(reward=f"{m['reward/mean']:.3f}", loss=f"{m['actor/pg_loss']:+.4f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0
        rewards = [m["reward/mean"] for m in self.history[-self.cfg.steps :]]
        k = max(1, min(3, len(rewards) // 2))
        return {
            "steps": self.cfg.steps,
            "samples_per_step": self.cfg.prompts_per_step * self.cfg.n,
            "dp": self.cfg.dp,
            "seed": self.cfg.seed,
            "reward_first": sum(rewards[:k]) / k,
            "reward_last": sum(rewards[-k:]) / k,
            "reward_history": rewards,
            "loss_last": self.history[-1]["actor/pg_loss"],
            "seconds": elapsed,
            "steps_per_s": self.cfg.steps / elapsed if elapsed > 0 else float("inf"),
            "driver_bytes": self.driver_bytes - driver0,
            "store_bytes": self.store_bytes() - store0,
        }

    def close(self) -> None:
        """Stop the workers, free their placement groups, and stop the store if this trainer started it.

        Idempotent.
        """
        groups, self._groups = self._groups, []
        pools, self._pools = self._pools, []
        for group in groups:
            group.kill()
        for pool in pools:
            pool.remove()
        if self._owns_store and dp.is_initialized():
            dp.close()


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table.

    Example:
        >>> print(format_summary({"steps": 2, "reward_first": 0.1, "reward_last": 0.2, "steps_per_s": 1.0,
        ...                       "driver_bytes": 10, "store_bytes": 100, "samples_per_step": 8}))
    """
    rows = [
        ("steps", f"{summary['steps']}  ({summary['samples_per_step']} samples/step)"),
        ("mean reward, start", f"{summary['reward_first']:.3f}"),
        ("mean reward, end", f"{summary['reward_last']:.3f}"),
        ("steps/s", f"{summary['steps_per_s']:.2f}"),
        ("bytes via driver", f"{summary['driver_bytes']:,}"),
        ("bytes via store", f"{summary['store_bytes']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])


def cli(args: argparse.Namespace) -> int:
    """``rlplane demo``: train on an embedded store and a local Ray; print and save the summary."""
    import ray

    cfg = TrainerConfig(seed=args.seed, **({"steps": args.steps} if args.steps else {}))
    started_ray = not ray.is_initialized()
    if started_ray:
        # A Ray of its own ("local": never attach to a cluster RAY_ADDRESS points at). Logical
        # CPUs: the demo's placement groups need 3 bundles; the actors use 0.1 CPU each.
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    trainer = None
    try:
        t0 = time.perf_counter()
        trainer = GRPOTrainer(cfg)
        setup_s = time.perf_counter() - t0
        summary = trainer.fit(progress=True)
        summary["setup_seconds"] = setup_s
    finally:
        if trainer is not None:
            trainer.close()
        elif dp.is_initialized():
            dp.close()
        if started_ray:
            ray.shutdown()
    out = pathlib.Path(args.summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(format_summary(summary) + f"\nsummary written to {out}\n")
    return 0 if summary["reward_last"] > summary["reward_first"] else 1
