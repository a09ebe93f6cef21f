"""The trainer inside a Ray actor (verl's ``TaskRunner``): the driver process only waits.

``rlplane demo --driver-actor`` starts Ray and the store in the driver process, then runs the whole
trainer (its worker groups, every call, every metric dict) in one small actor, so the process the
user launched holds no worker handle and no batch, and its own failure or a laptop going to sleep
does not tear the training loop apart mid-step. The runner attaches to the driver's store by name.

Example:
    >>> summary, run = run_in_actor(TrainerConfig(steps=2), timeout_s=600)
    >>> summary["trainer_pid"] != os.getpid()
    True
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

__all__ = ["run_in_actor"]


class TaskRunner:
    """Builds a ``GRPOTrainer`` in this actor, trains, and returns the summary and timeline."""

    def run(self, cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        from workers.trainer import GRPOTrainer

        t0 = time.perf_counter()
        trainer = GRPOTrainer(cfg)
        try:
            setup_s = time.perf_counter() - t0
            summary = trainer.fit(progress=False)
            summary["setup_seconds"] = setup_s
            summary["trainer_pid"] = os.getpid()
            return summary, trainer.timeline_run(summary)
        finally:
            trainer.close()


# num_cpus=0: the driver's loop holds no CPU slot the worker groups' bundles need.
_TaskRunnerActor = ray.remote(num_cpus=0)(TaskRunner)


def run_in_actor(cfg: Any, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train ``cfg`` in a fresh ``TaskRunner`` actor; returns ``(summary, timeline run)``.

    Raises:
        TimeoutError: the run did not finish within ``timeout_s`` (the runner is killed, and with
            it the trainer's worker groups, which it owns).
    """
    runner = _TaskRunnerActor.remote()
    try:
        result: tuple[dict[str, Any], dict[str, Any]] = ray.get(runner.run.remote(cfg), timeout=timeout_s)
        return result
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"the trainer actor did not finish within {timeout_s:.0f}s") from exc
    finally:
        ray.kill(runner, no_restart=True)
