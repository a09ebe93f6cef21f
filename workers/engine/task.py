"""The toy task the demo model learns: continue a counting pattern.

Vocabulary: ``PAD`` (0), ``EOS`` (1), then ``num_content`` content tokens ``2 .. vocab_size - 1``
that form a cycle (the successor of the last content token is the first). A prompt is a run
of consecutive content tokens starting at a random place in the cycle; a perfect response keeps
counting for ``response_len`` tokens. The rule is simple enough for a two-layer transformer
to pick up in a few dozen GRPO steps from a random start (initial reward about
``1 / num_content``), and structured enough that the rise is the model learning, not luck.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["PAD", "EOS", "CountingTask"]

PAD = 0
EOS = 1
_FIRST_CONTENT = 2


@dataclasses.dataclass(frozen=True)
class CountingTask:
    """Shapes and rule of the counting task.

    Attributes:
        vocab_size: total token ids, including ``PAD`` and ``EOS``.
        prompt_len: tokens per prompt.
        response_len: maximum tokens per response.

    Example:
        >>> task = CountingTask(vocab_size=8, prompt_len=3, response_len=4)
        >>> task.successor(torch.tensor([2, 7]))
        tensor([3, 2])
    """

    vocab_size: int = 16
    prompt_len: int = 4
    response_len: int = 8

    def __post_init__(self) -> None:
        if self.vocab_size < _FIRST_CONTENT + 2:
            raise ValueError(f"CountingTask.vocab_size must be >= 4, got {self.vocab_size}")
        if self.prompt_len < 1 or self.response_len < 1:
            raise ValueError(
                f"CountingTask needs prompt_len >= 1 and response_len >= 1, "
                f"got {self.prompt_len} and {self.response_len}"
            )

    @property
    def num_content(self) -> int:
        """How many content tokens the cycle has."""
        return self.vocab_size - _FIRST_CONTENT

    @property
    def max_len(self) -> int:
        """Longest sequence the model must cover: prompt plus response."""
        return self.prompt_len + self.response_len

    def successor(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next content token in the cycle (defined on content tokens only)."""
        return (tokens - _FIRST_CONTENT + 1) % self.num_content + _FIRST_CONTENT

    def target(self, prompts: torch.Tensor) -> torch.Tensor:
        """The perfect response ``[B, response_len]`` to int64 ``prompts`` ``[B, P]``: keep counting."""
        steps = torch.arange(1, self.response_len + 1, device=prompts.device).unsqueeze(0)
        return (prompts[:, -1:] - _FIRST_CONTENT + steps) % self.num_content + _FIRST_CONTENT

    def sample_prompts(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num`` prompts as int64 ``[num, prompt_len]``, each a run of consecutive content tokens."""
        if num < 0:
            raise ValueError(f"num must be >= 0, got {num}")
        start = torch.randint(0, self.num_content, (num, 1), generator=generator)
        offsets = torch.arange(self.prompt_len).unsqueeze(0)
        return (start + offsets) % self.num_content + _FIRST_CONTENT
