"""TransferQueue's samplers (``transfer_queue.sampler``), with its ``sample`` contracts."""

from dataplane.tq.sampler import base as _base
from dataplane.tq.sampler import grpo_group_n_sampler as _grpo_group_n_sampler
from dataplane.tq.sampler import rank_aware_sampler as _rank_aware_sampler
from dataplane.tq.sampler import seqlen_balanced_sampler as _seqlen_balanced_sampler
from dataplane.tq.sampler import sequential_sampler as _sequential_sampler

# Each public name is written once, in the ``__all__`` of the module that defines it.
from dataplane.tq.sampler.base import *  # noqa: F403
from dataplane.tq.sampler.grpo_group_n_sampler import *  # noqa: F403
from dataplane.tq.sampler.rank_aware_sampler import *  # noqa: F403
from dataplane.tq.sampler.seqlen_balanced_sampler import *  # noqa: F403
from dataplane.tq.sampler.sequential_sampler import *  # noqa: F403

__all__: list[str] = []
__all__ += _base.__all__
__all__ += _grpo_group_n_sampler.__all__
__all__ += _rank_aware_sampler.__all__
__all__ += _seqlen_balanced_sampler.__all__
__all__ += _sequential_sampler.__all__
