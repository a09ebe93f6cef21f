"""Rollout: sample responses from the policy, with the log-probs of the sampled tokens.

Sampling is plain autoregressive decoding (one full forward per new token; at these sizes a
KV cache would cost more code than time). A response ends at ``EOS``: that token is kept
and counted in ``response_mask``, every later position holds ``PAD`` with mask 0 and
log-prob 0.

Batch fields (TensorDicts, batch dim first):

- in: ``prompts`` int64 ``[B, P]``; optional ``uid`` int64 ``[B]`` (prompt group id;
  defaults to the row index).
- out: ``prompts`` and ``uid`` (each row repeated ``n`` times, repeats adjacent),
  ``responses`` int64 ``[B*n, R]``, ``response_mask`` float32 ``[B*n, R]``,
  ``rollout_log_probs`` float32 ``[B*n, R]`` (the sampler's "old" log-probs).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from workers.engine.model import TinyCausalLM
from workers.engine.task import EOS, PAD

__all__ = ["Rollout"]


class Rollout:
    """Samples ``n`` responses per prompt from a policy model.

    The rollout holds a reference to the model, not a copy: colocated with the actor it
    always samples from the latest weights.

    Args:
        model: the policy.
        response_len: tokens to sample per response (at most).
        temperature: softmax temperature; log-probs are reported at this temperature.

    Example:
        >>> from workers.engine.model import ModelConfig
        >>> rollout = Rollout(TinyCausalLM(ModelConfig(vocab_size=8, max_len=6)), response_len=3)
        >>> out = rollout.generate(TensorDict({"prompts": torch.full((2, 3), 2)}, [2]), n=4)
        >>> out["responses"].shape, out["uid"].tolist()
        (torch.Size([8, 3]), [0, 0, 0, 0, 1, 1, 1, 1])
    """

    def __init__(self, model: TinyCausalLM, response_len: int, temperature: float = 1.0) -> None:
        if response_len < 1:
            raise ValueError(f"response_len must be >= 1, got {response_len}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model
        self.response_len = response_len
        self.temperature = temperature

    @torch.no_grad()
    def generate(self, batch: TensorDict, n: int = 1, generator: torch.Generator | None = None) -> TensorDict:
        """Sample ``n`` responses for each prompt of ``batch``.

        Args:
            batch: ``prompts`` (and optionally ``uid``); see the module docstring.
            n: responses per prompt.
            generator: a seeded ``torch.Generator`` for reproducible sampling.

        Returns:
            A TensorDict of batch size ``B * n`` with the fields listed in the module docstring.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        prompts = batch["prompts"]
        if prompts.dim() != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts must be int64 [B, P], got {prompts.dtype} {tuple(prompts.shape)}")
        b = prompts.shape[0]
        uid = batch["uid"] if "uid" in batch.keys() else torch.arange(b)
        prompts = prompts.repeat_interleave(n, dim=0)
        uid = uid.repeat_interleave(n, dim=0)
        was_training = self.model.training
        self.model.eval()
        try:
            responses, mask, logp = self._sample(prompts, generator)
        finally:
            self.model.train(was_training)
        return TensorDict(
            {
                "prompts": prompts,
                "uid": uid,
                "responses": responses,
                "response_mask": mask,
                "rollout_log_probs": logp,
            },
            batch_size=[b * n],
        )

    def _sample(
        self, prompts: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, r = prompts.shape[0], self.response_len
        responses = torch.full((rows, r), PAD, dtype=torch.long)
        mask = torch.zeros(rows, r)
        logp = torch.zeros(rows, r)
        alive = torch.ones(rows, dtype=torch.bool)
        seq = prompts.to(self.model.tok.weight.device)
        for i in range(r):
            logits = self.model(seq)[:, -1].float() / self.temperature
            # Sample on the CPU: a CPU generator gives the same stream whatever the model's device.
            log_dist = torch.log_softmax(logits, dim=-1).cpu()
            token = torch.multinomial(log_dist.exp(), 1, generator=generator).squeeze(1)
            token = torch.where(alive, token, torch.full_like(token, PAD))
            responses[:, i] = token
            mask[:, i] = alive.float()
            logp[:, i] = torch.where(alive, log_dist.gather(1, token.unsqueeze(1)).squeeze(1), 0.0)
            alive = alive & (token != EOS)
            seq = torch.cat([seq, token.unsqueeze(1).to(seq.device)], dim=1)
            if not alive.any():
                # Every response ended: the rest of the positions stay PAD with mask 0.
                break
        return responses, mask, logp
