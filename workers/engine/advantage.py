"""GRPO advantages: each reward normalised within its prompt group.

Every prompt is sampled ``n`` times; the ``n`` responses share a group id (``uid``). A
response's advantage is its reward minus the group's mean, divided by the group's standard
deviation (plus ``eps``), broadcast over its response tokens and zeroed where
``response_mask`` is 0. A group of one response, or one whose rewards are all equal, has
advantage 0: it carries no signal about which response was better.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["grpo_advantages", "compute_advantage"]


def grpo_advantages(
    rewards: torch.Tensor,
    uid: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Group-normalised advantages ``[B, R]``.

    Args:
        rewards: float ``[B]`` sequence rewards.
        uid: int64 ``[B]`` prompt group of each row (any ids; rows of a group need not be adjacent).
        response_mask: ``[B, R]`` 1 for real response tokens.
        eps: added to the standard deviation.
        norm_by_std: divide by the group's std (GRPO); False gives Dr.GRPO-style centring only.

    Returns:
        float32 ``[B, R]``.

    Example:
        >>> adv = grpo_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([7, 7, 9]), torch.ones(3, 2))
        >>> [round(v, 3) for v in adv[:, 0].tolist()]
        [0.707, -0.707, 0.0]
    """
    if rewards.dim() != 1 or uid.shape != rewards.shape or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            "grpo_advantages needs rewards [B], uid [B], response_mask [B, R]; got "
            f"{tuple(rewards.shape)}, {tuple(uid.shape)}, {tuple(response_mask.shape)}"
        )
    rewards = rewards.float()
    _, group = torch.unique(uid, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    # Unbiased std like torch.std; groups of one get std 0 and centred 0, so advantage 0.
    var = torch.zeros(num_groups).index_add_(0, group, centred**2) / (count - 1).clamp(min=1)
    scores = centred / (var.sqrt()[group] + eps) if norm_by_std else centred
    return scores.unsqueeze(1) * response_mask.float()


def compute_advantage(batch: TensorDict, *, norm_by_std: bool = True) -> TensorDict:
    """Advantages for a batch that holds whole prompt groups.

    Args:
        batch: ``rewards`` ``[B]``, ``uid`` ``[B]``, ``response_mask`` ``[B, R]``.
        norm_by_std: see :func:`grpo_advantages`.

    Returns:
        A TensorDict of the same batch size with ``advantages`` (float32 ``[B, R]``).
    """
    adv = grpo_advantages(batch["rewards"], batch["uid"], batch["response_mask"], norm_by_std=norm_by_std)
    return TensorDict({"advantages": adv}, batch_size=batch.batch_size[:1])
