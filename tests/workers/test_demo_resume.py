"""The stream demo survives a crash: killed with SIGKILL once it has saved a checkpoint, then started
again with ``--resume``, it continues from that checkpoint and trains every prompt of every step
exactly once across the two runs; the resumed run reports its own training (the steps it trained, its
steps/s over them, a progress bar from the resumed step to the end). Neither run names ``--mode``: the
checkpoint flags select stream mode.

Each run is its own process. The first starts a local Ray of its own (as ``make demo`` runs), in a
process group of its own so that the kill takes its Ray along; the kill waits for a natural point (the
first complete checkpoint on disk), never for a time. The second joins the session's cluster
(``--address``): a checkpoint taken on one Ray resumes on another, and the suite pays one Ray start.
It is forked by the session's fork server (``tests.forkserver.run_python``), as the session's workers are.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.dataplane.conftest import wait_for
from tests.forkserver import run_python
from tests.workers.conftest import SUMMARY_ROWS
from workers.checkpoints import check_ledger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, PROMPTS, N = 8, 2, 16, 8


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
    log = tmp_path / "first.log"  # what it printed, for the message if it ends early
    with open(log, "wb") as out:
        first = subprocess.Popen(
            _demo(ckpt, tmp_path / "first.json"),
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: (ckpt / "latest").exists() or first.poll() is not None, 600, "the first checkpoint")
        assert first.poll() is None, (
            f"the first run ended ({first.returncode}) before it saved a checkpoint:\n"
            + log.read_text(errors="replace")[-4000:]
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL and not (tmp_path / "first.json").exists()
    killed_at = int((ckpt / "latest").read_text().strip().removeprefix("step-"))
    assert 0 < killed_at < STEPS

    second = run_python(  # forked by the session's server, which has imported what the demo imports
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
