"""The trainer's settings (:class:`TrainerConfig`) and the configs ``rlplane demo`` builds from its flags.

The standard library only, on purpose: ``rlplane demo`` checks its flags and ``--resume``'s checkpoint
here before it loads torch or starts Ray, so that a mistyped flag or a missing checkpoint is answered
at once (``rlplane.cli``). A config's errors name its settings as whoever wrote them knows them:
``TrainerConfig.dp`` from Python, ``--dp`` from the command line (:func:`from_demo_args`).

Example:
    >>> TrainerConfig(checkpoint_every=2, mode="stream")
    Traceback (most recent call last):
    ValueError: TrainerConfig.checkpoint_every needs TrainerConfig.checkpoint_dir to save into
    >>> TrainerConfig(checkpoint_every=2, mode="stream", source="cli")
    Traceback (most recent call last):
    ValueError: --checkpoint-every needs --checkpoint-dir to save into
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import Any

from workers import checkpoints

__all__ = ["MODES", "TrainerConfig", "from_demo_args"]

MODES = ("sync", "stream")
SOURCES = ("python", "cli")
# The settings `rlplane demo` has a flag for (the flag: `--` and the name, `_` written `-`).
DEMO_FLAGS = (
    "steps", "seed", "dp", "mode", "max_staleness", "stream_chunks", "rollout_chunks", "colocate",
    "checkpoint_dir", "checkpoint_every", "resume",
)  # fmt: skip
# Only stream mode writes checkpoints: these flags select it when --mode is not given.
CHECKPOINT_FLAGS = ("checkpoint_dir", "checkpoint_every", "resume")


DEVICES = ("auto", "cpu", "cuda")  # rlplane demo --device


def demo_uses_gpu(device: str, gpus: float, dp: int) -> bool:
    """Whether ``rlplane demo --device DEVICE`` trains on GPUs (``TrainerConfig.use_gpu``), in a Ray
    cluster of ``gpus`` GPUs with ``dp`` actor ranks: each rank needs a GPU of its own (NCCL refuses
    two ranks on one device). ``auto`` (the default) takes the GPUs when there are enough, else
    the CPU, so a machine without GPUs runs as it always did; ``cuda`` insists.

    Raises:
        ValueError: ``cuda`` and fewer GPUs than ranks (the message names the flags), or an unknown
            device.

    Example:
        >>> demo_uses_gpu("auto", 0, 2), demo_uses_gpu("auto", 1, 1), demo_uses_gpu("cpu", 8, 2)
        (False, True, False)
    """
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return False
    if gpus >= dp:
        return True
    if device == "cuda":
        raise ValueError(
            f"--device cuda needs a GPU per actor rank (--dp {dp}); the Ray cluster has {gpus:g}: "
            f"give --dp {int(gpus)} or fewer, or leave --device out (auto: the CPU then)"
            if gpus >= 1
            else "--device cuda needs a GPU per actor rank; the Ray cluster has none: leave --device out"
        )
    return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass
class TrainerConfig:
    """What the trainer runs.

    Attributes:
        steps: training steps.
        prompts_per_step: distinct prompts per step; each is sampled ``n`` times.
        n: responses per prompt (the GRPO group size).
        dp: data-parallel actor workers.
        seed: weights, prompts and sampling streams.
        task: ``CountingTask`` fields.
        model: ``ModelConfig`` fields (besides vocabulary and length, which come from the task).
        actor: ``ActorConfig`` fields.
        num_shards: store shards when the trainer starts the store itself.
        use_gpu: one GPU per actor worker (model on CUDA, NCCL); default CPU with gloo.
        mode: ``"sync"`` (one blocking call per stage, in order) or ``"stream"`` (stages pull
            ready rows and overlap; see ``workers.trainer``).
        max_staleness: stream mode: how many steps the rollout may run ahead of the update
            (0: on-policy, stages still overlap within a step).
        stream_chunks: stream mode: batches the reward and advantage stages split a step into
            (whole groups each; more: earlier hand-offs, more calls).
        rollout_chunks: stream mode: rollout calls per actor rank and step. Each call decodes its
            rows token by token, so two calls of 32 rows cost far more than one of 64 here; with 1
            the reward stage still starts on the rows of the first rank to finish.
        stream_timeout_s: stream mode: how long a stage waits for its rows (``next_batch``) and
            the driver for a result before giving up.
        colocate: run the reward role in the actor's processes (verl's single global pool:
            ``create_colocated_worker_cls`` and ``spawn``) instead of a process of its own.
        checkpoint_dir: stream mode: where to save checkpoints (``workers.checkpoints``: the policy,
            the store and the trainer together).
        checkpoint_every: stream mode: save one before every ``checkpoint_every``-th step (0: never).
        resume: stream mode: a ``checkpoint_dir`` to resume from (its newest complete checkpoint).
        source: who wrote the settings, for the errors only (not a setting: not kept, compared or
            saved): ``"python"`` names them ``TrainerConfig.dp``, ``"cli"`` as ``rlplane demo``'s
            flags, ``--dp``.

    Raises:
        ValueError: a setting is out of range, or settings do not fit together (both named).
    """

    steps: int = 40
    prompts_per_step: int = 16
    n: int = 8
    dp: int = 2
    seed: int = 0
    task: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"vocab_size": 16, "prompt_len": 4, "response_len": 8}
    )
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    actor: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_shards: int = 2
    use_gpu: bool = False
    mode: str = "sync"
    max_staleness: int = 1
    stream_chunks: int = 2
    rollout_chunks: int = 1
    stream_timeout_s: float = 120.0
    colocate: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    source: dataclasses.InitVar[str] = "python"

    def __post_init__(self, source: str) -> None:
        if source not in SOURCES:
            raise ValueError(f"TrainerConfig.source must be one of {SOURCES}, got {source!r}")
        self._source = source
        name = self._name
        positive = ("steps", "prompts_per_step", "n", "dp", "num_shards", "stream_chunks", "rollout_chunks")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name(field)} must be a positive int, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"{name('mode')} must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"{name('max_staleness')} must be an int >= 0, got {self.max_staleness!r}")
        if not self.stream_timeout_s > 0:
            raise ValueError(f"{name('stream_timeout_s')} must be > 0, got {self.stream_timeout_s!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"{name('checkpoint_every')} must be an int >= 0, got {self.checkpoint_every!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"{name('checkpoint_every')} needs {name('checkpoint_dir')} to save into")
        if (self.checkpoint_dir or self.resume) and self.mode != "stream":
            raise ValueError(
                f"checkpoints ({name('checkpoint_dir')}, {name('resume')}) are for stream mode "
                f"({self._said('mode', 'stream')})"
            )
        if self.mode == "stream":
            self._check_stream()

    def _check_stream(self) -> None:
        # Every stream batch is exact (a short one would wait for rows that never come).
        said, rows = self._said, self.prompts_per_step * self.n
        if self.prompts_per_step % self.stream_chunks:
            raise ValueError(
                f"stream mode: {said('prompts_per_step')} must divide into {said('stream_chunks')} "
                "chunks of whole groups"
            )
        if rows % (self.rollout_chunks * self.dp):
            raise ValueError(
                f"stream mode: the {rows} rows of a step must divide into {said('rollout_chunks')} "
                f"calls on each of {said('dp')} ranks"
            )
        if self.colocate and (rows // self.stream_chunks) % self.dp:
            raise ValueError(
                f"stream mode with {said('colocate')}: the {rows // self.stream_chunks} rows of a reward "
                f"batch must divide over the {said('dp')} ranks that score them"
            )
        if self.prompts_per_step % self.dp:
            raise ValueError(
                f"stream mode: {said('prompts_per_step')} must divide over {said('dp')} ranks (each "
                "rank updates on whole groups)"
            )

    def _from_cli(self, field: str) -> bool:
        # getattr: a config unpickled from before `source` existed has no _source.
        return getattr(self, "_source", "python") == "cli" and field in DEMO_FLAGS

    def _name(self, field: str) -> str:
        """A setting as its writer knows it: ``TrainerConfig.dp`` or ``--dp``."""
        return _flag(field) if self._from_cli(field) else f"TrainerConfig.{field}"

    def _said(self, field: str, value: object = dataclasses.MISSING) -> str:
        """A setting and its value: ``dp=3`` or ``--dp 3`` (a switch: ``--colocate``)."""
        value = getattr(self, field) if value is dataclasses.MISSING else value
        if not self._from_cli(field):
            return f"{field}={value!r}"
        return _flag(field) if isinstance(value, bool) else f"{_flag(field)} {value}"

    def check_resume(self) -> tuple[pathlib.Path, checkpoints.TrainerState]:
        """The checkpoint ``resume`` names and its trainer state, checked against these settings and
        before anything starts (it reads files only: no torch, no Ray).

        Raises:
            checkpoints.ResumeError: no complete checkpoint there, or one of a run with other settings,
                or one that leaves none of ``steps`` to train (the message names the directory).
        """
        if not self.resume:
            raise ValueError(f"{self._name('resume')} is not set: there is nothing to resume from")
        try:
            path, state = checkpoints.latest(self.resume)
        except checkpoints.ResumeError as exc:
            if self._from_cli("resume"):  # the message begins with the directory the user typed
                raise checkpoints.ResumeError(f"{_flag('resume')} {exc}") from None
            raise
        checkpoints.check_settings(state["settings"], dataclasses.asdict(self), path, self._said)
        done = int(state["step"])
        if self.steps <= done:
            raise checkpoints.ResumeError(
                f"cannot resume from {path}: it was saved after {done} steps, so {self._said('steps')} "
                f"leaves none to train (ask for more than {done})"
            )
        return path, state


def from_demo_args(args: argparse.Namespace) -> dict[str, TrainerConfig]:
    """The configs ``rlplane demo`` trains with, by mode, built from its flags and checked, ``--resume``'s
    checkpoint included (files only: no torch, no Ray); errors name the flags.

    ``--resume``, ``--checkpoint-dir`` and ``--checkpoint-every`` select stream mode when ``--mode``
    is not given: only stream mode writes checkpoints, so the run a checkpoint continues is a stream
    run, and a user who asks for checkpoints asks for the mode that has them. With ``--mode sync`` or
    ``both`` they are refused.

    Raises:
        ValueError: flags out of range or that do not fit together; ``checkpoints.ResumeError`` when
            ``--resume``'s checkpoint cannot be resumed.
    """
    typed = [name for name in CHECKPOINT_FLAGS if getattr(args, name, None) is not None]
    mode = getattr(args, "mode", None)
    if mode is None:
        mode = "stream" if typed else "sync"
    elif typed and mode != "stream":
        flags = ", ".join(_flag(name) for name in typed)
        one = len(typed) == 1
        raise ValueError(
            f"{flags} {'is' if one else 'are'} for stream mode, not --mode {mode}: leave --mode out "
            f"({'it selects' if one else 'they select'} stream mode) or give --mode stream"
        )
    modes = list(MODES) if mode == "both" else [mode]
    given = {
        name: getattr(args, name)
        for name in DEMO_FLAGS
        if name not in ("mode", "seed") and getattr(args, name, None) is not None
    }
    seed = getattr(args, "seed", 0)
    configs = {m: TrainerConfig(seed=seed, mode=m, source="cli", **given) for m in modes}
    for cfg in configs.values():
        if cfg.resume:
            cfg.check_resume()
    return configs
