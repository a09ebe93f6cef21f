"""The reads and writes of verl 0.9.1's ``PPOTrainer`` (``trainer_base.py``), unchanged, over
``transfer_queue``: old log-probs, advantages and the colocated reward, each bound to a small
stub trainer (a config and fakes for the worker groups it calls).

These methods compute on the layout TransferQueue returns (jagged nested tensor fields:
``.offsets()``, ``.values()``, ``to_padded_tensor``), so every case runs twice: rows of varied
lengths, and rows of one length (where a dense layout breaks them).
"""

from __future__ import annotations

import uuid

import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu

N = 4  # two prompts, two responses each


pytestmark = pytest.mark.usefixtures("store")  # conftest.py: a Ray and the queue on it


def _config():
    return OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": "grpo",
                "gamma": 1.0,
                "lam": 1.0,
                "use_kl_in_reward": False,
                "norm_adv_by_std_in_grpo": True,
                "rollout_correction": None,
            },
            "actor_rollout_ref": {
                "rollout": {"n": 2, "temperature": 1.0, "calculate_log_probs": False},
                "actor": {"loss_agg_mode": "token-mean", "loss_scale_factor": None},
            },
        }
    )


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _rows(same_length: bool):
    prompt_lens = [3, 3, 3, 3] if same_length else [2, 3, 2, 4]
    resp_lens = [4, 4, 4, 4] if same_length else [3, 1, 4, 2]
    return prompt_lens, resp_lens


def _put_rollout(pid: str, same_length: bool) -> KVBatchMeta:
    """What the agent loop leaves in the queue: keys ``{uid}_{session}_{index}``, jagged rows."""
    prompt_lens, resp_lens = _rows(same_length)
    uids = [uuid.uuid4().hex for _ in range(N // 2)]
    keys = [f"{uids[i // 2]}_{i % 2}_0" for i in range(N)]
    fields = tu.get_tensordict(
        {
            "prompts": _nested([torch.arange(p) + 1 for p in prompt_lens]),
            "responses": _nested([torch.arange(r) + 10 for r in resp_lens]),
            "response_mask": _nested([torch.ones(r, dtype=torch.int64) for r in resp_lens]),
            "rm_scores": _nested([torch.full((r,), float(i)) for i, r in enumerate(resp_lens)]),
            "uid": [uids[i // 2] for i in range(N)],
            "raw_prompt": [[{"role": "user", "content": f"q{i // 2}"}] for i in range(N)],
        }
    )
    return tq.kv_batch_put(keys=keys, partition_id=pid, fields=fields, tags=[{}] * N)


class _FakeActorGroup:
    """``compute_log_prob`` as the actor's tqbridge-wrapped method leaves it: the model's outputs
    over prompt + response, written back under the same keys."""

    def compute_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"]
        )
        lens = (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
        out = TensorDict(
            {
                "log_probs": _nested([-torch.arange(n, dtype=torch.float32) / 10 for n in lens]),
                "entropy": _nested([torch.full((n,), 0.5) for n in lens]),
            },
            batch_size=[len(batch)],
        )
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)


class _FakeRewardManager:
    def compute_rm_score(self, data: DataProto) -> DataProto:
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        scores[:, 0] = 1.0
        return DataProto(batch=TensorDict({"rm_scores": scores}, batch_size=[len(data)]))


def _trainer():
    stub = type("Stub", (), {})()
    stub.config = _config()
    stub.actor_rollout_wg = _FakeActorGroup()
    stub.reward_loop_manager = _FakeRewardManager()
    stub.tokenizer = type("Tok", (), {"pad_token_id": 0})()
    stub.use_critic = False
    for name in ("_compute_old_log_prob", "_compute_advantage", "_compute_reward_colocate"):
        setattr(stub, name, getattr(PPOTrainer, name).__get__(stub))
    stub._lengths_to_mask = PPOTrainer._lengths_to_mask
    return stub


@pytest.mark.parametrize("same_length", [False, True], ids=["varied", "same-length"])
def test_old_log_prob_then_advantage(same_length):
    pid = f"train-{uuid.uuid4().hex[:8]}"
    batch = _put_rollout(pid, same_length)
    trainer = _trainer()
    metrics: dict = {}
    batch = trainer._compute_old_log_prob(batch, metrics)
    assert "actor/entropy" in metrics and abs(metrics["actor/entropy"] - 0.5) < 1e-6
    _, resp_lens = _rows(same_length)
    got = tq.kv_batch_get(keys=batch.keys, partition_id=pid, select_fields=["old_log_probs", "entropy"])
    assert [len(t) for t in got["old_log_probs"].unbind()] == resp_lens
    trainer._compute_advantage(batch, metrics)
    adv = tq.kv_batch_get(keys=batch.keys, partition_id=pid, select_fields=["advantages", "returns"])
    assert [len(t) for t in adv["advantages"].unbind()] == resp_lens
    tq.kv_clear(keys=batch.keys, partition_id=pid)


@pytest.mark.parametrize("same_length", [False, True], ids=["varied", "same-length"])
def test_colocated_reward(same_length):
    pid = f"train-{uuid.uuid4().hex[:8]}"
    batch = _put_rollout(pid, same_length)
    out = _trainer()._compute_reward_colocate(batch)
    assert out.keys == batch.keys
    got = tq.kv_batch_get(keys=batch.keys, partition_id=pid, select_fields="rm_scores")
    rows = got["rm_scores"].unbind()
    assert [len(t) for t in rows] == _rows(same_length)[1]
    assert all(float(t[0]) == 1.0 for t in rows)
    tq.kv_clear(keys=batch.keys, partition_id=pid)
