"""The engine: a small torch policy and the GRPO roles, as plain classes.

Nothing here knows about Ray, the store or the controller; the role workers in
:mod:`workers.roles` wrap these classes. Every role takes and returns TensorDicts whose
batch dimension is the sample; the field names are:

=====================  ===============  =======================================================
field                  dtype, shape     meaning
=====================  ===============  =======================================================
``prompts``            int64 [B, P]     prompt tokens
``uid``                int64 [B]        prompt group: the ``n`` samples of one prompt share it
``responses``          int64 [B, R]     sampled tokens (``PAD`` after ``EOS``)
``response_mask``      float32 [B, R]   1 for real response tokens (``EOS`` included)
``rollout_log_probs``  float32 [B, R]   log-probs the sampler drew the tokens with
``old_log_probs``      float32 [B, R]   actor log-probs before the update (``compute_log_prob``)
``ref_log_probs``      float32 [B, R]   log-probs of the frozen reference
``rewards``            float32 [B]      sequence reward from the rule
``advantages``         float32 [B, R]   GRPO group-normalised advantage per token
=====================  ===============  =======================================================

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> task = CountingTask()
    >>> model = TinyCausalLM(ModelConfig(vocab_size=task.vocab_size, max_len=task.max_len))
    >>> prompts = TensorDict({"prompts": task.sample_prompts(2)}, [2])
    >>> batch = Rollout(model, task.response_len).generate(prompts, n=4)
    >>> _ = batch.update(PatternReward(task).compute_reward(batch))
    >>> _ = batch.update(compute_advantage(batch))
    >>> _ = batch.update(Actor(model).compute_log_prob(batch))
    >>> sorted(batch.keys())
    ['advantages', 'old_log_probs', 'prompts', 'response_mask', 'responses', 'rewards',
     'rollout_log_probs', 'uid']
"""

from workers.engine.actor import Actor, ActorConfig, clipped_pg_loss
from workers.engine.advantage import compute_advantage, grpo_advantages
from workers.engine.model import ModelConfig, TinyCausalLM, response_log_probs
from workers.engine.reference import Reference, kl_penalty
from workers.engine.reward import PatternReward
from workers.engine.rollout import Rollout
from workers.engine.task import EOS, PAD, CountingTask

__all__ = [
    "EOS",
    "PAD",
    "Actor",
    "ActorConfig",
    "CountingTask",
    "ModelConfig",
    "PatternReward",
    "Reference",
    "Rollout",
    "TinyCausalLM",
    "clipped_pg_loss",
    "compute_advantage",
    "grpo_advantages",
    "kl_penalty",
    "response_log_probs",
]
