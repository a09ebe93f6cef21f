"""The metadata-only GRPO trainer: the driver's guard, its bytes as the batch grows, and learning."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
from rlplane.cli import build_parser
from tests.workers.conftest import SUMMARY_ROWS
from workers import DriverDataError, MetadataOnlyGroup
from workers import demo as demo_module
from workers.trainer import STREAM_TASKS, GRPOTrainer, TrainerConfig


@pytest.fixture(scope="module")
def groups(store):
    """The trainers' workers for this module (two actor ranks and a reward worker), started once:
    each test's trainer starts a fresh model on them (``GRPOTrainer(groups=...)``), so only the tests
    about processes of their own (the demo, the driver actor) pay for new ones."""
    built = GRPOTrainer.build_groups(TrainerConfig())
    yield built
    built.close()


class _EchoGroup:
    """A real (tiny, local) stand-in for a worker group: returns what it is given."""

    def __init__(self) -> None:
        self.calls = 0

    def echo(self, *args, **kwargs):
        self.calls += 1
        return args[0] if args else kwargs


def test_guard_refuses_tensors_before_dispatch_and_counts_bytes() -> None:
    inner = _EchoGroup()
    group = MetadataOnlyGroup(inner, "echo")
    meta = dp.KVBatchMeta(["a", "b"], partition_id="p", extra_info={"step": 1})
    assert group.echo(meta) == meta
    assert group.echo({"loss": 0.5, "names": ["x"]}) == {"loss": 0.5, "names": ["x"]}
    assert group.driver_bytes > 0
    for bad, where in [
        (torch.zeros(2), "args[0]"),
        (TensorDict({"x": torch.zeros(2)}, [2]), "args[0]"),
        ({"batch": [torch.zeros(1)]}, "args[0]['batch'][0]"),
    ]:
        with pytest.raises(DriverDataError, match=r"echo\.echo") as err:
            group.echo(bad)
        assert err.value.where == where
    assert inner.calls == 2  # nothing was dispatched for the refused calls
    with pytest.raises(DriverDataError, match=r"kwargs\['t'\]"):
        group.echo(t=torch.zeros(1))


def test_guard_refuses_tensor_results() -> None:
    group = MetadataOnlyGroup(_EchoGroup(), "echo")

    class Leaky:
        def leak(self):
            return {"logits": torch.zeros(3)}

    leaky = MetadataOnlyGroup(Leaky(), "leaky")
    with pytest.raises(DriverDataError, match=r"result\['logits'\]"):
        leaky.leak()
    assert group.driver_bytes == 0


@pytest.mark.ray
@pytest.mark.slow
def test_driver_bytes_stay_metadata_sized_as_the_batch_grows_8x(groups) -> None:
    trainer = GRPOTrainer(TrainerConfig(prompts_per_step=2, n=4, dp=2, seed=0), groups=groups)
    try:
        traffic = {}
        for label, prompts in (("1x", 2), ("8x", 16)):
            driver0, store0 = trainer.driver_bytes, trainer.store_bytes()
            for i in range(2):
                trainer.step(100 * prompts + i, prompts_per_step=prompts)
            traffic[label] = (trainer.driver_bytes - driver0, trainer.store_bytes() - store0)
        # the strict guard is live on the trainer's groups: data cannot reach the driver
        with pytest.raises(DriverDataError):
            trainer.actor.compute_log_prob(TensorDict({"prompts": torch.zeros(2, 4)}, [2]))
    finally:
        trainer.close()
    (d1, s1), (d8, s8) = traffic["1x"], traffic["8x"]
    samples = 2 * 16 * 4  # two steps of the 8x batch
    calls = 8  # worker-group calls per step
    assert s8 >= 6 * s1, f"store traffic should scale with the batch: {s1} -> {s8}"
    # driver bytes are keys and small dicts: linear in the number of keys at most, never the payload
    assert d8 <= 8 * d1 * 1.25, f"driver traffic grew faster than the keys: {d1} -> {d8}"
    assert d8 / (samples * calls) < 120, f"{d8} driver bytes is more than metadata for {samples} samples"
    assert d8 < s8 / 3, f"driver bytes {d8} are not small next to store bytes {s8}"


@pytest.mark.ray
@pytest.mark.slow
def test_reward_improves_over_a_short_run(groups) -> None:
    trainer = GRPOTrainer(TrainerConfig(steps=20, seed=1), groups=groups)  # a fresh model from seed 1
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["steps"] == 20 and len(summary["reward_history"]) == 20
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary["reward_history"]
    assert 0 < summary["driver_bytes"] < summary["store_bytes"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_trainer_on_running_groups_starts_as_new_workers_would(groups) -> None:
    # Two runs of the same seed in turn on the same workers (started with seed 0): the second starts
    # from fresh weights, the same prompts and sampling streams, so it repeats the first exactly (sync
    # mode is deterministic); a run of another seed then differs.
    runs = []
    for seed in (2, 2, 3):
        trainer = GRPOTrainer(TrainerConfig(steps=3, prompts_per_step=2, n=4, seed=seed), groups=groups)
        try:
            runs.append(trainer.fit())
            assert trainer.store_bytes() == runs[-1]["store_bytes"] > 0  # this trainer's bytes only
        finally:
            trainer.close()
        assert not groups.closed  # the groups' owner closes them, not the trainer
    assert runs[0]["reward_history"] == runs[1]["reward_history"]
    assert runs[0]["loss_last"] == runs[1]["loss_last"]
    assert runs[2]["reward_history"] != runs[0]["reward_history"]
    with pytest.raises(ValueError, match=r"dp=2 \(config: 1\)"):
        GRPOTrainer(TrainerConfig(dp=1), groups=groups)


def test_stream_config_is_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        TrainerConfig(mode="async")
    with pytest.raises(ValueError, match="whole groups"):
        TrainerConfig(mode="stream", prompts_per_step=3, stream_chunks=2)
    with pytest.raises(ValueError, match="max_staleness"):
        TrainerConfig(mode="stream", max_staleness=-1)
    TrainerConfig(prompts_per_step=3, stream_chunks=2)  # sync mode does not use the chunks


def _spans(spans: list[dict], task: str, step: int, rank: int) -> list[dict]:
    return [s for s in spans if s["task"] == task and s["step"] == step and s["rank"] == rank]


@pytest.mark.ray
@pytest.mark.slow
def test_stream_mode_takes_every_row_once_with_bounded_staleness(groups) -> None:
    steps, prompts, n = 4, 4, 4
    cfg = TrainerConfig(mode="stream", steps=steps, prompts_per_step=prompts, n=n, seed=0)
    trainer = GRPOTrainer(cfg, groups=groups)
    try:
        summary = trainer.fit()
        with pytest.raises(DriverDataError):  # the guard covers submitted calls too
            trainer.actor.submit("compute_log_prob", TensorDict({"prompts": torch.zeros(2, 4)}, [2]))
    finally:
        trainer.close()
    rows = steps * prompts * n
    assert summary["mode"] == "stream" and len(summary["reward_history"]) == steps
    # every stage took every row of every step exactly once: rows processed == rows consumed
    assert summary["stream_rows"]["prompts"]["rows"] == rows
    for task in STREAM_TASKS:
        assert summary["stream_rows"][task] == {"rows": rows, "consumed": rows}, task
    # the driver saw metadata only (the guard checked every argument and result): requests, counts
    # and timings, no keys; a few KB a step whatever the batch (16 rows here, so the store moved
    # little more)
    assert 0 < summary["driver_bytes"] < summary["store_bytes"]
    assert summary["driver_bytes"] / steps < 12_000
    spans = trainer.timeline
    for step in range(steps):
        assert {s["task"] for s in spans if s["step"] == step} == {"prompts", *STREAM_TASKS}
    # bounded staleness (max_staleness=1), per actor rank: the rollout of step s+1 started before
    # the update of step s, and the rollout of step s+2 only after it ended
    for rank in range(2):
        for step in range(steps - 1):
            update = _spans(spans, "update", step, rank)[0]
            ahead = _spans(spans, "rollout", step + 1, rank)
            assert min(s["start"] for s in ahead) < update["start"]
            if step + 2 < steps:
                assert min(s["start"] for s in _spans(spans, "rollout", step + 2, rank)) >= update["end"]


def _live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


@pytest.mark.ray
@pytest.mark.slow
def test_demo_both_modes_of_one_step_write_summary_and_timeline_and_judge_nothing(
    store, tmp_path, capsys
) -> None:
    # Ray and the store are already up in this process: the demo attaches and leaves them running.
    # One step: the smallest run must work, exit 0, and say that a rise cannot be judged. (The demo run
    # as a program of its own, starting its own Ray: tests/workers/test_demo_resume.py.)
    out = tmp_path / "demo-summary.json"
    # One actor rank (--dp 1): what is checked here does not depend on data parallelism.
    argv = ["demo", "--steps", "1", "--dp", "1", "--mode", "both", "--summary", str(out)]
    args = build_parser().parse_args(argv)
    groups_before = _live_placement_groups()
    assert demo_module.cli(args) == 0
    assert _live_placement_groups() == groups_before, "the demo left its workers' groups running"
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["mode"] == "both" and set(record["runs"]) == {"sync", "stream"}
    for mode, summary in record["runs"].items():
        assert summary["mode"] == mode and summary["steps"] == 1 and summary["reward_window"] == 1
        assert summary["dp"] == 1
        assert summary["steps_per_s"] > 0 and summary["setup_seconds"] > 0 and summary["seconds"] > 0
        assert 0 < summary["driver_bytes"] < summary["store_bytes"]
        assert (
            f"{mode}: one step, so the first and last steps are the same: whether the reward rises was "
            "not judged" in printed
        ), printed
    assert record["runs"]["sync"]["startup_seconds"] >= 0 and record["stream_vs_sync_steps_per_s"] > 0
    # The stream run trained on the sync run's workers (a fresh model on them): one set of processes.
    assert record["runs"]["stream"]["workers_reused"] and "workers_reused" not in record["runs"]["sync"]
    assert "a fresh model on the same workers" in printed, printed
    for row in (*SUMMARY_ROWS, "stream / sync steps/s"):
        assert row in printed, printed
    timeline = json.loads((tmp_path / "demo-timeline.json").read_text())
    assert [r["mode"] for r in timeline["runs"]] == ["sync", "stream"]
    for run in timeline["runs"]:
        assert {s["task"] for s in run["spans"]} >= {"rollout", "reward", "advantage", "update"}
        assert all(s["start"] <= s["end"] for s in run["spans"])
    assert dp.is_initialized()


@pytest.mark.ray
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_demo_trains_on_the_gpu_in_both_modes(store, tmp_path, capsys) -> None:
    """``rlplane demo --device cuda``: the actor rank's model on the GPU (NCCL), its log-probs
    written to the store from the device; one step of each mode, as on the CPU."""
    out = tmp_path / "demo-summary.json"
    argv = ["demo", "--steps", "1", "--dp", "1", "--device", "cuda", "--mode", "both", "--summary", str(out)]
    assert demo_module.cli(build_parser().parse_args(argv)) == 0, capsys.readouterr().out
    record = json.loads(out.read_text())
    assert {summary["steps"] for summary in record["runs"].values()} == {1}


@pytest.mark.ray
@pytest.mark.slow
def test_colocated_roles_in_a_driver_actor(store, tmp_path) -> None:
    """verl's layout: both roles on one pool (create_colocated_worker_cls + spawn), and the trainer
    itself in a Ray actor (TaskRunner); the driver only waits for the summary. Stream mode: the
    sync mode's calls are a subset of its calls on the same wiring."""
    out = tmp_path / "actor-summary.json"
    argv = ["demo", "--steps", "2", "--colocate", "--driver-actor", "--mode", "stream", "--summary", str(out)]
    demo_module.cli(build_parser().parse_args(argv))
    summary = json.loads(out.read_text())
    assert summary["mode"] == "stream" and summary["steps"] == 2
    assert summary["trainer_pid"] != os.getpid()
    assert 0 < summary["driver_bytes"] < summary["store_bytes"]
    for task in STREAM_TASKS:  # two scoring ranks still take every row exactly once
        assert summary["stream_rows"][task]["rows"] == summary["stream_rows"][task]["consumed"], task


def test_role_wiring_maps_both_roles_to_one_pool_when_colocated() -> None:
    from workers.wiring import Role, pool_manager

    shared = pool_manager(2, colocate=True, use_gpu=False)
    assert set(shared.mapping.values()) == {"global_pool"}
    assert shared.resource_pool_spec == {"global_pool": [2]}
    apart = pool_manager(2, colocate=False, use_gpu=False)
    assert apart.mapping[Role.Reward] == "reward_pool" and apart.resource_pool_spec["actor_pool"] == [2]
