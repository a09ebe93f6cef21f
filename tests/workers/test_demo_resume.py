"""The stream demo survives a crash: killed with SIGKILL once it has saved a checkpoint, then started
again with ``--resume``, it continues from that checkpoint and trains every prompt of every step
exactly once across the two runs; the resumed run reports its own training (the steps it trained, its
steps/s over them, a progress bar from the resumed step to the end). Neither run names ``--mode``: the
checkpoint flags select stream mode.

Each run is its own process, forked by the session's fork server (``tests.forkserver``, as the
session's workers are) and joined to the session's cluster (``--address``). The first is killed with
SIGKILL at a natural point (the first complete checkpoint on disk), never at a time; its workers and
its embedded store go with it (Ray ends the actors a dead driver owned), and the second starts only
once they are gone, so it starts a store of its own and has only the checkpoint on disk to go on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest

from dataplane.config import StoreConfig
from dataplane.service.launch import store_actor_names
from tests.dataplane.conftest import wait_for
from tests.forkserver import run_python, start_python
from tests.workers.conftest import SUMMARY_ROWS
from workers.checkpoints import check_ledger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, PROMPTS, N = 8, 2, 16, 8


def _demo_store_actors() -> list[str]:
    """The live actors of the demo's embedded store (``dp.init``'s default name)."""
    return store_actor_names(StoreConfig.from_options(name="dataplane"))


def _demo(ckpt, summary, *extra: str) -> list[str]:
    # No --mode: the checkpoint flags select stream mode (the only one that has checkpoints).
    return [
        sys.executable, "-m", "rlplane", "demo", "--steps", str(STEPS),
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--summary", str(summary), *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_the_stream_demo_killed_after_a_checkpoint_resumes_and_trains_every_prompt_once(
    ray_cluster, tmp_path
) -> None:
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    before = _demo_store_actors()
    # Its output goes to this test's streams (shown if the test fails).
    first = start_python(
        _demo(ckpt, tmp_path / "first.json", "--address", ray_cluster.address)[1:], env=env, cwd=ROOT
    )
    try:
        wait_for(lambda: (ckpt / "latest").exists() or first.poll() is not None, 600, "the first checkpoint")
        assert first.poll() is None, f"the first run ended ({first.returncode}) before it saved a checkpoint"
    finally:
        first.kill()
        first.wait()
    assert first.returncode == -signal.SIGKILL and not (tmp_path / "first.json").exists()
    wait_for(lambda: _demo_store_actors() == before, 120, "the killed run's store to end with it")
    killed_at = int((ckpt / "latest").read_text().strip().removeprefix("step-"))
    assert 0 < killed_at < STEPS

    second = run_python(
        _demo(ckpt, tmp_path / "second.json", "--resume", str(ckpt), "--address", ray_cluster.address)[1:],
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert second.returncode == 0, second.stdout + second.stderr  # the reward rose, the ledger holds
    summary = json.loads((tmp_path / "second.json").read_text())
    assert summary["mode"] == "stream" and summary["resumed_from"] >= killed_at and summary["run"] == 2
    # This run's figures are this run's: the steps it trained, its speed over them, its bar from the
    # resumed step to the end (tqdm's "k/STEPS" counts), its timeline's steps.
    resumed = summary["resumed_from"]
    assert summary["steps"] == STEPS and summary["steps_this_run"] == STEPS - resumed
    assert summary["steps_per_s"] == pytest.approx(summary["steps_this_run"] / summary["seconds"])
    counts = [int(k) for k in re.findall(rf"\b(\d+)/{STEPS} \[", second.stderr)]
    assert counts and counts[0] == resumed and counts[-1] == STEPS, second.stderr[-3000:]
    assert f"this run trained {STEPS - resumed}: steps {resumed + 1}-{STEPS}" in second.stdout, second.stdout
    (run,) = json.loads((tmp_path / "second-timeline.json").read_text())["runs"]
    assert (run["steps"], run["first_step"]) == (STEPS - resumed, resumed)
    assert {s["step"] for s in run["spans"] if s["task"] == "update"} == set(range(resumed, STEPS))
    ok, line = check_ledger(summary["ledger"], STEPS, PROMPTS, N)
    assert ok and summary["ledger_ok"], line
    runs = {entry["step"]: entry["run"] for entry in summary["ledger"]}
    assert runs == {s: 1 if s < summary["resumed_from"] else 2 for s in range(STEPS)}
    assert "was trained exactly once (run 1: steps 0-" in second.stdout and "run 2: steps" in second.stdout
    assert all(row in second.stdout for row in (*SUMMARY_ROWS, "resumed")), second.stdout  # the one-run table
    assert len(summary["reward_history"]) == STEPS and summary["reward_last"] > summary["reward_first"]
    for task, counts in summary["stream_rows"].items():  # every stage took every row of every step once
        assert counts["rows"] == STEPS * PROMPTS * N, task
