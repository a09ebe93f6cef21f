"""``rlplane demo`` (``make demo``): train the GRPO demo, print what it did, and say whether it learned.

The run: join a Ray (``--address``: by default a new one of the demo's own), attach to the store
running there or start one, train ``--steps`` steps (``workers.trainer.GRPOTrainer``, in this
process or in a driver actor), and write the summary and a timeline next to ``--summary``.

The table says what each figure is: the mean reward over the first and the last 10% of the steps
(at least one step each; a step's reward is the mean over its samples), the range of those per-step
means, the seconds spent setting up (Ray, the store, the workers and their model) apart from the
seconds spent training, steps per second of training, and the bytes that passed through the driver
against the bytes the workers moved through the store. A resumed run (``--resume``) reports its own
training: the steps it trained (``steps_this_run``: those from ``resumed_from`` on), its seconds and
steps/s over them; the rewards are the whole training's.

Exit status (``cli``'s return value): 0 when the mean reward of the last 10% of steps is above that
of the first 10% in every mode run; 1 when it is not (a line says so). With one step the two windows
are the same step, so nothing can be judged: 0, and a line says the rise was not judged.

Example:
    >>> status, line = judge({"mode": "sync", "steps": 20, "reward_window": 2,
    ...                       "reward_first": 0.1, "reward_last": 0.4})
    >>> status, line
    (0, 'sync: the mean reward rose, 0.100 over the first 2 steps -> 0.400 over the last 2 steps')
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time
from typing import Any

import dataplane as dp
from dataplane._units import format_bytes
from workers import timeline
from workers.config import TrainerConfig, demo_uses_gpu, from_demo_args
from workers.task_runner import run_in_actor
from workers.trainer import GRPOTrainer
from workers.wiring import Groups

logger = logging.getLogger(__name__)

__all__ = ["cli", "format_comparison", "format_summary", "judge", "reward_window"]

_RUN_TIMEOUT_S = 3600.0  # the demo's whole run in a driver actor (a few minutes on 2 cores)
_DEMO_NUM_CPUS = 8  # logical CPUs of the demo's own Ray: 3 placement-group bundles, actors at 0.1 CPU


def reward_window(steps: int) -> int:
    """Steps averaged at each end of the run: 10% of them, at least one.

    Example:
        >>> reward_window(40), reward_window(9), reward_window(1)
        (4, 1, 1)
    """
    return max(1, steps // 10)


def judge(summary: dict[str, Any]) -> tuple[int, str]:
    """``(exit status, the line that says it)`` for one run: did the mean reward rise?"""
    mode, k = summary.get("mode", "sync"), summary.get("reward_window", 1)
    first, last = summary["reward_first"], summary["reward_last"]
    if summary["steps"] < 2:
        return 0, (
            f"{mode}: one step, so the first and last steps are the same: whether the reward rises was "
            "not judged (run --steps 2 or more)"
        )
    steps = "step" if k == 1 else f"{k} steps"
    change = f"{first:.3f} over the first {steps} -> {last:.3f} over the last {steps}"
    if last > first:
        return 0, f"{mode}: the mean reward rose, {change}"
    return 1, (
        f"{mode}: the mean reward did not rise, {change} (exit status 1); more --steps give the model "
        "longer to learn"
    )


def _bytes(n: int) -> str:
    return f"{n:,}  ({format_bytes(n)})"


def _rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    mode = summary.get("mode", "sync")
    if mode == "stream":
        mode += (
            f" (max staleness {summary['max_staleness']}, rollout {summary.get('rollout_chunks', 1)} "
            f"call/rank, reward+advantage {summary['stream_chunks']} batches/step)"
        )
    steps, k = summary["steps"], summary.get("reward_window", 1)
    history = summary.get("reward_history") or [summary["reward_first"], summary["reward_last"]]
    first = "step 1" if k == 1 else f"steps 1-{k}"
    last = f"step {steps}" if k == 1 else f"steps {steps - k + 1}-{steps}"
    this_run = summary.get("steps_this_run", steps)  # fewer than steps after a resume
    resumed = this_run < steps
    trained = f"; this run trained {this_run}: steps {steps - this_run + 1}-{steps}" if resumed else ""
    rows = [
        ("mode", mode),
        ("steps", f"{steps}  ({summary['samples_per_step']} samples/step{trained})"),
        ("mean reward, first 10% of steps", f"{summary['reward_first']:.3f}  ({first})"),
        ("mean reward, last 10% of steps", f"{summary['reward_last']:.3f}  ({last})"),
        ("reward range (per-step means)", f"{min(history):.3f} .. {max(history):.3f}"),
    ]
    if "setup_seconds" in summary:
        startup, workers = summary.get("startup_seconds", 0.0), summary["setup_seconds"]
        parts = "a fresh model on the same workers" if summary.get("workers_reused") else "workers and model"
        if startup:  # the first run only: later ones reuse Ray and the store
            parts = f"Ray and store {startup:.1f}, workers and model {workers:.1f}"
        rows.append(("setup, s", f"{startup + workers:.1f}  ({parts})"))
    if "seconds" in summary:
        rows.append(("training, s", f"{summary['seconds']:.1f}"))
    rows += [
        (
            "steps/s (training)",
            f"{summary['steps_per_s']:.2f}" + (f"  ({this_run} steps, this run)" if resumed else ""),
        ),
        ("bytes via driver", _bytes(summary["driver_bytes"])),
        ("bytes via store", _bytes(summary["store_bytes"])),
    ]
    if summary.get("resumed_from") is not None:
        done = summary["resumed_from"]
        rows.append(
            (
                "resumed",
                f"run {summary['run']}, from the checkpoint after step {done} (steps 1-{done} trained by "
                "earlier runs)",
            )
        )
    if "overlap_s" in summary and "seconds" in summary:
        rows.append(("tasks overlapping", f"{summary['overlap_s']:.2f} s of {summary['seconds']:.2f} s"))
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return " | ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=True)).rstrip()

    line = "-" * len(fmt(["-" * w for w in widths]))
    head = [fmt(header), line] if any(header) else []
    return "\n".join([line, *head, *(fmt(r) for r in rows), line])


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table of one run (``GRPOTrainer.fit``'s summary).

    Example:
        >>> text = format_summary({"steps": 2, "reward_first": 0.1, "reward_last": 0.2, "steps_per_s": 1.0,
        ...                        "driver_bytes": 10, "store_bytes": 2048, "samples_per_step": 8})
        >>> print(text.splitlines()[4])
        mean reward, last 10% of steps  | 0.200  (step 2)
    """
    return _table(["", ""], [[k, v] for k, v in _rows(summary)])


def format_comparison(summaries: dict[str, dict[str, Any]]) -> str:
    """One table, a column per mode (``rlplane demo --mode both``), and the stream/sync speed ratio."""
    modes = list(summaries)
    per_mode = {m: dict(_rows({**summaries[m], "mode": m})) for m in modes}
    names = [k for k, _ in _rows(summaries[modes[0]]) if k != "mode"]
    table = _table(["", *modes], [[k, *(per_mode[m].get(k, "") for m in modes)] for k in names])
    if {"sync", "stream"} <= set(modes):
        ratio = summaries["stream"]["steps_per_s"] / summaries["sync"]["steps_per_s"]
        table += f"\nstream / sync steps/s: {ratio:.2f}x (same seed, same store and Ray)"
    return table


def _run_here(cfg: TrainerConfig, groups: Groups | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train in this process with a progress bar, on ``groups`` if given (else on workers of its
    own); returns ``(summary, timeline run)``."""
    trainer = None
    try:
        t0 = time.perf_counter()
        trainer = GRPOTrainer(cfg, groups=groups)
        setup_s = time.perf_counter() - t0
        summary = trainer.fit(progress=True)
        summary["setup_seconds"] = setup_s
        return summary, trainer.timeline_run(summary)
    finally:
        if trainer is not None:
            trainer.close()


def _join_ray(address: str) -> bool:
    """Join the Ray ``--address`` names unless this process already has one; True if it joined."""
    import ray

    from dataplane.service.connect import connect

    if ray.is_initialized():  # a test or a notebook brought its own Ray: train there
        return False
    opts: dict[str, Any] = {"log_to_driver": False}
    if address == "local":  # a new Ray: size it (a cluster that exists has its own resources)
        opts.update(num_cpus=_DEMO_NUM_CPUS, include_dashboard=False)
    connect(address, **opts)
    return True


def cli(args: argparse.Namespace) -> int:
    """``rlplane demo``: train, print and save the summary and the timeline; returns the exit status
    (module docstring).

    ``--mode both`` trains twice on the same seed, sync then stream, with the same store and Ray and
    (unless ``--driver-actor``) the same workers: each run starts a fresh model on them, as new
    workers would, and the first run's setup counts their start; it prints both side by side.
    ``--driver-actor`` runs each trainer in a Ray actor (``workers.task_runner``); ``--colocate``
    puts the reward role in the actor's processes.
    """
    import ray

    try:  # before Ray starts: flags that do not fit, or a checkpoint that is not there, cost nothing
        configs = from_demo_args(args)
    except ValueError as exc:
        sys.stdout.write(f"rlplane demo: {exc}\n")
        return 2
    modes = list(configs)
    t0 = time.perf_counter()
    try:
        started_ray = _join_ray(getattr(args, "address", None) or "local")
    except (ValueError, dp.ClusterConnectError) as exc:
        sys.stdout.write(f"rlplane demo: {exc}\n")
        return 2 if isinstance(exc, ValueError) else 1
    try:  # the GPUs are known once Ray is joined
        gpus = ray.cluster_resources().get("GPU", 0.0)
        for cfg in configs.values():
            cfg.use_gpu = demo_uses_gpu(getattr(args, "device", "auto"), gpus, cfg.dp)
    except ValueError as exc:
        if started_ray:
            ray.shutdown()
        sys.stdout.write(f"rlplane demo: {exc}\n")
        return 2
    owns_store = not dp.is_initialized()
    summaries: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    groups: Groups | None = None
    try:
        dp.init(num_shards=configs[modes[0]].num_shards)
        startup_s = time.perf_counter() - t0
        in_actor = getattr(args, "driver_actor", False)
        groups_s = 0.0  # the shared workers' start, counted in the first run's setup
        if len(modes) > 1 and not in_actor:  # one set of workers for both runs: their process starts once
            t1 = time.perf_counter()
            groups = GRPOTrainer.build_groups(configs[modes[0]])
            groups_s = time.perf_counter() - t1
        for m, cfg in configs.items():
            if in_actor:
                summaries[m], run = run_in_actor(cfg, timeout_s=_RUN_TIMEOUT_S)
            else:
                summaries[m], run = _run_here(cfg, groups)
                if m == modes[0]:
                    summaries[m]["setup_seconds"] += groups_s
                else:
                    summaries[m]["workers_reused"] = groups is not None
            summaries[m]["startup_seconds"] = startup_s if m == modes[0] else 0.0
            runs.append(run)
    finally:
        if groups is not None:
            groups.close()
        if owns_store and dp.is_initialized():
            dp.close()
        if started_ray:
            ray.shutdown()
    out = pathlib.Path(args.summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(modes) == 1:
        record, text = summaries[modes[0]], format_summary(summaries[modes[0]])
    else:
        record = {"mode": "both", "runs": summaries}
        record["stream_vs_sync_steps_per_s"] = (
            summaries["stream"]["steps_per_s"] / summaries["sync"]["steps_per_s"]
        )
        text = format_comparison(summaries)
    out.write_text(json.dumps(record, indent=2) + "\n")
    timeline_json = timeline.write(runs, getattr(args, "timeline", None) or timeline.timeline_path(out))
    png, note = timeline.plot(runs, timeline_json.with_suffix(".png"))
    verdicts = [judge(s) for s in summaries.values()]
    verdicts += [
        (0 if s["ledger_ok"] else 1, s["ledger_line"]) for s in summaries.values() if "ledger_ok" in s
    ]
    lines = [
        text,
        f"summary written to {out}",
        f"timeline written to {timeline_json}" + (f" and {png}" if png else ""),
    ]
    if note:
        lines.append(note)
    lines += [line for _, line in verdicts]
    sys.stdout.write("\n".join(lines) + "\n")
    return max(status for status, _ in verdicts)
