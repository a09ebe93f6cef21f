"""A GRPO trainer whose driver handles metadata only (``rlplane demo``, ``make demo``).

Each step the driver names the step's rows (keys in a fresh partition) and calls the worker
groups with ``KVBatchMeta`` only::

    make_prompts -> generate_sequences -> compute_reward -> compute_ref_log_prob
      -> compute_log_prob -> compute_advantage -> update_actor      (then clear the partition)

Prompts, responses, log-probs, rewards and advantages go worker -> store -> worker; the driver
gets back metadata and small metric dicts. Every group is wrapped in
:class:`~workers.driver_guard.MetadataOnlyGroup`, so a tensor reaching the driver raises
instead of passing silently, and the bytes through the driver are counted next to the bytes
the workers' bridges moved through the store.

Stream mode (``TrainerConfig(mode="stream")``, ``rlplane demo --mode stream``): the driver never
sees a key. Per step it *submits* (``MetadataOnlyGroup.submit``: no wait) one call per batch of
every stage, each with a ``dp.StreamRequest``; each worker pulls the rows that are ready for its
task with ``next_batch`` (the bridge does it), works, and writes back, so a stage starts on the
first rows its producer wrote, not when the producer's whole call returned::

    make_stream_prompts -> generate_sequences x rollout_chunks -> compute_reward x stream_chunks
      -> reward_metrics -> compute_advantage x stream_chunks (whole groups: dp.GroupSampler)
      -> compute_ref_log_prob;  then compute_log_prob -> update_actor (whole groups per rank)

(the actor group's calls on every rank, the others on the reward worker); every call is one
batch: its size is the step's rows divided by the calls (and ranks), so each stage takes every
row of the step exactly once and no call waits for rows that never come.

Bounded staleness: the stages up to the advantage of step ``s + max_staleness`` are submitted
before the update of step ``s``. Calls to one worker from the driver run in submission order
(Ray's guarantee for a single-threaded actor), so the rollout of step ``s + 1`` runs on the weights
after update ``s - 1`` (one step stale with ``max_staleness=1``) and never further ahead: it is
submitted only after update ``s - 1`` was. While the actor group updates step ``s``, the reward
worker scores and normalises step ``s + 1``. Old log-probs are computed just before each update,
so the clipped ratio starts at 1 as in sync mode. The driver waits for step ``s - 1`` while step
``s`` is queued (the actors never idle for a driver round trip), records each task's
``dp.consumption`` (every row taken exactly once), then clears the partition.

Checkpoints (stream mode: ``checkpoint_dir``, ``checkpoint_every``, ``resume``; ``rlplane demo --mode
stream --checkpoint-dir DIR --checkpoint-every N`` then ``--resume DIR``): before every N-th step
trains, the stages of the steps in flight finish, then the policy (weights and optimizer), the store
(``dp.save_checkpoint``: the rows of the steps in flight and what each stage took) and the trainer's
state are saved together (``workers.checkpoints``). A run killed at any point resumes from the last
one: it trains the steps in flight from the rows the store kept, and its summary's prompt ledger
shows every prompt of every step trained exactly once across the runs.

Why stream mode is only a little faster on 2 cores (figures: bench/README.md, "Stream-mode
training"): the actor processes' rollout and update take most of a step's CPU, and sync mode
already keeps both cores busy most of the time. Stream mode takes the reward worker's turn and the
driver's round trips off the critical path, but what it overlaps them with runs on the same two
cores; it also adds a ``next_batch`` round trip per batch and the reports' bookkeeping. Splitting
the rollout into more calls costs more than it overlaps (each call decodes token by token at a
fixed cost per token), hence one rollout call per rank and two reward/advantage batches per step by
default: the reward stage starts on the first rank's rows while the other rank still decodes. With
a core per process the reward side and the driver's round trips leave the critical path entirely.

Example:
    >>> trainer = GRPOTrainer(TrainerConfig(steps=3))
    >>> summary = trainer.fit()
    >>> trainer.close()
    >>> summary["reward_last"] > summary["reward_first"]
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
import sys
import time
from typing import Any

import dataplane as dp
from controlplane import RayClassWithInitArgs
from workers import checkpoints, timeline
from workers.bridge import StreamReport

# The settings live in workers.config (no torch there: the CLI checks its flags before loading any).
from workers.config import MODES as MODES
from workers.config import TrainerConfig as TrainerConfig
from workers.driver_guard import MetadataOnlyGroup, PendingCall
from workers.wiring import ROLE_WORKERS, Groups, Role, build_groups, pool_manager

logger = logging.getLogger(__name__)

__all__ = ["GRPOTrainer"]

# The fields each call reads; the driver asks for no more than that.
_GEN = ["prompts"]
_SCORE = ["prompts", "responses", "response_mask"]
_ADV = ["rewards", "uid", "response_mask"]
_UPDATE = ["prompts", "responses", "response_mask", "old_log_probs", "advantages", "ref_log_probs"]
_METRICS = ["rewards", "response_mask"]

# Stream mode's consumer tasks, in pipeline order (every one takes every row of a step once).
STREAM_TASKS = ("rollout", "reward", "reward_metrics", "advantage", "ref", "old_log_prob", "update")


# What the workers are started with, apart from the seed (a new run on them takes its own).
_WORKER_SETTINGS = ("dp", "colocate", "use_gpu", "task", "model", "actor")


def _worker_settings(cfg: TrainerConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in _WORKER_SETTINGS}


def _check_groups(groups: Groups, cfg: TrainerConfig) -> None:
    """Refuse groups a trainer with ``cfg`` cannot train on (``GRPOTrainer(groups=...)``)."""
    if groups.closed:
        raise ValueError("GRPOTrainer: the groups it was handed are closed")
    if not groups.settings:
        raise ValueError(
            "GRPOTrainer: hand it groups from GRPOTrainer.build_groups (these record no settings)"
        )
    want = _worker_settings(cfg)
    differ = [
        f"{k}={groups.settings.get(k)!r} (config: {v!r})"
        for k, v in want.items()
        if groups.settings.get(k) != v
    ]
    if differ:
        raise ValueError(f"GRPOTrainer: the groups were built for other workers: {', '.join(differ)}")


class GRPOTrainer:
    """Builds the worker groups (and the store if none runs) and runs GRPO steps.

    Args:
        cfg: the run's settings.
        groups: worker groups to train on instead of starting new ones: what
            :meth:`build_groups` returned for a config with the same workers (``dp``, ``colocate``,
            ``use_gpu``, ``task``, ``model``, ``actor``; the seed may differ). The trainer starts a
            fresh model on them (weights, reference, optimizer and sampling streams from
            ``cfg.seed``, as new workers would have), so several runs in turn skip the workers'
            process starts (seconds of CPU each). The caller owns them: :meth:`close` leaves them
            running; one trainer at a time may use them.

    The store is attached to if this process already has one; otherwise an embedded one is
    started and :meth:`close` stops it. Ray must be initialised (``dp.init`` starts it if not).

    Raises:
        ValueError: ``groups`` are closed, or were built for other workers (the settings named).
        checkpoints.ResumeError: ``cfg.resume`` holds no complete checkpoint of these settings
            (before any worker starts).
    """

    def __init__(self, cfg: TrainerConfig, groups: Groups | None = None) -> None:
        self.cfg = cfg
        if groups is not None:
            _check_groups(groups, cfg)
        # Checked before the store or a worker starts: a missing checkpoint costs nothing.
        resume = cfg.check_resume() if cfg.resume else None
        self._owns_store = not dp.is_initialized()
        dp.init(num_shards=cfg.num_shards)
        self.history: list[dict[str, float]] = []
        self.timeline: list[dict[str, Any]] = []  # spans: see workers.timeline
        self.stream_counts: dict[str, dict[str, int]] = {}  # stream mode: task -> rows / consumed
        self.ledger: list[checkpoints.LedgerEntry] = []  # with checkpoints: the prompts each step trained
        self.run = 1  # the runs of this training so far (a resumed run is the next)
        self.resumed_from: int | None = None
        self._restored_counts: dict[str, dict[str, int]] = {}
        # (in flight, launched, next step)
        self._resumed: tuple[dict[int, list[tuple[str, Any]]], int, int] | None = None
        self._groups: Groups | None = None
        self._owns_groups = groups is None
        self._store0 = 0  # the workers' store bytes before this trainer (reused groups count on)
        try:
            self._groups = self.build_groups(cfg) if groups is None else groups
            self.actor = MetadataOnlyGroup(self._groups.views[Role.ActorRolloutRef], "actor")
            self.reward = MetadataOnlyGroup(self._groups.views[Role.Reward], "reward")
            if groups is None:
                self.actor.init_model()
            else:  # a new run on running workers: what fresh ones would start from
                self.actor.init_model(cfg.seed)
                self.reward.reseed(cfg.seed)
                self._store0 = self.store_bytes()
            if resume is not None:
                self._resume(*resume)
        except BaseException:
            self.close()  # leave no actors, placement groups or owned store behind
            raise

    @staticmethod
    def build_groups(cfg: TrainerConfig) -> Groups:
        """Start the worker groups ``cfg`` asks for, to hand to trainers in turn (``groups=``).

        Ray must be running (``dp.init`` starts it). The caller stops them with ``Groups.close``.

        Example:
            >>> groups = GRPOTrainer.build_groups(TrainerConfig())
            >>> for seed in (0, 1):
            ...     trainer = GRPOTrainer(TrainerConfig(seed=seed), groups=groups)
            ...     summaries.append(trainer.fit())
            ...     trainer.close()   # the groups keep running
            >>> groups.close()
        """
        device = "cuda" if cfg.use_gpu else "cpu"
        specs = {
            Role.ActorRolloutRef: RayClassWithInitArgs(
                ROLE_WORKERS[Role.ActorRolloutRef], cfg.task, cfg.model, cfg.actor, cfg.seed, device
            ),
            Role.Reward: RayClassWithInitArgs(ROLE_WORKERS[Role.Reward], cfg.task, cfg.seed),
        }
        manager = pool_manager(cfg.dp, colocate=cfg.colocate, use_gpu=cfg.use_gpu)
        groups = build_groups(manager, specs)
        groups.settings = _worker_settings(cfg)
        return groups

    # ---- traffic ------------------------------------------------------------------------------
    @property
    def driver_bytes(self) -> int:
        """Bytes of arguments and results that went through the driver so far."""
        return self.actor.driver_bytes + self.reward.driver_bytes

    def _worker_traffic(self) -> list[dict[str, int]]:
        """Each worker process's bridge counters, every process once."""
        per_pid = {}
        for stats in [*self.actor.group.store_traffic(), *self.reward.group.store_traffic()]:
            per_pid[stats["pid"]] = stats
        return list(per_pid.values())

    def store_bytes(self) -> int:
        """Bytes the workers read from and wrote to the store for this trainer so far (each process
        counted once)."""
        total = sum(stats["read_bytes"] + stats["written_bytes"] for stats in self._worker_traffic())
        return total - self._store0

    # ---- one step -----------------------------------------------------------------------------
    def step(self, index: int, prompts_per_step: int | None = None) -> dict[str, float]:
        """Run GRPO step ``index`` on ``prompts_per_step`` prompts (default: the config's); return metrics."""
        num = prompts_per_step or self.cfg.prompts_per_step
        n = self.cfg.n
        pid = f"grpo-{index}"
        keys = [f"{index}.{i}.{j}" for i in range(num) for j in range(n)]
        batch = dp.KVBatchMeta(keys, partition_id=pid, extra_info={"step": index, "n": n})
        timed = self._timed(index, batch.size)
        try:
            self._expect(timed("prompts", self.reward.make_prompts, batch), batch, "make_prompts")
            self._expect(
                timed("rollout", self.actor.generate_sequences, batch.select_fields(_GEN)),
                batch,
                "generate_sequences",
            )
            self._expect(
                timed("reward", self.reward.compute_reward, batch.select_fields(_SCORE)),
                batch,
                "compute_reward",
            )
            scores = timed("reward_metrics", self.reward.reward_metrics, batch.select_fields(_METRICS))
            self._expect(
                timed("ref", self.actor.compute_ref_log_prob, batch.select_fields(_SCORE)), batch, "ref"
            )
            self._expect(
                timed("old_log_prob", self.actor.compute_log_prob, batch.select_fields(_SCORE)),
                batch,
                "compute_log_prob",
            )
            self._expect(
                timed("advantage", self.reward.compute_advantage, batch.select_fields(_ADV)),
                batch,
                "compute_advantage",
            )
            per_rank = timed("update", self.actor.update_actor, batch.select_fields(_UPDATE))
        finally:
            dp.clear_partition(pid)
        metrics = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
        metrics.update(scores)
        self.history.append(metrics)
        return metrics

    def _timed(self, index: int, rows: int) -> Any:
        """``timed(task, call, *args)``: a blocking call, its wall-clock span kept in the timeline."""

        def timed(task: str, call: Any, *args: Any) -> Any:
            start = time.time()
            result = call(*args)
            end = time.time()
            span = {"task": task, "step": index, "rank": "all", "rows": rows, "called": start}
            self.timeline.append({**span, "start": start, "end": end})
            return result

        return timed

    @staticmethod
    def _expect(result: object, batch: dp.KVBatchMeta, what: str) -> None:
        # Cheap sanity on the metadata that came back: the same rows, in order.
        if not isinstance(result, dp.KVBatchMeta) or result.keys != batch.keys:
            raise RuntimeError(
                f"{what} returned {result!r}, not the metadata of the {batch.size} rows it was given"
            )

    # ---- stream mode --------------------------------------------------------------------------
    def _request(
        self, index: int, task: str, batch_size: int, fields: list[str], groups: bool = False
    ) -> dp.StreamRequest:
        sampler = dp.GroupSampler("uid", self.cfg.n) if groups else None
        return dp.StreamRequest(
            f"grpo-{index}", task, batch_size, fields, sampler=sampler, timeout_s=self.cfg.stream_timeout_s
        )

    def _launch(self, index: int) -> list[tuple[str, PendingCall]]:
        """Submit step ``index`` up to its advantages and reference log-probs (nothing waits here)."""
        cfg = self.cfg
        rows, chunks = cfg.prompts_per_step * cfg.n, cfg.stream_chunks
        req = functools.partial(self._request, index)
        actor, reward = self.actor.submit, self.reward.submit
        prompts = reward("make_stream_prompts", f"grpo-{index}", index, cfg.prompts_per_step, cfg.n)
        calls = [("prompts", prompts)]
        per_rank = rows // (cfg.rollout_chunks * cfg.dp)  # rollout rows per call on every actor rank
        for _ in range(cfg.rollout_chunks):
            calls.append(("rollout", actor("generate_sequences", req("rollout", per_rank, _GEN), step=index)))
        # Each scoring rank takes its share (several ranks when the reward role is colocated).
        per_scorer = rows // chunks // self.reward.group.world_size
        for _ in range(chunks):
            calls.append(("reward", reward("compute_reward", req("reward", per_scorer, _SCORE))))
        calls.append(("reward_metrics", reward("reward_metrics", req("reward_metrics", rows, _METRICS))))
        for _ in range(chunks):
            advantage = req("advantage", rows // chunks, _ADV, groups=True)
            calls.append(("advantage", reward("compute_advantage", advantage)))
        calls.append(("ref", actor("compute_ref_log_prob", req("ref", rows // cfg.dp, _SCORE))))
        return calls

    def _train(self, index: int) -> list[tuple[str, PendingCall]]:
        """Submit step ``index``'s old log-probs and update (whole groups on every rank)."""
        per_rank = self.cfg.prompts_per_step * self.cfg.n // self.cfg.dp
        req = functools.partial(self._request, index)
        return [
            ("old_log_prob", self.actor.submit("compute_log_prob", req("old_log_prob", per_rank, _SCORE))),
            ("update", self.actor.submit("update_actor", req("update", per_rank, _UPDATE, groups=True))),
        ]

    def _finish(self, index: int, calls: list[tuple[str, PendingCall]]) -> dict[str, float]:
        """Collect step ``index`` (each wait bounded), check every task took every row once, record
        its spans and consumption, clear its partition; return the step's metrics."""
        pid, rows = f"grpo-{index}", self.cfg.prompts_per_step * self.cfg.n
        done: dict[str, list[StreamReport]] = {}
        try:
            for task, pending in calls:
                result = pending.result(timeout=2 * self.cfg.stream_timeout_s)
                parts = result if isinstance(result, list) else [result]  # per rank (update)
                done.setdefault(task, []).append(StreamReport.concat(parts))
            counts = {task: dp.consumption(pid, task) for task in STREAM_TASKS}
            if self.cfg.checkpoint_dir or self.cfg.resume:  # the prompts this step trained (uid tags)
                uids = sorted({tag["uid"] for tag in dp.kv_list(pid).get(pid, {}).values()})
                entry: checkpoints.LedgerEntry = {
                    "step": index,
                    "uids": uids,
                    "rows": counts["update"]["consumed"],
                    "run": self.run,
                }
                self.ledger.append(entry)
        finally:
            dp.clear_partition(pid)
        for task in ("prompts", *STREAM_TASKS):
            taken = sum(r.rows for r in done.get(task, []))
            consumed = counts[task]["consumed"] if task in counts else taken
            if taken != rows or consumed != rows:
                raise RuntimeError(
                    f"step {index}: task {task!r} processed {taken} rows and consumed {consumed}, not {rows}"
                )
            total = self.stream_counts.setdefault(task, {"rows": 0, "consumed": 0})
            total["rows"] += taken
            total["consumed"] += consumed
        for reports in done.values():
            for report in reports:
                self.timeline.extend({**span, "step": index} for span in report.spans)
        per_rank = [out for r in done["update"] for out in r.outputs]
        metrics = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
        metrics.update(done["reward_metrics"][0].outputs[0])
        self.history.append(metrics)
        return metrics

    def _progress_ahead(self, index: int) -> str:
        """What the stages of the step in flight have taken so far (``dp.consumption``)."""
        pid, rows = f"grpo-{index}", self.cfg.prompts_per_step * self.cfg.n
        try:
            got = {t: dp.consumption(pid, t)["consumed"] for t in ("rollout", "reward", "advantage")}
        except dp.DataplaneError:  # not created yet, or already cleared
            return ""
        return f"s{index} " + " ".join(f"{t[:3]} {c}/{rows}" for t, c in got.items())

    def _fit_stream(self, report: Any) -> None:
        steps, ahead, every = self.cfg.steps, self.cfg.max_staleness, self.cfg.checkpoint_every
        inflight: dict[int, list[tuple[str, Any]]] = {}
        launched, start = -1, 0
        if self._resumed is not None:
            inflight, launched, start = self._resumed
        try:
            for index in range(start, steps):
                while launched < min(index + ahead, steps - 1):
                    launched += 1
                    inflight[launched] = self._launch(launched)
                if every and index % every == 0 and index - 1 in inflight:
                    # A checkpoint before step index trains: step index - 1 trained first (the policy
                    # then holds exactly the updates of the steps before index).
                    report(index - 1, self._finish(index - 1, inflight.pop(index - 1)), launched)
                    self._checkpoint(index, inflight, launched)
                inflight[index] += self._train(index)
                if index - 1 in inflight:  # step index is queued behind it: the actors stay busy
                    report(index - 1, self._finish(index - 1, inflight.pop(index - 1)), launched)
            report(steps - 1, self._finish(steps - 1, inflight.pop(steps - 1)), launched)
        finally:
            for index in inflight:  # after a failure: give the memory back; close() stops the workers
                try:
                    dp.clear_partition(f"grpo-{index}")
                except dp.DataplaneError as exc:  # the store itself may be what failed
                    logger.warning("could not clear partition grpo-%d: %s", index, exc)

    # ---- checkpoints (workers.checkpoints) -------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.cfg)

    def _checkpoint(self, index: int, inflight: dict[int, list[tuple[str, Any]]], launched: int) -> None:
        """Save the policy, the store and the trainer before step ``index`` trains (every stage of
        the steps in flight finishes first: no consumer then holds rows it has not written back)."""
        wait = 2 * self.cfg.stream_timeout_s
        for step in sorted(inflight):
            inflight[step] = [
                (task, checkpoints.Done(call.result(timeout=wait))) for task, call in inflight[step]
            ]
        root = self.cfg.checkpoint_dir
        assert root is not None
        path = checkpoints.step_dir(root, index)
        path.mkdir(parents=True, exist_ok=True)
        self.actor.save_state(str(path / "actor.pt"))
        dp.save_checkpoint(path / "store", metadata={"step": index})
        state: checkpoints.TrainerState = {
            "version": checkpoints.STATE_VERSION,
            "run": self.run,
            "step": index,
            "launched": launched,
            "settings": self._settings(),
            "history": self.history,
            "stream_counts": self.stream_counts,
            "ledger": self.ledger,
            "inflight": {
                str(step): [(task, checkpoints.report_to_json(call.report)) for task, call in calls]
                for step, calls in inflight.items()
            },
        }
        checkpoints.write_state(path, state)
        checkpoints.mark_latest(root, index)
        logger.info("checkpoint before step %d saved in %s", index, path)

    def _resume(self, path: pathlib.Path, state: checkpoints.TrainerState) -> None:
        """Continue from the checkpoint in ``path`` (``TrainerConfig.check_resume``): the policy, the
        store (the steps in flight, with what each stage took), the metrics and the ledger so far."""
        self.actor.load_state(str(path / "actor.pt"))
        dp.load_checkpoint(path / "store", overwrite=True)
        self.history = list(state["history"])
        self.ledger = list(state["ledger"])
        self._restored_counts = state["stream_counts"]
        self.run = int(state["run"]) + 1
        self.resumed_from = int(state["step"])
        inflight = {
            int(step): [(task, checkpoints.Done(checkpoints.report_from_json(r))) for task, r in calls]
            for step, calls in state["inflight"].items()
        }
        self._resumed = (inflight, int(state["launched"]), self.resumed_from)

    # ---- a run --------------------------------------------------------------------------------
    def fit(self, progress: bool = False) -> dict[str, Any]:
        """Run ``cfg.steps`` steps in ``cfg.mode``; return the summary (``workers.demo.format_summary``).

        ``steps`` is the whole training's, ``steps_this_run`` those this call trained: fewer after a
        resume, which trains from step ``resumed_from`` on (the earlier runs trained the ones before).
        ``reward_first`` / ``reward_last`` are the mean of the per-step mean rewards over the first /
        last ``reward_window`` steps of the whole training (10% of the steps, at least one);
        ``seconds`` is this run's training only, and ``steps_per_s`` is ``steps_this_run / seconds``.
        """
        first = self.resumed_from or 0  # the steps before it were trained by earlier runs
        bar = None
        if progress:
            from tqdm import tqdm

            # From the resumed step on: the bar of a resumed run ends full, and its rate is this run's.
            bar = tqdm(
                total=self.cfg.steps,
                initial=first,
                desc=f"GRPO {self.cfg.mode}",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )

        def report(index: int, m: dict[str, float], launched: int | None = None) -> None:
            logger.info("step %d: %s", index, m)
            if bar is not None:
                post = {"reward": f"{m['reward/mean']:.3f}", "loss": f"{m['actor/pg_loss']:+.4f}"}
                if launched is not None and launched > index:
                    post["next"] = self._progress_ahead(index + 1)
                bar.set_postfix(post)
                bar.update(1)

        spans0 = len(self.timeline)
        self.stream_counts = {t: dict(c) for t, c in self._restored_counts.items()}
        driver0, store0 = self.driver_bytes, self.store_bytes()
        wall0, t0 = time.time(), time.perf_counter()
        try:
            if self.cfg.mode == "stream":
                self._fit_stream(report)
            else:
                for index in range(self.cfg.steps):
                    report(index, self.step(index))
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0
        rewards = [m["reward/mean"] for m in self.history[-self.cfg.steps :]]
        k = max(1, len(rewards) // 10)  # the first and last 10% of the steps, at least one each
        spans = self.timeline[spans0:]
        trained = self.cfg.steps - first
        summary = {
            "mode": self.cfg.mode,
            "steps": self.cfg.steps,
            "steps_this_run": trained,
            "samples_per_step": self.cfg.prompts_per_step * self.cfg.n,
            "dp": self.cfg.dp,
            "seed": self.cfg.seed,
            "reward_window": k,
            "reward_first": sum(rewards[:k]) / k,
            "reward_last": sum(rewards[-k:]) / k,
            "reward_min": min(rewards),
            "reward_max": max(rewards),
            "reward_history": rewards,
            "loss_last": self.history[-1]["actor/pg_loss"],
            "seconds": elapsed,
            "steps_per_s": trained / elapsed if elapsed > 0 else float("inf"),
            "driver_bytes": self.driver_bytes - driver0,
            "store_bytes": self.store_bytes() - store0,
            "timeline_t0": wall0,
            **timeline.overlap(spans),
        }
        if self.cfg.mode == "stream":
            summary.update(
                max_staleness=self.cfg.max_staleness,
                stream_chunks=self.cfg.stream_chunks,
                rollout_chunks=self.cfg.rollout_chunks,
                stream_rows={task: dict(c) for task, c in self.stream_counts.items()},
            )
        if self.cfg.checkpoint_dir or self.cfg.resume:
            ok, line = checkpoints.check_ledger(
                self.ledger, self.cfg.steps, self.cfg.prompts_per_step, self.cfg.n
            )
            summary.update(resumed_from=self.resumed_from, run=self.run, ledger=self.ledger, ledger_ok=ok)
            summary["ledger_line"] = line
        return summary

    def timeline_run(self, summary: dict[str, Any]) -> dict[str, Any]:
        """This run's timeline entry (see :func:`workers.timeline.write`)."""
        spans = [s for s in self.timeline if s["end"] >= summary["timeline_t0"]]
        keys = ("mode", "seconds", "steps_per_s")
        run = {k: summary[k] for k in keys}
        # The steps drawn: this run's (a resumed run trained the last ones only).
        run.update(steps=summary["steps_this_run"], first_step=summary["steps"] - summary["steps_this_run"])
        return {**run, "t0": summary["timeline_t0"], "spans": spans}

    def close(self) -> None:
        """Stop the workers, free their placement groups, and stop the store if this trainer started it.

        Idempotent. Groups handed to the trainer (``groups=``) keep running: their owner closes them.
        """
        if self._groups is not None and self._owns_groups:
            self._groups.close()
        if self._owns_store and dp.is_initialized():
            dp.close()
