"""The reward: a rule on the tokens, scored on a worker.

A response earns one point per position whose token is the successor (in the counting
task's cycle) of the token before it; the first response token follows the last prompt
token. ``EOS``, padding and masked positions earn nothing, so stopping early costs reward.
The score is the fraction of ``response_len`` positions that earned a point, in ``[0, 1]``;
:meth:`CountingTask.target` scores 1.

The rule is relative (each token against its predecessor) on purpose: a random policy earns
about ``1 / num_content`` and every correct pair anywhere counts, so GRPO gets a signal from
the first step. (An absolute rule, "position ``i`` must hold the count's ``i``-th token",
left the model stuck on input-independent outputs at ``1 / num_content`` in trials.)
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from workers.engine.task import EOS, CountingTask

__all__ = ["PatternReward"]


class PatternReward:
    """Scores responses against the counting rule of a :class:`CountingTask`.

    Args:
        task: the task whose rule and shapes apply.

    Example:
        >>> task = CountingTask(vocab_size=8, prompt_len=2, response_len=3)
        >>> reward = PatternReward(task)
        >>> p = torch.tensor([[2, 3]])            # content tokens 2..7 form a cycle: 7 -> 2
        >>> reward.score(p, torch.tensor([[4, 5, 6]]), torch.ones(1, 3)).tolist()
        [1.0]
        >>> round(reward.score(p, torch.tensor([[4, 5, 2]]), torch.ones(1, 3)).item(), 3)  # 5 -> 2 misses
        0.667
    """

    def __init__(self, task: CountingTask) -> None:
        self.task = task

    def score(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        """Float32 ``[B]`` rewards for int64 ``prompts [B, P]`` and ``responses [B, R]``."""
        if responses.shape != response_mask.shape:
            raise ValueError(
                f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} differ"
            )
        prev = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
        # PAD and EOS have no successor: a pair that starts at one never scores.
        hit = (responses == self.task.successor(prev)) & (prev > EOS) & response_mask.bool()
        return hit.float().sum(dim=1) / responses.shape[1]

    def compute_reward(self, batch: TensorDict) -> TensorDict:
        """Score a batch.

        Args:
            batch: ``prompts``, ``responses``, ``response_mask``.

        Returns:
            A TensorDict of the same batch size with ``rewards`` (float32 ``[B]``).
        """
        rewards = self.score(batch["prompts"], batch["responses"], batch["response_mask"])
        return TensorDict({"rewards": rewards}, batch_size=batch.batch_size[:1])
