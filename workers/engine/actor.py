"""The actor: log-probs of the current policy, and a clipped policy-gradient (GRPO) update.

Device: the model may live on a GPU; batches arrive on the CPU (from the store) and are moved to
the model's device for the update; the log-probs stay on the model's device (the bridge writes them
to the store from there, one copy: ``docs/gpu.md``).

Data parallelism: when ``torch.distributed`` has a process group (gloo on CPU, NCCL on GPU)
with more than one rank, every rank runs the same number of optimiser steps on its own
shard and the gradients are averaged with one all-reduce per step (flattened into one
buffer), so all replicas keep identical weights. The number of optimiser steps per update
is ``epochs * mini_batches`` on every rank, whatever its shard size (an empty shard still
joins the all-reduce with zero gradients), so uneven shards cannot deadlock the group.

Batch fields read by :meth:`Actor.update`: ``prompts``, ``responses``, ``response_mask``,
``old_log_probs``, ``advantages`` and, when ``kl_coef > 0``, ``ref_log_probs``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tensordict import TensorDict

from workers.engine.model import TinyCausalLM, response_log_probs
from workers.engine.reference import kl_penalty

__all__ = ["ActorConfig", "Actor", "clipped_pg_loss"]


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """Optimisation settings of an :class:`Actor`.

    Attributes:
        lr: Adam learning rate.
        clip_ratio: PPO clip range epsilon (ratio clipped to ``[1 - eps, 1 + eps]``).
        kl_coef: weight of the KL penalty against ``ref_log_probs`` (0 disables it).
        epochs: passes over the batch per update.
        mini_batches: optimiser steps per pass (the batch is split into this many parts).
        max_grad_norm: gradient clipping threshold.
        temperature: temperature the log-probs are computed at (must match sampling).
    """

    lr: float = 2e-3
    clip_ratio: float = 0.2
    kl_coef: float = 0.0
    epochs: int = 1
    mini_batches: int = 2
    max_grad_norm: float = 1.0
    temperature: float = 1.0


def clipped_pg_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, averaged over the masked tokens.

    Args:
        log_probs: current log-probs ``[B, R]`` (with grad).
        old_log_probs: log-probs the samples were scored with before the update ``[B, R]``.
        advantages: ``[B, R]``.
        mask: ``[B, R]`` 1 for real response tokens.
        clip_ratio: epsilon of the clip range.

    Returns:
        ``(loss, clip_fraction)``: scalars; the loss is 0 (with grad) for an all-zero mask.

    Example:
        >>> z = torch.zeros(1, 2, requires_grad=True)
        >>> loss, frac = clipped_pg_loss(z, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2)
        >>> loss.item(), frac.item()
        (-1.0, 0.0)
    """
    ratio = torch.exp(log_probs - old_log_probs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * advantages)
    clipped = ((ratio - 1).abs() > clip_ratio).float()
    denom = mask.sum().clamp(min=1.0)
    return -(surrogate * mask).sum() / denom, (clipped * mask).sum() / denom


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Actor:
    """Trains a policy model with GRPO's clipped policy-gradient loss.

    Args:
        model: the policy (updated in place; share it with a :class:`~workers.engine.rollout.Rollout`).
        cfg: optimisation settings.

    Example:
        >>> from workers.engine.model import ModelConfig
        >>> actor = Actor(TinyCausalLM(ModelConfig(vocab_size=8, max_len=6)))
        >>> batch = TensorDict({"prompts": torch.full((2, 2), 2), "responses": torch.full((2, 3), 3),
        ...                     "response_mask": torch.ones(2, 3)}, [2])
        >>> actor.compute_log_prob(batch)["old_log_probs"].shape
        torch.Size([2, 3])
    """

    def __init__(self, model: TinyCausalLM, cfg: ActorConfig | None = None) -> None:
        self.model = model
        self.cfg = cfg or ActorConfig()
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.cfg.lr)
        self.broadcast_weights()

    def broadcast_weights(self) -> None:
        """Copy rank 0's weights to every rank (a no-op without a process group)."""
        if _world() > 1:
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        """``old_log_probs`` (float32 ``[B, R]``, 0 where masked) under the current weights."""
        was_training = self.model.training
        self.model.eval()
        try:
            logp = response_log_probs(self.model, batch["prompts"], batch["responses"], self.cfg.temperature)
        finally:
            self.model.train(was_training)
        return TensorDict(
            {"old_log_probs": logp * batch["response_mask"].to(logp.device).float()},
            batch_size=batch.batch_size[:1],
        )

    def update(self, batch: TensorDict) -> dict[str, float]:
        """Run ``epochs * mini_batches`` optimiser steps on ``batch``; return averaged metrics.

        Metrics (averaged over steps and, under a process group, over ranks):
        ``actor/pg_loss``, ``actor/clip_frac``, ``actor/kl``, ``actor/entropy``, ``actor/grad_norm``.
        """
        cfg = self.cfg
        if cfg.kl_coef > 0 and batch.shape[0] and "ref_log_probs" not in batch.keys():
            raise KeyError("Actor.update: kl_coef > 0 needs the field 'ref_log_probs' in the batch")
        self.model.train()
        device = self.model.tok.weight.device
        batch = batch.to(device)  # one copy per update, not one per mini-batch
        totals = torch.zeros(5, device=device)
        steps = 0
        for _ in range(cfg.epochs):
            for part in _split(batch.shape[0], cfg.mini_batches):
                totals += self._step(batch[part])
                steps += 1
        totals /= max(steps, 1)
        if _world() > 1:
            dist.all_reduce(totals)  # on the model's device: NCCL needs GPU tensors, gloo takes CPU ones
            totals /= _world()
        names = ("actor/pg_loss", "actor/clip_frac", "actor/kl", "actor/entropy", "actor/grad_norm")
        return dict(zip(names, totals.tolist(), strict=True))

    def _step(self, mb: TensorDict) -> torch.Tensor:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=False)
        if mb.shape[0]:
            mask = mb["response_mask"].float()
            logp, entropy = response_log_probs(
                self.model, mb["prompts"], mb["responses"], cfg.temperature, with_entropy=True
            )
            pg, clip_frac = clipped_pg_loss(logp, mb["old_log_probs"], mb["advantages"], mask, cfg.clip_ratio)
            denom = mask.sum().clamp(min=1.0)
            kl = (kl_penalty(logp, mb["ref_log_probs"]) * mask).sum() / denom if cfg.kl_coef > 0 else pg * 0
            (pg + cfg.kl_coef * kl).backward()
            ent = (entropy.detach() * mask).sum() / denom
        else:
            pg = clip_frac = kl = ent = torch.zeros((), device=self.model.tok.weight.device)
        self._all_reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        return torch.stack(
            [pg.detach(), clip_frac, kl.detach(), ent, grad_norm.detach().to(pg.device)]
        ).float()

    def _all_reduce_grads(self) -> None:
        world = _world()
        if world == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # One flat buffer, one collective: far fewer round trips than one all-reduce per tensor.
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def _split(rows: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(rows)`` (some empty when rows < parts)."""
    if parts < 1:
        raise ValueError(f"mini_batches must be >= 1, got {parts}")
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]
