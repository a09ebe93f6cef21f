"""The submit and re-issue sequence of verl 0.9.1's ``PPOTrainer`` (``trainer_base.py``), unchanged,
over ``transfer_queue``: prompts registered by ``_submit_batch_to_rollout`` (their rows kept for
recovery), statuses moved as the agent loop moves them, then ``_reissue_inflight_prompts`` after a
restart, with and without a ``tq.save_checkpoint`` / ``tq.load_checkpoint`` round trip.

verl's own test of this (``tests/trainer/ppo/v1/test_reissue_inflight_on_cpu.py``) exists only for
later trainers (it reads ``trainer_base._tq_supports_checkpoint``, which 0.9.1 does not have), so
this file drives 0.9.1's methods the same way, bound to a small stub.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, _count_tq_prompt_groups
from verl.utils import tensordict_utils as tu

PID = "train"  # _submit_batch_to_rollout writes there


pytestmark = pytest.mark.usefixtures("store")  # conftest.py: a Ray and the queue on it


@pytest.fixture(autouse=True)
def clean():
    yield
    _clear()


class _AgentLoop:
    def __init__(self):
        self.batches = []

    def generate_sequences(self, batch):
        self.batches.append(batch)


def _trainer(mode: str = "separate_async", steps: int = 2):
    stub = type("Stub", (), {})()
    stub.trainer_mode, stub.global_steps, stub.agent_loop_manager = mode, steps, _AgentLoop()
    for name in ("_submit_batch_to_rollout", "_reissue_inflight_prompts"):
        setattr(stub, name, getattr(PPOTrainer, name).__get__(stub))
    return stub


def _submit(stub, n: int) -> list[str]:
    uids = [uuid.uuid4().hex for _ in range(n)]
    batch = tu.get_tensordict(
        {"uid": uids, "raw_prompt": [f"prompt-{u}" for u in uids], "index": torch.arange(n)}
    )
    tu.assign_non_tensor_data(batch, "global_steps", stub.global_steps)
    assert stub._submit_batch_to_rollout(batch) == n
    return uids


def _status(uid: str) -> str:
    return tq.kv_list(partition_id=PID)[PID][uid]["status"]


def _advance(uid: str, status: str, sessions: int = 1) -> list[str]:
    """What the agent loop does: move the prompt's status, add its trajectories."""
    tq.kv_put(key=uid, partition_id=PID, tag={"status": status})
    keys = []
    for s in range(sessions):
        key = f"{uid}_{s}_0"
        tq.kv_put(
            key=key, partition_id=PID, fields={"input_ids": torch.tensor([1, 2, 3])}, tag={"is_prompt": False}
        )
        keys.append(key)
    return keys


def test_submit_registers_prompts_with_their_rows():
    stub = _trainer(steps=3)
    uids = _submit(stub, 2)
    listed = tq.kv_list(partition_id=PID)[PID]
    assert all(listed[u] == {"is_prompt": True, "status": "pending", "global_steps": 3} for u in uids)
    got = tq.kv_batch_get(keys=uids, partition_id=PID)
    assert set(got.keys()) == {"uid", "raw_prompt", "index"}
    assert list(got["raw_prompt"]) == [f"prompt-{u}" for u in uids] and _count_tq_prompt_groups(PID) == 2


def test_reissue_restarts_only_inflight_prompts():
    first = _trainer(steps=2)
    pending, running, finished = _submit(first, 3)
    running_traj = _advance(running, "running")
    finished_traj = _advance(finished, "finished", sessions=2)
    resumed = _trainer(steps=5)
    assert resumed._reissue_inflight_prompts(PID) == 2
    (batch,) = resumed.agent_loop_manager.batches
    assert set(batch["uid"]) == {pending, running} and int(batch["global_steps"]) == 5
    assert sorted(batch["raw_prompt"]) == sorted(f"prompt-{u}" for u in (pending, running))
    assert _status(pending) == _status(running) == "pending" and _status(finished) == "finished"
    listed = tq.kv_list(partition_id=PID)[PID]
    assert listed[running]["global_steps"] == 5
    assert not set(running_traj) & set(listed) and set(finished_traj) <= set(listed)


def _clear():
    keys = list(tq.kv_list(partition_id=PID).get(PID, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=PID)


def test_reissue_is_a_noop_in_sync_mode_and_on_terminal_prompts():
    stub = _trainer(mode="sync")
    _submit(stub, 1)  # sync mode registers tags only
    assert stub._reissue_inflight_prompts(PID) == 0
    _clear()
    done = _trainer()
    (uid,) = _submit(done, 1)
    _advance(uid, "failure")
    assert _trainer()._reissue_inflight_prompts(PID) == 0


def test_reissue_after_a_checkpoint_round_trip(tmp_path):
    first = _trainer(steps=4)
    pending, finished = _submit(first, 2)
    _advance(finished, "finished")
    ckpt = str(tmp_path / "global_step_4" / "transfer_queue")
    tq.save_checkpoint(ckpt, metadata={"global_steps": 4})  # as PPOTrainer._save_checkpoint does
    keys = list(tq.kv_list(partition_id=PID)[PID])
    tq.kv_clear(keys=keys, partition_id=PID)  # a fresh queue, as after a restart
    tq.load_checkpoint(ckpt)
    assert _status(pending) == "pending" and f"{finished}_0_0" in tq.kv_list(partition_id=PID)[PID]
    resumed = _trainer(steps=5)
    assert resumed._reissue_inflight_prompts(PID) == 1
    assert list(resumed.agent_loop_manager.batches[0]["uid"]) == [pending]
