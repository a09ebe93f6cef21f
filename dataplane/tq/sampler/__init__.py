"""TransferQueue's samplers (``transfer_queue.sampler``), with its ``sample`` contracts."""

from dataplane.tq.sampler.base import BaseSampler
from dataplane.tq.sampler.grpo_group_n_sampler import GRPOGroupNSampler
from dataplane.tq.sampler.rank_aware_sampler import RankAwareSampler
from dataplane.tq.sampler.seqlen_balanced_sampler import SeqlenBalancedSampler
from dataplane.tq.sampler.sequential_sampler import SequentialSampler

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
]
