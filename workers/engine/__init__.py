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

from workers.engine import actor as _actor
from workers.engine import advantage as _advantage
from workers.engine import model as _model
from workers.engine import reference as _reference
from workers.engine import reward as _reward
from workers.engine import rollout as _rollout
from workers.engine import task as _task

# Each public name is written once, in the ``__all__`` of the module that defines it.
from workers.engine.actor import *  # noqa: F403
from workers.engine.advantage import *  # noqa: F403
from workers.engine.model import *  # noqa: F403
from workers.engine.reference import *  # noqa: F403
from workers.engine.reward import *  # noqa: F403
from workers.engine.rollout import *  # noqa: F403
from workers.engine.task import *  # noqa: F403

__all__: list[str] = []
__all__ += _actor.__all__
__all__ += _advantage.__all__
__all__ += _model.__all__
__all__ += _reference.__all__
__all__ += _reward.__all__
__all__ += _rollout.__all__
__all__ += _task.__all__
