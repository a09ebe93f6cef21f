"""A small causal transformer language model, CPU-trainable in seconds.

The model is deliberately tiny (a few layers, a vocabulary of a few dozen tokens) so that the
GRPO loop in :mod:`workers.trainer` learns its toy task on a 2-core laptop. It is a real
decoder-only transformer (token + learned position embeddings, pre-norm blocks of causal
self-attention and an MLP, a tied output head), so the engine code around it is the same code
one would write for a large model.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyCausalLM", "response_log_probs"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`TinyCausalLM`.

    Attributes:
        vocab_size: number of token ids (special tokens included).
        max_len: longest sequence (prompt + response) the position table covers.
        dim: embedding width.
        n_layers: transformer blocks.
        n_heads: attention heads per block; must divide ``dim``.

    Example:
        >>> ModelConfig(vocab_size=16, max_len=16).dim
        64
    """

    vocab_size: int = 16
    max_len: int = 16
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")


class _Block(nn.Module):
    """One pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """A decoder-only transformer over integer tokens.

    Args:
        cfg: the model's shape.

    Example:
        >>> model = TinyCausalLM(ModelConfig(vocab_size=16, max_len=12))
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab]`` for int64 ``tokens`` ``[B, T]``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_len={self.cfg.max_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        # Tied output head: the embedding matrix doubles as the unembedding.
        return self.norm(x) @ self.tok.weight.T


@overload
def response_log_probs(
    model: TinyCausalLM,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def response_log_probs(
    model: TinyCausalLM,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def response_log_probs(
    model: TinyCausalLM,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each response token given the prompt and the tokens before it.

    One forward pass over ``cat(prompts, responses)``; position ``P - 1 + i`` predicts
    response token ``i``. Tokens after an end-of-sequence are scored too; callers mask
    them with ``response_mask``.

    Args:
        model: the policy (or a frozen reference).
        prompts: int64 ``[B, P]``.
        responses: int64 ``[B, R]``.
        temperature: logits are divided by it, as at sampling time.
        with_entropy: also return the per-token entropy ``[B, R]``.

    Returns:
        float32 ``[B, R]`` log-probs (and the entropy if asked), on the model's device (the
        inputs are moved there).

    Example:
        >>> model = TinyCausalLM(ModelConfig(vocab_size=16, max_len=12))
        >>> p, r = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 6, dtype=torch.long)
        >>> response_log_probs(model, p, r).shape
        torch.Size([3, 6])
    """
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"prompts and responses disagree on batch size: {prompts.shape[0]} vs {responses.shape[0]}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    p, r = prompts.shape[1], responses.shape[1]
    device = model.tok.weight.device
    logits = (
        model(torch.cat([prompts, responses], dim=1).to(device))[:, p - 1 : p - 1 + r].float() / temperature
    )
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
