"""The reference policy: log-probs of a frozen copy, and the KL penalty against it."""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDict

from workers.engine.model import TinyCausalLM, response_log_probs

__all__ = ["Reference", "kl_penalty"]


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    Args:
        log_probs: current policy log-probs ``[B, R]``.
        ref_log_probs: reference log-probs ``[B, R]``.
        kind: ``"k1"`` (log ratio, unbiased, can be negative) or ``"k3"`` (Schulman's
            non-negative, low-variance estimator ``exp(-d) - 1 + d`` with ``d = logp - ref``).

    Returns:
        ``[B, R]`` per-token penalties.

    Example:
        >>> kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2)).tolist()
        [[0.0, 0.0]]
    """
    delta = log_probs - ref_log_probs
    if kind == "k1":
        return delta
    if kind == "k3":
        # Clamp the exponent: a huge negative ratio would overflow exp and poison the loss.
        neg = (-delta).clamp(max=20.0)
        return neg.exp() - 1 - neg
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1' or 'k3'")


class Reference:
    """A frozen copy of a policy that scores responses.

    Args:
        model: the policy to copy (at its current weights); the copy never changes.
        temperature: the sampling temperature the log-probs are computed at.

    Example:
        >>> from workers.engine.model import ModelConfig
        >>> ref = Reference(TinyCausalLM(ModelConfig(vocab_size=8, max_len=6)))
        >>> batch = TensorDict({"prompts": torch.full((2, 2), 2), "responses": torch.full((2, 3), 3)}, [2])
        >>> ref.compute_ref_log_prob(batch)["ref_log_probs"].shape
        torch.Size([2, 3])
    """

    def __init__(self, model: TinyCausalLM, temperature: float = 1.0) -> None:
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        self.temperature = temperature

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """``ref_log_probs`` (float32 ``[B, R]``, 0 where ``response_mask`` is 0 if given)."""
        logp = response_log_probs(self.model, batch["prompts"], batch["responses"], self.temperature)
        if "response_mask" in batch.keys():  # (the log-probs stay on the model's device)
            logp = logp * batch["response_mask"].to(logp.device).float()
        return TensorDict({"ref_log_probs": logp}, batch_size=batch.batch_size[:1])
