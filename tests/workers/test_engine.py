"""The engine on its own: plain torch, no Ray, no store (tests/workers/test_engine.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests._fresh_ray import free_port
from tests.forkserver import start_python
from workers.engine import (
    EOS,
    PAD,
    Actor,
    ActorConfig,
    CountingTask,
    ModelConfig,
    PatternReward,
    Reference,
    Rollout,
    TinyCausalLM,
    clipped_pg_loss,
    compute_advantage,
    grpo_advantages,
    kl_penalty,
)

TASK = CountingTask(vocab_size=16, prompt_len=4, response_len=8)


def _model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.max_len))


def _prompts(num: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"prompts": TASK.sample_prompts(num, g), "uid": torch.arange(num) * 10}, [num])


def _rollout_batch(model: TinyCausalLM, prompts: int = 8, n: int = 8, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return Rollout(model, TASK.response_len).generate(_prompts(prompts, seed), n=n, generator=g)


def test_model_shapes_and_bad_input() -> None:
    model = _model()
    assert model(torch.zeros(3, TASK.max_len, dtype=torch.long)).shape == (3, TASK.max_len, TASK.vocab_size)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, TASK.max_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(dim=30, n_heads=4)


def test_rollout_shapes_masks_and_groups() -> None:
    batch = _rollout_batch(_model(), prompts=8, n=8)
    b, r = 64, TASK.response_len
    assert batch.batch_size == torch.Size([b])
    assert batch["responses"].shape == (b, r) and batch["responses"].dtype == torch.long
    assert batch["response_mask"].shape == (b, r) and batch["response_mask"].dtype == torch.float32
    assert batch["rollout_log_probs"].shape == (b, r)
    # n repeats of each prompt are adjacent and share the prompt's uid.
    assert batch["uid"].tolist() == [10 * i for i in range(8) for _ in range(8)]
    assert torch.equal(batch["prompts"][8:16], batch["prompts"][8:9].expand(8, -1))
    ended_early = 0
    rows = zip(batch["responses"], batch["response_mask"], batch["rollout_log_probs"], strict=True)
    for resp, mask, logp in rows:
        eos = (resp == EOS).nonzero()
        stop = int(eos[0]) + 1 if len(eos) else r
        ended_early += stop < r
        assert mask[:stop].eq(1).all() and mask[stop:].eq(0).all()
        assert resp[stop:].eq(PAD).all()
        assert logp[:stop].lt(0).all() and logp[stop:].eq(0).all()
    # A random model emits EOS about once in 16 tokens: some of 64 responses must stop early.
    assert ended_early > 0


def test_rollout_is_reproducible_with_a_generator() -> None:
    model = _model()
    a, b = _rollout_batch(model, seed=3), _rollout_batch(model, seed=3)
    assert torch.equal(a["responses"], b["responses"])


def test_log_probs_agree_between_rollout_actor_and_reference() -> None:
    model = _model()
    batch = _rollout_batch(model)
    old = Actor(model).compute_log_prob(batch)["old_log_probs"]
    ref = Reference(model).compute_ref_log_prob(batch)["ref_log_probs"]
    torch.testing.assert_close(old, batch["rollout_log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref, batch["rollout_log_probs"], atol=1e-5, rtol=1e-5)


def test_reward_rule() -> None:
    reward = PatternReward(TASK)
    prompts = TASK.sample_prompts(4, torch.Generator().manual_seed(1))
    perfect = TASK.target(prompts)
    ones = torch.ones_like(perfect, dtype=torch.float32)
    assert reward.score(prompts, perfect, ones).tolist() == [1.0] * 4
    # Masked positions, EOS and a broken first step lose exactly their points.
    half = ones.clone()
    half[:, 4:] = 0
    assert reward.score(prompts, perfect, half).tolist() == [0.5] * 4
    eos = perfect.clone()
    eos[:, 6] = EOS
    assert reward.score(prompts, eos, ones).tolist() == [0.75] * 4  # position 6 and 7 (after EOS) lost
    wrong_start = TASK.target(TASK.successor(prompts))  # skips one number, then counts on correctly
    assert reward.score(prompts, wrong_start, ones).tolist() == [7 / 8] * 4
    batch = TensorDict({"prompts": prompts, "responses": perfect, "response_mask": ones}, [4])
    assert reward.compute_reward(batch)["rewards"].shape == (4,)


def test_advantage_normalises_per_group() -> None:
    torch.manual_seed(0)
    uid = torch.tensor([3, 1, 3, 1, 3, 1, 7, 9, 9])  # groups interleaved, a singleton, a constant pair
    rewards = torch.tensor([0.0, 1.0, 0.5, 3.0, 1.0, 2.0, 5.0, 0.4, 0.4])
    mask = torch.ones(9, 4)
    mask[0, 2:] = 0
    adv = grpo_advantages(rewards, uid, mask)
    assert adv.shape == (9, 4)
    seq = adv[:, 0]
    for g in (1, 3):
        rows = uid == g
        assert abs(float(seq[rows].mean())) < 1e-5
        assert abs(float(seq[rows].std()) - 1.0) < 1e-4
    assert seq[6] == 0 and seq[7] == 0 and seq[8] == 0
    assert adv[0, 2:].eq(0).all() and adv[0, :2].eq(seq[0]).all()
    td = TensorDict({"rewards": rewards, "uid": uid, "response_mask": mask}, [9])
    torch.testing.assert_close(compute_advantage(td)["advantages"], adv)
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(rewards[:3], uid, mask)


def test_clipped_loss_and_kl() -> None:
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    # ratio e^1 > 1.2 with positive advantage: clipped, and the clipped branch has no gradient.
    logp = torch.ones(1, 2, requires_grad=True)
    loss, frac = clipped_pg_loss(logp, old, adv, mask, 0.2)
    loss.backward()
    assert float(frac) == 1.0 and abs(float(loss.detach()) + 1.2) < 1e-6
    assert logp.grad.abs().sum() == 0
    assert kl_penalty(torch.zeros(2), torch.zeros(2)).eq(0).all()
    assert kl_penalty(torch.tensor([0.5]), torch.zeros(1)).gt(0).all()
    with pytest.raises(ValueError, match="k9"):
        kl_penalty(torch.zeros(1), torch.zeros(1), kind="k9")


def test_actor_update_changes_weights_and_reports_metrics() -> None:
    model = _model()
    actor = Actor(model, ActorConfig(kl_coef=0.01))
    batch = _rollout_batch(model)
    batch.update(PatternReward(TASK).compute_reward(batch))
    batch.update(actor.compute_log_prob(batch))
    batch.update(compute_advantage(batch))
    with pytest.raises(KeyError, match="ref_log_probs"):
        actor.update(batch)
    batch.update(Reference(model).compute_ref_log_prob(batch))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = actor.update(batch)
    names = {"actor/pg_loss", "actor/clip_frac", "actor/kl", "actor/entropy", "actor/grad_norm"}
    assert set(metrics) == names
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_actor_update_on_an_empty_shard_still_steps() -> None:
    # An empty data-parallel shard must still join every optimiser step (and its all-reduce).
    actor = Actor(_model(), ActorConfig(kl_coef=0.01, mini_batches=3))
    metrics = actor.update(TensorDict({}, batch_size=[0]))
    assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/grad_norm"] == 0.0


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of the data-parallel update, in a process of its own; saves its weights and metrics
    to ``out/rank<rank>.pt``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = _model(seed=rank)  # different init on purpose: the actor broadcasts rank 0's
        actor = Actor(model)
        batch = _rollout_batch(model, prompts=4 + rank, n=4, seed=rank)  # uneven shards
        batch.update(PatternReward(TASK).compute_reward(batch))
        batch.update(actor.compute_log_prob(batch))
        batch.update(compute_advantage(batch))
        metrics = actor.update(batch)
        torch.save(([p.detach() for p in model.parameters()], metrics), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_RANK = (
    "import sys; from tests.workers.test_engine import _ddp_rank; "
    "_ddp_rank(*map(int, sys.argv[1:4]), sys.argv[4])"
)


def test_actor_data_parallel_under_gloo_keeps_replicas_identical(fork_server, tmp_path) -> None:
    # Each rank a process of its own (forked by the session's server, which has imported torch).
    world, port = 2, free_port()
    ranks = [start_python(["-c", _RANK, str(r), str(world), str(port), str(tmp_path)]) for r in range(world)]
    try:
        assert [rank.wait(timeout=240) for rank in ranks] == [0] * world
    finally:
        for rank in ranks:
            rank.kill()
    (w0, m0), (w1, m1) = (torch.load(tmp_path / f"rank{r}.pt") for r in range(world))
    for a, b in zip(w0, w1, strict=True):
        assert torch.equal(a, b), "replicas diverged after a data-parallel update"
    assert m0 == m1  # metrics are averaged over ranks
    untrained = _model(seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(w0, untrained.parameters(), strict=True))


def _local_grpo(seed: int, steps: int, prompts: int = 16, n: int = 8) -> list[float]:
    """The whole GRPO loop in one process: sample, score, old log-probs, advantage, update."""
    model = _model(seed)
    g = torch.Generator().manual_seed(seed)
    rollout, actor, reward = Rollout(model, TASK.response_len), Actor(model), PatternReward(TASK)
    history = []
    for _ in range(steps):
        batch = rollout.generate(
            TensorDict({"prompts": TASK.sample_prompts(prompts, g), "uid": torch.arange(prompts)}, [prompts]),
            n=n,
            generator=g,
        )
        batch.update(reward.compute_reward(batch))
        batch.update(actor.compute_log_prob(batch))
        batch.update(compute_advantage(batch))
        actor.update(batch)
        history.append(float(batch["rewards"].mean()))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_loop_learns_the_rule(seed: int) -> None:
    history = _local_grpo(seed, steps=30)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    # A random policy scores about 1/14; the trained one must at least double it and gain 0.1.
    assert last > 2 * first and last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f}"
